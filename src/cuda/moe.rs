//! Launchers of the prefill MoE's grouped-GEMM machinery (`kernels/moe_route.cu`,
//! `kernels/moe_gemm.cu`): the tile plan over expert-sorted rows, the scatter into that order,
//! and the grouped GEMM `moe_gemm6` (sm_90a wgmma, 128x256 blocks of two consumer warpgroups
//! fed by a producer warpgroup through four mbarrier-guarded stages, persistent: a block an SM
//! claiming (tile, column block) items from a counter; SwiGLU fused into gate/up).

use super::{Arg, Gpu};
use anyhow::{Result, bail};

/// Rows of a plan tile: `moe_gemm6`'s 128 (a consumer warpgroup without rows in a tile only
/// releases the stages, so an expert's last tile of <= 64 rows costs one warpgroup's products).
pub const TILE_M: usize = 128;

/// Output columns a block of `moe_gemm6` (two warpgroups of m64n256 products).
const TILE_N: usize = 256;

/// Threads of `moe_gemm6`: a producer and two consumer warpgroups.
const GEMM_THREADS: u32 = 384;

/// Dynamic shared memory of `moe_gemm6`: 4 stages of (128 + 256) rows of 64 bf16 and the
/// stages' eight mbarriers.
const GEMM_SMEM: usize = 4 * (128 + 256) * 64 * 2 + 2 * 4 * 8 + 48;

/// The grouped kernels, with their dynamic shared memory (set at `Gpu::open`).
pub(super) const GEMM_KERNELS: [(&str, usize); 3] = [
    ("moe_gemm6_m128", GEMM_SMEM),
    ("moe_gemm6_m128_bf16", GEMM_SMEM),
    ("moe_gemm6_swiglu_m128", GEMM_SMEM),
];

/// Tiles the plan can produce for `rows` rows over `experts` experts.
pub fn max_tiles(rows: usize, experts: usize) -> usize {
    rows.div_ceil(TILE_M) + experts
}

/// What a grouped product writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedOut {
    /// f32 `[rows, ndim]`.
    F32,
    /// bf16 `[rows, ndim]` (the down product's y: half the bytes to write and for
    /// `moe_combine_bf16` to read); `ndim % 8 == 0`.
    Bf16,
    /// act = bf16(SiLU(gate) * up) `[rows, ndim / 2]`: `w` holds `ndim = 2 * inter` rows per
    /// expert, gate then up.
    SwiGlu,
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

    /// The grouped product `g` over the plan's tiles (built by [`Gpu::moe_plan`]), writing
    /// `out` as `kind` says; `rows` and `experts` bound the tile count. On the second stream
    /// with `aux`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_grouped(
        &self,
        kind: GroupedOut,
        p: &MoePlan,
        rows: usize,
        experts: usize,
        g: &Grouped,
        aux: bool,
    ) -> Result<()> {
        let (name, out_cols) = match kind {
            GroupedOut::F32 => ("moe_gemm6_m128", g.ndim),
            GroupedOut::Bf16 => ("moe_gemm6_m128_bf16", g.ndim),
            GroupedOut::SwiGlu => ("moe_gemm6_swiglu_m128", g.ndim / 2),
        };
        if kind == GroupedOut::Bf16 && !g.ndim.is_multiple_of(8) {
            bail!(
                "{name}: bf16 rows of {} columns (a multiple of 8 needed)",
                g.ndim
            );
        }
        // the swiglu kernel's block covers 128 act columns (256 gate|up rows)
        let tile_n = if kind == GroupedOut::SwiGlu {
            TILE_N / 2
        } else {
            TILE_N
        };
        let (tiles, blocks_n) = (
            max_tiles(rows, experts) as u32,
            out_cols.div_ceil(tile_n) as u32,
        );
        if (rows.max(g.ndim) as u64) * (g.kdim as u64) >= 1 << 31 {
            // the kernel keeps its row offsets in 32-bit registers
            bail!(
                "{name}: {rows} or {} rows of {} exceed 2^31 elements",
                g.ndim,
                g.kdim
            );
        }
        // One block an SM at most; the kernel walks the (tile, column block) items.
        let grid = ((tiles * blocks_n).min(self.sm_count as u32), 1, 1);
        let args = [
            Arg::Ptr(g.a),
            Arg::Ptr(g.gather),
            Arg::Ptr(g.w),
            Arg::Ptr(g.out),
            Arg::Ptr(p.tile_expert),
            Arg::Ptr(p.tile_row),
            Arg::Ptr(p.tile_rows),
            Arg::Ptr(p.num_tiles),
            Arg::I(g.ndim as i32),
            Arg::I(g.kdim as i32),
            Arg::I(blocks_n as i32),
            Arg::Ptr(p.claim),
        ];
        if aux {
            self.launch_on(
                self.stream_of(true),
                name,
                grid,
                GEMM_THREADS,
                GEMM_SMEM as u32,
                &args,
                false,
            )
        } else {
            self.launch_dep(name, grid, GEMM_THREADS, GEMM_SMEM as u32, &args)
        }
    }

    /// A dense SwiGLU MLP (the shared expert) of `rows` rows on the second stream:
    /// `act` = bf16(SiLU(x · gateᵀ) * (x · upᵀ)) for `gu` (`gu.w` = [gate; up], `gu.out` = act),
    /// then `down.out` (f32) = act · downᵀ, over `p`, a plan of one expert with all the rows in
    /// order ([`DensePlan`]).
    pub fn dense_mlp_aux(
        &self,
        p: &MoePlan,
        rows: usize,
        gu: &Grouped,
        down: &Grouped,
    ) -> Result<()> {
        self.moe_grouped(GroupedOut::SwiGlu, p, rows, 1, gu, true)?;
        self.moe_grouped(GroupedOut::F32, p, rows, 1, down, true)
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

    /// Every grouped kernel is loaded and fits Hopper's shared memory.
    #[test]
    fn grouped_kernels_are_loaded() {
        for (name, smem) in &GEMM_KERNELS {
            assert!(super::super::KERNELS.contains(name), "{name} not loaded");
            assert!(*smem <= 227 * 1024, "{name}");
        }
        assert_eq!(max_tiles(300, 4), 3 + 4);
        assert_eq!(DensePlan::TILE_M, TILE_M);
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
