//! Launchers of the prefill flash-attention kernels (`kernels/attn_prefill.cu`): `attn_flash4_hd256`
//! (wgmma, warp-specialised) at the model's head dim 256, `attn_flash3_hd*` (mma.sync) at the
//! other head dims the fixtures use.

use super::{Arg, Gpu};
use anyhow::{Result, bail};

/// Query positions per block of both kernels (attn_prefill.cu's FA_BQ and attn_flash4's 64).
const BLOCK_Q: usize = 64;

/// Dynamic shared memory of `attn_flash3_hd*`: Q for 64 positions x 2 heads and
/// double-buffered K and V tiles of 64 keys, rows padded by 8, then the warps' P fragments
/// (8 warps x 4 x 32 lanes x 16 bytes) and row maxima / sums (8 warps x 32 lanes x 16 bytes)
/// exchanged within warp pairs (223,232 bytes at hd 256).
const fn mma3_smem(hd: usize) -> usize {
    (2 * 64 + 4 * 64) * (hd + 8) * 2 + 8 * 4 * 32 * 16 + 8 * 32 * 16
}

/// `attn_flash4_hd256` with its dynamic shared memory (F4_SMEM): Q of two heads (64 rows of
/// 256 bf16 each) and two stages of K and V (80 rows each), in the 128-byte swizzle (224 KiB),
/// 4 mbarriers.
const WGMMA_KERNEL: (&str, usize) = ("attn_flash4_hd256", (2 * 64 + 4 * 80) * 256 * 2 + 32);

/// `attn_flash4_hd256`'s block: two consumer warpgroups and a producer warpgroup.
const WGMMA_THREADS: u32 = 384;

/// The flash kernels with the dynamic shared memory each may use (set at `Gpu::open`).
pub(super) const FLASH_KERNELS: [(&str, usize); 5] = [
    ("attn_flash3_hd32", mma3_smem(32)),
    ("attn_flash3_hd64", mma3_smem(64)),
    ("attn_flash3_hd128", mma3_smem(128)),
    ("attn_flash3_hd256", mma3_smem(256)),
    WGMMA_KERNEL,
];

/// Dynamic shared memory of `attn_decode_mma_hd*`: Q (16 rows) and double-buffered K and V
/// tiles of 32 keys, rows padded by 8.
pub const fn decode_mma_smem(hd: usize) -> usize {
    (16 + 4 * 32) * (hd + 8) * 2
}

/// The decode kernels on tensor cores with their dynamic shared memory (set at `Gpu::open`).
pub(super) const DECODE_KERNELS: [(&str, usize); 4] = [
    ("attn_decode_mma_hd32", decode_mma_smem(32)),
    ("attn_decode_mma_hd64", decode_mma_smem(64)),
    ("attn_decode_mma_hd128", decode_mma_smem(128)),
    ("attn_decode_mma_hd256", decode_mma_smem(256)),
];

/// The tensor-core decode kernel for head dim `hd` and `group` query heads per KV head, if
/// there is one (a group's heads are rows of one 16-row tile, of which the kernel writes 8).
pub fn decode_mma_kernel(hd: usize, group: usize) -> Option<&'static str> {
    match (group <= 8).then_some(hd)? {
        32 => Some(DECODE_KERNELS[0].0),
        64 => Some(DECODE_KERNELS[1].0),
        128 => Some(DECODE_KERNELS[2].0),
        256 => Some(DECODE_KERNELS[3].0),
        _ => None,
    }
}

/// The mma.sync kernel `attn_flash3_hd*` for head dim `hd` with `group` query heads per KV
/// head, if there is one (a block takes two heads of a group), with its dynamic shared memory.
fn mma_kernel(hd: usize, group: usize) -> Option<(&'static str, usize)> {
    let i = match hd {
        32 => 0,
        64 => 1,
        128 => 2,
        256 => 3,
        _ => return None,
    };
    group.is_multiple_of(2).then_some(FLASH_KERNELS[i])
}

/// Whether the attention kernels take this shape: a flash kernel for prefill and a tensor-core
/// kernel for decode (head dim 32, 64, 128 or 256; an even number of query heads per KV head,
/// at most 8).
pub fn attention_fits(nq: usize, nkv: usize, hd: usize) -> bool {
    nkv > 0
        && nq.is_multiple_of(nkv)
        && mma_kernel(hd, nq / nkv).is_some()
        && decode_mma_kernel(hd, nq / nkv).is_some()
}

/// The query heads' RMSNorm and partial rotation (attn_prep's), done by `attn_flash4` as it
/// loads Q from `qg`'s first half: `q_norm` f32 `[hd]`, `inv_freq` f32 `[rot_half]`.
#[derive(Clone, Copy, Debug)]
pub struct QPrep {
    pub q_norm: u64,
    pub inv_freq: u64,
    pub rot_half: usize,
    pub eps: f32,
}

/// One prefill attention call: `q` f32 `[t, nq, hd]` (unused with `q_prep`), the bf16 caches
/// `[positions, nkv, hd]` holding `past + t` positions, `qg` f32 `[t, nq, 2 * hd]` (the output
/// gate in the second half; with `q_prep` also the raw queries in the first), `out` bf16
/// `[t, nq * hd]`.
#[derive(Clone, Copy, Debug)]
pub struct FlashCall {
    pub q_prep: Option<QPrep>,
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub qg: u64,
    pub out: u64,
    pub t: usize,
    pub past: usize,
    pub nq: usize,
    pub nkv: usize,
    pub hd: usize,
}

impl Gpu {
    /// Whether this shape runs `attn_flash4`, the kernel that prepares the queries itself
    /// (`FlashCall::q_prep`): head dim 256 and a rotation of at most 64 dims in steps of 8.
    pub fn flash_preps_q(&self, nq: usize, nkv: usize, hd: usize, rot_half: usize) -> bool {
        hd == 256 && (nq / nkv).is_multiple_of(2) && rot_half <= 32 && rot_half.is_multiple_of(4)
    }

    /// Causal attention of the `t` new positions over the cache, sigmoid output gate fused:
    /// `attn_flash4` where the shape takes it (the caller passes its query prep), else
    /// `attn_flash3`.
    pub fn attn_flash(&self, a: &FlashCall) -> Result<()> {
        let group = a.nq / a.nkv;
        let wgmma = a.q_prep.is_some();
        if let Some(p) = a.q_prep {
            anyhow::ensure!(
                self.flash_preps_q(a.nq, a.nkv, a.hd, p.rot_half),
                "attention: the query prep fused for a shape without it (head dim {}, rotation {})",
                a.hd,
                2 * p.rot_half
            );
        }
        let ((name, smem), threads) = if wgmma {
            (WGMMA_KERNEL, WGMMA_THREADS)
        } else {
            match mma_kernel(a.hd, group) {
                Some(k) => (k, 256),
                None => bail!(
                    "attention: no flash kernel for head dim {} with {group} query heads a KV head",
                    a.hd
                ),
            }
        };
        // (head pairs, query tiles), heaviest tile first in launch order (attn_prefill.cu)
        let grid = ((a.nq / 2) as u32, a.t.div_ceil(BLOCK_Q) as u32, 1);
        let mut args = vec![
            Arg::Ptr(a.q),
            Arg::Ptr(a.k_cache),
            Arg::Ptr(a.v_cache),
            Arg::Ptr(a.qg),
            Arg::Ptr(a.out),
            Arg::I(a.t as i32),
            Arg::I(a.past as i32),
            Arg::I(a.nq as i32),
            Arg::I(a.nkv as i32),
            Arg::I(a.hd as i32),
            Arg::F(1.0 / (a.hd as f32).sqrt()),
        ];
        if let Some(p) = a.q_prep {
            args.extend([
                Arg::Ptr(p.q_norm),
                Arg::Ptr(p.inv_freq),
                Arg::I(p.rot_half as i32),
                Arg::F(p.eps),
            ]);
        }
        self.launch_dep(name, grid, threads, smem as u32, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel whose shared memory is set at `Gpu::open` is one the module loads, and the
    /// selection rules pick the kernel of the right head dim or none.
    #[test]
    fn kernel_tables_and_choices_agree() {
        for (name, smem) in FLASH_KERNELS.iter().chain(&DECODE_KERNELS) {
            assert!(super::super::KERNELS.contains(name), "{name} not loaded");
            assert!(
                *smem <= 227 * 1024,
                "{name}: {smem} bytes is over Hopper's opt-in limit"
            );
        }
        assert_eq!(decode_mma_kernel(256, 8), Some("attn_decode_mma_hd256"));
        assert_eq!(decode_mma_kernel(32, 2), Some("attn_decode_mma_hd32"));
        assert_eq!(
            decode_mma_kernel(256, 16),
            None,
            "16 heads per KV head: 8 rows written"
        );
        assert_eq!(decode_mma_kernel(96, 2), None);
        assert_eq!(mma_kernel(256, 8).map(|k| k.0), Some("attn_flash3_hd256"));
        assert_eq!(
            mma_kernel(128, 3),
            None,
            "a block takes two heads of a group"
        );
        assert_eq!(mma_kernel(80, 2), None);
        assert_eq!(mma_kernel(64, 2).map(|k| k.1), Some(mma3_smem(64)));
        assert!(attention_fits(16, 2, 256), "the model");
        assert!(
            attention_fits(4, 2, 32) && attention_fits(8, 2, 64),
            "the fixtures"
        );
        assert!(!attention_fits(6, 2, 256), "3 heads a group");
        assert!(!attention_fits(32, 2, 256), "16 heads a group");
        assert!(!attention_fits(16, 2, 96));
    }
}
