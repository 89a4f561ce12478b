//! Prefill attention (`kernels/attn_prefill.rs`): `attn_flash4_hd256` (wgmma, the queries
//! prepared on the way in), and which attention shapes the kernels take.

use super::Gpu;
pub use super::decode::decode_splits;
use super::kernels::attn_decode::AttnDecodeMma;
use super::kernels::attn_prefill::AttnFlash4;
use super::kernels::{Dev, On};
use anyhow::Result;
use half::bf16;

/// Whether the attention kernels take this shape (`rot_half` rotated frequencies): the prefill
/// flash kernel (head dim 256, an even number of query heads per KV head, a rotation of at most
/// 64 dims in steps of 8) and the decode kernel (at most 8 query heads per KV head).
pub fn attention_fits(nq: usize, nkv: usize, hd: usize, rot_half: usize) -> bool {
    AttnFlash4::fits(nq, nkv, hd, rot_half) && AttnDecodeMma::kernel(hd, nq / nkv).is_some()
}

/// The query heads' RMSNorm and partial rotation (attn_prep's), done by `attn_flash4` as it
/// loads Q from `qg`'s first half: `q_norm` f32 `[hd]`, `inv_freq` f32 `[rot_half]`.
#[derive(Clone, Copy, Debug)]
pub struct QPrep {
    pub q_norm: Dev<f32>,
    pub inv_freq: Dev<f32>,
    pub rot_half: usize,
    pub eps: f32,
}

/// One prefill attention call: the bf16 caches `[positions, nkv, hd]` holding `past + t`
/// positions, `qg` f32 `[t, nq, 2 * hd]` (the raw queries, then the output gate), `out` bf16
/// `[t, nq * hd]`.
#[derive(Clone, Copy, Debug)]
pub struct FlashCall {
    pub q_prep: QPrep,
    pub k_cache: Dev<bf16>,
    pub v_cache: Dev<bf16>,
    pub qg: Dev<f32>,
    pub out: Dev<bf16>,
    pub t: usize,
    pub past: usize,
    pub nq: usize,
    pub nkv: usize,
    pub hd: usize,
}

impl Gpu {
    /// Causal attention of the `t` new positions over the cache, the queries' RMSNorm and
    /// rotation and the sigmoid output gate fused (`attn_flash4`).
    pub fn attn_flash(&self, a: &FlashCall) -> Result<()> {
        let p = a.q_prep;
        AttnFlash4 {
            q: Dev::null(),
            kc: a.k_cache,
            vc: a.v_cache,
            qg: a.qg,
            out: a.out,
            t: a.t as i32,
            past: a.past as i32,
            nq: a.nq as i32,
            nkv: a.nkv as i32,
            hd: a.hd as i32,
            scale: 1.0 / (a.hd as f32).sqrt(),
            q_norm: p.q_norm,
            inv_freq: p.inv_freq,
            rot_half: p.rot_half as i32,
            eps: p.eps,
        }
        .launch(self, On::Prefill)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The selection rules take the model's shape and refuse the others.
    #[test]
    fn kernel_choices() {
        assert_eq!(AttnDecodeMma::kernel(256, 8), Some("attn_decode_mma_hd256"));
        assert_eq!(
            AttnDecodeMma::kernel(256, 16),
            None,
            "16 heads per KV head: 8 rows written"
        );
        assert_eq!(AttnDecodeMma::kernel(128, 2), None);
        assert!(attention_fits(16, 2, 256, 32), "the model");
        assert!(
            attention_fits(4, 2, 256, 32) && attention_fits(8, 2, 256, 32),
            "the fixtures"
        );
        assert!(!attention_fits(6, 2, 256, 32), "3 heads a group");
        assert!(!attention_fits(32, 2, 256, 32), "16 heads a group");
        assert!(!attention_fits(16, 2, 128, 32), "head dim 128");
        assert!(!attention_fits(16, 2, 256, 40), "a rotation of 80 dims");
    }
}
