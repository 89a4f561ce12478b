//! `moe_gemm.cu`: the prefill MoE's grouped GEMM `moe_gemm6` (sm_90a wgmma, 128x256 blocks of
//! two consumer warpgroups fed by a producer warpgroup through four mbarrier-guarded stages,
//! persistent: a block an SM claiming (tile, column block) items from a counter). `_m128`: f32
//! out; `_m128_bf16`: bf16 out (the down product's y); `_swiglu_m128`: gate/up with the SwiGLU
//! fused, bf16 act out.

use super::{Dev, On, Untyped, kernels};
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
}

/// Threads of `moe_gemm6`: a producer and two consumer warpgroups.
const THREADS: u32 = 384;

/// Dynamic shared memory of `moe_gemm6`: 4 stages of (128 + 256) rows of 64 bf16 and the
/// stages' eight mbarriers.
pub const SMEM: usize = 4 * (128 + 256) * 64 * 2 + 2 * 4 * 8 + 48;

pub(super) fn dynamic_smem() -> Vec<(&'static str, usize)> {
    MoeGemm6::NAMES.iter().map(|&n| (n, SMEM)).collect()
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
