//! `moe_gemm.cu`: the prefill MoE's grouped GEMM `moe_gemm6` (sm_90a wgmma, 128x256 blocks of
//! two consumer warpgroups fed by a producer warpgroup through four mbarrier-guarded stages,
//! persistent: a block an SM claiming (tile, column block) items from a counter). `_m128`: f32
//! out; `_m128_bf16`: bf16 out (the down product's y); `_swiglu_m128`: gate/up with the SwiGLU
//! fused, bf16 act out. `moe_grouped(_swiglu)_q4`: the same products over the same plan for
//! affine 4-bit experts (q4 tiles on `mma.sync`, the codes held in registers across a tile's
//! rows, no bf16 copy of the experts); `moe_grouped(_swiglu)_fp8` the same for FP8 experts (the
//! e4m3 words converted exactly to bf16 fragments in registers, each 64-column unit's f32 sum
//! times its 128 x 128 block scale).

use super::{Dev, On, U128, Untyped, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, bail};
use half::bf16;

kernels! {
    /// `out[row] = A[gather[row] or row] · W_x[n]ᵀ` over the plan's tiles of expert x; `out`
    /// f32, bf16 or (swiglu) bf16 act as the kernel says; `nblk` column blocks, `claim` the item
    /// counter (zero before the launch, left at zero).
    MoeGemm6 ["moe_gemm6_m128", "moe_gemm6_m128_bf16", "moe_gemm6_swiglu_m128"] {
        a: Dev<bf16>, gather: Dev<i32>, w: Dev<bf16>, out: Untyped, tile_expert: Dev<i32>,
        tile_row: Dev<i32>, tile_rows: Dev<i32>, num_tiles: Dev<i32>, ndim: i32, kdim: i32,
        nblk: i32, claim: Dev<i32>,
    }
    /// The grouped products for affine 4-bit experts ([`crate::cuda::kernels::gemv::Q4`]
    /// tiles and pairs): `out[row] = A[gather[row] or row] · W_x[n]ᵀ` (f32), or with the
    /// SwiGLU fused, bf16 act.
    MoeGroupedQ4 ["moe_grouped_q4", "moe_grouped_swiglu_q4"] {
        a: Dev<bf16>, gather: Dev<i32>, w: Dev<U128>, sb: Dev<u32>, group: i32, out: Untyped,
        tile_expert: Dev<i32>, tile_row: Dev<i32>, tile_rows: Dev<i32>, num_tiles: Dev<i32>,
        nf: i32, kdim: i32,
    }
    /// The grouped products for FP8 experts ([`crate::cuda::kernels::gemv::Fp8`]: e4m3 words of
    /// 16 and the stack's f32 block scales): `out[row] = A[gather[row] or row] · W_x[n]ᵀ` (f32),
    /// or with the SwiGLU fused, bf16 act.
    MoeGroupedFp8 ["moe_grouped_fp8", "moe_grouped_swiglu_fp8"] {
        a: Dev<bf16>, gather: Dev<i32>, w: Dev<U128>, sc: Dev<f32>, out: Untyped,
        tile_expert: Dev<i32>, tile_row: Dev<i32>, tile_rows: Dev<i32>, num_tiles: Dev<i32>,
        nf: i32, kdim: i32,
    }
}

/// Routed rows up to which a prefill call runs FP8 experts through `moe_grouped_fp8` on the
/// e4m3 words; past it the layer's experts are dequantised to bf16 (1.6 GB written a layer) and
/// take the bf16 grouped GEMM on the tensor cores' full tiles. The grouped FP8 kernel (mma.sync,
/// 16 rows at a time) costs ~46 us a token where the dequantised route costs ~13 us a token plus
/// ~71 ms a call (H100, synthetic full-fp8: 30.4 / 209 ms at 256 / 4,096 tokens grouped, 75 /
/// 124 ms dequantised): they meet near 1,560 tokens, 12,288 routed rows at top-8.
pub const FP8_GROUPED_MAX_ROWS: usize = 12_288;

/// Rows of a tile `moe_grouped_q4` takes at a time (moe_gemm.cu's MOE_Q4_CHUNK).
const Q4_CHUNK: usize = 16;

/// Strips of 16 features a `moe_grouped_q4` block takes.
fn q4_strips(swiglu: bool, kdim: usize) -> usize {
    if swiglu {
        2
    } else {
        super::gemv::q4_strips(kdim)
    }
}

/// Blocks along y of `moe_grouped(_swiglu)_q4` and `_fp8` (the same split) for `nf` output
/// features: a SwiGLU block writes 16 features (its two strips are their gate and up rows), a
/// plain one 16 a strip.
fn grouped_grid_y(swiglu: bool, nf: usize, kdim: usize) -> usize {
    if swiglu {
        nf.div_ceil(16)
    } else {
        nf.div_ceil(16).div_ceil(q4_strips(false, kdim))
    }
}

/// Dynamic shared memory of `moe_grouped(_swiglu)_q4` for inner dimension `kdim`.
pub fn grouped_q4_smem(swiglu: bool, kdim: usize, group: usize) -> usize {
    let spb = q4_strips(swiglu, kdim);
    super::gemv::q4_smem(Q4_CHUNK, kdim, group, false, 8 * 16 * Q4_CHUNK * spb)
}

/// Dynamic shared memory of `moe_grouped(_swiglu)_fp8` for inner dimension `kdim`: 16 staged
/// rows (gemv.cuh's q4_ldw words each) and the 8 warps' partial sums of its strips.
pub fn grouped_fp8_smem(swiglu: bool, kdim: usize) -> usize {
    let spb = q4_strips(swiglu, kdim);
    4 * (Q4_CHUNK * (kdim / 2 + 4) + 8 * 16 * Q4_CHUNK * spb)
}

impl MoeGroupedFp8 {
    /// Over at most `tiles` plan tiles of `experts` experts' weights (`rows` sorted rows): a
    /// block a tile and strips of 16 features (as [`MoeGroupedQ4::launch`]).
    pub fn launch(
        &self,
        gpu: &Gpu,
        swiglu: bool,
        tiles: usize,
        rows: usize,
        experts: usize,
    ) -> Result<()> {
        let (nf, kdim) = (self.nf as usize, self.kdim as usize);
        let wrows = if swiglu { 2 * nf } else { nf };
        if !(kdim.is_multiple_of(64)
            && nf.is_multiple_of(16)
            && self.w.len * 16 >= experts * wrows * kdim
            && self.sc.len >= (experts * wrows).div_ceil(128) * kdim.div_ceil(128)
            && self.tile_expert.len >= tiles
            && (self.gather.is_null() || self.gather.len >= rows))
        {
            bail!(
                "moe_grouped_fp8: {rows} rows ({tiles} tiles) over {experts} experts of {wrows} x \
                 {kdim}: w {:?}, scales {:?}, gather {:?}",
                self.w,
                self.sc,
                self.gather
            );
        }
        let grid = (tiles as u32, grouped_grid_y(swiglu, nf, kdim) as u32, 1);
        gpu.run(
            Self::NAMES[swiglu as usize],
            grid,
            256,
            grouped_fp8_smem(swiglu, kdim),
            &self.args(),
            On::Prefill,
        )
    }
}

impl MoeGroupedQ4 {
    /// Over at most `tiles` plan tiles of `experts` experts' weights (`rows` sorted rows): a
    /// block a tile and strips of 16 features.
    pub fn launch(
        &self,
        gpu: &Gpu,
        swiglu: bool,
        tiles: usize,
        rows: usize,
        experts: usize,
    ) -> Result<()> {
        let (nf, kdim, group) = (self.nf as usize, self.kdim as usize, self.group as usize);
        let wrows = if swiglu { 2 * nf } else { nf };
        if !(kdim.is_multiple_of(64)
            && nf.is_multiple_of(16)
            && matches!(group, 32 | 64 | 128)
            && kdim.is_multiple_of(group)
            && self.w.len * 32 >= experts * wrows * kdim
            && self.sb.len >= experts * wrows * (kdim / group)
            && self.tile_expert.len >= tiles
            && (self.gather.is_null() || self.gather.len >= rows))
        {
            bail!(
                "moe_grouped_q4: {rows} rows ({tiles} tiles) over {experts} experts of {wrows} x \
                 {kdim} (group {group}): w {:?}, scales {:?}, gather {:?}",
                self.w,
                self.sb,
                self.gather
            );
        }
        let grid = (tiles as u32, grouped_grid_y(swiglu, nf, kdim) as u32, 1);
        let smem = grouped_q4_smem(swiglu, kdim, group);
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

/// Threads of `moe_gemm6`: a producer and two consumer warpgroups.
const THREADS: u32 = 384;

/// Dynamic shared memory of `moe_gemm6`: 4 stages of (128 + 256) rows of 64 bf16 and the
/// stages' eight mbarriers.
pub const SMEM: usize = 4 * (128 + 256) * 64 * 2 + 2 * 4 * 8 + 48;

pub(super) fn dynamic_smem() -> Vec<(&'static str, usize)> {
    let mut v: Vec<(&'static str, usize)> = MoeGemm6::NAMES.iter().map(|&n| (n, SMEM)).collect();
    // the most any 4-bit shape takes: k 4,096, groups of 32
    for (swiglu, name) in [
        (false, MoeGroupedQ4::NAMES[0]),
        (true, MoeGroupedQ4::NAMES[1]),
    ] {
        v.push((name, grouped_q4_smem(swiglu, 4096, 32)));
    }
    // FP8: k 4,096 at most as well
    for (swiglu, name) in [
        (false, MoeGroupedFp8::NAMES[0]),
        (true, MoeGroupedFp8::NAMES[1]),
    ] {
        v.push((name, grouped_fp8_smem(swiglu, 4096)));
    }
    v
}

impl MoeGemm6 {
    /// `name` (one of [`MoeGemm6::NAMES`]) over `items` (tile, column block) pairs, at most a
    /// block an SM.
    pub fn launch(&self, gpu: &Gpu, name: &'static str, items: usize, on: On) -> Result<()> {
        if !Self::NAMES.contains(&name) {
            bail!("{name} is not a moe_gemm6 kernel");
        }
        if self.claim.is_null() || self.tile_expert.is_null() {
            bail!("{name}: the plan's tiles and item counter are needed");
        }
        let grid = (items.min(gpu.sm_count).max(1) as u32, 1, 1);
        gpu.run(name, grid, THREADS, SMEM, &self.args(), on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grouped 4-bit grids cover every feature exactly as the kernels split them: a SwiGLU
    /// block 16 features (blockIdx.y * 16), a plain block q4_strips strips of 16.
    #[test]
    fn grouped_grids_cover_every_feature() {
        for kdim in [128, 384, 512, 2048, 4096] {
            for nf in [16, 32, 48, 128, 512, 2048] {
                let sw = grouped_grid_y(true, nf, kdim);
                assert_eq!(sw * 16, nf, "swiglu nf {nf} k {kdim}");
                let spb = q4_strips(false, kdim);
                let pl = grouped_grid_y(false, nf, kdim);
                assert!(
                    pl * spb * 16 >= nf && (pl - 1) * spb * 16 < nf,
                    "plain nf {nf} k {kdim}"
                );
            }
        }
        // the model's gate/up: 512 features of k 2,048 in 32 blocks, not 16
        assert_eq!(grouped_grid_y(true, 512, 2048), 32);
    }
}
