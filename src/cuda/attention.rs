//! Launcher of the prefill flash-attention kernels (`kernels/attention.cu`).

use super::{Arg, Gpu};
use anyhow::Result;

/// Which prefill attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flash {
    /// `attn_flash`: WMMA, 64 queries of one head per block (`KESTREL_ATTN=wmma`).
    Wmma,
    /// mma.sync, 64 queries of two heads of one KV group per block (the default; shapes without
    /// such a kernel fall back to `Wmma`): `attn_flash3_hd*` (warp pairs exchanging P), or
    /// `attn_flash2_hd*` when `KESTREL_ATTN=mma2`.
    Mma,
    /// `attn_flash2_hd*` whatever `KESTREL_ATTN` says (16 rows of one head per warp).
    Mma2,
    /// `attn_flash4_hd256`: wgmma, warp-specialised (a producer warpgroup for the K/V copies, a
    /// consumer warpgroup per head of `attn_flash3`'s block); the default, on sm_90a at head
    /// dim 256 (elsewhere it runs as `Mma`).
    Wgmma,
}

/// Whether `Flash::Mma` runs the older `attn_flash2_hd*` (`KESTREL_ATTN=mma2`), read once.
fn mma2_selected() -> bool {
    static MMA2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MMA2.get_or_init(|| std::env::var("KESTREL_ATTN").is_ok_and(|v| v == "mma2"))
}

/// Query positions per block of every kernel (attention.cu's FQ, FA_BQ and attn_flash4's 64).
const BLOCK_Q: usize = 64;

/// Dynamic shared memory of `attn_flash`: Q, K and V tiles, the f32 running output, the
/// scores and probabilities, the row max and sum.
const fn wmma_smem(hd: usize) -> usize {
    let (fq, fk) = (64, 64);
    (fq + 2 * fk) * (hd + 8) * 2
        + fq * (hd + 4) * 4
        + fq * (fk + 4) * 4
        + fq * (fk + 8) * 2
        + 2 * fq * 4
}

/// Dynamic shared memory of `attn_flash2_hd*`: Q for 64 positions x 2 heads and
/// double-buffered K and V tiles of 64 keys, rows padded by 8.
const fn mma_smem(hd: usize) -> usize {
    (2 * 64 + 4 * 64) * (hd + 8) * 2
}

/// Dynamic shared memory of `attn_flash3_hd*`: `attn_flash2`'s, then the warps' P fragments
/// (8 warps x 4 x 32 lanes x 16 bytes) and row maxima / sums (8 warps x 32 lanes x 16 bytes)
/// exchanged within warp pairs (223,232 bytes at hd 256).
const fn mma3_smem(hd: usize) -> usize {
    mma_smem(hd) + 8 * 4 * 32 * 16 + 8 * 32 * 16
}

/// `attn_flash4_hd256` with its dynamic shared memory (F4_SMEM): Q of two heads (64 rows of
/// 256 bf16 each) and two stages of K and V (80 rows each), in the 128-byte swizzle (224 KiB),
/// 4 mbarriers. (A build with the kernel define F4_BK=64 uses 192 KiB of it.)
const WGMMA_KERNEL: (&str, usize) = ("attn_flash4_hd256", (2 * 64 + 4 * 80) * 256 * 2 + 32);

/// `attn_flash4_hd256`'s block: two consumer warpgroups and a producer warpgroup.
const WGMMA_THREADS: u32 = 384;

/// `attn_flash4` by clusters of 2 and of 4 head pairs of one KV head, each K/V tile copied
/// once a cluster by multicast tensor copies (the same shared memory).
const WGMMA_CLUSTER_KERNELS: [(&str, usize); 2] = [
    ("attn_flash4c2_hd256", WGMMA_KERNEL.1),
    ("attn_flash4c4_hd256", WGMMA_KERNEL.1),
];

/// K/V rows a tile of `attn_flash4` (F4_BK, the tensor maps' box height).
const WGMMA_TILE_KEYS: usize = 80;

/// The cluster size of `attn_flash4`'s K/V sharing: `KESTREL_ATTN_CLUSTER` (1: none, the
/// default; 2 or 4), read once. A size the shape cannot take falls back to the largest it can.
/// Measured on the H200 (docs/KERNELS.md, nineteenth session): clusters of 2 level with single
/// blocks end to end, of 4 2% slower at 8,192 tokens and 5% at 32,768 (a cluster's blocks wait
/// for each other's release of every stage, two stages deep).
fn cluster_setting() -> usize {
    static CS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CS.get_or_init(|| {
        std::env::var("KESTREL_ATTN_CLUSTER")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|c| [1, 2, 4].contains(c))
            .unwrap_or(1)
    })
}

/// The cluster size `attn_flash4` runs with for `group` query heads per KV head: `want` (1, 2
/// or 4), halved until it divides the head pairs of a group.
fn cluster_size(want: usize, group: usize) -> usize {
    let mut cs = want.clamp(1, 4);
    while cs > 1 && !(group / 2).is_multiple_of(cs) {
        cs /= 2;
    }
    cs
}

/// The flash kernels with the dynamic shared memory each may use (set at `Gpu::open`; the
/// WMMA kernel at the largest head dim it takes).
pub(super) const FLASH_KERNELS: [(&str, usize); 12] = [
    ("attn_flash", wmma_smem(256)),
    ("attn_flash2_hd32", mma_smem(32)),
    ("attn_flash2_hd64", mma_smem(64)),
    ("attn_flash2_hd128", mma_smem(128)),
    ("attn_flash2_hd256", mma_smem(256)),
    ("attn_flash3_hd32", mma3_smem(32)),
    ("attn_flash3_hd64", mma3_smem(64)),
    ("attn_flash3_hd128", mma3_smem(128)),
    ("attn_flash3_hd256", mma3_smem(256)),
    WGMMA_KERNEL,
    WGMMA_CLUSTER_KERNELS[0],
    WGMMA_CLUSTER_KERNELS[1],
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

/// The mma.sync kernel (`attn_flash3_hd*`, or `attn_flash2_hd*` with `v2`) for head dim `hd`
/// with `group` query heads per KV head, if there is one (a block takes two heads of a group),
/// with its dynamic shared memory.
fn mma_kernel(hd: usize, group: usize, v2: bool) -> Option<(&'static str, usize)> {
    let i = match hd {
        32 => 0,
        64 => 1,
        128 => 2,
        256 => 3,
        _ => return None,
    };
    // FLASH_KERNELS: attn_flash, then attn_flash2_hd{32..256}, then attn_flash3_hd{32..256}.
    let table = if v2 { 1 } else { 5 };
    group.is_multiple_of(2).then_some(FLASH_KERNELS[table + i])
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
    /// Whether `kind` runs `attn_flash4` for this shape: the kernel that can take a `QPrep`.
    fn flash_is_wgmma(&self, kind: Flash, nq: usize, nkv: usize, hd: usize) -> bool {
        kind == Flash::Wgmma
            && self.compute_capability == (9, 0)
            && hd == 256
            && (nq / nkv).is_multiple_of(2)
    }

    /// Whether `attn_flash` can prepare the queries itself (`FlashCall::q_prep`) for this
    /// kernel and shape: `attn_flash4`, a rotation of at most 64 dims in steps of 8.
    pub fn flash_preps_q(
        &self,
        kind: Flash,
        nq: usize,
        nkv: usize,
        hd: usize,
        rot_half: usize,
    ) -> bool {
        self.flash_is_wgmma(kind, nq, nkv, hd) && rot_half <= 32 && rot_half.is_multiple_of(4)
    }

    /// Causal attention of the `t` new positions over the cache, sigmoid output gate fused,
    /// through `kind` (head dim a multiple of 32 up to 256).
    pub fn attn_flash(&self, kind: Flash, a: &FlashCall) -> Result<()> {
        self.attn_flash_clustered(kind, a, cluster_setting())
    }

    /// [`Gpu::attn_flash`] with `attn_flash4` in clusters of at most `cluster` blocks (1, 2 or
    /// 4; `KESTREL_ATTN_CLUSTER` sets it for `attn_flash`).
    pub fn attn_flash_clustered(&self, kind: Flash, a: &FlashCall, cluster: usize) -> Result<()> {
        let group = a.nq / a.nkv;
        let wgmma = self.flash_is_wgmma(kind, a.nq, a.nkv, a.hd);
        if let Some(p) = a.q_prep {
            anyhow::ensure!(
                self.flash_preps_q(kind, a.nq, a.nkv, a.hd, p.rot_half),
                "attention: the query prep fused for a kernel or shape without it ({kind:?}, head dim {}, rotation {})",
                a.hd,
                2 * p.rot_half
            );
        }
        // (kernel, dynamic smem, threads); every one but the WMMA kernel takes two heads a block
        let two_heads = match kind {
            Flash::Wgmma if wgmma => Some((WGMMA_KERNEL, WGMMA_THREADS)),
            Flash::Mma | Flash::Wgmma => mma_kernel(a.hd, group, mma2_selected()).map(|k| (k, 256)),
            Flash::Mma2 => mma_kernel(a.hd, group, true).map(|k| (k, 256)),
            Flash::Wmma => None,
        };
        let cs = if wgmma {
            cluster_size(cluster, group)
        } else {
            1
        };
        let (name, heads_per_block, threads, smem) = match two_heads {
            Some(_) if wgmma && cs > 1 => {
                let (k, smem) = WGMMA_CLUSTER_KERNELS[cs / 4];
                (k, 2, WGMMA_THREADS, smem)
            }
            Some(((k, smem), threads)) => (k, 2, threads, smem),
            None => ("attn_flash", 1, 128, wmma_smem(a.hd)),
        };
        let (q_tiles, head_blocks) = (
            a.t.div_ceil(BLOCK_Q) as u32,
            (a.nq / heads_per_block) as u32,
        );
        // The two-head kernels take (head pairs, query tiles), heaviest tile first in launch
        // order (attention.cu, attn_flash2); the WMMA kernel (query tiles, heads).
        let grid = if heads_per_block == 2 {
            (head_blocks, q_tiles, 1)
        } else {
            (q_tiles, head_blocks, 1)
        };
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
        if name == WGMMA_KERNEL.0 || cs > 1 {
            // attn_flash4's fused query prep (a null q_norm: q is read prepared)
            let p = a.q_prep;
            args.extend([
                Arg::Ptr(p.map_or(0, |p| p.q_norm)),
                Arg::Ptr(p.map_or(0, |p| p.inv_freq)),
                Arg::I(p.map_or(0, |p| p.rot_half as i32)),
                Arg::F(p.map_or(0.0, |p| p.eps)),
            ]);
        }
        if cs > 1 {
            let n = a.past + a.t;
            args.extend([
                Arg::Map(kv_tensor_map(a.k_cache, n, a.nkv, a.hd)?),
                Arg::Map(kv_tensor_map(a.v_cache, n, a.nkv, a.hd)?),
                Arg::I(WGMMA_TILE_KEYS as i32),
            ]);
        }
        self.launch_dep(name, grid, threads, smem as u32, &args)
    }
}

/// A 3-D tensor map over the first `n` positions of a bf16 KV cache `[positions, nkv, hd]`:
/// boxes of `WGMMA_TILE_KEYS` positions x 64 of one KV head in the 128-byte swizzle (the
/// layout `attn_flash4`'s descriptors read), positions past `n` zero.
fn kv_tensor_map(cache: u64, n: usize, nkv: usize, hd: usize) -> Result<[u64; 16]> {
    anyhow::ensure!(
        hd.is_multiple_of(64),
        "attention: a KV tensor map needs a head dim multiple of 64"
    );
    super::tensor_map_bf16(
        cache,
        &[hd as u64, nkv as u64, n as u64],
        &[(hd * 2) as u64, (nkv * hd * 2) as u64],
        &[64, 1, WGMMA_TILE_KEYS as u32],
        &format!("KV cache, {n} positions"),
    )
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
        assert_eq!(
            mma_kernel(256, 8, false).map(|k| k.0),
            Some("attn_flash3_hd256")
        );
        assert_eq!(
            mma_kernel(256, 8, true).map(|k| k.0),
            Some("attn_flash2_hd256")
        );
        assert_eq!(
            mma_kernel(128, 3, false),
            None,
            "a block takes two heads of a group"
        );
        assert_eq!(mma_kernel(80, 2, false), None);
        assert_eq!(cluster_size(4, 8), 4, "the model: 4 head pairs a KV head");
        assert_eq!(cluster_size(4, 4), 2);
        assert_eq!(cluster_size(4, 2), 1);
        assert_eq!(cluster_size(2, 6), 1, "3 head pairs: no cluster of 2");
        assert_eq!(
            WGMMA_CLUSTER_KERNELS[cluster_size(2, 8) / 4].0,
            "attn_flash4c2_hd256"
        );
        assert_eq!(mma_kernel(64, 2, false).map(|k| k.1), Some(mma3_smem(64)));
    }
}
