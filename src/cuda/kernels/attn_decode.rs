//! `attn_decode.cu`: attention for few query positions. The decode step's `attn_prep` (a
//! block a head: q/k RMSNorm and rotation at the device's position, K and V into the cache),
//! split-K attention on tensor cores (`attn_decode_mma_hd*`, a warp a KV head and split) and its
//! merge with the output gate (`attn_combine_dec`); and for prefill calls shorter than the
//! flash kernels' tile, the scalar split-K pair `attn_split` / `attn_combine`.

use super::{Dev, On, kernels};
use crate::cuda::{Gpu, block_threads};
use anyhow::{Result, ensure};
use half::bf16;

kernels! {
    /// A block a head: q (RMSNorm, rotation) into `q_out`, K and V into the caches, at position
    /// `past` or (non-null) `past_dev[0]`.
    AttnPrep ["attn_prep"] {
        qg: Dev<f32>, k: Dev<f32>, v: Dev<f32>, q_norm: Dev<f32>, k_norm: Dev<f32>,
        inv_freq: Dev<f32>, q_out: Dev<f32>, k_cache: Dev<bf16>, v_cache: Dev<bf16>, past: i32,
        past_dev: Dev<i32>, nq: i32, nkv: i32, hd: i32, rot_half: i32, eps: f32, tab: Dev<u64>,
    }
    /// Each split's partial softmax sums over `chunk` positions into `part [.., nsplit, hd + 2]`.
    AttnSplit ["attn_split"] {
        q: Dev<f32>, k_cache: Dev<bf16>, v_cache: Dev<bf16>, part: Dev<f32>, past: i32,
        past_dev: Dev<i32>, nq: i32, nkv: i32, hd: i32, nsplit: i32, chunk: i32, scale: f32,
    }
    /// Merges [`AttnSplit`]'s splits, normalises, gates by sigmoid(qg's second half).
    AttnCombine ["attn_combine"] {
        part: Dev<f32>, qg: Dev<f32>, out: Dev<bf16>, past: i32, past_dev: Dev<i32>, nq: i32,
        hd: i32, nsplit: i32, chunk: i32,
    }
    /// The decode step's split-K attention on tensor cores: a warp a (KV head, split), the
    /// group's query heads rows of one 16-row tile; the splits' length from the position.
    AttnDecodeMma ["attn_decode_mma_hd256"] {
        q: Dev<f32>, kc: Dev<bf16>, vc: Dev<bf16>, part: Dev<f32>, past_dev: Dev<i32>, nq: i32,
        nkv: i32, nsplit: i32, scale: f32, tab: Dev<u64>,
    }
    /// Merges [`AttnDecodeMma`]'s splits, normalises and gates: a block a head and 32 dims.
    AttnCombineDec ["attn_combine_dec"] {
        part: Dev<f32>, qg: Dev<f32>, out: Dev<bf16>, past_dev: Dev<i32>, nq: i32, hd: i32,
        nsplit: i32, ldqg: i32,
    }
}

/// Head dims `attn_decode_mma` is compiled for (the model's).
pub const DECODE_HEAD_DIMS: [usize; 1] = [256];

/// Dynamic shared memory of `attn_decode_mma_hd*`: Q (16 rows) and double-buffered K and V
/// tiles of 32 keys, rows padded by 8.
pub const fn decode_mma_smem(hd: usize) -> usize {
    (16 + 4 * 32) * (hd + 8) * 2
}

pub(super) fn dynamic_smem() -> Vec<(&'static str, usize)> {
    AttnDecodeMma::NAMES
        .iter()
        .zip(DECODE_HEAD_DIMS)
        .map(|(&n, hd)| (n, decode_mma_smem(hd)))
        .collect()
}

impl AttnPrep {
    /// A block a head of each of `rows` tokens: one sequence's next (its caches given), or
    /// with `tab` (`[K cache of each row | V cache of each row]`) one of each of `rows`
    /// sequences, at the positions `past_dev` holds per row.
    pub fn launch(&self, gpu: &Gpu, rows: usize, on: On) -> Result<()> {
        let (hd, nq) = (self.hd as usize, self.nq as usize);
        ensure!(
            self.past_dev.is_null() || self.past == 0,
            "attn_prep: a host and a device position"
        );
        ensure!(
            rows == 1
                || (self.tab.len >= 2 * rows
                    && self.past_dev.len >= rows
                    && self.q_out.len >= rows * nq * hd),
            "attn_prep: {rows} rows: table {:?}, positions {:?}, q {:?}",
            self.tab,
            self.past_dev,
            self.q_out
        );
        let grid = (rows as u32, (self.nq + self.nkv) as u32, 1);
        gpu.run(
            "attn_prep",
            grid,
            block_threads(hd),
            hd * 4,
            &self.args(),
            on,
        )
    }
}

impl AttnSplit {
    /// Grid (tokens, query heads, split groups of 4).
    pub fn launch(&self, gpu: &Gpu, t: usize, on: On) -> Result<()> {
        let (nq, hd, nsplit) = (self.nq as usize, self.hd as usize, self.nsplit as usize);
        ensure!(
            self.part.len >= t * nq * nsplit * (hd + 2),
            "attn_split: {t} x {nq} x {nsplit} splits into {:?}",
            self.part
        );
        let grid = (t as u32, nq as u32, nsplit.div_ceil(4) as u32);
        gpu.run("attn_split", grid, 128, 0, &self.args(), on)
    }
}

impl AttnCombine {
    /// A block a (token, head).
    pub fn launch(&self, gpu: &Gpu, t: usize, on: On) -> Result<()> {
        let (nq, hd) = (self.nq as usize, self.hd as usize);
        ensure!(
            self.out.len >= t * nq * hd,
            "attn_combine: out {:?}",
            self.out
        );
        let grid = (t as u32, nq as u32, 1);
        gpu.run("attn_combine", grid, block_threads(hd), 0, &self.args(), on)
    }
}

impl AttnDecodeMma {
    /// The kernel for head dim `hd` and `group` query heads a KV head, if there is one (a
    /// group's heads are rows of one 16-row tile, of which the kernel writes 8).
    pub fn kernel(hd: usize, group: usize) -> Option<&'static str> {
        let i = DECODE_HEAD_DIMS.iter().position(|&d| d == hd)?;
        (group <= 8).then_some(Self::NAMES[i])
    }

    /// A warp a (KV head, split) of each of `rows` sequences (more than one: through `tab`).
    pub fn launch(&self, gpu: &Gpu, hd: usize, rows: usize, on: On) -> Result<()> {
        let (nq, nkv, nsplit) = (self.nq as usize, self.nkv as usize, self.nsplit as usize);
        let name = Self::kernel(hd, nq / nkv.max(1)).ok_or_else(|| {
            anyhow::anyhow!("attn_decode_mma: no kernel for head dim {hd}, {nq} heads over {nkv}")
        })?;
        ensure!(
            self.part.len >= rows * nq * nsplit * (hd + 2)
                && self.past_dev.len >= rows
                && self.q.len >= rows * nq * hd
                && (rows == 1 || self.tab.len >= 2 * rows),
            "attn_decode_mma: {rows} x {nq} x {nsplit} splits into {:?}, table {:?}",
            self.part,
            self.tab
        );
        let grid = (nkv as u32, nsplit as u32, rows as u32);
        gpu.run(name, grid, 32, decode_mma_smem(hd), &self.args(), on)
    }
}

impl AttnCombineDec {
    /// A block a (head, 32 dims) of each of `rows` sequences.
    pub fn launch(&self, gpu: &Gpu, rows: usize, on: On) -> Result<()> {
        let (nq, hd) = (self.nq as usize, self.hd as usize);
        let last = rows.saturating_sub(1);
        ensure!(
            rows >= 1
                && hd.is_multiple_of(32)
                && self.out.len >= rows * nq * hd
                && self.past_dev.len >= rows
                && self.qg.len >= last * self.ldqg as usize + nq * 2 * hd,
            "attn_combine_dec: {rows} rows, head dim {hd}, out {:?}, gates {:?}",
            self.out,
            self.qg
        );
        let grid = (nq as u32, (hd / 32) as u32, rows as u32);
        gpu.run("attn_combine_dec", grid, 256, 0, &self.args(), on)
    }
}
