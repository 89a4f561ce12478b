//! `moe_route.cu`: the prefill MoE around its grouped GEMM: the router's top-k with the
//! shared expert's gate (`moe_route`), the tile plan over expert-sorted rows (`moe_plan`), the
//! scatter into that order (`moe_scatter`), the few-row GEMVs of short calls over expert-sorted rows (`moe_gemv_sorted`, `_swiglu`), the
//! SwiGLU of unfused products (`swiglu_bf16`), and the weighted combine into the residual with
//! the next layer's RMSNorm fused (`moe_combine`, `moe_combine_bf16` for bf16 y).

use super::{Dev, On, U128, Untyped, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};
use half::bf16;

kernels! {
    /// Per token (a warp each): softmax top-k of the router's logits, renormalised, into
    /// `topk_ids` / `topk_w`, rows per expert counted into `counts`, and the shared expert's
    /// gate sigmoid(x · w_sg) into `sgate`.
    MoeRoute ["moe_route"] {
        logits: Dev<f32>, e: i32, k: i32, topk_ids: Dev<i32>, topk_w: Dev<f32>, counts: Dev<i32>,
        x: Dev<bf16>, w_sg: Dev<f32>, sgate: Dev<f32>, d: i32, t: i32,
    }
    /// The few-row path's routing in one launch: the router's logits `wr · x` into `logits`
    /// `[t, e]`, each token's top-k (`topk_ids` / `topk_w`) and shared gate (`sgate`), and the
    /// expert-sorted order: `row_expert[sorted row]`, `sorted_token`, `slot_row` (as
    /// [`MoeScatter`]'s); `ticket` the last-block counter (zero between launches).
    MoeRouteSmall ["moe_route_small"] {
        x: Dev<bf16>, t: i32, d: i32, wr: Dev<bf16>, e: i32, k: i32, w_sg: Dev<f32>,
        logits: Dev<f32>, topk_ids: Dev<i32>, topk_w: Dev<f32>, sgate: Dev<f32>,
        row_expert: Dev<i32>, sorted_token: Dev<i32>, slot_row: Dev<i32>, ticket: Dev<u32>,
    }
    /// From `counts`: the experts' first sorted rows (`offsets`), the scatter's cursors and
    /// the list of `tile_m`-row tiles (expert, first row, rows) and its length.
    MoeTilePlan ["moe_plan"] {
        counts: Dev<i32>, e: i32, tile_m: i32, offsets: Dev<i32>, cursor: Dev<i32>,
        tile_expert: Dev<i32>, tile_row: Dev<i32>, tile_rows: Dev<i32>, num_tiles: Dev<i32>,
    }
    /// Sorts the `n` (token, slot) pairs by expert: `sorted_token[sorted row]` = token,
    /// `slot_row[token * k + slot]` = sorted row (the order within an expert not deterministic).
    MoeScatter ["moe_scatter"] {
        topk_ids: Dev<i32>, n: i32, k: i32, cursor: Dev<i32>, sorted_token: Dev<i32>,
        slot_row: Dev<i32>,
    }
    /// `out[r] = A[gather[r] or r] · W_x[..]ᵀ` for each expert-sorted row r of expert
    /// x = `expert[r]`, a GEMV a row (the repeats of an expert neighbours: L2 reads);
    /// `_swiglu`: `w` holds gate then up rows (`2 nf` an expert) and `out` is bf16 act =
    /// bf16(SiLU(gate) * up) `[rows, nf]`, else f32 `[rows, nf]`.
    MoeGemvSorted ["moe_gemv_sorted", "moe_gemv_sorted_swiglu"] {
        a: Dev<bf16>, gather: Dev<i32>, w: Dev<bf16>, out: Untyped, expert: Dev<i32>, nf: i32,
        kdim: i32,
    }
    /// [`MoeGemvSorted`] for FP8 experts (e4m3 words of 16, block scales `sc`).
    MoeGemvSortedFp8 ["moe_gemv_sorted_fp8", "moe_gemv_sorted_swiglu_fp8"] {
        a: Dev<bf16>, gather: Dev<i32>, w: Dev<U128>, sc: Dev<f32>, out: Untyped,
        expert: Dev<i32>, nf: i32, kdim: i32,
    }
    /// [`MoeGemvSorted`] for affine 4-bit experts (q4 tiles and scale/bias pairs): each
    /// expert's run of sorted rows goes through its weights 8 rows at a time on the tensor cores
    /// (`rows`: the sorted rows, to find where a run ends).
    MoeGemvSortedQ4 ["moe_gemv_sorted_q4", "moe_gemv_sorted_swiglu_q4"] {
        a: Dev<bf16>, gather: Dev<i32>, w: Dev<U128>, sb: Dev<u32>, group: i32, out: Untyped,
        expert: Dev<i32>, rows: i32, nf: i32, kdim: i32,
    }
    /// `act = bf16(SiLU(gu[:, :inter]) * gu[:, inter:])`.
    SwigluBf16 ["swiglu_bf16"] { gu: Dev<f32>, act: Dev<bf16>, rows: i32, inter: i32 }
    /// `h += Σ_slot topk_w · y[slot_row] + sgate · ys`, then (non-null `norm_w`) the next
    /// layer's RMSNorm of h into `xb`; `_bf16` reads bf16 y.
    MoeCombine ["moe_combine"] {
        y: Dev<f32>, slot_row: Dev<i32>, topk_w: Dev<f32>, ys: Dev<f32>, sgate: Dev<f32>,
        h: Dev<f32>, k: i32, d: i32, norm_w: Dev<f32>, xb: Dev<bf16>, eps: f32,
    }
    /// [`MoeCombine`] with bf16 y (the grouped GEMM's output).
    MoeCombineBf16 ["moe_combine_bf16"] {
        y: Dev<bf16>, slot_row: Dev<i32>, topk_w: Dev<f32>, ys: Dev<f32>, sgate: Dev<f32>,
        h: Dev<f32>, k: i32, d: i32, norm_w: Dev<f32>, xb: Dev<bf16>, eps: f32,
    }
}

/// Tokens (a warp each) per block of `moe_route` (moe_route.cu's ROUTE_WARPS).
const ROUTE_WARPS: usize = 8;

impl MoeRoute {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (t, e, k) = (self.t as usize, self.e as usize, self.k as usize);
        ensure!(
            self.logits.len >= t * e && self.topk_ids.len >= t * k && self.counts.len >= e,
            "moe_route: {t} tokens over {e} experts: logits {:?}, ids {:?}",
            self.logits,
            self.topk_ids
        );
        let grid = (t.div_ceil(ROUTE_WARPS) as u32, 1, 1);
        gpu.run(
            "moe_route",
            grid,
            32 * ROUTE_WARPS as u32,
            ROUTE_WARPS * e * 4,
            &self.args(),
            on,
        )
    }
}

/// Tokens `moe_route_small` stages at a time (moe_route.cu's ROUTE_SMALL_TOKENS).
const ROUTE_SMALL_TOKENS: usize = 8;

impl MoeRouteSmall {
    /// Shared memory in bytes (moe_route.cu's moe_route_small_smem): a stage of input rows,
    /// then (the last block) a logits row a warp, the counts, the first rows, 8 warp sums.
    pub fn smem(d: usize, e: usize) -> usize {
        (ROUTE_SMALL_TOKENS * d * 2).max((10 * e + 8) * 4)
    }

    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        let (t, d, e, k) = (
            self.t as usize,
            self.d as usize,
            self.e as usize,
            self.k as usize,
        );
        ensure!(
            d.is_multiple_of(8)
                && (1..=1024).contains(&e)
                && k <= e.min(32)
                && self.wr.len >= e * d
                && self.x.len >= t * d
                && self.logits.len >= t * e
                && self.topk_ids.len >= t * k
                && self.row_expert.len >= t * k
                && self.slot_row.len >= t * k
                && Self::smem(d, e) <= 48 * 1024,
            "moe_route_small: {t} tokens of {d} over {e} experts (top {k}): logits {:?}, ids {:?}, \
             row_expert {:?}",
            self.logits,
            self.topk_ids,
            self.row_expert
        );
        // 8 router rows a block, then the shared gates' "row" e
        let grid = ((e + 1).div_ceil(8) as u32, 1, 1);
        gpu.run(
            "moe_route_small",
            grid,
            256,
            Self::smem(d, e),
            &self.args(),
            On::Prefill,
        )
    }
}

impl MoeTilePlan {
    /// One block of a thread an expert.
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let e = self.e as usize;
        ensure!(
            self.offsets.len > e && self.cursor.len >= e,
            "moe_plan: offsets {:?}",
            self.offsets
        );
        let block = e.next_multiple_of(32) as u32;
        gpu.run("moe_plan", (1, 1, 1), block, 0, &self.args(), on)
    }
}

impl MoeScatter {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let n = self.n as usize;
        ensure!(
            self.sorted_token.len >= n && self.slot_row.len >= n,
            "moe_scatter: {n} rows"
        );
        gpu.run(
            "moe_scatter",
            (n.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}

/// Output features a block of [`MoeGemvSorted`] (moe_route.cu's gemv_sorted_features): 8
/// warps of one feature (SwiGLU: its gate and up rows), of 8 rows of 512, or of 2 rows of other
/// widths.
fn gemv_sorted_features(swiglu: bool, kdim: usize) -> usize {
    8 * match (swiglu, kdim) {
        (true, _) => 1,
        (false, 512) => 8,
        _ => 2,
    }
}

/// Launches a few-row MoE GEMV (`moe_gemv_sorted*`, bf16 or FP8): a block a sorted row and
/// group of output features, the row's input staged as bf16.
fn run_sorted(
    gpu: &Gpu,
    name: &str,
    rows: usize,
    nf: usize,
    kdim: usize,
    swiglu: bool,
    args: &[crate::cuda::Arg],
) -> Result<()> {
    let grid = (
        rows as u32,
        nf.div_ceil(gemv_sorted_features(swiglu, kdim)) as u32,
        1,
    );
    gpu.run(name, grid, 256, kdim * 2, args, On::Prefill)
}

impl MoeGemvSorted {
    /// Over `rows` sorted rows of `experts` experts' weights (a block a row and group of
    /// output features).
    pub fn launch(&self, gpu: &Gpu, swiglu: bool, rows: usize, experts: usize) -> Result<()> {
        let (nf, kdim) = (self.nf as usize, self.kdim as usize);
        let wrows = if swiglu { 2 * nf } else { nf };
        ensure!(
            kdim.is_multiple_of(8)
                && self.w.len >= experts * wrows * kdim
                && self.expert.len >= rows
                && (self.gather.is_null() || self.gather.len >= rows),
            "moe_gemv_sorted: {rows} rows over {experts} experts of {wrows} x {kdim}: w {:?}, \
             expert {:?}, gather {:?}",
            self.w,
            self.expert,
            self.gather
        );
        run_sorted(
            gpu,
            Self::NAMES[swiglu as usize],
            rows,
            nf,
            kdim,
            swiglu,
            &self.args(),
        )
    }
}

impl MoeGemvSortedFp8 {
    /// [`MoeGemvSorted::launch`] for FP8 weights.
    pub fn launch(&self, gpu: &Gpu, swiglu: bool, rows: usize, experts: usize) -> Result<()> {
        let (nf, kdim) = (self.nf as usize, self.kdim as usize);
        let wrows = if swiglu { 2 * nf } else { nf };
        ensure!(
            kdim.is_multiple_of(16)
                && wrows.is_multiple_of(128)
                && self.w.len * 16 >= experts * wrows * kdim
                && self.sc.len >= experts * wrows / 128 * kdim.div_ceil(128)
                && self.expert.len >= rows
                && (self.gather.is_null() || self.gather.len >= rows),
            "moe_gemv_sorted_fp8: {rows} rows over {experts} experts of {wrows} x {kdim}: w {:?}, \
             scales {:?}, expert {:?}",
            self.w,
            self.sc,
            self.expert
        );
        run_sorted(
            gpu,
            Self::NAMES[swiglu as usize],
            rows,
            nf,
            kdim,
            swiglu,
            &self.args(),
        )
    }
}

/// Dynamic shared memory the few-row 4-bit MoE may take (inner dimensions up to 4,096, groups
/// of 32: more than the default 48 KB there).
pub(super) fn dynamic_smem() -> Vec<(&'static str, usize)> {
    let most = |swiglu: bool| {
        let spb = if swiglu { 2 } else { 1 };
        super::gemv::q4_smem(8, 4096, 32, false, 8 * 8 * 16 * spb)
    };
    vec![
        (MoeGemvSortedQ4::NAMES[0], most(false)),
        (MoeGemvSortedQ4::NAMES[1], most(true)),
    ]
}

impl MoeGemvSortedQ4 {
    /// Over the `rows` sorted rows (`self.rows`) of `experts` experts' weights: a block a
    /// sorted row (those that lead no tile of 8 return at once) and strips of 16 features.
    pub fn launch(&self, gpu: &Gpu, swiglu: bool, experts: usize) -> Result<()> {
        let (rows, nf, kdim, group) = (
            self.rows as usize,
            self.nf as usize,
            self.kdim as usize,
            self.group as usize,
        );
        let wrows = if swiglu { 2 * nf } else { nf };
        ensure!(
            kdim.is_multiple_of(64)
                && nf.is_multiple_of(16)
                && matches!(group, 32 | 64 | 128)
                && kdim.is_multiple_of(group)
                && self.w.len * 32 >= experts * wrows * kdim
                && self.sb.len >= experts * wrows * (kdim / group)
                && self.expert.len >= rows
                && (self.gather.is_null() || self.gather.len >= rows),
            "moe_gemv_sorted_q4: {rows} rows over {experts} experts of {wrows} x {kdim} (group \
             {group}): w {:?}, scales {:?}, expert {:?}",
            self.w,
            self.sb,
            self.expert
        );
        let spb = if swiglu {
            1
        } else {
            super::gemv::q4_strips(kdim)
        };
        let smem = super::gemv::q4_smem(
            8,
            kdim,
            group,
            false,
            8 * 8 * 16 * if swiglu { 2 } else { spb },
        );
        let grid = (rows as u32, (nf / 16).div_ceil(spb) as u32, 1);
        gpu.run(
            Self::NAMES[swiglu as usize],
            grid,
            256,
            smem,
            &self.args(),
            On::Prefill,
        )
    }
}

impl SwigluBf16 {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let n = (self.rows * self.inter) as usize;
        ensure!(
            self.gu.len >= 2 * n && self.act.len >= n,
            "swiglu_bf16: gu {:?}, act {:?}",
            self.gu,
            self.act
        );
        let grid = (n.div_ceil(256).min(65_535) as u32, 1, 1);
        gpu.run("swiglu_bf16", grid, 256, 0, &self.args(), on)
    }
}

impl MoeCombine {
    /// A block a token, `t` tokens.
    pub fn launch(&self, gpu: &Gpu, t: usize, on: On) -> Result<()> {
        let (k, d) = (self.k as usize, self.d as usize);
        ensure!(
            self.y.len >= t * k * d && self.h.len >= t * d,
            "moe_combine: y {:?}",
            self.y
        );
        gpu.run("moe_combine", (t as u32, 1, 1), 256, 0, &self.args(), on)
    }
}

impl MoeCombineBf16 {
    /// A block a token, `t` tokens.
    pub fn launch(&self, gpu: &Gpu, t: usize, on: On) -> Result<()> {
        let (k, d) = (self.k as usize, self.d as usize);
        ensure!(
            self.y.len >= t * k * d && self.h.len >= t * d && !self.slot_row.is_null(),
            "moe_combine_bf16: y {:?}",
            self.y
        );
        gpu.run(
            "moe_combine_bf16",
            (t as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}
