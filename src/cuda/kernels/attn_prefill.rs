//! `attn_prefill.cu`: prefill attention. `attn_prep_rows` (the new rows' q/k RMSNorm and
//! partial rotation, K and V into the bf16 cache) and `attn_flash4_hd256` (warp-specialised
//! wgmma flash attention at head dim 256, the query prep fused, sigmoid output gate fused).

use super::{Dev, On, kernels};
use crate::cuda::Gpu;
use anyhow::{Result, ensure};
use half::bf16;

kernels! {
    /// A warp a (token, head) row: heads `h0..nq` of q (RMSNorm, rotation) into `q_out`, then
    /// the KV heads normalised and rotated into the caches at positions `past..past + t`.
    AttnPrepRows ["attn_prep_rows"] {
        qg: Dev<f32>, k: Dev<f32>, v: Dev<f32>, q_norm: Dev<f32>, k_norm: Dev<f32>,
        inv_freq: Dev<f32>, q_out: Dev<f32>, k_cache: Dev<bf16>, v_cache: Dev<bf16>, past: i32,
        t: i32, nq: i32, nkv: i32, hd: i32, rot_half: i32, eps: f32, h0: i32,
    }
    /// Causal attention of `t` new positions after `past` cached ones at head dim 256 on wgmma
    /// (a producer warpgroup streaming 80-key K/V tiles, two consumer warpgroups a head each of
    /// a KV group, 64 positions a block), the queries read raw from `qg` and prepared on the
    /// way in (`q_norm`, `inv_freq`, `rot_half`, `eps`; `q` unused); the output gated by
    /// sigmoid(qg's second half).
    AttnFlash4 ["attn_flash4_hd256"] {
        q: Dev<f32>, kc: Dev<bf16>, vc: Dev<bf16>, qg: Dev<f32>, out: Dev<bf16>, t: i32, past: i32,
        nq: i32, nkv: i32, hd: i32, scale: f32, q_norm: Dev<f32>, inv_freq: Dev<f32>,
        rot_half: i32, eps: f32,
    }
}

/// Query positions per block of `attn_flash4`.
const BLOCK_Q: usize = 64;

/// Dynamic shared memory of `attn_flash4_hd256` (F4_SMEM): Q of two heads (64 rows of 256
/// bf16 each) and two stages of K and V (80 rows each), in the 128-byte swizzle (224 KiB), 4
/// mbarriers.
pub const FLASH4_SMEM: usize = (2 * 64 + 4 * 80) * 256 * 2 + 32;

/// `attn_flash4_hd256`'s block: two consumer warpgroups and a producer warpgroup.
const FLASH4_THREADS: u32 = 384;

pub(super) fn dynamic_smem() -> Vec<(&'static str, usize)> {
    vec![("attn_flash4_hd256", FLASH4_SMEM)]
}

/// The causal grid: (head pairs, query tiles), the heaviest tile first in launch order.
fn flash_grid(nq: i32, t: i32) -> (u32, u32, u32) {
    ((nq / 2) as u32, (t as usize).div_ceil(BLOCK_Q) as u32, 1)
}

/// The flash kernel's contract: a block takes two heads of one KV group, the caches hold
/// `past + t` positions.
fn check_flash(
    name: &str,
    (q, kc, qg, out): (Dev<f32>, Dev<bf16>, Dev<f32>, Dev<bf16>),
    (t, past, nq, nkv, hd): (i32, i32, i32, i32, i32),
) -> Result<()> {
    let (t, past, nq, nkv, hd) = (
        t as usize,
        past as usize,
        nq as usize,
        nkv as usize,
        hd as usize,
    );
    ensure!(
        nkv > 0 && nq.is_multiple_of(nkv) && (nq / nkv).is_multiple_of(2),
        "{name}: {nq} query heads over {nkv} KV heads (two heads of a group a block)"
    );
    ensure!(
        kc.len >= (past + t) * nkv * hd && qg.len >= t * nq * 2 * hd && out.len >= t * nq * hd,
        "{name}: t {t} past {past}: caches {kc:?}, qg {qg:?}, out {out:?}"
    );
    ensure!(q.is_null() || q.len >= t * nq * hd, "{name}: q {q:?}");
    Ok(())
}

impl AttnPrepRows {
    /// A warp a row, 8 rows a block.
    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        let (t, nq, nkv, hd) = (
            self.t as usize,
            self.nq as usize,
            self.nkv as usize,
            self.hd as usize,
        );
        let past = self.past as usize;
        ensure!(
            hd.is_multiple_of(4) && self.k_cache.len >= (past + t) * nkv * hd,
            "attn_prep_rows: head dim {hd}, cache {:?} for {} positions",
            self.k_cache,
            past + t
        );
        let rows = t * (nq + nkv - self.h0 as usize);
        let grid = (rows.div_ceil(8) as u32, 1, 1);
        gpu.run("attn_prep_rows", grid, 256, 8 * hd * 4, &self.args(), on)
    }
}

impl AttnFlash4 {
    /// Whether this kernel takes the shape: head dim 256, two heads of a group a block, a
    /// rotation of at most 64 dims in steps of 8.
    pub fn fits(nq: usize, nkv: usize, hd: usize, rot_half: usize) -> bool {
        hd == 256
            && nkv > 0
            && nq.is_multiple_of(nkv)
            && (nq / nkv).is_multiple_of(2)
            && rot_half <= 32
            && rot_half.is_multiple_of(4)
    }

    pub fn launch(&self, gpu: &Gpu, on: On) -> Result<()> {
        ensure!(
            Self::fits(
                self.nq as usize,
                self.nkv as usize,
                self.hd as usize,
                self.rot_half as usize
            ),
            "attn_flash4: head dim {}, {} heads over {}, rotation {}",
            self.hd,
            self.nq,
            self.nkv,
            2 * self.rot_half
        );
        let (a, b) = (
            (self.q, self.kc, self.qg, self.out),
            (self.t, self.past, self.nq, self.nkv, self.hd),
        );
        check_flash("attn_flash4", a, b)?;
        let grid = flash_grid(self.nq, self.t);
        gpu.run(
            "attn_flash4_hd256",
            grid,
            FLASH4_THREADS,
            FLASH4_SMEM,
            &self.args(),
            on,
        )
    }
}
