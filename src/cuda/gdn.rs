//! Launchers of the Gated DeltaNet prefill kernels (`kernels/gdn_decode.cu`,
//! `kernels/gdn_chunk.cu`): the causal conv and the delta rule, sequential (short calls, and
//! prefill with the `KESTREL_GDN=recurrent` oracle) or token-parallel and chunked (prefill).

use super::{Arg, Gpu, block_threads as block};
use crate::config::TextConfig;
use anyhow::Result;

/// Chunk length of the chunked delta rule (`GDN_C` in gdn_chunk.cu).
pub const CHUNK: usize = 64;
/// Tokens per block of `gdn_conv_prefill` (`GDN_CONV_TT` in gdn_chunk.cu).
const CONV_TOKENS: usize = 32;
/// Value columns per block of `gdn_chunk_state` (`GDN_DVS`).
const STATE_COLS: usize = 32;
/// Threads of `gdn_chunk_prep` (its tiling is written for 256, 8 warps).
const PREP_THREADS: u32 = 256;
/// Threads of `gdn_chunk_state` (two teams of 8 warps, `GDN_STATE_THREADS`).
const STATE_THREADS: u32 = 512;
/// Threads of `gdn_chunk_state_t64` (a consumer and two producer warpgroups, `GDN_T64_THREADS`).
const STATE_T64_THREADS: u32 = 384;
/// Value columns per block of `gdn_chunk_state_t64` (`GDN_T64_COLS`).
const STATE_T64_COLS: usize = 64;
/// `gdn_chunk_state_t64`'s progress counters: one a 128-byte line (`GDN_T64_FLAG_STRIDE`).
const STATE_T64_FLAG_STRIDE: usize = 32;
/// Key head dims the delta-rule kernels are compiled for.
pub const KEY_DIMS: [usize; 4] = [16, 32, 64, 128];
/// The chunked kernels, which use more than the default 48 KiB of shared memory.
pub(super) const CHUNK_KERNELS: [&str; 9] = [
    "gdn_chunk_prep_16",
    "gdn_chunk_prep_32",
    "gdn_chunk_prep_64",
    "gdn_chunk_prep_128",
    "gdn_chunk_state_16",
    "gdn_chunk_state_32",
    "gdn_chunk_state_64",
    "gdn_chunk_state_128",
    "gdn_chunk_state_t64_128",
];

/// One GDN call: `t` tokens; `hk` key heads of dim `dk`, `hv` value heads of dim `dv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The conv's input rows `[t, c]` (f32): at `ptr`, `ld` floats apart (0: packed, `c`), so
/// that they can be the first columns of the whole in-projection's output.
#[derive(Clone, Copy, Debug)]
pub struct ConvRows {
    pub ptr: u64,
    pub ld: usize,
}

impl ConvRows {
    /// Rows of exactly the shape's channels.
    pub fn packed(ptr: u64) -> Self {
        ConvRows { ptr, ld: 0 }
    }

    fn ld(&self, sh: &GdnShape) -> i32 {
        (if self.ld == 0 { sh.channels() } else { self.ld }) as i32
    }
}

/// Device buffers (f32) of one delta-rule call.
#[derive(Clone, Copy, Debug)]
pub struct DeltaBufs {
    /// Conv output `[t, c]`: q heads, k heads, v heads; q and k L2-normalised.
    pub qkv: u64,
    /// Log-decay `[t, hv]`.
    pub g: u64,
    /// Write strength `[t, hv]`.
    pub beta: u64,
    /// Recurrent state `[hv, dk, dv]`, advanced in place.
    pub state: u64,
    /// Output `[t, hv, dv]`.
    pub o: u64,
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

    /// Dynamic shared memory of `gdn_chunk_state`: W, Q' twice, K, S twice and V' (tf32 hi and
    /// lo in gdn_state.cu's quad layout, 4 * 32 + 8 floats per 2 rows), γ twice; 223,744 bytes at
    /// dk = 128.
    fn state_smem_bytes(&self) -> usize {
        let quad = (4 * STATE_COLS + 8) / 2;
        4 * (3 * CHUNK * (self.dk + 4)
            + CHUNK * (self.dk + 8)
            + 2 * self.dk * quad
            + CHUNK * quad
            + 2 * CHUNK)
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

    /// Whether the token-parallel conv and chunked delta rule take this shape, given `smem`
    /// bytes of shared memory per block (otherwise prefill runs the sequential kernels).
    pub fn chunked_fits(&self, smem: usize) -> bool {
        KEY_DIMS.contains(&self.dk)
            && self.dv.is_multiple_of(4)
            && self.channels().is_multiple_of(4)
            && self.prep_smem_bytes() <= smem
            && self.state_smem_bytes() <= smem
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
        conv_state: u64,
        conv_w: u64,
        out: u64,
    ) -> Result<()> {
        let c = sh.channels();
        self.launch(
            "gdn_conv",
            (c.div_ceil(128) as u32, 1, 1),
            128,
            0,
            &[
                Arg::Ptr(p.ptr),
                Arg::Ptr(conv_state),
                Arg::Ptr(conv_w),
                Arg::Ptr(out),
                Arg::I(sh.t as i32),
                Arg::I(c as i32),
                Arg::I(p.ld(sh)),
                Arg::I(kern as i32),
            ],
        )?;
        self.launch(
            "gdn_qk_l2norm",
            (sh.t as u32, 2 * sh.hk as u32, 1),
            block(sh.dk),
            0,
            &[
                Arg::Ptr(out),
                Arg::I(c as i32),
                Arg::I(sh.hk as i32),
                Arg::I(sh.dk as i32),
                Arg::F(1.0 / (sh.dk as f32).sqrt()),
            ],
        )
    }

    /// [`Gpu::gdn_conv_sequential`] with every (token, channel) in parallel and the norm
    /// fused, then the conv state advanced by a second kernel. Needs dk <= 128.
    pub fn gdn_conv_prefill(
        &self,
        sh: &GdnShape,
        kern: usize,
        p: ConvRows,
        conv_state: u64,
        conv_w: u64,
        out: u64,
    ) -> Result<()> {
        let c = sh.channels();
        let v_groups = (sh.hv * sh.dv).div_ceil(128);
        self.launch_dep(
            "gdn_conv_prefill",
            (
                sh.t.div_ceil(CONV_TOKENS) as u32,
                (2 * sh.hk + v_groups) as u32,
                1,
            ),
            128,
            0,
            &[
                Arg::Ptr(p.ptr),
                Arg::Ptr(conv_state),
                Arg::Ptr(conv_w),
                Arg::Ptr(out),
                Arg::I(sh.t as i32),
                Arg::I(c as i32),
                Arg::I(p.ld(sh)),
                Arg::I(kern as i32),
                Arg::I(sh.hk as i32),
                Arg::I(sh.dk as i32),
                Arg::F(1.0 / (sh.dk as f32).sqrt()),
            ],
        )?;
        self.launch_dep(
            "gdn_conv_advance",
            (c.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(p.ptr),
                Arg::Ptr(conv_state),
                Arg::I(sh.t as i32),
                Arg::I(c as i32),
                Arg::I(p.ld(sh)),
                Arg::I(kern as i32),
            ],
        )
    }

    /// The delta rule token by token: a block per value head, a thread per value column.
    pub fn gdn_delta_recurrent(&self, sh: &GdnShape, b: &DeltaBufs) -> Result<()> {
        self.launch(
            &format!("gdn_recurrent_{}", sh.dk),
            (sh.hv as u32, 1, 1),
            block(sh.dv),
            0,
            &[
                Arg::Ptr(b.qkv),
                Arg::I(sh.channels() as i32),
                Arg::Ptr(b.g),
                Arg::Ptr(b.beta),
                Arg::Ptr(b.state),
                Arg::Ptr(b.o),
                Arg::I(sh.t as i32),
                Arg::I(sh.hk as i32),
                Arg::I(sh.hv as i32),
                Arg::I(sh.dv as i32),
            ],
        )
    }

    /// gdn_chunk_state's phase clock (trace.cuh, `g_gdn_phase`: 16 u64 a chunk, all 0 unless
    /// the kernels were compiled with `KESTREL_TRACE=1`).
    pub fn gdn_phase_trace(&self) -> Result<Vec<u64>> {
        let n = 256 * 16;
        let out = self.alloc(n * 8)?;
        self.launch("gdn_phase_read", (1, 1, 1), 256, 0, &[Arg::Ptr(out.ptr)])?;
        let mut v = vec![0u64; n];
        self.copy_to_host(out.ptr, &mut v)?;
        Ok(v)
    }

    /// The delta rule in chunks of 64 (same results as [`Gpu::gdn_delta_recurrent`] up to
    /// rounding): `gdn_chunk_prep`, grid (chunks, hv), prepares every chunk in parallel, then
    /// the state pass carries the state through the chunks: `gdn_chunk_state_t64` (Sᵀ in
    /// registers, 3xBF16 wgmma products, a block an SM) at dk = 128, else `gdn_chunk_state`
    /// (3xTF32 mma.sync), grid (hv, dv / 32).
    /// `scratch` holds [`GdnShape::chunk_scratch_floats`] floats; the shape must pass
    /// [`GdnShape::chunked_fits`].
    pub fn gdn_delta_chunked(&self, sh: &GdnShape, b: &DeltaBufs, scratch: u64) -> Result<()> {
        let tp = sh.chunks() * CHUNK;
        let w = scratch;
        let qp = w + (sh.hv * tp * sh.dk * 4) as u64;
        let u = qp + (sh.hv * tp * sh.dk * 4) as u64;
        let gamma = u + (sh.hv * tp * sh.dv * 4) as u64;
        let c = sh.channels() as i32;
        let t64 = sh.state_t64_fits(self.max_smem_per_block, self.sm_count);
        let s_out = scratch + (sh.prep_scratch_floats() * 4) as u64;
        let flags = s_out + (sh.t64_state_blocks() * sh.chunks() * 128 * 64 * 4) as u64;
        if t64 {
            // its progress counters start at zero (set before the prep, so that the state
            // pass still follows the prep directly)
            self.memset_zero(flags, sh.t64_state_blocks() * STATE_T64_FLAG_STRIDE * 4)?;
        }
        let tail = [
            Arg::I(sh.t as i32),
            Arg::I(sh.hk as i32),
            Arg::I(sh.hv as i32),
            Arg::I(sh.dv as i32),
        ];
        let mut args = vec![
            Arg::Ptr(b.qkv),
            Arg::I(c),
            Arg::Ptr(b.g),
            Arg::Ptr(b.beta),
            Arg::Ptr(w),
            Arg::Ptr(qp),
            Arg::Ptr(u),
            Arg::Ptr(gamma),
            Arg::Ptr(b.o),
        ];
        args.extend(tail);
        self.launch_dep(
            &format!("gdn_chunk_prep_{}", sh.dk),
            (sh.chunks() as u32, sh.hv as u32, 1),
            PREP_THREADS,
            sh.prep_smem_bytes() as u32,
            &args,
        )?;
        let mut args = vec![
            Arg::Ptr(b.qkv),
            Arg::I(c),
            Arg::Ptr(w),
            Arg::Ptr(qp),
            Arg::Ptr(u),
            Arg::Ptr(gamma),
            Arg::Ptr(b.state),
            Arg::Ptr(b.o),
        ];
        args.extend(tail);
        // the Sᵀ-in-registers pass where it takes the shape (decided above)
        let (name, threads, smem, grid) = if t64 {
            // one block an SM: the state blocks, then out blocks on the other SMs; its Sᵀ
            // scratch and counters after the output
            let tail = args.split_off(8);
            args.extend([Arg::Ptr(s_out), Arg::Ptr(flags)]);
            args.extend(tail);
            (
                "gdn_chunk_state_t64",
                STATE_T64_THREADS,
                sh.state_t64_smem_bytes(),
                (self.sm_count as u32, 1, 1),
            )
        } else {
            (
                "gdn_chunk_state",
                STATE_THREADS,
                sh.state_smem_bytes(),
                (sh.hv as u32, sh.dv.div_ceil(STATE_COLS) as u32, 1),
            )
        };
        self.launch_dep(
            &format!("{name}_{}", sh.dk),
            grid,
            threads,
            smem as u32,
            &args,
        )
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
        assert!(sh.chunked_fits(h200));
        assert_eq!(sh.state_smem_bytes(), 223_744);
        assert_eq!(sh.state_t64_smem_bytes(), 133_712);
        assert!(sh.state_t64_fits(h200, 132));
        assert!(!GdnShape { dk: 64, ..sh }.state_t64_fits(h200, 132));
        assert!(
            !sh.state_t64_fits(h200, 64),
            "64 state blocks need an SM each and one more for an out block"
        );
        assert!(
            !sh.chunked_fits(100 * 1024),
            "a smaller GPU falls back to the recurrent path"
        );
        assert_eq!(
            sh.chunk_scratch_floats(),
            32 * 8192 * (2 * 128 + 128 + 1) + 64 * (128 * 128 * 64 + 32),
            "W, Q', U and γ for every token of every head; gdn_chunk_state_t64's states and counters (a 128-byte line each)"
        );
    }
}
