//! `gdn_chunk.cu`: the Gated DeltaNet's token-parallel prefill kernels: the causal conv with
//! SiLU and the q/k norm fused (`gdn_conv_prefill`), the conv state's advance, and the chunk
//! prep of the chunked delta rule (`gdn_chunk_prep_*`: W, Q', U and γ of every 64-token chunk
//! in parallel, the triangular solve blocked over 16x16 diagonal inverses on tensor cores).

use super::gdn_decode::for_dk;
use super::{Dev, On, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};

kernels! {
    /// [`super::gdn_decode::GdnConv`] with every (token, channel) in parallel and the q/k norm
    /// fused; the state is read, not written ([`GdnConvAdvance`] moves it).
    GdnConvPrefill ["gdn_conv_prefill"] {
        p: Dev<f32>, state: Dev<f32>, w: Dev<f32>, out: Dev<f32>, t: i32, c: i32, ldp: i32,
        kern: i32, hk: i32, dk: i32, q_scale: f32,
    }
    /// The conv state after `t` more inputs.
    GdnConvAdvance ["gdn_conv_advance"] {
        p: Dev<f32>, state: Dev<f32>, t: i32, c: i32, ldp: i32, kern: i32,
    }
    /// W, Q', U and γ of every chunk and value head, and O's intra-chunk part into `o`.
    GdnChunkPrep ["gdn_chunk_prep_128"] {
        qkv: Dev<f32>, c: i32, g: Dev<f32>, beta: Dev<f32>, w_out: Dev<f32>, qp_out: Dev<f32>,
        u_out: Dev<f32>, gamma_out: Dev<f32>, o: Dev<f32>, t: i32, hk: i32, hv: i32, dv: i32,
    }
}

/// Tokens per block of `gdn_conv_prefill` (`GDN_CONV_TT` in gdn_chunk.cu).
const CONV_TOKENS: usize = 32;
/// Threads of `gdn_chunk_prep` (its tiling is written for 256, 8 warps).
const PREP_THREADS: u32 = 256;

/// The chunk prep may use the GPU's whole opt-in shared memory (how much it needs depends on
/// the shape: `GdnShape::chunked_fits` checks it).
pub(super) fn dynamic_smem(max_smem: usize) -> Vec<(&'static str, usize)> {
    GdnChunkPrep::NAMES.iter().map(|&n| (n, max_smem)).collect()
}

impl GdnConvPrefill {
    /// Blocks of 32 tokens by (q and k heads, then groups of 128 value channels); `hv_dv` the
    /// value channels.
    pub fn launch(&self, gpu: &Gpu, hv_dv: usize, on: On) -> Result<()> {
        let (t, c) = (self.t as usize, self.c as usize);
        ensure!(
            self.out.len >= t * c && c == 2 * (self.hk * self.dk) as usize + hv_dv,
            "gdn_conv_prefill: {t} x {c}: out {:?}",
            self.out
        );
        let grid = (
            t.div_ceil(CONV_TOKENS) as u32,
            (2 * self.hk as usize + hv_dv.div_ceil(128)) as u32,
            1,
        );
        gpu.run("gdn_conv_prefill", grid, 128, 0, &self.args(), on)
    }
}

impl GdnConvAdvance {
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let c = self.c as usize;
        ensure!(
            self.state.len >= (self.kern as usize - 1) * c,
            "gdn_conv_advance: state {:?}",
            self.state
        );
        gpu.run(
            "gdn_conv_advance",
            (c.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &self.args(),
            on,
        )
    }
}

impl GdnChunkPrep {
    /// Grid (chunks, value heads) with `smem` bytes (`GdnShape::prep_smem_bytes`).
    pub fn launch(&self, gpu: &Gpu, dk: usize, chunks: usize, smem: usize, on: On) -> Result<()> {
        ensure!(
            smem <= gpu.max_smem_per_block,
            "gdn_chunk_prep: {smem} bytes of shared memory"
        );
        let name = for_dk(Self::NAMES, dk)?;
        let grid = (chunks as u32, self.hv as u32, 1);
        gpu.run(name, grid, PREP_THREADS, smem, &self.args(), on)
    }
}
