//! `gdn_state.cu`: the chunked delta rule's state pass, which carries the recurrent state
//! through the chunks and adds O's inter-chunk part: `gdn_chunk_state_t64_128` (dk = 128, Sᵀ in
//! registers, 3xBF16 wgmma products, a block an SM: the state blocks and out blocks meeting
//! through counters).

use super::{Dev, On, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};

kernels! {
    /// The Sᵀ-register state pass at dk = 128: `s_out` holds every chunk's Sᵀ of every state
    /// block and `flags` their progress counters (zero before the launch).
    GdnChunkStateT64 ["gdn_chunk_state_t64_128"] {
        qkv: Dev<f32>, c: i32, w_in: Dev<f32>, qp_in: Dev<f32>, u_in: Dev<f32>,
        gamma_in: Dev<f32>, state: Dev<f32>, o: Dev<f32>, s_out: Dev<f32>, flags: Dev<u32>, t: i32,
        hk: i32, hv: i32, dv: i32,
    }
}

/// Threads of `gdn_chunk_state_t64` (a consumer and two producer warpgroups, `GDN_T64_THREADS`).
const STATE_T64_THREADS: u32 = 384;

pub(super) fn dynamic_smem(max_smem: usize) -> Vec<(&'static str, usize)> {
    GdnChunkStateT64::NAMES
        .iter()
        .map(|&n| (n, max_smem))
        .collect()
}

impl GdnChunkStateT64 {
    /// One block an SM (the state blocks first, out blocks on the others), `smem` bytes
    /// (`GdnShape::state_t64_smem_bytes`).
    pub fn launch(&self, gpu: &Gpu, smem: usize, on: On) -> Result<()> {
        ensure!(
            smem <= gpu.max_smem_per_block && !self.flags.is_null() && !self.s_out.is_null(),
            "gdn_chunk_state_t64: {smem} bytes, s_out {:?}, flags {:?}",
            self.s_out,
            self.flags
        );
        let grid = (gpu.sm_count as u32, 1, 1);
        gpu.run(
            "gdn_chunk_state_t64_128",
            grid,
            STATE_T64_THREADS,
            smem,
            &self.args(),
            on,
        )
    }
}
