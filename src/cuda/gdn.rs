//! Launchers of the Gated DeltaNet prefill kernels (`kernels/gdn_decode.cu`,
//! `kernels/gdn_chunk.cu`): the causal conv and the delta rule, sequential (short calls, and
//! prefill with the `KESTREL_GDN=recurrent` oracle) or token-parallel and chunked (prefill).

use super::Gpu;
use super::kernels::gdn_chunk::{GdnChunkPrep, GdnConvAdvance, GdnConvPrefill};
pub use super::kernels::gdn_decode::KEY_DIMS;
use super::kernels::gdn_decode::{GdnConv, GdnQkL2norm, GdnRecurrent};
use super::kernels::gdn_state::GdnChunkStateT64;
use super::kernels::trace::GdnPhaseRead;
use super::kernels::{Dev, On};
use crate::config::TextConfig;
use anyhow::Result;

/// Chunk length of the chunked delta rule (`GDN_C` in gdn_chunk.cu).
pub const CHUNK: usize = 64;
/// Value columns per block of `gdn_chunk_state_t64` (`GDN_T64_COLS`).
const STATE_T64_COLS: usize = 64;
/// `gdn_chunk_state_t64`'s progress counters: one a 128-byte line (`GDN_T64_FLAG_STRIDE`).
const STATE_T64_FLAG_STRIDE: usize = 32;

/// One GDN call: `t` tokens; `hk` key heads of dim `dk`, `hv` value heads of dim `dv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The conv's input rows `[t, c]` (f32): at `p`, `ld` floats apart (0: packed, `c`), so
/// that they can be the first columns of the whole in-projection's output.
#[derive(Clone, Copy, Debug)]
pub struct ConvRows {
    pub p: Dev<f32>,
    pub ld: usize,
}

impl ConvRows {
    /// Rows of exactly the shape's channels.
    pub fn packed(p: Dev<f32>) -> Self {
        ConvRows { p, ld: 0 }
    }

    fn ld(&self, sh: &GdnShape) -> i32 {
        (if self.ld == 0 { sh.channels() } else { self.ld }) as i32
    }
}

/// Device buffers (f32) of one delta-rule call.
#[derive(Clone, Copy, Debug)]
pub struct DeltaBufs {
    /// Conv output `[t, c]`: q heads, k heads, v heads; q and k L2-normalised.
    pub qkv: Dev<f32>,
    /// Log-decay `[t, hv]`.
    pub g: Dev<f32>,
    /// Write strength `[t, hv]`.
    pub beta: Dev<f32>,
    /// Recurrent state `[hv, dk, dv]`, advanced in place.
    pub state: Dev<f32>,
    /// Output `[t, hv, dv]`.
    pub o: Dev<f32>,
}

impl GdnShape {
    pub fn of(cfg: &TextConfig, t: usize) -> Self {
        GdnShape {
            t,
            hk: cfg.gdn_num_key_heads,
            hv: cfg.gdn_num_value_heads,
            dk: cfg.gdn_key_dim,
            dv: cfg.gdn_value_dim,
        }
    }

    /// Channels of a conv row: q heads, k heads, v heads.
    pub fn channels(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }

    fn chunks(&self) -> usize {
        self.t.div_ceil(CHUNK)
    }

    /// Floats of the scratch of [`Gpu::gdn_delta_chunked`]: W, Q', U and γ for every token
    /// of every chunk (the last one padded) and value head, then (dk = 128) the states and
    /// counters `gdn_chunk_state_t64` hands its out blocks.
    pub fn chunk_scratch_floats(&self) -> usize {
        self.prep_scratch_floats() + self.t64_scratch_floats()
    }

    /// W, Q', U and γ (the prep's outputs) in the scratch.
    fn prep_scratch_floats(&self) -> usize {
        self.hv * self.chunks() * CHUNK * (2 * self.dk + self.dv + 1)
    }

    /// State blocks of `gdn_chunk_state_t64`: a value head's 64-column slices.
    fn t64_state_blocks(&self) -> usize {
        self.hv * self.dv.div_ceil(STATE_T64_COLS)
    }

    /// `gdn_chunk_state_t64`'s part of the scratch (dk = 128 only): every chunk's Sᵀ of every
    /// state block (128 threads x 64 floats) and a progress counter (u32) a state block.
    fn t64_scratch_floats(&self) -> usize {
        if self.dk != 128 {
            return 0;
        }
        self.t64_state_blocks() * (self.chunks() * 128 * 64 + STATE_T64_FLAG_STRIDE)
    }

    /// Dynamic shared memory of `gdn_chunk_prep` (layout in gdn_chunk.cu): −L and −P, γ, e^γ, β, the
    /// four 16x16 T_d (rows of 20), and K and Q, which X = [W | U | zero padding to 8 columns]
    /// (rows of ≡ 8 mod 32 floats) later replaces; 108,288 bytes at dk = dv = 128.
    fn prep_smem_bytes(&self) -> usize {
        let (dk, dv) = (self.dk, self.dv);
        let nx = dk + dv.div_ceil(8) * 8;
        let ldx = nx + (40 - nx % 32) % 32;
        let kq = (2 * CHUNK * (dk + 4)).max(CHUNK * ldx);
        4 * (2 * CHUNK * (CHUNK + 4) + 3 * CHUNK + 4 * 16 * 20 + kq)
    }

    /// Dynamic shared memory of `gdn_chunk_state_t64` (dk = 128 only): the bf16 hi and lo
    /// tiles of two W buffers (the out role's Q' the second) and K (64 x dk each), U and
    /// O_intra ([64][68] f32 each), γ twice and ten mbarriers; 133,712 bytes.
    fn state_t64_smem_bytes(&self) -> usize {
        2 * 2 * 3 * CHUNK * self.dk + 4 * (2 * CHUNK * 68 + 2 * CHUNK) + 10 * 8
    }

    /// Whether `gdn_chunk_state_t64` takes this shape (it is compiled for dk = 128) on a GPU of
    /// `sms` SMs: a block an SM, the state blocks and at least one out block all resident.
    fn state_t64_fits(&self, smem: usize, sms: usize) -> bool {
        self.dk == 128 && self.state_t64_smem_bytes() <= smem && self.t64_state_blocks() < sms
    }

    /// Whether the token-parallel conv and chunked delta rule take this shape on a GPU of
    /// `smem` bytes of shared memory per block and `sms` SMs (otherwise prefill runs the
    /// sequential kernels).
    pub fn chunked_fits(&self, smem: usize, sms: usize) -> bool {
        KEY_DIMS.contains(&self.dk)
            && self.dv.is_multiple_of(4)
            && self.channels().is_multiple_of(4)
            && self.prep_smem_bytes() <= smem
            && self.state_t64_fits(smem, sms)
    }
}

impl Gpu {
    /// Causal conv + SiLU of the rows `p` `[t, c]` into `out`, token by token (one thread
    /// per channel), then the q/k L2 norm (q also times dk^-1/2). `conv_state`
    /// `[kern-1, c]` is advanced to end with the last inputs.
    pub fn gdn_conv_sequential(
        &self,
        sh: &GdnShape,
        kern: usize,
        p: ConvRows,
        conv_state: Dev<f32>,
        conv_w: Dev<f32>,
        out: Dev<f32>,
    ) -> Result<()> {
        let c = sh.channels() as i32;
        GdnConv {
            p: p.p,
            state: conv_state,
            w: conv_w,
            out,
            t: sh.t as i32,
            c,
            ldp: p.ld(sh),
            kern: kern as i32,
        }
        .launch(self, On::Plain)?;
        GdnQkL2norm {
            qkv: out,
            c,
            hk: sh.hk as i32,
            dk: sh.dk as i32,
            q_scale: 1.0 / (sh.dk as f32).sqrt(),
        }
        .launch(self, sh.t, On::Plain)
    }

    /// [`Gpu::gdn_conv_sequential`] with every (token, channel) in parallel and the norm
    /// fused, then the conv state advanced by a second kernel. Needs dk <= 128.
    pub fn gdn_conv_prefill(
        &self,
        sh: &GdnShape,
        kern: usize,
        p: ConvRows,
        conv_state: Dev<f32>,
        conv_w: Dev<f32>,
        out: Dev<f32>,
    ) -> Result<()> {
        let (t, c, ldp, kern) = (sh.t as i32, sh.channels() as i32, p.ld(sh), kern as i32);
        GdnConvPrefill {
            p: p.p,
            state: conv_state,
            w: conv_w,
            out,
            t,
            c,
            ldp,
            kern,
            hk: sh.hk as i32,
            dk: sh.dk as i32,
            q_scale: 1.0 / (sh.dk as f32).sqrt(),
        }
        .launch(self, sh.hv * sh.dv, On::Prefill)?;
        GdnConvAdvance {
            p: p.p,
            state: conv_state,
            t,
            c,
            ldp,
            kern,
        }
        .launch(self, On::Prefill)
    }

    /// The delta rule token by token: a block per value head, a thread per value column.
    pub fn gdn_delta_recurrent(&self, sh: &GdnShape, b: &DeltaBufs) -> Result<()> {
        GdnRecurrent {
            qkv: b.qkv,
            c: sh.channels() as i32,
            g: b.g,
            beta: b.beta,
            state: b.state,
            o: b.o,
            t: sh.t as i32,
            hk: sh.hk as i32,
            hv: sh.hv as i32,
            dv: sh.dv as i32,
        }
        .launch(self, sh.dk, On::Plain)
    }

    /// gdn_chunk_state's phase clock (trace.cuh, `g_gdn_phase`: 16 u64 a chunk, all 0 unless
    /// the kernels were compiled with `KESTREL_TRACE=1`).
    pub fn gdn_phase_trace(&self) -> Result<Vec<u64>> {
        let n = 256 * 16;
        let out = self.alloc(n * 8)?;
        GdnPhaseRead { out: out.view() }.launch(self)?;
        let mut v = vec![0u64; n];
        self.copy_to_host(out.ptr, &mut v)?;
        Ok(v)
    }

    /// The delta rule in chunks of 64 (same results as [`Gpu::gdn_delta_recurrent`] up to
    /// rounding): `gdn_chunk_prep`, grid (chunks, hv), prepares every chunk in parallel, then
    /// `gdn_chunk_state_t64` (Sᵀ in registers, 3xBF16 wgmma products, a block an SM) carries
    /// the state through the chunks.
    /// `scratch` holds [`GdnShape::chunk_scratch_floats`] floats; the shape must pass
    /// [`GdnShape::chunked_fits`].
    pub fn gdn_delta_chunked(&self, sh: &GdnShape, b: &DeltaBufs, scratch: Dev<f32>) -> Result<()> {
        anyhow::ensure!(
            scratch.len >= sh.chunk_scratch_floats(),
            "gdn_delta_chunked: scratch {scratch:?} for {sh:?}"
        );
        let tp = sh.chunks() * CHUNK;
        let w = scratch;
        let qp = w.at(sh.hv * tp * sh.dk);
        let u = qp.at(sh.hv * tp * sh.dk);
        let gamma = u.at(sh.hv * tp * sh.dv);
        let (c, t, hk, hv, dv) = (
            sh.channels() as i32,
            sh.t as i32,
            sh.hk as i32,
            sh.hv as i32,
            sh.dv as i32,
        );
        anyhow::ensure!(
            sh.chunked_fits(self.max_smem_per_block, self.sm_count),
            "gdn_delta_chunked: {sh:?} does not fit the chunked kernels"
        );
        let s_out = scratch.at(sh.prep_scratch_floats());
        let flags: Dev<u32> = {
            let f = s_out.at(sh.t64_state_blocks() * sh.chunks() * 128 * 64);
            Dev::new(f.ptr, f.len)
        };
        // the state pass's progress counters start at zero (set before the prep, so that the
        // state pass still follows the prep directly)
        self.memset_zero(flags.ptr, sh.t64_state_blocks() * STATE_T64_FLAG_STRIDE * 4)?;
        GdnChunkPrep {
            qkv: b.qkv,
            c,
            g: b.g,
            beta: b.beta,
            w_out: w,
            qp_out: qp,
            u_out: u,
            gamma_out: gamma,
            o: b.o,
            t,
            hk,
            hv,
            dv,
        }
        .launch(self, sh.dk, sh.chunks(), sh.prep_smem_bytes(), On::Prefill)?;
        // one block an SM: the state blocks, then out blocks on the other SMs; its Sᵀ scratch
        // and counters after the prep's outputs
        GdnChunkStateT64 {
            qkv: b.qkv,
            c,
            w_in: w,
            qp_in: qp,
            u_in: u,
            gamma_in: gamma,
            state: b.state,
            o: b.o,
            s_out,
            flags,
            t,
            hk,
            hv,
            dv,
        }
        .launch(self, sh.state_t64_smem_bytes(), On::Prefill)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model's GDN shape takes the chunked kernels on an H200 (227 KiB of shared memory a
    /// block); a GPU with less falls back.
    #[test]
    fn model_shape_fits_the_chunked_kernels() {
        let h200 = 232_448;
        let sh = GdnShape {
            t: 8192,
            hk: 16,
            hv: 32,
            dk: 128,
            dv: 128,
        };
        assert!(sh.chunked_fits(h200, 132));
        assert_eq!(sh.state_t64_smem_bytes(), 133_712);
        assert!(sh.state_t64_fits(h200, 132));
        assert!(!GdnShape { dk: 64, ..sh }.state_t64_fits(h200, 132));
        assert!(
            !sh.state_t64_fits(h200, 64),
            "64 state blocks need an SM each and one more for an out block"
        );
        assert!(
            !sh.chunked_fits(100 * 1024, 132),
            "a smaller GPU falls back to the recurrent path"
        );
        assert_eq!(
            sh.chunk_scratch_floats(),
            32 * 8192 * (2 * 128 + 128 + 1) + 64 * (128 * 128 * 64 + 32),
            "W, Q', U and γ for every token of every head; gdn_chunk_state_t64's states and counters (a 128-byte line each)"
        );
    }
}
