//! Launchers of the prefill MoE's grouped-GEMM machinery (`kernels/moe.cu`): the tile plan
//! over expert-sorted rows, the scatter into that order, and the grouped GEMMs.

use super::{Arg, Gpu};
use anyhow::{Result, bail};

/// Which grouped GEMM the prefill MoE runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeGemm {
    /// `moe_gemm`: WMMA, 64x64 tiles (`KESTREL_MOE_GEMM=v1`).
    V1,
    /// `moe_gemm2`: WMMA, 128x128 tiles, cp.async double buffering (`KESTREL_MOE_GEMM=v2`).
    V2,
    /// `moe_gemm3_*`: mma.sync + ldmatrix, 4-stage cp.async, 128- or 64-row tiles; gate/up
    /// fused with the SwiGLU (`KESTREL_MOE_GEMM=v3`).
    V3,
    /// `moe_gemm4_*` (`KESTREL_MOE_GEMM=v4`, the default off compute capability 9.0, and
    /// V5's 64-row tiles): V3's numerics (bitwise) with K tiles of 64, swizzled shared memory
    /// and 64x64 warp tiles; 128x128 (or 64x128) blocks of 4 warps, a tile's column blocks
    /// launched together (grid y = tiles). On the H200 at commit 5d4c1c9: prefill 38.0k /
    /// 43.9k tok/s at 2,048 / 8,192 tokens against V3's 29.9k / 38.9k.
    V4,
    /// `moe_gemm5_*` (`KESTREL_MOE_GEMM=v5`, compute capability 9.0): the
    /// Hopper tensor-core path (sm_90a wgmma), 128x256 blocks of two warpgroups, for 128-row
    /// tiles ([`gemm5_tile_m`]); 64-row tiles (few rows per expert, where reading the weights
    /// bounds the product) run `moe_gemm4`. On the H200 at afdf9c6: prefill 40.3k / 47.8k /
    /// 49.3k tok/s at 2,048 / 4,096 / 8,192 tokens against V4's 39.6k / 43.9k / 45.2k.
    V5,
    /// `moe_gemm6_*` (the default on compute capability 9.0, `KESTREL_MOE_GEMM=v6`): V5's
    /// tiles and products (bitwise its outputs), warp-specialised (a producer warpgroup feeding
    /// four stages through mbarriers) and persistent (a block an SM walks the tiles, its next
    /// tile's copies overlapping the current one's stores). 64-row tiles run `moe_gemm4`, as for
    /// V5. On the H200 at 8,192 tokens (full-shape GPU test): gate/up + SwiGLU 0.601 -> 0.549
    /// ms, down 0.399 -> 0.364 ms; prefill 41.5k / 53.3k / 45.7k -> 42.4k / 54.3k / 46.4k tok/s
    /// at 2,048 / 8,192 / 32,768 tokens.
    V6,
    /// `moe_gemm7_*` (opt-in, `KESTREL_MOE_GEMM=v7`, compute capability 9.0): V6's products
    /// (bitwise its outputs) on 256-row tiles by clusters of two blocks, each block 128 rows,
    /// each stage's B rows copied once for both by a multicast tensor copy (a third fewer bytes
    /// from L2 a row); where experts average fewer than 192 rows, V6's 128-row tiles with the B
    /// rows by tensor copy. Slower than V6 on the H200 at 8,192 tokens (gate/up 0.82 / 0.64
    /// against 0.58 ms; docs/KERNELS.md, "Seventeenth session"): kept as the base for cluster
    /// and tensor-copy work.
    V7,
}

/// How a grouped kernel's grid covers the plan's (tile, column block) pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GridOrder {
    /// (tiles, column blocks): V1-V3.
    TilesX,
    /// (column blocks, tiles), a tile's column blocks adjacent in launch order (its A rows
    /// shared in L2): moe_gemm4 and moe_gemm5.
    TilesY,
    /// One block an SM walking the pairs in TilesY's order (moe_gemm6; the column block count
    /// is its last argument).
    Persistent,
    /// Persistent's order walked by clusters of two blocks, one cluster an SM pair (moe_gemm7;
    /// `w` is the weights' tensor map).
    Cluster2,
    /// Persistent, with the weights' tensor map for `w` (moe_gemm7's 128-row kernels).
    PersistentTma,
}

impl GridOrder {
    fn of(kind: MoeGemm, tile_m: usize) -> Self {
        match (kind, tile_m) {
            (MoeGemm::V7, 256) => GridOrder::Cluster2,
            (MoeGemm::V7, 128) => GridOrder::PersistentTma,
            (MoeGemm::V6, 128) => GridOrder::Persistent,
            (MoeGemm::V4 | MoeGemm::V5 | MoeGemm::V6 | MoeGemm::V7, _) => GridOrder::TilesY,
            _ => GridOrder::TilesX,
        }
    }
}

/// The smallest plan tile of any grouped GEMM: the workspace's tile list is sized for it.
pub const MIN_TILE_M: usize = 64;

/// The `moe_gemm3` kernels, with their dynamic shared memory (set at `Gpu::open`).
pub(super) const GEMM3_KERNELS: [(&str, usize); 4] = [
    ("moe_gemm3_m128", gemm3_smem(128)),
    ("moe_gemm3_m64", gemm3_smem(64)),
    ("moe_gemm3_swiglu_m128", gemm3_smem(128)),
    ("moe_gemm3_swiglu_m64", gemm3_smem(64)),
];

/// The `moe_gemm4` kernels, with their dynamic shared memory (set at `Gpu::open`).
pub(super) const GEMM4_KERNELS: [(&str, usize); 4] = [
    ("moe_gemm4_m128", gemm4_smem(128)),
    ("moe_gemm4_m64", gemm4_smem(64)),
    ("moe_gemm4_swiglu_m128", gemm4_smem(128)),
    ("moe_gemm4_swiglu_m64", gemm4_smem(64)),
];

/// The `moe_gemm5` kernels (128-row tiles), with their dynamic shared memory: 4 stages of
/// (128 + 256) rows of 64 bf16.
pub(super) const GEMM5_KERNELS: [(&str, usize); 2] = [
    ("moe_gemm5_m128", GEMM5_SMEM),
    ("moe_gemm5_swiglu_m128", GEMM5_SMEM),
];
const GEMM5_SMEM: usize = 4 * (128 + 256) * 64 * 2;

/// The `moe_gemm6` and `moe_gemm7` kernels, with their dynamic shared memory: `moe_gemm5`'s
/// four stages and the stages' eight mbarriers.
pub(super) const GEMM6_KERNELS: [(&str, usize); 9] = [
    ("moe_gemm6_m128", GEMM6_SMEM),
    ("moe_gemm6_m128_bf16", GEMM6_SMEM),
    ("moe_gemm6_swiglu_m128", GEMM6_SMEM),
    ("moe_gemm7_m256", GEMM6_SMEM),
    ("moe_gemm7_m256_bf16", GEMM6_SMEM),
    ("moe_gemm7_swiglu_m256", GEMM6_SMEM),
    ("moe_gemm7_m128", GEMM6_SMEM),
    ("moe_gemm7_m128_bf16", GEMM6_SMEM),
    ("moe_gemm7_swiglu_m128", GEMM6_SMEM),
];
const GEMM6_SMEM: usize = GEMM5_SMEM + 2 * 4 * 8 + 48;

/// Dynamic shared memory of `moe_gemm4` with `tile_m`-row tiles: 3 stages of (BM + 128) rows
/// of 64 bf16, unpadded.
const fn gemm4_smem(tile_m: usize) -> usize {
    3 * (tile_m + 128) * 64 * 2
}

/// Output columns per block of `moe_gemm3` with `tile_m`-row tiles (moe.cu's BN).
const fn gemm3_tile_n(tile_m: usize) -> usize {
    if tile_m == 128 { 128 } else { 256 }
}

/// Dynamic shared memory of `moe_gemm3`: 4 stages of (BM + BN) rows of 32 bf16 padded to 40.
const fn gemm3_smem(tile_m: usize) -> usize {
    4 * (tile_m + gemm3_tile_n(tile_m)) * 40 * 2
}

/// The mma.sync kernels' (V3, V4) tile height for `rows` (token, expert) rows over `experts`
/// experts: 64 unless the experts average 256 rows or more. A tile is wasted on each expert's
/// last, partial tile (half a tile on average), which at the real model's ~128 rows per expert
/// (4,096-token chunks) is a third of the 128-row tiles' work; once experts carry 256+ rows
/// that waste is small and the larger tile's better operand reuse wins (measured on V3).
pub fn gemm3_tile_m(rows: usize, experts: usize) -> usize {
    if rows >= 256 * experts.max(1) {
        128
    } else {
        64
    }
}

/// V5's tile height: 128 (the wgmma kernel) once the experts average 64 rows, else 64
/// (`moe_gemm4`). Half-empty 128-row wgmma tiles still beat full 64-row mma.sync ones there
/// (H200 at afdf9c6, 2,048 tokens, ~64 rows an expert: 40.3k vs 39.6k tok/s prefill); at ~16
/// rows an expert (512 tokens) reading the weights bounds both and 64 is ahead (18.6k vs 17.8k).
pub fn gemm5_tile_m(rows: usize, experts: usize) -> usize {
    if rows >= 64 * experts.max(1) { 128 } else { 64 }
}

/// Tiles the plan can produce for `rows` rows over `experts` experts (the grid's x extent).
pub fn max_tiles(rows: usize, experts: usize, tile_m: usize) -> usize {
    rows.div_ceil(tile_m) + experts
}

impl MoeGemm {
    /// From `KESTREL_MOE_GEMM`: `v1` .. `v5`, else (unset too) `V6` (which [`MoeGemm::on`] turns
    /// into V4 off compute capability 9.0).
    pub fn from_env() -> Self {
        Self::parse(std::env::var("KESTREL_MOE_GEMM").as_deref().unwrap_or(""))
    }

    /// [`MoeGemm::from_env`]'s reading of `s`.
    pub fn parse(s: &str) -> Self {
        match s {
            "v1" => MoeGemm::V1,
            "v2" => MoeGemm::V2,
            "v3" => MoeGemm::V3,
            "v4" => MoeGemm::V4,
            "v5" => MoeGemm::V5,
            "v7" => MoeGemm::V7,
            _ => MoeGemm::V6,
        }
    }

    /// The variant that runs on a GPU of compute capability `cc`: the wgmma kernels (V5-V7) need
    /// sm_90a (the kernels are built for compute_90a only there), elsewhere V4.
    pub fn on(self, cc: (i32, i32)) -> Self {
        if matches!(self, MoeGemm::V5 | MoeGemm::V6 | MoeGemm::V7) && cc != (9, 0) {
            MoeGemm::V4
        } else {
            self
        }
    }

    /// Whether the gate/up kernel applies the SwiGLU itself (bf16 act out, no f32 gu).
    pub fn fused_swiglu(self) -> bool {
        matches!(
            self,
            MoeGemm::V3 | MoeGemm::V4 | MoeGemm::V5 | MoeGemm::V6 | MoeGemm::V7
        )
    }

    /// The plan's tile height: fixed by the WMMA kernels; for V3 and V4 `force` or
    /// [`gemm3_tile_m`], for V5 `force` or [`gemm5_tile_m`], for V6 `force` or 128: in
    /// `moe_gemm6` a warpgroup without rows in a tile only releases the stages, so an expert's
    /// tile of <= 64 rows costs one warpgroup's products, and the persistent 128-row kernel is
    /// ahead of `moe_gemm4`'s 64-row tiles at every length (H200 at 1451577, prefill tok/s
    /// 256 / 512 / 1,024: 11.19k / 20.08k / 32.14k -> 11.33k / 20.21k / 32.21k).
    pub fn tile_m(self, rows: usize, experts: usize, force: Option<usize>) -> usize {
        match self {
            MoeGemm::V1 => 64,
            MoeGemm::V2 => 128,
            MoeGemm::V3 | MoeGemm::V4 => force.unwrap_or_else(|| gemm3_tile_m(rows, experts)),
            MoeGemm::V5 => force.unwrap_or_else(|| gemm5_tile_m(rows, experts)),
            MoeGemm::V6 => force.unwrap_or(128),
            MoeGemm::V7 => force.unwrap_or(if rows >= 192 * experts.max(1) {
                256
            } else {
                128
            }),
        }
    }
}

/// Device buffers (i32) of the expert plan: `counts [E]` in (rows per expert), then from
/// `moe_plan`: `offsets [E + 1]`, `cursor [E]` (the scatter's per-expert write positions),
/// the tile list `tile_expert`, `tile_row`, `tile_rows` (`max_tiles` each) and `num_tiles`;
/// `claim`, the persistent kernels' item counter (`moe_gemm6`): zero before the first grouped
/// product, and each launch leaves it at zero.
#[derive(Clone, Copy, Debug)]
pub struct MoePlan {
    pub counts: u64,
    pub offsets: u64,
    pub cursor: u64,
    pub tile_expert: u64,
    pub tile_row: u64,
    pub tile_rows: u64,
    pub num_tiles: u64,
    pub claim: u64,
}

/// The plan of a dense product over rows taken in order, as one expert's 128-row tiles, for
/// the persistent grouped kernels ([`Gpu::dense_mlp_aux`], the shared expert), in one i32
/// buffer of [`DensePlan::ints`]: `cap` tile experts (all 0), first rows and row counts, then
/// the tile count and the kernels' item counter.
pub struct DensePlan {
    cap: usize,
}

impl DensePlan {
    /// Rows of a tile.
    pub const TILE_M: usize = 128;

    fn new(max_rows: usize) -> Self {
        DensePlan {
            cap: max_rows.div_ceil(Self::TILE_M).max(1),
        }
    }

    /// Length of the buffer for up to `max_rows` rows.
    pub fn ints(max_rows: usize) -> usize {
        3 * Self::new(max_rows).cap + 2
    }

    /// The buffer's contents for `rows` rows (the counter zero), in a buffer sized for
    /// `max_rows`.
    pub fn contents(max_rows: usize, rows: usize) -> Result<Vec<i32>> {
        let cap = Self::new(max_rows).cap;
        let n = rows.div_ceil(Self::TILE_M);
        if n > cap {
            bail!("a dense plan of {rows} rows in a buffer for {max_rows}");
        }
        let mut v = vec![0i32; 3 * cap + 2];
        for j in 0..n {
            v[cap + j] = (j * Self::TILE_M) as i32;
            v[2 * cap + j] = (rows - j * Self::TILE_M).min(Self::TILE_M) as i32;
        }
        v[3 * cap] = n as i32;
        Ok(v)
    }

    /// The [`MoePlan`] over such a buffer at `base` (for up to `max_rows` rows): its tile list,
    /// count and counter (the other fields are not used without `moe_plan`).
    pub fn plan(base: u64, max_rows: usize) -> MoePlan {
        let cap = Self::new(max_rows).cap as u64;
        MoePlan {
            counts: 0,
            offsets: 0,
            cursor: 0,
            tile_expert: base,
            tile_row: base + 4 * cap,
            tile_rows: base + 8 * cap,
            num_tiles: base + 12 * cap,
            claim: base + 12 * cap + 4,
        }
    }
}

/// One grouped product over the plan's tiles: `out[row] = A[gather[row]] · W_x[n]ᵀ` for the
/// sorted rows of expert x. `a` bf16 `[*, kdim]`, `gather` i32 per sorted row (0: row itself),
/// `w` bf16 `[E, ndim, kdim]`.
#[derive(Clone, Copy, Debug)]
pub struct Grouped {
    pub a: u64,
    pub gather: u64,
    pub w: u64,
    pub out: u64,
    pub ndim: usize,
    pub kdim: usize,
    /// `w`'s tensor map ([`Gpu::moe_tensor_map`]) for V7's kernels, else 0.
    pub tmap: u64,
}

impl Gpu {
    /// Builds the tile list of `tile_m`-row tiles from `p.counts` and resets `p.cursor`.
    pub fn moe_plan(&self, p: &MoePlan, experts: usize, tile_m: usize) -> Result<()> {
        self.launch_dep(
            "moe_plan",
            (1, 1, 1),
            experts.next_multiple_of(32) as u32,
            0,
            &[
                Arg::Ptr(p.counts),
                Arg::I(experts as i32),
                Arg::I(tile_m as i32),
                Arg::Ptr(p.offsets),
                Arg::Ptr(p.cursor),
                Arg::Ptr(p.tile_expert),
                Arg::Ptr(p.tile_row),
                Arg::Ptr(p.tile_rows),
                Arg::Ptr(p.num_tiles),
            ],
        )
    }

    /// Sorts the `rows` (token, slot) pairs of `topk_ids` (`k` per token) by expert:
    /// `sorted_token[sorted row]` = token, `slot_row[token * k + slot]` = sorted row. Needs the
    /// cursor from [`Gpu::moe_plan`]; the order within an expert is not deterministic.
    pub fn moe_scatter(
        &self,
        topk_ids: u64,
        rows: usize,
        k: usize,
        cursor: u64,
        sorted_token: u64,
        slot_row: u64,
    ) -> Result<()> {
        self.launch_dep(
            "moe_scatter",
            (rows.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(topk_ids),
                Arg::I(rows as i32),
                Arg::I(k as i32),
                Arg::Ptr(cursor),
                Arg::Ptr(sorted_token),
                Arg::Ptr(slot_row),
            ],
        )
    }

    /// The grouped GEMM `g` into f32 `out [rows, ndim]` with
    /// kernel `kind` over the plan's tiles, which must have been built with `tile_m`
    /// (`kind.tile_m`); `rows` and `experts` bound the tile count.
    pub fn moe_grouped(
        &self,
        kind: MoeGemm,
        tile_m: usize,
        p: &MoePlan,
        rows: usize,
        experts: usize,
        g: &Grouped,
    ) -> Result<()> {
        self.grouped_plain(kind, tile_m, p, rows, experts, g, false, false)
    }

    /// [`Gpu::moe_grouped`] with a bf16 `out [rows, ndim]` (the down product's y, half the
    /// bytes to write and for `moe_combine_bf16` to read): the V6 / V7 kernels with 128-row
    /// tiles, or V7's 256-row ones; `g.ndim % 8 == 0`.
    pub fn moe_grouped_bf16(
        &self,
        kind: MoeGemm,
        tile_m: usize,
        p: &MoePlan,
        rows: usize,
        experts: usize,
        g: &Grouped,
    ) -> Result<()> {
        self.grouped_plain(kind, tile_m, p, rows, experts, g, true, false)
    }

    /// The kernel of [`Gpu::moe_grouped`] (f32 out) or [`Gpu::moe_grouped_bf16`] (`y16`), and
    /// its launch (on the second stream with `aux`).
    #[allow(clippy::too_many_arguments)]
    fn grouped_plain(
        &self,
        kind: MoeGemm,
        tile_m: usize,
        p: &MoePlan,
        rows: usize,
        experts: usize,
        g: &Grouped,
        y16: bool,
        aux: bool,
    ) -> Result<()> {
        // (name, output columns a block, threads, smem bytes)
        let kernel = match (kind, tile_m, y16) {
            (MoeGemm::V1, 64, false) => Some(("moe_gemm", 64, 128, 0)),
            (MoeGemm::V2, 128, false) => Some(("moe_gemm2", 128, 256, 0)),
            (MoeGemm::V3, 128, false) => Some(("moe_gemm3_m128", 128, 256, gemm3_smem(128))),
            (MoeGemm::V3, 64, false) => Some(("moe_gemm3_m64", 256, 256, gemm3_smem(64))),
            (MoeGemm::V4, 128, false) => Some(("moe_gemm4_m128", 128, 128, gemm4_smem(128))),
            (MoeGemm::V4 | MoeGemm::V5 | MoeGemm::V6 | MoeGemm::V7, 64, false) => {
                Some(("moe_gemm4_m64", 128, 128, gemm4_smem(64)))
            }
            (MoeGemm::V5, 128, false) => Some(("moe_gemm5_m128", 256, 256, GEMM5_SMEM)),
            (MoeGemm::V6, 128, false) => Some(("moe_gemm6_m128", 256, 384, GEMM6_SMEM)),
            (MoeGemm::V7, 128, false) => Some(("moe_gemm7_m128", 256, 384, GEMM6_SMEM)),
            (MoeGemm::V7, 256, false) => Some(("moe_gemm7_m256", 256, 384, GEMM6_SMEM)),
            (MoeGemm::V6, 128, true) => Some(("moe_gemm6_m128_bf16", 256, 384, GEMM6_SMEM)),
            (MoeGemm::V7, 128, true) => Some(("moe_gemm7_m128_bf16", 256, 384, GEMM6_SMEM)),
            (MoeGemm::V7, 256, true) => Some(("moe_gemm7_m256_bf16", 256, 384, GEMM6_SMEM)),
            _ => None,
        };
        let Some((name, tile_n, block, smem)) = kernel.filter(|_| !y16 || g.ndim.is_multiple_of(8))
        else {
            bail!(
                "no {}{kind:?} grouped GEMM with {tile_m}-row tiles and {} columns",
                if y16 { "bf16-output " } else { "" },
                g.ndim
            );
        };
        let order = GridOrder::of(kind, tile_m);
        self.grouped_launch(
            name,
            (tile_m, tile_n, block, smem),
            p,
            rows,
            experts,
            g,
            g.ndim,
            order,
            aux,
        )
    }

    /// The gate/up product with the SwiGLU fused (`kind` V3 or V4): `g.w` holds
    /// `ndim = 2 * inter` rows per expert (gate, then up); `g.out` receives act = SiLU(gate) *
    /// up as bf16 `[rows, inter]`.
    pub fn moe_grouped_swiglu(
        &self,
        kind: MoeGemm,
        tile_m: usize,
        p: &MoePlan,
        rows: usize,
        experts: usize,
        g: &Grouped,
    ) -> Result<()> {
        self.grouped_swiglu(kind, tile_m, p, rows, experts, g, false)
    }

    /// The kernel of [`Gpu::moe_grouped_swiglu`] and its launch (on the second stream with
    /// `aux`).
    #[allow(clippy::too_many_arguments)]
    fn grouped_swiglu(
        &self,
        kind: MoeGemm,
        tile_m: usize,
        p: &MoePlan,
        rows: usize,
        experts: usize,
        g: &Grouped,
        aux: bool,
    ) -> Result<()> {
        let (name, geometry) = match (kind, tile_m) {
            (MoeGemm::V3, 128) => ("moe_gemm3_swiglu_m128", (128, 64, 256, gemm3_smem(128))),
            (MoeGemm::V3, 64) => ("moe_gemm3_swiglu_m64", (64, 128, 256, gemm3_smem(64))),
            (MoeGemm::V4, 128) => ("moe_gemm4_swiglu_m128", (128, 64, 128, gemm4_smem(128))),
            (MoeGemm::V4 | MoeGemm::V5 | MoeGemm::V6 | MoeGemm::V7, 64) => {
                ("moe_gemm4_swiglu_m64", (64, 64, 128, gemm4_smem(64)))
            }
            (MoeGemm::V5, 128) => ("moe_gemm5_swiglu_m128", (128, 128, 256, GEMM5_SMEM)),
            (MoeGemm::V6, 128) => ("moe_gemm6_swiglu_m128", (128, 128, 384, GEMM6_SMEM)),
            (MoeGemm::V7, 128) => ("moe_gemm7_swiglu_m128", (128, 128, 384, GEMM6_SMEM)),
            (MoeGemm::V7, 256) => ("moe_gemm7_swiglu_m256", (256, 128, 384, GEMM6_SMEM)),
            _ => bail!("no fused-SwiGLU {kind:?} grouped GEMM with {tile_m}-row tiles"),
        };
        let order = GridOrder::of(kind, tile_m);
        self.grouped_launch(name, geometry, p, rows, experts, g, g.ndim / 2, order, aux)
    }

    /// A dense SwiGLU MLP (the shared expert) of `rows` rows on the second stream through
    /// `moe_gemm6`: `act` = bf16(SiLU(x · gateᵀ) * (x · upᵀ)) for `gu` (`gu.w` = [gate; up],
    /// `gu.out` = act), then `down.out` (f32) = act · downᵀ, over `p`, a plan of one expert with
    /// all the rows in order ([`DensePlan`]). Needs sm_90a (`moe_gemm6`).
    pub fn dense_mlp_aux(
        &self,
        p: &MoePlan,
        rows: usize,
        gu: &Grouped,
        down: &Grouped,
    ) -> Result<()> {
        let (v6, m) = (MoeGemm::V6, DensePlan::TILE_M);
        self.grouped_swiglu(v6, m, p, rows, 1, gu, true)?;
        self.grouped_plain(v6, m, p, rows, 1, down, false, true)
    }

    /// Launches a grouped kernel: (tile_m, output columns per block, threads, smem bytes),
    /// its grid laid out as `order` says.
    #[allow(clippy::too_many_arguments)]
    fn grouped_launch(
        &self,
        name: &str,
        (tile_m, tile_n, block, smem): (usize, usize, u32, usize),
        p: &MoePlan,
        rows: usize,
        experts: usize,
        g: &Grouped,
        out_cols: usize,
        order: GridOrder,
        aux: bool,
    ) -> Result<()> {
        let (tiles, blocks_n) = (
            max_tiles(rows, experts, tile_m) as u32,
            out_cols.div_ceil(tile_n) as u32,
        );
        if order != GridOrder::TilesX && (rows.max(g.ndim) as u64) * (g.kdim as u64) >= 1 << 31 {
            // moe_gemm4/5/6 keep their row offsets in 32-bit registers
            bail!(
                "{name}: {rows} or {} rows of {} exceed 2^31 elements",
                g.ndim,
                g.kdim
            );
        }
        if order == GridOrder::TilesY && tiles > 65_535 {
            bail!("{name}: {tiles} tiles exceed the grid's y extent (65,535)");
        }
        let grid = match order {
            GridOrder::TilesX => (tiles, blocks_n, 1),
            GridOrder::TilesY => (blocks_n, tiles, 1),
            // One block an SM at most; the kernel walks the (tile, column block) items.
            GridOrder::Persistent | GridOrder::PersistentTma => {
                ((tiles * blocks_n).min(self.sm_count as u32), 1, 1)
            }
            // As many clusters as run at once (fewer than half the SMs where a GPC has an odd
            // number of free SMs).
            GridOrder::Cluster2 => (
                2 * (tiles * blocks_n)
                    .min(self.max_active_clusters(name, block, smem as u32, 2)?)
                    .max(1),
                1,
                1,
            ),
        };
        let tma = matches!(order, GridOrder::Cluster2 | GridOrder::PersistentTma);
        if tma && g.tmap == 0 {
            bail!("{name}: needs the weights' tensor map");
        }
        let mut args = vec![
            Arg::Ptr(g.a),
            Arg::Ptr(g.gather),
            Arg::Ptr(if tma { g.tmap } else { g.w }),
            Arg::Ptr(g.out),
            Arg::Ptr(p.tile_expert),
            Arg::Ptr(p.tile_row),
            Arg::Ptr(p.tile_rows),
            Arg::Ptr(p.num_tiles),
            Arg::I(g.ndim as i32),
            Arg::I(g.kdim as i32),
        ];
        if matches!(
            order,
            GridOrder::Persistent | GridOrder::Cluster2 | GridOrder::PersistentTma
        ) {
            args.push(Arg::I(blocks_n as i32));
        }
        if order == GridOrder::Persistent {
            args.push(Arg::Ptr(p.claim));
        }
        if aux {
            self.launch_on(
                self.stream_of(true),
                name,
                grid,
                block,
                smem as u32,
                &args,
                false,
            )
        } else {
            self.launch_dep(name, grid, block, smem as u32, &args)
        }
    }

    /// The tensor map `moe_gemm7` copies B rows with, in device memory: `w` as a 2-D bf16
    /// tensor of `rows` rows of `kdim` (`[E, ndim, kdim]` is `E * ndim` rows), boxes of 128 rows
    /// x 64 in the 128-byte swizzle that the wgmma descriptors read, zeros outside.
    pub fn moe_tensor_map(&self, w: u64, rows: usize, kdim: usize) -> Result<super::DeviceBuf> {
        if !kdim.is_multiple_of(8) {
            bail!("a tensor map needs rows of a multiple of 16 bytes ({kdim} bf16)");
        }
        let map = super::tensor_map_bf16(
            w,
            &[kdim as u64, rows as u64],
            &[(kdim * 2) as u64],
            &[64, 128],
            &format!("{rows} x {kdim} bf16"),
        )?;
        self.upload(&map)
    }

    /// act `[rows, inter]` bf16 = SiLU(gu[:, :inter]) * gu[:, inter:] from f32 `gu`.
    pub fn swiglu_bf16(&self, gu: u64, act: u64, rows: usize, inter: usize) -> Result<()> {
        self.swiglu_bf16_on(false, gu, act, rows, inter)
    }

    /// [`Gpu::swiglu_bf16`], on the second stream when `aux` is set.
    pub fn swiglu_bf16_on(
        &self,
        aux: bool,
        gu: u64,
        act: u64,
        rows: usize,
        inter: usize,
    ) -> Result<()> {
        self.launch_on(
            self.stream_of(aux),
            "swiglu_bf16",
            ((rows * inter).div_ceil(256).min(65_535) as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(gu),
                Arg::Ptr(act),
                Arg::I(rows as i32),
                Arg::I(inter as i32),
            ],
            false,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `KESTREL_MOE_GEMM`'s values, the wgmma kernels only on compute capability 9.0, and the
    /// tile height rules: V3/V4 64-row tiles until the experts average 256 rows, V5 until 64,
    /// V6 always 128;
    /// the grid orders.
    #[test]
    fn variant_names_and_tile_rule() {
        assert_eq!(MoeGemm::parse("v1"), MoeGemm::V1);
        assert_eq!(MoeGemm::parse("v3"), MoeGemm::V3);
        assert_eq!(MoeGemm::parse("v4"), MoeGemm::V4);
        assert_eq!(MoeGemm::parse(""), MoeGemm::V6, "the default");
        assert_eq!(MoeGemm::parse("v5"), MoeGemm::V5);
        assert_eq!(MoeGemm::V5.on((9, 0)), MoeGemm::V5);
        assert_eq!(MoeGemm::V5.on((8, 9)), MoeGemm::V4);
        assert_eq!(MoeGemm::V5.on((10, 0)), MoeGemm::V4);
        assert_eq!(MoeGemm::V3.on((8, 0)), MoeGemm::V3);
        assert_eq!(MoeGemm::parse("v6"), MoeGemm::V6);
        assert_eq!(MoeGemm::V6.on((9, 0)), MoeGemm::V6);
        assert_eq!(MoeGemm::V6.on((8, 9)), MoeGemm::V4);
        assert!(MoeGemm::V6.fused_swiglu());
        assert_eq!(MoeGemm::V6.tile_m(2048 * 8, 256, None), 128);
        assert_eq!(MoeGemm::V6.tile_m(1024 * 8, 256, None), 128);
        assert_eq!(MoeGemm::V6.tile_m(8, 256, None), 128);
        assert_eq!(MoeGemm::V6.tile_m(2048 * 8, 256, Some(64)), 64);
        // moe_gemm6 is persistent only at its own tile height; 64-row tiles run moe_gemm4.
        assert_eq!(GridOrder::of(MoeGemm::V6, 128), GridOrder::Persistent);
        // V7: 256-row tiles by clusters where experts average 192 rows, else V6's kernels.
        assert_eq!(MoeGemm::parse("v7"), MoeGemm::V7);
        assert_eq!(MoeGemm::V7.on((8, 9)), MoeGemm::V4);
        assert!(MoeGemm::V7.fused_swiglu());
        assert_eq!(MoeGemm::V7.tile_m(192 * 256, 256, None), 256);
        assert_eq!(MoeGemm::V7.tile_m(191 * 256, 256, None), 128);
        assert_eq!(GridOrder::of(MoeGemm::V7, 256), GridOrder::Cluster2);
        assert_eq!(GridOrder::of(MoeGemm::V7, 128), GridOrder::PersistentTma);
        assert_eq!(GridOrder::of(MoeGemm::V7, 64), GridOrder::TilesY);
        assert_eq!(GridOrder::of(MoeGemm::V6, 64), GridOrder::TilesY);
        assert_eq!(GridOrder::of(MoeGemm::V5, 128), GridOrder::TilesY);
        assert_eq!(GridOrder::of(MoeGemm::V3, 128), GridOrder::TilesX);
        assert!(
            MoeGemm::V4.fused_swiglu() && MoeGemm::V5.fused_swiglu() && !MoeGemm::V2.fused_swiglu()
        );
        assert_eq!(gemm3_tile_m(8192 * 8, 256), 128);
        assert_eq!(gemm3_tile_m(4096 * 8, 256), 64);
        assert_eq!(MoeGemm::V5.tile_m(2048 * 8, 256, None), 128);
        assert_eq!(MoeGemm::V5.tile_m(1024 * 8, 256, None), 64);
        assert_eq!(MoeGemm::V5.tile_m(2048 * 8, 256, Some(64)), 64);
        assert_eq!(MoeGemm::V4.tile_m(4096 * 8, 256, Some(128)), 128);
        assert_eq!(MoeGemm::V2.tile_m(8192 * 8, 256, None), 128);
        for (name, smem) in GEMM3_KERNELS
            .iter()
            .chain(&GEMM4_KERNELS)
            .chain(&GEMM5_KERNELS)
            .chain(&GEMM6_KERNELS)
        {
            assert!(super::super::KERNELS.contains(name), "{name} not loaded");
            assert!(*smem <= 227 * 1024, "{name}");
        }
    }

    /// The shared expert's plan: 128-row tiles of one expert covering the rows in order, the
    /// last one partial, the count and a zero counter after them; the MoePlan's pointers at
    /// those places; too many rows for the buffer an error.
    #[test]
    fn dense_plan_covers_the_rows_in_order() {
        let (max, rows) = (1000, 300);
        let v = DensePlan::contents(max, rows).unwrap();
        let cap = 8; // ceil(1000 / 128)
        assert_eq!(v.len(), DensePlan::ints(max));
        assert_eq!(v.len(), 3 * cap + 2);
        assert!(v[..cap].iter().all(|&x| x == 0), "one expert");
        assert_eq!(&v[cap..cap + 3], &[0, 128, 256]);
        assert_eq!(&v[2 * cap..2 * cap + 3], &[128, 128, 44]);
        assert_eq!(v[3 * cap], 3, "tiles");
        assert_eq!(v[3 * cap + 1], 0, "the counter starts at zero");
        let p = DensePlan::plan(1 << 20, max);
        assert_eq!(p.tile_row, (1 << 20) + 4 * cap as u64);
        assert_eq!(p.tile_rows, (1 << 20) + 8 * cap as u64);
        assert_eq!(p.num_tiles, (1 << 20) + 12 * cap as u64);
        assert_eq!(p.claim, p.num_tiles + 4);
        assert_eq!(DensePlan::contents(max, 1024).unwrap()[3 * cap], 8);
        assert!(DensePlan::contents(max, 1025).is_err());
    }
}
