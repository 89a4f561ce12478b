//! Launchers of the prefill MoE's grouped-GEMM machinery (`kernels/moe_route.cu`,
//! `kernels/moe_gemm.cu`): the tile plan over expert-sorted rows, the scatter into that order,
//! and the grouped GEMM `moe_gemm6` (sm_90a wgmma, 128x256 blocks of two consumer warpgroups
//! fed by a producer warpgroup through four mbarrier-guarded stages, persistent: a block an SM
//! claiming (tile, column block) items from a counter; SwiGLU fused into gate/up).

use super::Gpu;
use super::kernels::moe_gemm::MoeGemm6;
use super::kernels::moe_route::{MoeScatter, MoeTilePlan, SwigluBf16};
use super::kernels::{Dev, On, Untyped};
use anyhow::{Result, bail};
use half::bf16;

/// Rows of a plan tile: `moe_gemm6`'s 128 (a consumer warpgroup without rows in a tile only
/// releases the stages, so an expert's last tile of <= 64 rows costs one warpgroup's products).
pub const TILE_M: usize = 128;

/// Output columns a block of `moe_gemm6` (two warpgroups of m64n256 products).
const TILE_N: usize = 256;

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
    pub counts: Dev<i32>,
    pub offsets: Dev<i32>,
    pub cursor: Dev<i32>,
    pub tile_expert: Dev<i32>,
    pub tile_row: Dev<i32>,
    pub tile_rows: Dev<i32>,
    pub num_tiles: Dev<i32>,
    pub claim: Dev<i32>,
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

    /// The [`MoePlan`] over such a buffer `buf` (for up to `max_rows` rows): its tile list,
    /// count and counter (the other fields are not used without `moe_plan`).
    pub fn plan(buf: Dev<i32>, max_rows: usize) -> MoePlan {
        let cap = Self::new(max_rows).cap;
        let part = |at: usize, n: usize| Dev::new(buf.at(at).ptr, n);
        MoePlan {
            counts: Dev::null(),
            offsets: Dev::null(),
            cursor: Dev::null(),
            tile_expert: part(0, cap),
            tile_row: part(cap, cap),
            tile_rows: part(2 * cap, cap),
            num_tiles: part(3 * cap, 1),
            claim: part(3 * cap + 1, 1),
        }
    }
}

/// One grouped product over the plan's tiles: `out[row] = A[gather[row]] · W_x[n]ᵀ` for the
/// sorted rows of expert x. `a` bf16 `[*, kdim]`, `gather` i32 per sorted row (0: row itself),
/// `w` bf16 `[E, ndim, kdim]`.
#[derive(Clone, Copy, Debug)]
pub struct Grouped {
    pub a: Dev<bf16>,
    pub gather: Dev<i32>,
    pub w: Dev<bf16>,
    /// f32 or bf16 as the product's [`GroupedOut`] says.
    pub out: Untyped,
    pub ndim: usize,
    pub kdim: usize,
}

impl Gpu {
    /// Builds the tile list of `tile_m`-row tiles from `p.counts` and resets `p.cursor`.
    pub fn moe_plan(&self, p: &MoePlan, experts: usize, tile_m: usize) -> Result<()> {
        MoeTilePlan {
            counts: p.counts,
            e: experts as i32,
            tile_m: tile_m as i32,
            offsets: p.offsets,
            cursor: p.cursor,
            tile_expert: p.tile_expert,
            tile_row: p.tile_row,
            tile_rows: p.tile_rows,
            num_tiles: p.num_tiles,
        }
        .launch(self, On::Prefill)
    }

    /// Sorts the `rows` (token, slot) pairs of `topk_ids` (`k` per token) by expert:
    /// `sorted_token[sorted row]` = token, `slot_row[token * k + slot]` = sorted row. Needs the
    /// cursor from [`Gpu::moe_plan`]; the order within an expert is not deterministic.
    pub fn moe_scatter(
        &self,
        topk_ids: Dev<i32>,
        rows: usize,
        k: usize,
        cursor: Dev<i32>,
        sorted_token: Dev<i32>,
        slot_row: Dev<i32>,
    ) -> Result<()> {
        MoeScatter {
            topk_ids,
            n: rows as i32,
            k: k as i32,
            cursor,
            sorted_token,
            slot_row,
        }
        .launch(self, On::Prefill)
    }

    /// The grouped product `g` over the plan's tiles (built by [`Gpu::moe_plan`]), writing
    /// `out` as `kind` says; `rows` and `experts` bound the tile count. On the second stream
    /// with `aux`.
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
        if g.w.len < experts * g.ndim * g.kdim || (!g.gather.is_null() && g.gather.len < rows) {
            bail!(
                "{name}: weights {:?} for {experts} x {} x {}, gather {:?} for {rows} rows",
                g.w,
                g.ndim,
                g.kdim,
                g.gather
            );
        }
        // the swiglu kernel's block covers 128 act columns (256 gate|up rows)
        let tile_n = if kind == GroupedOut::SwiGlu {
            TILE_N / 2
        } else {
            TILE_N
        };
        let (tiles, blocks_n) = (max_tiles(rows, experts), out_cols.div_ceil(tile_n));
        if (rows.max(g.ndim) as u64) * (g.kdim as u64) >= 1 << 31 {
            // the kernel keeps its row offsets in 32-bit registers
            bail!(
                "{name}: {rows} or {} rows of {} exceed 2^31 elements",
                g.ndim,
                g.kdim
            );
        }
        MoeGemm6 {
            a: g.a,
            gather: g.gather,
            w: g.w,
            out: g.out,
            tile_expert: p.tile_expert,
            tile_row: p.tile_row,
            tile_rows: p.tile_rows,
            num_tiles: p.num_tiles,
            ndim: g.ndim as i32,
            kdim: g.kdim as i32,
            nblk: blocks_n as i32,
            claim: p.claim,
        }
        .launch(
            self,
            name,
            tiles * blocks_n,
            if aux { On::Aux } else { On::Prefill },
        )
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

    /// act `[rows, inter]` bf16 = SiLU(gu[:, :inter]) * gu[:, inter:] from f32 `gu`, on the
    /// second stream (the shared expert of short calls).
    pub fn swiglu_bf16_aux(
        &self,
        gu: Dev<f32>,
        act: Dev<bf16>,
        rows: usize,
        inter: usize,
    ) -> Result<()> {
        SwigluBf16 {
            gu,
            act,
            rows: rows as i32,
            inter: inter as i32,
        }
        .launch(self, On::Aux)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_counts() {
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
        let p = DensePlan::plan(Dev::new(1 << 20, DensePlan::ints(max)), max);
        assert_eq!(p.tile_row.ptr, (1 << 20) + 4 * cap as u64);
        assert_eq!(p.tile_rows.ptr, (1 << 20) + 8 * cap as u64);
        assert_eq!(p.num_tiles.ptr, (1 << 20) + 12 * cap as u64);
        assert_eq!(p.claim.ptr, p.num_tiles.ptr + 4);
        assert_eq!(DensePlan::contents(max, 1024).unwrap()[3 * cap], 8);
        assert!(DensePlan::contents(max, 1025).is_err());
    }
}
