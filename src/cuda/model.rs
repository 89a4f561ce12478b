//! The forward pass on the GPU, top to bottom, mirroring `crate::model` (the CPU reference).
//!
//! Activations: the residual stream is f32; every GEMM input is bf16 (like the reference's
//! bf16 run), accumulation f32. The GDN recurrent and conv states are f32, the KV cache bf16.
//! Workspace is allocated once for `max_chunk` tokens: no allocation inside a step.

use super::attention::{Flash, FlashCall, QPrep, decode_mma_kernel, decode_mma_smem};
use super::gdn::{ConvRows, DeltaBufs, GdnShape};
use super::moe::{DensePlan, Grouped, MIN_TILE_M, MoeGemm, MoePlan};
use super::{Arg, DeviceBuf, Gpu, block_threads};
use crate::config::{LayerKind, TextConfig};
use crate::model::{Engine, Logits, StateMemory};
use crate::ops::attention::rope_inv_freq;
use crate::tensor::{DType, Mat, encode_f32};
use crate::weights::{ExpertWeights, Mixer, ModelWeights};
use anyhow::{Result, anyhow, bail};
use std::sync::Arc;

/// Rows of logits computed per lm_head call in `Logits::All` mode.
const LOGITS_ROWS: usize = 64;
/// Tokens (a warp each) per block of `moe_route` (moe.cu's ROUTE_WARPS).
const ROUTE_WARPS: usize = 8;
/// Router rows per block of `moe_router_dec` (moe.cu's ROUTER_ROWS).
const ROUTER_ROWS: usize = 2;

/// Shared memory of `moe_router_dec` in floats (moe.cu's router_smem): the staged input, the
/// RMSNorm weight and the shared gate's row.
fn router_smem(d: usize) -> usize {
    3 * d
}
/// Shared memory of `moe_gate_up_dec` in floats (moe.cu's gate_up_dec_smem): the staged input,
/// then for each of the 8 warps the logits, the top-k ids and weights (rounded up to 16 bytes).
fn gate_up_dec_smem(d: usize, e: usize, k: usize) -> usize {
    d + 8 * (e + 2 * k).next_multiple_of(4)
}
/// Up to this many (token, expert) rows the MoE runs as per-row GEMVs (decode), reading only
/// the selected experts' weights with 16-byte loads; above it, the grouped tensor-core GEMM.
const MOE_GEMV_MAX_ROWS: usize = 64;
/// Attention splits per query in prefill (bounded workspace); decode may use up to 256.
const PREFILL_SPLITS: usize = 8;
const DECODE_SPLITS: usize = 256;
/// Output rows per block of the decode GEMVs with inner dimension `k` (as
/// `gemv_rows_per_block` in common.cuh; `whole_rows`: `gemv_dec_w`).
fn gemv_rows_per_block(k: usize, whole_rows: bool) -> usize {
    match k {
        0..=2048 => 16,
        4096 if !whole_rows => 4,
        _ => 8,
    }
}

/// At most this many blocks per decode GEMV (8 per SM of an H200): each stages its input
/// once, then walks row groups, so a tall matrix (lm_head) does not restage it per 16 rows.
const GEMV_MAX_BLOCKS: usize = 132 * 8;

/// Dynamic shared memory of `attn_decode`: two stages of 32-position K and V tiles, and the
/// group's queries.
fn attn_decode_smem(c: &TextConfig) -> usize {
    2 * 2 * 32 * (c.head_dim + 8) * 2 + c.num_attention_heads / c.num_kv_heads * c.head_dim * 4
}

/// Attention splits per query head in the fused decode step, by context length: each bucket
/// gets its own captured graph; the kernels derive the chunk length from the position.
fn decode_splits(n: usize) -> usize {
    [4, 16, 64]
        .into_iter()
        .find(|&b| b * 64 >= n)
        .unwrap_or(DECODE_SPLITS)
}
/// Calls with at least this many tokens use the tensor-core flash kernel for attention.
const FLASH_MIN_TOKENS: usize = 16;

struct GdnW {
    /// `[C + Hv*Dv + 2*Hv, D]`: the qkv conv inputs, z, b, a rows in one matrix, so decode
    /// reads them in one GEMV and prefill in one GEMM (the three parts with
    /// `KESTREL_GDN_INPROJ=split`).
    in_proj: DeviceBuf,
    conv: DeviceBuf,
    a_log: DeviceBuf,
    dt_bias: DeviceBuf,
    norm: DeviceBuf,
    out: DeviceBuf,
}

struct AttnW {
    /// `[Nq*2*Hd + 2*Nkv*Hd, D]`: query+gate, key and value rows in one matrix.
    qkv: DeviceBuf,
    o: DeviceBuf,
    q_norm: DeviceBuf,
    k_norm: DeviceBuf,
}

impl GdnW {
    /// Device pointers of the qkv, z and b|a parts of `in_proj`.
    fn in_parts(&self, c: &TextConfig) -> (u64, u64, u64) {
        let row = (c.hidden_size * 2) as u64;
        let (ch, vw) = (c.gdn_conv_channels() as u64, c.gdn_v_width() as u64);
        let p = self.in_proj.ptr;
        (p, p + ch * row, p + (ch + vw) * row)
    }
}

impl AttnW {
    /// Device pointers of the query+gate, key and value parts of `qkv`.
    fn qkv_parts(&self, c: &TextConfig) -> (u64, u64, u64) {
        let row = (c.hidden_size * 2) as u64;
        let (q, kv) = (
            (c.num_attention_heads * 2 * c.head_dim) as u64,
            (c.num_kv_heads * c.head_dim) as u64,
        );
        let p = self.qkv.ptr;
        (p, p + q * row, p + (q + kv) * row)
    }
}

enum MixerW {
    Gdn(GdnW),
    Attn(AttnW),
}

struct LayerW {
    input_norm: DeviceBuf,
    post_norm: DeviceBuf,
    mixer: MixerW,
    router: DeviceBuf,
    /// `[E, 2I, D]`: per expert gate rows then up rows.
    gate_up: DeviceBuf,
    /// `[E, D, I]`.
    down: DeviceBuf,
    /// `[2Is, D]`.
    shared_gate_up: DeviceBuf,
    shared_down: DeviceBuf,
    shared_gate: DeviceBuf,
    /// Tensor maps of `gate_up` and `down` for `moe_gemm7` (`KESTREL_MOE_GEMM=v7` on compute
    /// capability 9.0, d and I multiples of 8), else None.
    moe_maps: Option<(DeviceBuf, DeviceBuf)>,
}

/// Scratch buffers for up to `max_chunk` tokens.
struct Workspace {
    ids: DeviceBuf,
    h: DeviceBuf,
    xb: DeviceBuf,
    p: DeviceBuf,
    qkv: DeviceBuf,
    beta: DeviceBuf,
    g: DeviceBuf,
    o: DeviceBuf,
    /// Scratch of the chunked delta rule (W, Q', U, γ per chunk).
    gdn: DeviceBuf,
    ob: DeviceBuf,
    qg: DeviceBuf,
    k: DeviceBuf,
    v: DeviceBuf,
    q: DeviceBuf,
    part: DeviceBuf,
    part_floats: usize,
    router: DeviceBuf,
    counts: DeviceBuf,
    offsets: DeviceBuf,
    cursor: DeviceBuf,
    tile_expert: DeviceBuf,
    tile_row: DeviceBuf,
    tile_rows: DeviceBuf,
    num_tiles: DeviceBuf,
    dense_plan: DeviceBuf,
    topk_ids: DeviceBuf,
    topk_w: DeviceBuf,
    /// The shared expert's gate per token (moe_route's, for moe_combine).
    sgate: DeviceBuf,
    sorted_token: DeviceBuf,
    slot_row: DeviceBuf,
    gu: DeviceBuf,
    act: DeviceBuf,
    y: DeviceBuf,
    sgu: DeviceBuf,
    sact: DeviceBuf,
    ys: DeviceBuf,
    logits: DeviceBuf,
}

/// Buffers of the fused one-token decode step, apart from the prefill workspace. A captured
/// decode graph holds these pointers, so they never move.
struct DecodeWs {
    /// `[token id, position]`: the step's only input, written before each launch (the greedy
    /// argmax also writes the next id into slot 0).
    step_in: DeviceBuf,
    h: DeviceBuf,
    /// Output of the fused input projection (GDN: qkv|z|b|a; attention: q+gate|k|v).
    proj: DeviceBuf,
    qkv: DeviceBuf,
    q: DeviceBuf,
    ob: DeviceBuf,
    xb: DeviceBuf,
    router: DeviceBuf,
    topk_ids: DeviceBuf,
    topk_w: DeviceBuf,
    sgate: DeviceBuf,
    /// The lm_head argmax's last-block counter (zero between launches).
    done: DeviceBuf,
    /// `[k + 1, act_ld]`: the chosen experts' then the shared expert's SwiGLU outputs.
    act: DeviceBuf,
    part: DeviceBuf,
    logits: DeviceBuf,
    arg_val: DeviceBuf,
    arg_idx: DeviceBuf,
    next: DeviceBuf,
}

impl DecodeWs {
    /// Row stride of `act`: the larger of the routed and shared intermediate sizes.
    fn act_ld(c: &TextConfig) -> usize {
        c.moe_intermediate.max(c.shared_intermediate)
    }

    /// (name, bytes) of every buffer.
    fn sizes(c: &TextConfig) -> Vec<(&'static str, usize)> {
        let (d, hd, nq, nkv) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_kv_heads,
        );
        let gdn_rows = c.gdn_conv_channels() + c.gdn_v_width() + 2 * c.gdn_num_value_heads;
        let attn_rows = nq * 2 * hd + 2 * nkv * hd;
        vec![
            ("step_in", 8),
            ("h", d * 4),
            ("proj", gdn_rows.max(attn_rows) * 4),
            ("qkv", c.gdn_conv_channels() * 4),
            ("q", nq * hd * 4),
            ("ob", c.gdn_v_width().max(nq * hd) * 2),
            ("xb", d * 2),
            ("router", c.num_experts * 4),
            ("topk_ids", c.experts_per_token * 4),
            ("topk_w", c.experts_per_token * 4),
            ("sgate", 4),
            ("done", 4),
            ("act", (c.experts_per_token + 1) * Self::act_ld(c) * 4),
            ("part", nq * DECODE_SPLITS * (hd + 2) * 4),
            ("logits", c.vocab_size * 4),
            ("arg_val", c.vocab_size.div_ceil(8) * 4),
            ("arg_idx", c.vocab_size.div_ceil(8) * 4),
            ("next", 4),
        ]
    }

    fn alloc(gpu: &Gpu, c: &TextConfig) -> Result<Self> {
        let mut bufs = std::collections::HashMap::new();
        for (name, bytes) in Self::sizes(c) {
            bufs.insert(name, gpu.alloc_zeroed(bytes)?);
        }
        let mut take = |n: &str| bufs.remove(n).ok_or_else(|| anyhow!("decode buffer {n}"));
        Ok(DecodeWs {
            step_in: take("step_in")?,
            h: take("h")?,
            proj: take("proj")?,
            qkv: take("qkv")?,
            q: take("q")?,
            ob: take("ob")?,
            xb: take("xb")?,
            router: take("router")?,
            topk_ids: take("topk_ids")?,
            topk_w: take("topk_w")?,
            sgate: take("sgate")?,
            done: take("done")?,
            act: take("act")?,
            part: take("part")?,
            logits: take("logits")?,
            arg_val: take("arg_val")?,
            arg_idx: take("arg_idx")?,
            next: take("next")?,
        })
    }
}

/// Whether the fused decode kernels fit `c` (their staged vectors live in 48 KiB of shared
/// memory); otherwise one-token steps take the general path.
fn fused_decode_fits(c: &TextConfig) -> bool {
    let smem = 48 * 1024;
    c.gdn_v_width().max(c.num_attention_heads * c.head_dim) * 4 <= smem
        && 2 * c.hidden_size * 4 <= smem // the RMSNorm GEMVs: input and preloaded weight
        && router_smem(c.hidden_size) * 4 <= smem
        && gate_up_dec_smem(c.hidden_size, c.num_experts, c.experts_per_token) * 4 <= smem
        && down_dec_smem(
            c.num_experts,
            c.experts_per_token,
            c.moe_intermediate,
            c.shared_intermediate,
            true,
        ) <= smem
        && attn_decode_smem(c) <= 200 * 1024
        && c.num_attention_heads / c.num_kv_heads <= 32
        && c.gdn_value_dim <= 256
}

/// Dynamic shared memory of `gdn_convstep_dec*` in bytes (gdn.cu's `GDN_CONVSTEP_SMEM`): q and
/// k in padded quarters, the warps' sums, v.
fn convstep_smem(dk: usize, dv: usize) -> u32 {
    ((2 * (dk + 16) + 32 + dv) * 4) as u32
}

/// Shared memory of `moe_down_dec` in bytes (moe.cu's down_dec_smem): with `early`, the
/// router's logits, the ids and weights, then (expert widths 512) the block's weight rows.
fn down_dec_smem(e: usize, k: usize, inter: usize, s_inter: usize, early: bool) -> usize {
    let rows = if inter == 512 && s_inter == 512 {
        (k + 1) * (4 * 2 * 32 * 16 + 8) // and a bulk copy's mbarrier a warp
    } else {
        0
    };
    if early {
        ((e + 2 * k + 3) & !3) * 4 + rows
    } else {
        0
    }
}

/// `gemv_dec_stream`'s default (ring stages a warp, stages requested before its wait): H200 A/B
/// at 58f3f64 against `gemv_dec`, decode +2.8% / +2.6% / +3.3% at 256 / 4,096 / 32,768
/// (`bench/results/2026-12-01-h200-gemv-stream-default-ab-58f3f64.log`; other settings in
/// `...-gemv-stream-ab-2adc1c1.log`).
/// The third number: how many units before a warp's end the next kernels may start (0: at the
/// start): A/B at 16d8f5c (`...-gemv-stream-launch-variants-16d8f5c.log`), 3 or 4 against 0
/// +1.5-2.5% at 256, +0.5-2% at 4,096, level at 32,768. With bulk stages and h loaded before
/// the stages left to request after the wait, one stage early instead of two: +1.4% / +0.6% at
/// 256 / 4,096 (`...-stream-h-first-variants.log`).
const GEMV_STREAM: (usize, usize, usize) = (2, 1, 3);

/// `CudaModel::gemv_stream` from `KESTREL_GEMV_STREAM`: unset, or not NS,EARLY[,LAUNCH] in
/// range, the default; `off`: no stream (None).
fn gemv_stream_setting(v: Option<&str>) -> Option<(usize, usize, usize)> {
    let Some(v) = v else {
        return Some(GEMV_STREAM);
    };
    if v == "off" {
        return None;
    }
    let n: Vec<Option<usize>> = v.split(',').map(|p| p.trim().parse().ok()).collect();
    match n[..] {
        [Some(ns), Some(early)] => Some((ns, early, GEMV_STREAM.2)),
        [Some(ns), Some(early), Some(at)] => Some((ns, early, at)),
        _ => None,
    }
    .filter(|&(ns, early, at)| (2..=3).contains(&ns) && early <= ns && at <= 16)
    .or(Some(GEMV_STREAM))
}

/// Shared memory of `gemv_dec_stream` in bytes (gemv.cu's gemv_stream_smem): the staged input
/// and RMSNorm weight (2 x 2048 floats), then 8 warps' rings of `ns` 8 KiB stages and their
/// mbarriers.
fn gemv_stream_smem(ns: usize) -> usize {
    2 * 2048 * 4 + 8 * ns * (8192 + 8)
}

/// u64 a decode-timeline record (common.cuh's TRACE_RECORD): block id, SM, start, wait release,
/// end, three phase stamps.
pub const TRACE_RECORD: usize = 8;

pub struct CudaModel {
    pub config: TextConfig,
    pub gpu: Arc<Gpu>,
    embed: DeviceBuf,
    final_norm: DeviceBuf,
    lm_head: DeviceBuf,
    inv_freq: DeviceBuf,
    layers: Vec<LayerW>,
    ws: std::cell::RefCell<Workspace>,
    pub max_chunk: usize,
    pub max_seq: usize,
    pub weight_bytes: usize,
    /// The prefill attention kernel: wgmma on sm_90a at head dim 256 (`attn_flash4`), else
    /// mma.sync where the shape has one (`attn_flash3`; `KESTREL_ATTN=mma` keeps it on sm_90a,
    /// `mma2` the previous `attn_flash2`), or (`KESTREL_ATTN=wmma`) the WMMA kernel.
    pub flash: Flash,
    /// Decode attention on tensor cores (`attn_decode_mma_hd*` + `attn_combine_dec`) where the
    /// shape has a kernel; `KESTREL_ATTN_DECODE=simt` keeps the scalar `attn_decode`.
    pub decode_attn_mma: bool,
    /// Decode GEMVs with k = 4096 (the out-projections): a warp per whole row, 8 rows a block
    /// (`gemv_dec_w`, the default: H200 A/B at f667003, decode 316.5 -> 334.5 tok/s at 256,
    /// 287.5 -> 297.8 at 32,768), or with `KESTREL_GEMV=split` two warps per row, 4 rows a
    /// block (`gemv_dec`).
    pub gemv_whole_rows: bool,
    /// At most this many blocks per decode GEMV (`KESTREL_GEMV_MAX_BLOCKS`, default
    /// `GEMV_MAX_BLOCKS`); fewer blocks walk more row groups each. An A/B knob: at 264 (one
    /// wave of two 128-register blocks per SM) the in-projection runs in one wave instead of
    /// three, at 132 the next kernel's blocks fit beside one GEMV block per SM. H200 A/B at
    /// f27aa6c: 132 slower (348 -> 320 tok/s at 256), 264 the same (348 -> 345); default kept.
    pub gemv_max_blocks: usize,
    /// The k = 2048 decode GEMVs without argmax (the in-projections) as one stream a block
    /// (`gemv_dec_stream`, one block an SM, per-warp rings of stages; the same sums as
    /// `gemv_dec`): (ring stages a warp, how many of them are requested before the kernel's
    /// wait, how many units before its end the next kernels may start), default `GEMV_STREAM`;
    /// `KESTREL_GEMV_STREAM=NS,EARLY[,LAUNCH]` (NS 2 or 3, EARLY 0 to NS, LAUNCH 0 to 16, the
    /// default's when left out; anything else: the default) sets them, `KESTREL_GEMV_STREAM=off`
    /// keeps `gemv_dec`'s blocks of 16 rows (None).
    pub gemv_stream: Option<(usize, usize, usize)>,
    /// `gemv_dec_stream` fills its ring stages by bulk copies (sm_90: one a stage, completing on
    /// an mbarrier) rather than cp.async a lane: default on Hopper; `KESTREL_GEMV_STREAM_BULK=0`
    /// turns it off.
    pub gemv_stream_bulk: bool,
    /// The prefill MoE's grouped GEMM: `moe_gemm4` (default), or with `KESTREL_MOE_GEMM=v3`
    /// `moe_gemm3`, with `v2` / `v1` the WMMA kernels.
    pub moe_gemm: MoeGemm,
    /// `moe_gemm4`'s or `moe_gemm3`'s tile height, 64 or 128 (`KESTREL_MOE_TILE_M`); None: by
    /// the rows per expert (`moe::gemm3_tile_m`).
    pub moe_tile_m: Option<usize>,
    dws: DecodeWs,
    /// One-token steps through the fused decode kernels (off: the general path, for
    /// comparison; `KESTREL_DECODE=unfused`).
    pub fused_decode: bool,
    /// Replay the fused decode step as a CUDA graph (`KESTREL_DECODE_GRAPH=0` turns it off).
    pub decode_graph: bool,
    /// Launch the fused decode kernels with programmatic dependent launch, so each one's
    /// weight loads overlap the previous one's tail (`KESTREL_DECODE_PDL=0` turns it off).
    pub decode_pdl: bool,
    /// Prefill GDN with the token-parallel conv and the chunked delta rule; off
    /// (`KESTREL_GDN=recurrent`) it runs the sequential kernels that decode uses.
    pub gdn_chunked: bool,
    /// `moe_down_dec` picks the experts from the router's logits and loads its weight rows
    /// before its griddep_wait (`moe_gate_up_dec` then lets it start only after the router is
    /// done); off (`KESTREL_MOE_DOWN=late`) it reads the ids after the wait.
    pub moe_down_early: bool,
    /// With `moe_down_early`, its rows come as one bulk copy a warp (sm_90; `early` = 2 in the
    /// kernel) rather than cp.async a lane: default on Hopper; `KESTREL_MOE_DOWN_BULK=0` turns
    /// it off.
    pub moe_down_bulk: bool,
    /// The routed experts' down outputs y stored as bf16 where `moe_gemm6` runs them (half of
    /// y's bytes written and read back by the combine); `KESTREL_MOE_Y=f32` stores them as f32.
    /// Either way the combine (and the decode step) take them rounded to bf16.
    pub moe_y_bf16: bool,
    /// The shared expert of a prefill call through `moe_gemm6` on the second stream (SwiGLU
    /// fused, no f32 gate/up between) where the routed experts take `moe_gemm6` too;
    /// `KESTREL_SHARED_GEMM=cublas` keeps cuBLAS and `swiglu_bf16`.
    pub shared_gemm6: bool,
    /// The GDN prefill in-projection as one GEMM (q|k|v, z and b|a side by side in p);
    /// `KESTREL_GDN_INPROJ=split` runs z and b|a on the second stream beside q|k|v.
    pub gdn_inproj_merged: bool,
    /// Prefill attention prepares the query heads (RMSNorm, rotation) as it loads them where
    /// the kernel can (`attn_flash4`; attn_prep_rows then does the KV heads only);
    /// `KESTREL_ATTN_QPREP=separate` keeps attn_prep_rows writing q for all heads.
    pub flash_q_prep: bool,
    /// The decode step's GDN conv and delta-rule step in one launch (`gdn_convstep_dec*`) where
    /// it takes the shape (conv kernel 4, one or two value heads a key head, the latter on
    /// sm_90a as clusters); `KESTREL_GDN_DEC=split` keeps `gdn_conv_dec` + `gdn_step_dec`.
    pub gdn_convstep: bool,
    /// A diagnostic (`KESTREL_MOE_STATS=1`; it synchronizes every MoE layer, so timings taken
    /// with it are not the engine's): each prefill MoE layer's rows per expert and tiles, full
    /// and partial, on standard error.
    pub moe_stats: bool,
}

/// A sequence's state on the GPU: f32 GDN conv/recurrent states, bf16 KV cache of up to
/// `max_seq` positions. A fresh state has room for all of them; cloning copies it on the device
/// (a snapshot) with room for the positions it holds only, so that the prefix cache keeps a
/// short conversation's KV, not `max_seq`'s, and a clone grows to `max_seq` on its first
/// forward ([`CudaState::reserve_kv`]).
pub struct CudaState {
    pub len: usize,
    /// Captured decode graphs of this state, by (attention splits, argmax vocab limit).
    graphs: Vec<((usize, usize), DecodeGraph)>,
    max_seq: usize,
    gdn: Vec<(DeviceBuf, DeviceBuf)>,
    kv: Vec<(DeviceBuf, DeviceBuf)>,
    kv_token_bytes: usize,
    gpu: Arc<Gpu>,
}

/// A new device buffer of `bytes` holding the first `used` bytes of `b`.
fn copy_prefix(g: &Gpu, b: &DeviceBuf, bytes: usize, used: usize) -> Result<DeviceBuf> {
    let n = g.alloc(bytes)?;
    if used > 0 {
        g.copy_device(n.ptr, b.ptr, used)?;
    }
    Ok(n)
}

impl CudaState {
    /// Positions the KV buffers have room for.
    fn kv_room(&self) -> usize {
        self.kv
            .first()
            .map_or(usize::MAX, |(k, _)| k.bytes / self.kv_token_bytes)
    }

    /// Room for `max_seq` positions in the KV buffers (a snapshot's copy has room for its own
    /// only). The captured decode graphs name the old buffers, so they go.
    fn reserve_kv(&mut self) -> Result<()> {
        if self.kv_room() >= self.max_seq {
            return Ok(());
        }
        let (used, bytes) = (
            self.len * self.kv_token_bytes,
            self.max_seq * self.kv_token_bytes,
        );
        for (k, v) in &mut self.kv {
            *k = copy_prefix(&self.gpu, k, bytes, used)?;
            *v = copy_prefix(&self.gpu, v, bytes, used)?;
        }
        self.graphs.clear();
        Ok(())
    }

    fn try_clone(&self) -> Result<Self> {
        let g = &self.gpu;
        let mut gdn = Vec::with_capacity(self.gdn.len());
        for (c, r) in &self.gdn {
            gdn.push((
                copy_prefix(g, c, c.bytes, c.bytes)?,
                copy_prefix(g, r, r.bytes, r.bytes)?,
            ));
        }
        let used = self.len * self.kv_token_bytes;
        let mut kv = Vec::with_capacity(self.kv.len());
        for (k, v) in &self.kv {
            kv.push((
                copy_prefix(g, k, used, used)?,
                copy_prefix(g, v, used, used)?,
            ));
        }
        Ok(CudaState {
            len: self.len,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            kv,
            kv_token_bytes: self.kv_token_bytes,
            gpu: self.gpu.clone(),
        })
    }

    /// Bytes of device memory held.
    pub fn memory_bytes(&self) -> usize {
        self.gdn
            .iter()
            .map(|(a, b)| a.bytes + b.bytes)
            .sum::<usize>()
            + self
                .kv
                .iter()
                .map(|(a, b)| a.bytes + b.bytes)
                .sum::<usize>()
    }
}

impl Clone for CudaState {
    fn clone(&self) -> Self {
        self.try_clone()
            .expect("GPU memory exhausted while snapshotting a sequence state")
    }
}

/// A captured decode step. The graph only names device memory, so it may move between
/// threads with its state (it is never used from two threads at once).
struct DecodeGraph(cudarc::driver::CudaGraph);
// SAFETY: the CUDA graph handles are plain driver objects; the owning state is used by one
// thread at a time (`&mut` for every step), which is all the driver requires.
unsafe impl Send for DecodeGraph {}

/// Weights in the shape the GPU kernels read, from host matrices or seeded on the device.
enum Source<'a> {
    Host(&'a ModelWeights),
    Synthetic(u64),
}

fn bf16_bytes(m: &Mat) -> Vec<u8> {
    match m.dtype {
        DType::BF16 => m.bytes().to_vec(),
        _ => encode_f32(&m.to_f32(), DType::BF16),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    encode_f32(v, DType::F32)
}

/// Sizes of all buffers, to plan memory before allocating anything.
pub struct MemoryPlan {
    pub weights: usize,
    pub state: usize,
    pub workspace: usize,
}

impl MemoryPlan {
    pub fn total(&self) -> usize {
        self.weights + self.state + self.workspace
    }
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl CudaModel {
    /// Bytes of state for one sequence of `max_seq` tokens.
    pub fn state_bytes(cfg: &TextConfig, max_seq: usize) -> usize {
        let conv = (cfg.conv_kernel - 1) * cfg.gdn_conv_channels() * 4;
        let rec = cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim * 4;
        cfg.num_gdn_layers() * (conv + rec) + max_seq * cfg.kv_bytes_per_token(2)
    }

    fn workspace_floats(cfg: &TextConfig, t: usize) -> (Vec<(&'static str, usize, usize)>, usize) {
        let d = cfg.hidden_size;
        let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
        let hv = cfg.gdn_num_value_heads;
        let (e, k, i, is) = (
            cfg.num_experts,
            cfg.experts_per_token,
            cfg.moe_intermediate,
            cfg.shared_intermediate,
        );
        let max_tiles = super::moe::max_tiles(t * k, e, MIN_TILE_M);
        let part = (t * nq * PREFILL_SPLITS).max(nq * DECODE_SPLITS) * (hd + 2);
        // (name, elements, bytes per element)
        let list = vec![
            ("ids", t, 4),
            ("h", t * d, 4),
            ("xb", t * d.max(cfg.gdn_v_width()).max(nq * hd), 2),
            // the GDN in-projection's output: q|k|v, z, b|a side by side
            (
                "p",
                t * (cfg.gdn_conv_channels() + cfg.gdn_v_width() + 2 * cfg.gdn_num_value_heads),
                4,
            ),
            ("qkv", t * cfg.gdn_conv_channels(), 4),
            ("beta", t * hv, 4),
            ("g", t * hv, 4),
            ("o", t * cfg.gdn_v_width(), 4),
            ("gdn", GdnShape::of(cfg, t).chunk_scratch_floats(), 4),
            ("ob", t * cfg.gdn_v_width().max(nq * hd), 2),
            ("qg", t * nq * 2 * hd, 4),
            ("k", t * nkv * hd, 4),
            ("v", t * nkv * hd, 4),
            ("q", t * nq * hd, 4),
            ("part", part, 4),
            ("router", t * e, 4),
            // rows per expert, then the grouped GEMMs' item counter (MoePlan::claim)
            ("counts", e + 1, 4),
            ("offsets", e + 1, 4),
            ("cursor", e, 4),
            ("tile_expert", max_tiles, 4),
            ("tile_row", max_tiles, 4),
            ("tile_rows", max_tiles, 4),
            ("num_tiles", 1, 4),
            // the shared expert's one-expert plan (DensePlan): tiles, their count, a counter
            ("dense_plan", DensePlan::ints(t), 4),
            ("topk_ids", t * k, 4),
            ("topk_w", t * k, 4),
            ("sgate", t, 4),
            ("sorted_token", t * k, 4),
            ("slot_row", t * k, 4),
            ("gu", t * k * 2 * i, 4),
            ("act", t * k * i, 2),
            ("y", t * k * d, 4),
            ("sgu", t * 2 * is, 4),
            ("sact", t * is, 2),
            ("ys", t * d, 4),
            ("logits", LOGITS_ROWS.min(t.max(1)) * cfg.vocab_size, 4),
        ];
        let total = list.iter().map(|(_, n, b)| n * b).sum();
        (list, total)
    }

    /// The memory plan for `cfg`, a `max_seq` context and `max_chunk`-token prefill chunks.
    pub fn plan(cfg: &TextConfig, max_seq: usize, max_chunk: usize) -> MemoryPlan {
        let (total, _) = cfg.parameter_counts();
        let vec_extra = cfg.num_layers * 4 * cfg.hidden_size * 4;
        MemoryPlan {
            weights: total as usize * 2 + vec_extra,
            state: Self::state_bytes(cfg, max_seq),
            workspace: Self::workspace_floats(cfg, max_chunk).1
                + DecodeWs::sizes(cfg).iter().map(|(_, b)| b).sum::<usize>(),
        }
    }

    /// The first of `chunks` (prefill chunk sizes, most preferred first) whose memory plan
    /// fits the GPU's free memory with the load's 1 GiB headroom; the last one when none does
    /// (the load then reports the shortfall with the numbers).
    pub fn pick_chunk(
        gpu: &Gpu,
        cfg: &TextConfig,
        max_seq: usize,
        chunks: &[usize],
    ) -> Result<usize> {
        let (free, _) = gpu.memory()?;
        let fits = |&c: &usize| Self::plan(cfg, max_seq, c).total() + (1 << 30) <= free;
        Ok(chunks
            .iter()
            .copied()
            .find(fits)
            .or(chunks.last().copied())
            .unwrap_or(1))
    }

    fn check_supported(cfg: &TextConfig) -> Result<()> {
        if ![16, 32, 64, 128].contains(&cfg.gdn_key_dim) {
            bail!(
                "the CUDA GDN kernel supports key head dims 16/32/64/128, not {}",
                cfg.gdn_key_dim
            );
        }
        if !cfg.head_dim.is_multiple_of(32) || cfg.head_dim > 256 {
            bail!(
                "the CUDA attention kernel needs head_dim a multiple of 32 up to 256, not {}",
                cfg.head_dim
            );
        }
        if !cfg.hidden_size.is_multiple_of(8)
            || !cfg.moe_intermediate.is_multiple_of(8)
            || cfg.hidden_size > 12_288
        {
            bail!("the CUDA MoE kernels need hidden and expert sizes that are multiples of 8");
        }
        // The decode GEMVs stage their input as 16-byte words of 8 bf16 (the out-projections'
        // k is the GDN value width; the attention's is a multiple of 32 already).
        if !(cfg.gdn_num_value_heads * cfg.gdn_value_dim).is_multiple_of(8) {
            bail!(
                "the CUDA decode kernels need the GDN value width (heads x dim) a multiple of 8, not {}",
                cfg.gdn_num_value_heads * cfg.gdn_value_dim
            );
        }
        if cfg.conv_kernel > 9
            || cfg.experts_per_token > 16
            || cfg.gdn_value_dim > 1024
            || cfg.num_experts > 1024
        {
            bail!(
                "config exceeds the CUDA kernels' limits (conv kernel <= 9, top-k <= 16, value dim <= 1024, experts <= 1024)"
            );
        }
        Ok(())
    }

    /// Uploads host weights (converted to bf16) and allocates state/workspace.
    pub fn from_weights(
        gpu: Arc<Gpu>,
        cfg: TextConfig,
        weights: &ModelWeights,
        max_seq: usize,
        max_chunk: usize,
    ) -> Result<Self> {
        Self::from_weights_with_progress(gpu, cfg, weights, max_seq, max_chunk, &mut |_, _| {})
    }

    /// [`CudaModel::from_weights`], calling `progress(bytes_uploaded, total_bytes)` as the
    /// weights go up (for a progress bar).
    pub fn from_weights_with_progress(
        gpu: Arc<Gpu>,
        cfg: TextConfig,
        weights: &ModelWeights,
        max_seq: usize,
        max_chunk: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        Self::build(
            gpu,
            cfg,
            Source::Host(weights),
            max_seq,
            max_chunk,
            progress,
        )
    }

    /// Seeded random weights generated on the device (`--synthetic`), never real output.
    pub fn synthetic(
        gpu: Arc<Gpu>,
        cfg: TextConfig,
        seed: u64,
        max_seq: usize,
        max_chunk: usize,
    ) -> Result<Self> {
        Self::build(
            gpu,
            cfg,
            Source::Synthetic(seed),
            max_seq,
            max_chunk,
            &mut |_, _| {},
        )
    }

    fn build(
        gpu: Arc<Gpu>,
        cfg: TextConfig,
        src: Source,
        max_seq: usize,
        max_chunk: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        Self::check_supported(&cfg)?;
        let plan = Self::plan(&cfg, max_seq, max_chunk);
        let upload_total = plan.weights as u64;
        let uploaded = std::cell::Cell::new(0u64);
        let progress = std::cell::RefCell::new(progress);
        let upload = |bytes: &[u8]| -> Result<DeviceBuf> {
            let b = gpu.upload(bytes)?;
            uploaded.set(uploaded.get() + bytes.len() as u64);
            (progress.borrow_mut())(uploaded.get().min(upload_total), upload_total);
            Ok(b)
        };
        let (free, total) = gpu.memory()?;
        // One sequence state is created by the caller; keep 1 GiB of headroom for cuBLAS.
        let need = plan.total() + (1 << 30);
        if need > free {
            bail!(
                "not enough GPU memory on {}: need {:.2} GiB (weights {:.2} + state for --max-seq {max_seq} {:.2} + workspace {:.2} + 1.00 headroom), {:.2} GiB free of {:.2}",
                gpu.name,
                gib(need),
                gib(plan.weights),
                gib(plan.state),
                gib(plan.workspace),
                gib(free),
                gib(total)
            );
        }
        let d = cfg.hidden_size;
        let mut seed_counter = 0u64;
        let mut mat =
            |host: Option<Vec<u8>>, rows: usize, cols: usize, std: f32| -> Result<DeviceBuf> {
                match (host, &src) {
                    (Some(bytes), _) => upload(&bytes),
                    (None, Source::Synthetic(seed)) => {
                        let b = gpu.alloc(rows * cols * 2)?;
                        seed_counter += 1;
                        gpu.fill_random(
                            b.ptr,
                            rows * cols,
                            false,
                            seed.wrapping_add(seed_counter),
                            0.0,
                            std,
                        )?;
                        Ok(b)
                    }
                    (None, Source::Host(_)) => unreachable!("host weights always give bytes"),
                }
            };
        let host = match &src {
            Source::Host(w) => Some(*w),
            Source::Synthetic(_) => None,
        };
        let mut vec_counter = 0u64;
        let mut vecf = |host: Option<&[f32]>, n: usize, mean: f32, std: f32| -> Result<DeviceBuf> {
            match host {
                Some(v) => upload(&f32_bytes(v)),
                None => {
                    let b = gpu.alloc(n * 4)?;
                    vec_counter += 1;
                    gpu.fill_random(b.ptr, n, true, 0x5eed_0000 + vec_counter, mean, std)?;
                    Ok(b)
                }
            }
        };
        let wstd = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
        let embed = mat(host.map(|w| bf16_bytes(&w.embed)), cfg.vocab_size, d, 1.0)?;
        let lm_head = mat(
            host.map(|w| bf16_bytes(&w.lm_head)),
            cfg.vocab_size,
            d,
            wstd(d),
        )?;
        let final_norm = vecf(host.map(|w| w.final_norm.as_slice()), d, 0.0, 0.1)?;
        let moe_gemm = MoeGemm::from_env().on(gpu.compute_capability);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let cat = |parts: &[&Mat]| -> Vec<u8> {
            let mut v = Vec::new();
            for p in parts {
                v.extend(bf16_bytes(p));
            }
            v
        };
        for (l, kind) in cfg.layer_kinds.iter().enumerate() {
            let hl = host.map(|w| &w.layers[l]);
            let mixer = match kind {
                LayerKind::Gdn => {
                    let g = hl.map(|x| match &x.mixer {
                        Mixer::Gdn(g) => g,
                        Mixer::Attention(_) => unreachable!("layer kinds come from the config"),
                    });
                    let (hv, ch) = (cfg.gdn_num_value_heads, cfg.gdn_conv_channels());
                    MixerW::Gdn(GdnW {
                        in_proj: mat(
                            g.map(|g| cat(&[&g.in_qkv, &g.in_z, &g.in_b, &g.in_a])),
                            ch + cfg.gdn_v_width() + 2 * hv,
                            d,
                            wstd(d),
                        )?,
                        conv: vecf(g.map(|g| g.conv.as_slice()), ch * cfg.conv_kernel, 0.0, 0.5)?,
                        a_log: match g {
                            Some(g) => gpu.upload(&f32_bytes(&g.a_log))?,
                            None => gpu.upload(&f32_bytes(
                                &(0..hv)
                                    .map(|j| (1.0 + 15.0 * j as f32 / hv as f32).ln())
                                    .collect::<Vec<_>>(),
                            ))?,
                        },
                        dt_bias: vecf(g.map(|g| g.dt_bias.as_slice()), hv, 0.0, 0.5)?,
                        norm: vecf(g.map(|g| g.norm.as_slice()), cfg.gdn_value_dim, 1.0, 0.1)?,
                        out: mat(
                            g.map(|g| bf16_bytes(&g.out)),
                            d,
                            cfg.gdn_v_width(),
                            wstd(cfg.gdn_v_width()),
                        )?,
                    })
                }
                LayerKind::Attention => {
                    let a = hl.map(|x| match &x.mixer {
                        Mixer::Attention(a) => a,
                        Mixer::Gdn(_) => unreachable!("layer kinds come from the config"),
                    });
                    let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
                    MixerW::Attn(AttnW {
                        qkv: mat(
                            a.map(|a| cat(&[&a.q, &a.k, &a.v])),
                            nq * 2 * hd + 2 * nkv * hd,
                            d,
                            wstd(d),
                        )?,
                        o: mat(a.map(|a| bf16_bytes(&a.o)), d, nq * hd, wstd(nq * hd))?,
                        q_norm: vecf(a.map(|a| a.q_norm.as_slice()), hd, 0.0, 0.1)?,
                        k_norm: vecf(a.map(|a| a.k_norm.as_slice()), hd, 0.0, 0.1)?,
                    })
                }
            };
            let moe = hl.map(|x| &x.moe);
            let (e, i, is) = (
                cfg.num_experts,
                cfg.moe_intermediate,
                cfg.shared_intermediate,
            );
            let experts_gate_up = moe.map(|m| {
                let mut v = Vec::with_capacity(e * 2 * i * d * 2);
                for x in &m.experts {
                    v.extend(bf16_bytes(&x.gate));
                    v.extend(bf16_bytes(&x.up));
                }
                v
            });
            let experts_down = moe.map(|m| {
                let mut v = Vec::with_capacity(e * d * i * 2);
                for x in &m.experts {
                    v.extend(bf16_bytes(&x.down));
                }
                v
            });
            let shared = moe.map(|m| &m.shared);
            let sh_gu = shared.map(|s: &ExpertWeights| cat(&[&s.gate, &s.up]));
            let gate_up = mat(experts_gate_up, e * 2 * i, d, wstd(d))?;
            let down = mat(experts_down, e * d, i, wstd(i))?;
            let moe_maps = if moe_gemm == MoeGemm::V7 && d.is_multiple_of(8) && i.is_multiple_of(8)
            {
                Some((
                    gpu.moe_tensor_map(gate_up.ptr, e * 2 * i, d)?,
                    gpu.moe_tensor_map(down.ptr, e * d, i)?,
                ))
            } else {
                None
            };
            layers.push(LayerW {
                input_norm: vecf(hl.map(|x| x.input_norm.as_slice()), d, 0.0, 0.1)?,
                post_norm: vecf(hl.map(|x| x.post_attention_norm.as_slice()), d, 0.0, 0.1)?,
                mixer,
                router: mat(moe.map(|m| bf16_bytes(&m.router)), e, d, 0.1)?,
                gate_up,
                down,
                moe_maps,
                shared_gate_up: mat(sh_gu, 2 * is, d, wstd(d))?,
                shared_down: mat(shared.map(|s| bf16_bytes(&s.down)), d, is, wstd(is))?,
                shared_gate: vecf(moe.map(|m| m.shared_gate.as_slice()), d, 0.0, wstd(d))?,
            });
        }
        let inv_freq = gpu.upload(&f32_bytes(&rope_inv_freq(cfg.rotary_dim, cfg.rope_theta)))?;
        if fused_decode_fits(&cfg) {
            gpu.set_max_dynamic_smem("attn_decode", attn_decode_smem(&cfg))?;
        }
        (progress.borrow_mut())(upload_total, upload_total);
        let ws = Self::alloc_workspace(&gpu, &cfg, max_chunk)?;
        let dws = DecodeWs::alloc(&gpu, &cfg)?;
        gpu.sync()?;
        let fused_decode = fused_decode_fits(&cfg)
            && std::env::var("KESTREL_DECODE").map_or(true, |v| v != "unfused");
        let gemv_stream = gemv_stream_setting(std::env::var("KESTREL_GEMV_STREAM").ok().as_deref());
        gpu.set_max_dynamic_smem("gemv_dec_stream", gemv_stream_smem(3))?;
        // Bulk copies (cp.async.bulk) are sm_90 instructions; each use has its own switch.
        let bulk_on = |var: &str| gpu.sm90a && std::env::var(var).map_or(true, |v| v != "0");
        let gemv_stream_bulk = bulk_on("KESTREL_GEMV_STREAM_BULK");
        let moe_down_bulk = bulk_on("KESTREL_MOE_DOWN_BULK");
        Ok(CudaModel {
            config: cfg,
            gpu,
            embed,
            final_norm,
            lm_head,
            inv_freq,
            layers,
            ws: std::cell::RefCell::new(ws),
            max_chunk,
            max_seq,
            weight_bytes: plan.weights,
            flash: match std::env::var("KESTREL_ATTN").as_deref() {
                Ok("wmma") => Flash::Wmma,
                Ok("mma" | "mma2") => Flash::Mma,
                _ => Flash::Wgmma,
            },
            decode_attn_mma: !std::env::var("KESTREL_ATTN_DECODE").is_ok_and(|v| v == "simt"),
            gemv_whole_rows: !std::env::var("KESTREL_GEMV").is_ok_and(|v| v == "split"),
            gemv_max_blocks: std::env::var("KESTREL_GEMV_MAX_BLOCKS")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&b: &usize| b >= 1)
                .unwrap_or(GEMV_MAX_BLOCKS),
            gemv_stream,
            gemv_stream_bulk,
            moe_gemm,
            moe_tile_m: std::env::var("KESTREL_MOE_TILE_M")
                .ok()
                .and_then(|v| v.parse().ok()),
            dws,
            fused_decode,
            decode_graph: std::env::var("KESTREL_DECODE_GRAPH").map_or(true, |v| v != "0"),
            decode_pdl: std::env::var("KESTREL_DECODE_PDL").map_or(true, |v| v != "0"),
            gdn_chunked: std::env::var("KESTREL_GDN").map_or(true, |v| v != "recurrent"),
            moe_down_early: !std::env::var("KESTREL_MOE_DOWN").is_ok_and(|v| v == "late"),
            moe_down_bulk,
            moe_y_bf16: !std::env::var("KESTREL_MOE_Y").is_ok_and(|v| v == "f32"),
            shared_gemm6: !std::env::var("KESTREL_SHARED_GEMM").is_ok_and(|v| v == "cublas"),
            gdn_inproj_merged: !std::env::var("KESTREL_GDN_INPROJ").is_ok_and(|v| v == "split"),
            flash_q_prep: !std::env::var("KESTREL_ATTN_QPREP").is_ok_and(|v| v == "separate"),
            moe_stats: std::env::var("KESTREL_MOE_STATS").is_ok_and(|v| v == "1"),
            gdn_convstep: !std::env::var("KESTREL_GDN_DEC").is_ok_and(|v| v == "split"),
        })
    }

    fn alloc_workspace(gpu: &Gpu, cfg: &TextConfig, t: usize) -> Result<Workspace> {
        let (list, _) = Self::workspace_floats(cfg, t);
        let mut bufs: std::collections::HashMap<&str, DeviceBuf> = std::collections::HashMap::new();
        let mut part_floats = 0;
        for (name, n, b) in list {
            if name == "part" {
                part_floats = n;
            }
            bufs.insert(name, gpu.alloc((n * b).max(4))?);
        }
        let mut take = |n: &str| bufs.remove(n).ok_or_else(|| anyhow!("workspace {n}"));
        Ok(Workspace {
            ids: take("ids")?,
            h: take("h")?,
            xb: take("xb")?,
            p: take("p")?,
            qkv: take("qkv")?,
            beta: take("beta")?,
            g: take("g")?,
            o: take("o")?,
            gdn: take("gdn")?,
            ob: take("ob")?,
            qg: take("qg")?,
            k: take("k")?,
            v: take("v")?,
            q: take("q")?,
            part: take("part")?,
            part_floats,
            router: take("router")?,
            counts: take("counts")?,
            offsets: take("offsets")?,
            cursor: take("cursor")?,
            tile_expert: take("tile_expert")?,
            tile_row: take("tile_row")?,
            tile_rows: take("tile_rows")?,
            num_tiles: take("num_tiles")?,
            dense_plan: take("dense_plan")?,
            topk_ids: take("topk_ids")?,
            topk_w: take("topk_w")?,
            sgate: take("sgate")?,
            sorted_token: take("sorted_token")?,
            slot_row: take("slot_row")?,
            gu: take("gu")?,
            act: take("act")?,
            y: take("y")?,
            sgu: take("sgu")?,
            sact: take("sact")?,
            ys: take("ys")?,
            logits: take("logits")?,
        })
    }

    /// A fresh sequence state with room for `max_seq` tokens.
    pub fn new_state_checked(&self) -> Result<CudaState> {
        let c = &self.config;
        let g = &self.gpu;
        let mut gdn = Vec::new();
        let mut kv = Vec::new();
        let kv_token_bytes = c.num_kv_heads * c.head_dim * 2;
        for kind in &c.layer_kinds {
            match kind {
                LayerKind::Gdn => gdn.push((
                    g.alloc_zeroed((c.conv_kernel - 1) * c.gdn_conv_channels() * 4)?,
                    g.alloc_zeroed(c.gdn_num_value_heads * c.gdn_key_dim * c.gdn_value_dim * 4)?,
                )),
                LayerKind::Attention => kv.push((
                    g.alloc(self.max_seq * kv_token_bytes)?,
                    g.alloc(self.max_seq * kv_token_bytes)?,
                )),
            }
        }
        Ok(CudaState {
            len: 0,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            kv,
            kv_token_bytes,
            gpu: self.gpu.clone(),
        })
    }

    /// One forward pass over at most `max_chunk` tokens; the last hidden rows stay in `ws.h`.
    fn forward_chunk(&self, ws: &Workspace, state: &mut CudaState, tokens: &[u32]) -> Result<()> {
        let c = &self.config;
        let g = &*self.gpu;
        let t = tokens.len();
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let past = state.len;
        let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        g.copy_to_device(ws.ids.ptr, &ids)?;
        if self.shared_on_gemm6(t) {
            let plan = DensePlan::contents(self.max_chunk, t)?;
            g.copy_to_device(ws.dense_plan.ptr, &plan)?;
        }
        let ti = t as i32;
        let block = block_threads;

        // Embedding
        g.launch(
            "embed_gather",
            (t as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(self.embed.ptr),
                Arg::Ptr(ws.ids.ptr),
                Arg::Ptr(ws.h.ptr),
                Arg::I(d as i32),
            ],
        )?;
        let rmsnorm = |w: &DeviceBuf, src: u64, rows: usize| {
            g.launch_dep(
                "rmsnorm_zc_bf16",
                (rows as u32, 1, 1),
                256,
                0,
                &[
                    Arg::Ptr(src),
                    Arg::Ptr(w.ptr),
                    Arg::Ptr(ws.xb.ptr),
                    Arg::I(d as i32),
                    Arg::F(eps),
                ],
            )
        };
        let (mut gdn_i, mut attn_i) = (0, 0);
        for (li, layer) in self.layers.iter().enumerate() {
            // From the second layer on, the previous layer's moe_combine wrote the normalised
            // input already.
            if li == 0 {
                rmsnorm(&layer.input_norm, ws.h.ptr, t)?;
            }
            match &layer.mixer {
                MixerW::Gdn(w) => {
                    let (st_conv, st_rec) = &state.gdn[gdn_i];
                    gdn_i += 1;
                    let sh = GdnShape::of(c, t);
                    let (hv, dv) = (sh.hv, sh.dv);
                    let (ch, vw) = (c.gdn_conv_channels(), c.gdn_v_width());
                    // The in-projection's q|k|v, z and b|a side by side in p's rows (the conv,
                    // the gates and the gated norm read them in place): one GEMM, or
                    // (KESTREL_GDN_INPROJ=split) q|k|v with z and b|a on the second stream
                    // beside it and the conv (joined before the gates read b|a).
                    let rows_all = ch + vw + 2 * hv;
                    let at = |col: usize| ws.p.ptr + (col * 4) as u64;
                    let (xb, ld) = (ws.xb.ptr, rows_all);
                    if self.gdn_inproj_merged {
                        g.gemm(w.in_proj.ptr, rows_all, d, xb, t, ws.p.ptr, ld, 0.0)?;
                    } else {
                        let (in_qkv, in_z, in_ba) = w.in_parts(c);
                        g.fork_aux()?;
                        g.gemm_aux(in_z, vw, d, xb, t, at(ch), ld, 0.0)?;
                        g.gemm_aux(in_ba, 2 * hv, d, xb, t, at(ch + vw), ld, 0.0)?;
                        g.gemm(in_qkv, ch, d, xb, t, ws.p.ptr, ld, 0.0)?;
                    }
                    let conv_in = ConvRows { ptr: ws.p.ptr, ld };
                    let (z, ba) = (at(ch), at(ch + vw));
                    let chunked =
                        t > 1 && self.gdn_chunked && sh.chunked_fits(g.max_smem_per_block);
                    let conv = if chunked {
                        Gpu::gdn_conv_prefill
                    } else {
                        Gpu::gdn_conv_sequential
                    };
                    conv(
                        g,
                        &sh,
                        c.conv_kernel,
                        conv_in,
                        st_conv.ptr,
                        w.conv.ptr,
                        ws.qkv.ptr,
                    )?;
                    if !self.gdn_inproj_merged {
                        g.join_aux()?;
                    }
                    g.launch_dep(
                        "gdn_gates",
                        ((t * hv).div_ceil(256) as u32, 1, 1),
                        256,
                        0,
                        &[
                            Arg::Ptr(ba),
                            Arg::Ptr(ba + (hv * 4) as u64),
                            Arg::I(ld as i32),
                            Arg::Ptr(w.a_log.ptr),
                            Arg::Ptr(w.dt_bias.ptr),
                            Arg::Ptr(ws.beta.ptr),
                            Arg::Ptr(ws.g.ptr),
                            Arg::I(ti),
                            Arg::I(hv as i32),
                        ],
                    )?;
                    let bufs = DeltaBufs {
                        qkv: ws.qkv.ptr,
                        g: ws.g.ptr,
                        beta: ws.beta.ptr,
                        state: st_rec.ptr,
                        o: ws.o.ptr,
                    };
                    if chunked {
                        g.gdn_delta_chunked(&sh, &bufs, ws.gdn.ptr)?;
                    } else {
                        g.gdn_delta_recurrent(&sh, &bufs)?;
                    }
                    g.launch_dep(
                        "gdn_gated_norm",
                        ((t * hv).div_ceil(8) as u32, 1, 1),
                        256,
                        0,
                        &[
                            Arg::Ptr(ws.o.ptr),
                            Arg::Ptr(z),
                            Arg::Ptr(w.norm.ptr),
                            Arg::Ptr(ws.ob.ptr),
                            Arg::I((t * hv) as i32),
                            Arg::I(dv as i32),
                            Arg::I(hv as i32),
                            Arg::I(ld as i32),
                            Arg::F(eps),
                        ],
                    )?;
                    // Residual add fused into the GEMM (beta = 1).
                    g.gemm(w.out.ptr, d, vw, ws.ob.ptr, t, ws.h.ptr, d, 1.0)?;
                }
                MixerW::Attn(w) => {
                    let (kc, vc) = &state.kv[attn_i];
                    attn_i += 1;
                    let (nq, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
                    let (wq, wk, wv) = w.qkv_parts(c);
                    // k and v on the second stream beside the q|gate product.
                    g.fork_aux()?;
                    g.gemm_aux(wk, nkv * hd, d, ws.xb.ptr, t, ws.k.ptr, nkv * hd, 0.0)?;
                    g.gemm_aux(wv, nkv * hd, d, ws.xb.ptr, t, ws.v.ptr, nkv * hd, 0.0)?;
                    g.gemm(
                        wq,
                        nq * 2 * hd,
                        d,
                        ws.xb.ptr,
                        t,
                        ws.qg.ptr,
                        nq * 2 * hd,
                        0.0,
                    )?;
                    g.join_aux()?;
                    // A warp per (token, head) row (attn_prep_rows, 16-byte loads: hd % 4 ==
                    // 0), else attn_prep's block per row; the same arguments but the one
                    // before nq (the token count, or attn_prep's device-position pointer)
                    // and attn_prep_rows' first head (nq where attn_flash4 preps the queries).
                    let flash = t >= FLASH_MIN_TOKENS;
                    let rot_half = c.rotary_dim / 2;
                    // (flash_preps_q implies head dim 256, so attn_prep_rows runs below)
                    let q_prep = (flash
                        && self.flash_q_prep
                        && g.flash_preps_q(self.flash, nq, nkv, hd, rot_half))
                    .then_some(QPrep {
                        q_norm: w.q_norm.ptr,
                        inv_freq: self.inv_freq.ptr,
                        rot_half,
                        eps,
                    });
                    let rows = hd % 4 == 0;
                    let h0 = if q_prep.is_some() { nq } else { 0 };
                    let (name, grid, block_dim, smem) = if rows {
                        let grid = ((t * (nq + nkv - h0)).div_ceil(8) as u32, 1, 1);
                        ("attn_prep_rows", grid, 256, 8 * hd * 4)
                    } else {
                        let grid = (t as u32, (nq + nkv) as u32, 1);
                        ("attn_prep", grid, block(hd), hd * 4)
                    };
                    let mut args = vec![
                        Arg::Ptr(ws.qg.ptr),
                        Arg::Ptr(ws.k.ptr),
                        Arg::Ptr(ws.v.ptr),
                        Arg::Ptr(w.q_norm.ptr),
                        Arg::Ptr(w.k_norm.ptr),
                        Arg::Ptr(self.inv_freq.ptr),
                        Arg::Ptr(ws.q.ptr),
                        Arg::Ptr(kc.ptr),
                        Arg::Ptr(vc.ptr),
                        Arg::I(past as i32),
                        if rows { Arg::I(t as i32) } else { Arg::Ptr(0) },
                        Arg::I(nq as i32),
                        Arg::I(nkv as i32),
                        Arg::I(hd as i32),
                        Arg::I(rot_half as i32),
                        Arg::F(eps),
                    ];
                    if rows {
                        args.push(Arg::I(h0 as i32));
                    }
                    g.launch_dep(name, grid, block_dim, smem as u32, &args)?;
                    if flash {
                        g.attn_flash(
                            self.flash,
                            &FlashCall {
                                q_prep,
                                q: ws.q.ptr,
                                k_cache: kc.ptr,
                                v_cache: vc.ptr,
                                qg: ws.qg.ptr,
                                out: ws.ob.ptr,
                                t,
                                past,
                                nq,
                                nkv,
                                hd,
                            },
                        )?;
                    } else {
                        let n_max = past + t;
                        let cap = (ws.part_floats / (t * nq * (hd + 2))).clamp(1, DECODE_SPLITS);
                        let chunk = n_max.div_ceil(cap).max(64);
                        let nsplit = n_max.div_ceil(chunk);
                        g.launch(
                            "attn_split",
                            (t as u32, nq as u32, nsplit.div_ceil(4) as u32),
                            128,
                            0,
                            &[
                                Arg::Ptr(ws.q.ptr),
                                Arg::Ptr(kc.ptr),
                                Arg::Ptr(vc.ptr),
                                Arg::Ptr(ws.part.ptr),
                                Arg::I(past as i32),
                                Arg::Ptr(0),
                                Arg::I(nq as i32),
                                Arg::I(nkv as i32),
                                Arg::I(hd as i32),
                                Arg::I(nsplit as i32),
                                Arg::I(chunk as i32),
                                Arg::F(1.0 / (hd as f32).sqrt()),
                            ],
                        )?;
                        g.launch(
                            "attn_combine",
                            (t as u32, nq as u32, 1),
                            block(hd),
                            0,
                            &[
                                Arg::Ptr(ws.part.ptr),
                                Arg::Ptr(ws.qg.ptr),
                                Arg::Ptr(ws.ob.ptr),
                                Arg::I(past as i32),
                                Arg::Ptr(0),
                                Arg::I(nq as i32),
                                Arg::I(hd as i32),
                                Arg::I(nsplit as i32),
                                Arg::I(chunk as i32),
                            ],
                        )?;
                    }
                    g.gemm(w.o.ptr, d, nq * hd, ws.ob.ptr, t, ws.h.ptr, d, 1.0)?;
                }
            }
            rmsnorm(&layer.post_norm, ws.h.ptr, t)?;
            let next_norm = self.layers.get(li + 1).map(|l| &l.input_norm);
            self.moe(ws, layer, t, next_norm)?;
        }
        state.len += t;
        Ok(())
    }

    /// The MoE block of `layer` on the `t` rows of `ws.xb`, added into `ws.h`; with
    /// `next_norm`, `ws.xb` then holds the next layer's normalised input (moe_combine's
    /// fused RMSNorm).
    /// The grouped GEMM and its tile height for `rows` routed rows (V7 without tensor maps,
    /// where d or I is not a multiple of 8: V6's kernels).
    /// [`CudaModel::moe_stats`]' line for one prefill MoE layer, after its `moe_plan`.
    fn print_moe_stats(&self, ws: &Workspace, e: usize, rows: usize, tile_m: usize) -> Result<()> {
        let g = &*self.gpu;
        g.sync()?;
        let (mut counts, mut tiles) = (vec![0i32; e], [0i32]);
        g.copy_to_host(ws.counts.ptr, &mut counts)?;
        g.copy_to_host(ws.num_tiles.ptr, &mut tiles)?;
        let tiles = tiles[0].max(0) as usize;
        let mut tile_rows = vec![0i32; tiles];
        g.copy_to_host(ws.tile_rows.ptr, &mut tile_rows)?;
        let partial = tile_rows
            .iter()
            .filter(|&&r| 2 * r as usize <= tile_m)
            .count();
        eprintln!(
            "moe stats: {rows} rows over {e} experts ({} to {} an expert), {tiles} tiles of {tile_m} \
             ({partial} of <= {} rows; {} if every tile were full)",
            counts.iter().min().unwrap_or(&0),
            counts.iter().max().unwrap_or(&0),
            tile_m / 2,
            rows.div_ceil(tile_m)
        );
        Ok(())
    }

    fn moe_kind(&self, layer: &LayerW, rows: usize) -> (MoeGemm, usize) {
        let kind = match self.moe_gemm {
            MoeGemm::V7 if layer.moe_maps.is_none() => MoeGemm::V6,
            k => k,
        };
        let e = self.config.num_experts;
        (kind, kind.tile_m(rows, e, self.moe_tile_m))
    }

    /// Whether a prefill call of `t` tokens runs the shared expert through `moe_gemm6`
    /// ([`Gpu::dense_mlp_aux`]): where the routed experts run on it too (not the GEMV path).
    fn shared_on_gemm6(&self, t: usize) -> bool {
        let c = &self.config;
        let rows = t * c.experts_per_token;
        self.shared_gemm6
            && self.gpu.sm90a
            && rows > MOE_GEMV_MAX_ROWS
            && self.layers.first().is_some_and(|l| {
                matches!(
                    self.moe_kind(l, rows),
                    (MoeGemm::V6 | MoeGemm::V7, 128 | 256)
                )
            })
    }

    fn moe(
        &self,
        ws: &Workspace,
        layer: &LayerW,
        t: usize,
        next_norm: Option<&DeviceBuf>,
    ) -> Result<()> {
        let c = &self.config;
        let g = &*self.gpu;
        let (d, e, k, i, is) = (
            c.hidden_size,
            c.num_experts,
            c.experts_per_token,
            c.moe_intermediate,
            c.shared_intermediate,
        );
        let rows = t * k;
        // The shared expert (dense) on the second stream, beside the routed experts: where
        // reading the experts' weights bounds the routed products (short prompts) its small
        // GEMMs fill the SMs' idle issue slots. Joined before moe_combine reads ys.
        g.fork_aux()?;
        if self.shared_on_gemm6(t) {
            // moe_gemm6 with the SwiGLU fused, over the dense plan forward_chunk uploaded
            let plan = DensePlan::plan(ws.dense_plan.ptr, self.max_chunk);
            let gu = Grouped {
                a: ws.xb.ptr,
                gather: 0,
                w: layer.shared_gate_up.ptr,
                out: ws.sact.ptr,
                ndim: 2 * is,
                kdim: d,
                tmap: 0,
            };
            let down = Grouped {
                a: ws.sact.ptr,
                gather: 0,
                w: layer.shared_down.ptr,
                out: ws.ys.ptr,
                ndim: d,
                kdim: is,
                tmap: 0,
            };
            g.dense_mlp_aux(&plan, t, &gu, &down)?;
        } else {
            g.gemm_aux(
                layer.shared_gate_up.ptr,
                2 * is,
                d,
                ws.xb.ptr,
                t,
                ws.sgu.ptr,
                2 * is,
                0.0,
            )?;
            g.swiglu_bf16_on(true, ws.sgu.ptr, ws.sact.ptr, t, is)?;
            g.gemm_aux(
                layer.shared_down.ptr,
                d,
                is,
                ws.sact.ptr,
                t,
                ws.ys.ptr,
                d,
                0.0,
            )?;
        }
        g.gemm(layer.router.ptr, e, d, ws.xb.ptr, t, ws.router.ptr, e, 0.0)?;
        g.memset_zero(ws.counts.ptr, (e + 1) * 4)?;
        g.launch_dep(
            "moe_route",
            (t.div_ceil(ROUTE_WARPS) as u32, 1, 1),
            32 * ROUTE_WARPS as u32,
            (ROUTE_WARPS * e * 4) as u32,
            &[
                Arg::Ptr(ws.router.ptr),
                Arg::I(e as i32),
                Arg::I(k as i32),
                Arg::Ptr(ws.topk_ids.ptr),
                Arg::Ptr(ws.topk_w.ptr),
                Arg::Ptr(ws.counts.ptr),
                Arg::Ptr(ws.xb.ptr),
                Arg::Ptr(layer.shared_gate.ptr),
                Arg::Ptr(ws.sgate.ptr),
                Arg::I(d as i32),
                Arg::I(t as i32),
            ],
        )?;
        let gemv_path = rows <= MOE_GEMV_MAX_ROWS;
        let (kind, tile_m) = self.moe_kind(layer, rows);
        let (gu_map, down_map) = layer
            .moe_maps
            .as_ref()
            .map_or((0, 0), |(a, b)| (a.ptr, b.ptr));
        // y in bf16 only from moe_gemm6's and moe_gemm7's tiles (16-byte rows of 8 features).
        let y_bf16 = self.moe_y_bf16
            && !gemv_path
            && matches!(
                (kind, tile_m),
                (MoeGemm::V6 | MoeGemm::V7, 128) | (MoeGemm::V7, 256)
            )
            && d % 8 == 0;
        let gemv = |a: u64, by_k: bool, w: u64, out: u64, ndim: usize, kdim: usize| {
            g.launch(
                "moe_gemv",
                (
                    rows as u32,
                    ndim.div_ceil(gemv_rows_per_block(kdim, false)) as u32,
                    1,
                ),
                256,
                (kdim * 4) as u32,
                &[
                    Arg::Ptr(a),
                    Arg::I(by_k as i32),
                    Arg::Ptr(ws.topk_ids.ptr),
                    Arg::I(k as i32),
                    Arg::Ptr(w),
                    Arg::Ptr(out),
                    Arg::I(ndim as i32),
                    Arg::I(kdim as i32),
                ],
            )
        };
        if gemv_path {
            gemv(ws.xb.ptr, true, layer.gate_up.ptr, ws.gu.ptr, 2 * i, d)?;
            g.swiglu_bf16(ws.gu.ptr, ws.act.ptr, rows, i)?;
            gemv(ws.act.ptr, false, layer.down.ptr, ws.y.ptr, d, i)?;
        } else {
            let plan = MoePlan {
                counts: ws.counts.ptr,
                offsets: ws.offsets.ptr,
                cursor: ws.cursor.ptr,
                tile_expert: ws.tile_expert.ptr,
                tile_row: ws.tile_row.ptr,
                tile_rows: ws.tile_rows.ptr,
                num_tiles: ws.num_tiles.ptr,
                claim: ws.counts.ptr + (e * 4) as u64,
            };
            if tile_m < MIN_TILE_M {
                bail!(
                    "MoE tiles of {tile_m} rows: the workspace holds tiles of {MIN_TILE_M} or more"
                );
            }
            g.moe_plan(&plan, e, tile_m)?;
            if self.moe_stats {
                self.print_moe_stats(ws, e, rows, tile_m)?;
            }
            g.moe_scatter(
                ws.topk_ids.ptr,
                rows,
                k,
                ws.cursor.ptr,
                ws.sorted_token.ptr,
                ws.slot_row.ptr,
            )?;
            let gate_up = Grouped {
                a: ws.xb.ptr,
                gather: ws.sorted_token.ptr,
                w: layer.gate_up.ptr,
                out: ws.gu.ptr,
                ndim: 2 * i,
                kdim: d,
                tmap: gu_map,
            };
            if kind.fused_swiglu() {
                let fused = Grouped {
                    out: ws.act.ptr,
                    ..gate_up
                };
                g.moe_grouped_swiglu(kind, tile_m, &plan, rows, e, &fused)?;
            } else {
                g.moe_grouped(kind, tile_m, &plan, rows, e, &gate_up)?;
                g.swiglu_bf16(ws.gu.ptr, ws.act.ptr, rows, i)?;
            }
            let down = Grouped {
                a: ws.act.ptr,
                gather: 0,
                w: layer.down.ptr,
                out: ws.y.ptr,
                ndim: d,
                kdim: i,
                tmap: down_map,
            };
            if y_bf16 {
                g.moe_grouped_bf16(kind, tile_m, &plan, rows, e, &down)?;
            } else {
                g.moe_grouped(kind, tile_m, &plan, rows, e, &down)?;
            }
        }
        g.join_aux()?;
        g.launch_dep(
            if y_bf16 {
                "moe_combine_bf16"
            } else {
                "moe_combine"
            },
            (t as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(ws.y.ptr),
                // The GEMV path leaves rows unsorted (row = token * k + slot).
                Arg::Ptr(if gemv_path { 0 } else { ws.slot_row.ptr }),
                Arg::Ptr(ws.topk_w.ptr),
                Arg::Ptr(ws.ys.ptr),
                Arg::Ptr(ws.sgate.ptr),
                Arg::Ptr(ws.h.ptr),
                Arg::I(k as i32),
                Arg::I(d as i32),
                Arg::Ptr(next_norm.map_or(0, |w| w.ptr)),
                Arg::Ptr(ws.xb.ptr),
                Arg::F(c.rms_norm_eps),
            ],
        )
    }

    /// Decode GEMV: y = beta*y + W·x, x = the bf16 vector `x` or (x = 0) RMSNorm(h) with
    /// weight `norm` (h: f32, `k` values); with `greedy = Some((limit, out2))` also the argmax
    /// over rows < limit into `dws.next` (and into `out2` unless 0: the decode step writes the
    /// next step's input token there).
    #[allow(clippy::too_many_arguments)]
    fn gemv_dec(
        &self,
        w: u64,
        n: usize,
        k: usize,
        x: u64,
        h: u64,
        norm: u64,
        y: u64,
        beta: f32,
        greedy: Option<(usize, u64)>,
        pdl: bool,
    ) -> Result<()> {
        let dw = &self.dws;
        // Both kernels' arguments after the matrix's shape: the input (bf16 x, or RMSNorm(h)
        // with weight norm), no bf16 copy of it, y = beta * y + W . input.
        let io = [
            Arg::Ptr(x),
            Arg::Ptr(h),
            Arg::Ptr(norm),
            Arg::F(self.config.rms_norm_eps),
            Arg::Ptr(0),
            Arg::Ptr(y),
            Arg::F(beta),
        ];
        if let (Some((ns, early, at)), 2048, None) = (self.gemv_stream, k, greedy) {
            let args: Vec<Arg> = [Arg::Ptr(w), Arg::I(n as i32)]
                .into_iter()
                .chain(io)
                .chain([
                    Arg::I(ns as i32),
                    Arg::I(early as i32),
                    Arg::I(at as i32),
                    Arg::I(self.gemv_stream_bulk as i32),
                ])
                .collect();
            return self.gpu.launch_ex(
                "gemv_dec_stream",
                (n.div_ceil(2).min(self.gpu.sm_count) as u32, 1, 1),
                256,
                gemv_stream_smem(ns) as u32,
                &args,
                pdl,
            );
        }
        let (val, idx, done, limit, out, out2) = match greedy {
            Some((limit, out2)) => (
                dw.arg_val.ptr,
                dw.arg_idx.ptr,
                dw.done.ptr,
                limit.min(n) as i32,
                dw.next.ptr,
                out2,
            ),
            None => (0, 0, 0, 0, 0, 0),
        };
        let args: Vec<Arg> = [Arg::Ptr(w), Arg::I(n as i32), Arg::I(k as i32)]
            .into_iter()
            .chain(io)
            .chain([
                Arg::Ptr(val),
                Arg::Ptr(idx),
                Arg::Ptr(done),
                Arg::I(limit),
                Arg::Ptr(out),
                Arg::Ptr(out2),
            ])
            .collect();
        self.gpu.launch_ex(
            if self.gemv_whole_rows {
                "gemv_dec_w"
            } else {
                "gemv_dec"
            },
            (
                n.div_ceil(gemv_rows_per_block(k, self.gemv_whole_rows))
                    .min(self.gemv_max_blocks) as u32,
                1,
                1,
            ),
            256,
            // k floats of staged input, and with the RMSNorm (x = 0) its weight after them
            (k * 4 * if x == 0 { 2 } else { 1 }) as u32,
            &args,
            pdl,
        )
    }

    /// The fused GDN conv + delta-rule step kernel for this model, if it takes the shape: conv
    /// kernel 4, the key head's q and k plus the head's v no more channels than the block's
    /// 4 dv threads, one value head a key head, or two on sm_90a (a cluster of two blocks).
    /// (hk, hv, dk, dv): the GDN's key and value heads and their widths.
    fn convstep_kernel(
        &self,
        (hk, hv, dk, dv): (usize, usize, usize, usize),
    ) -> Option<&'static str> {
        let group = hv / hk;
        let fits = self.gdn_convstep
            && self.config.conv_kernel == 4
            && hv % hk == 0
            && 2 * dk + dv <= block_threads(4 * dv) as usize
            && (group == 1 || (group == 2 && self.gpu.sm90a));
        if !fits {
            return None;
        }
        Some(match (group, dk) {
            (1, 16) => "gdn_convstep_dec_16",
            (1, 32) => "gdn_convstep_dec_32",
            (1, 64) => "gdn_convstep_dec_64",
            (1, _) => "gdn_convstep_dec_128",
            (_, 16) => "gdn_convstep_dec_cl2_16",
            (_, 32) => "gdn_convstep_dec_cl2_32",
            (_, 64) => "gdn_convstep_dec_cl2_64",
            _ => "gdn_convstep_dec_cl2_128",
        })
    }

    /// The fused one-token step, top to bottom: every launch reads the token and position
    /// from `dws.step_in` and nothing else changes between steps, so the sequence can be
    /// captured once per state into a CUDA graph. Six launches per GDN layer (in-projection
    /// with the RMSNorm, conv + delta-rule step, out-projection with the residual, router,
    /// experts' gate/up, experts' down with the combine; seven where the conv and the step are
    /// two, see [`CudaModel::convstep_kernel`]), eight per attention layer.
    fn decode_launches(&self, state: &CudaState, nsplit: usize, vocab_limit: usize) -> Result<()> {
        let c = &self.config;
        let dw = &self.dws;
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let pos = dw.step_in.ptr + 4;
        let launch = |name: &str, grid, block, smem, args: &[Arg]| {
            self.gpu
                .launch_ex(name, grid, block, smem, args, self.decode_pdl)
        };
        let block = block_threads;
        // Not an early (programmatic) launch: the step starts after the previous one is done,
        // which lets later kernels read their own layer's recurrent state before
        // griddep_wait (nothing in this step writes it before them).
        self.gpu.launch_ex(
            "embed_gather",
            (1, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(self.embed.ptr),
                Arg::Ptr(dw.step_in.ptr),
                Arg::Ptr(dw.h.ptr),
                Arg::I(d as i32),
            ],
            false,
        )?;
        // y = beta*y + W·x, x = the bf16 vector `x` or (x = 0) RMSNorm(h) with weight `norm`;
        // with `greedy = Some(limit)` also the argmax over rows < limit into `next` and the
        // next step's input.
        let gemv = |w: u64,
                    n: usize,
                    k: usize,
                    x: u64,
                    norm: u64,
                    y: u64,
                    beta: f32,
                    greedy: Option<usize>| {
            let greedy = greedy.map(|limit| (limit, dw.step_in.ptr));
            self.gemv_dec(w, n, k, x, dw.h.ptr, norm, y, beta, greedy, self.decode_pdl)
        };
        let (mut gdn_i, mut attn_i) = (0, 0);
        for layer in &self.layers {
            // The mixer's fused input projection (GDN: qkv|z|b|a; attention: q+gate|k|v) of
            // RMSNorm(h) into dw.proj.
            let in_proj = |w: u64, rows: usize| {
                gemv(w, rows, d, 0, layer.input_norm.ptr, dw.proj.ptr, 0.0, None)
            };
            match &layer.mixer {
                MixerW::Gdn(w) => {
                    let (st_conv, st_rec) = &state.gdn[gdn_i];
                    gdn_i += 1;
                    let (hk, hv, dk, dv) = (
                        c.gdn_num_key_heads,
                        c.gdn_num_value_heads,
                        c.gdn_key_dim,
                        c.gdn_value_dim,
                    );
                    let (ch, vw) = (c.gdn_conv_channels(), c.gdn_v_width());
                    let rows = ch + vw + 2 * hv;
                    in_proj(w.in_proj.ptr, rows)?;
                    let (z, ba) = (
                        dw.proj.ptr + (ch * 4) as u64,
                        dw.proj.ptr + ((ch + vw) * 4) as u64,
                    );
                    if let Some(k) = self.convstep_kernel((hk, hv, dk, dv)) {
                        // conv + step in one launch (a cluster of two blocks a key head where it
                        // has two value heads)
                        launch(
                            k,
                            (hv as u32, 1, 1),
                            block(4 * dv),
                            convstep_smem(dk, dv),
                            &[
                                Arg::Ptr(dw.proj.ptr),
                                Arg::Ptr(st_conv.ptr),
                                Arg::Ptr(w.conv.ptr),
                                Arg::Ptr(z),
                                Arg::Ptr(ba),
                                Arg::Ptr(w.a_log.ptr),
                                Arg::Ptr(w.dt_bias.ptr),
                                Arg::Ptr(w.norm.ptr),
                                Arg::Ptr(st_rec.ptr),
                                Arg::Ptr(dw.ob.ptr),
                                Arg::I(ch as i32),
                                Arg::I(hk as i32),
                                Arg::I(hv as i32),
                                Arg::I(dv as i32),
                                Arg::F(1.0 / (dk as f32).sqrt()),
                                Arg::F(eps),
                            ],
                        )?;
                    } else {
                        launch(
                            "gdn_conv_dec",
                            ((2 * hk + hv) as u32, 1, 1),
                            block(dk.max(dv)),
                            0,
                            &[
                                Arg::Ptr(dw.proj.ptr),
                                Arg::Ptr(st_conv.ptr),
                                Arg::Ptr(w.conv.ptr),
                                Arg::Ptr(dw.qkv.ptr),
                                Arg::I(ch as i32),
                                Arg::I(c.conv_kernel as i32),
                                Arg::I(hk as i32),
                                Arg::I(dk as i32),
                                Arg::I(dv as i32),
                                Arg::F(1.0 / (dk as f32).sqrt()),
                            ],
                        )?;
                        let step = match dk {
                            16 => "gdn_step_dec_16",
                            32 => "gdn_step_dec_32",
                            64 => "gdn_step_dec_64",
                            _ => "gdn_step_dec_128",
                        };
                        launch(
                            step,
                            (hv as u32, 1, 1),
                            block(4 * dv),
                            0,
                            &[
                                Arg::Ptr(dw.qkv.ptr),
                                Arg::Ptr(ba),
                                Arg::Ptr(w.a_log.ptr),
                                Arg::Ptr(w.dt_bias.ptr),
                                Arg::Ptr(z),
                                Arg::Ptr(w.norm.ptr),
                                Arg::Ptr(st_rec.ptr),
                                Arg::Ptr(dw.ob.ptr),
                                Arg::I(hk as i32),
                                Arg::I(hv as i32),
                                Arg::I(dv as i32),
                                Arg::F(eps),
                            ],
                        )?;
                    }
                    gemv(w.out.ptr, d, vw, dw.ob.ptr, 0, dw.h.ptr, 1.0, None)?;
                }
                MixerW::Attn(w) => {
                    let (kc, vc) = &state.kv[attn_i];
                    attn_i += 1;
                    let (nq, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
                    let rows = nq * 2 * hd + 2 * nkv * hd;
                    in_proj(w.qkv.ptr, rows)?;
                    let kp = dw.proj.ptr + (nq * 2 * hd * 4) as u64;
                    launch(
                        "attn_prep",
                        (1, (nq + nkv) as u32, 1),
                        block(hd),
                        (hd * 4) as u32,
                        &[
                            Arg::Ptr(dw.proj.ptr),
                            Arg::Ptr(kp),
                            Arg::Ptr(kp + (nkv * hd * 4) as u64),
                            Arg::Ptr(w.q_norm.ptr),
                            Arg::Ptr(w.k_norm.ptr),
                            Arg::Ptr(self.inv_freq.ptr),
                            Arg::Ptr(dw.q.ptr),
                            Arg::Ptr(kc.ptr),
                            Arg::Ptr(vc.ptr),
                            Arg::I(0),
                            Arg::Ptr(pos),
                            Arg::I(nq as i32),
                            Arg::I(nkv as i32),
                            Arg::I(hd as i32),
                            Arg::I((c.rotary_dim / 2) as i32),
                            Arg::F(eps),
                        ],
                    )?;
                    // Split-K attention into dw.part: on tensor cores where the shape has a
                    // kernel (its head dim is compiled in), else the scalar kernel.
                    let mma = decode_mma_kernel(hd, nq / nkv).filter(|_| self.decode_attn_mma);
                    let (kernel, threads, smem) = match mma {
                        Some(k) => (k, 32, decode_mma_smem(hd)),
                        None => ("attn_decode", 32 * (nq / nkv) as u32, attn_decode_smem(c)),
                    };
                    let mut args = vec![
                        Arg::Ptr(dw.q.ptr),
                        Arg::Ptr(kc.ptr),
                        Arg::Ptr(vc.ptr),
                        Arg::Ptr(dw.part.ptr),
                        Arg::Ptr(pos),
                        Arg::I(nq as i32),
                        Arg::I(nkv as i32),
                    ];
                    if mma.is_none() {
                        args.push(Arg::I(hd as i32));
                    }
                    args.extend([Arg::I(nsplit as i32), Arg::F(1.0 / (hd as f32).sqrt())]);
                    launch(
                        kernel,
                        (nkv as u32, nsplit as u32, 1),
                        threads,
                        smem as u32,
                        &args,
                    )?;
                    // Merge the splits, normalise, gate: a block per head and 32 dims, or
                    // (scalar path, other head dims) a block per head.
                    let head = [
                        Arg::Ptr(dw.part.ptr),
                        Arg::Ptr(dw.proj.ptr),
                        Arg::Ptr(dw.ob.ptr),
                    ];
                    let tail = [Arg::I(nq as i32), Arg::I(hd as i32), Arg::I(nsplit as i32)];
                    if self.decode_attn_mma && hd.is_multiple_of(32) {
                        let args: Vec<Arg> = head
                            .into_iter()
                            .chain([Arg::Ptr(pos)])
                            .chain(tail)
                            .collect();
                        launch(
                            "attn_combine_dec",
                            (nq as u32, (hd / 32) as u32, 1),
                            256,
                            0,
                            &args,
                        )?;
                    } else {
                        let args: Vec<Arg> = head
                            .into_iter()
                            .chain([Arg::I(0), Arg::Ptr(pos)])
                            .chain(tail)
                            .chain([Arg::I(0)])
                            .collect();
                        launch("attn_combine", (1, nq as u32, 1), block(hd), 0, &args)?;
                    }
                    gemv(w.o.ptr, d, nq * hd, dw.ob.ptr, 0, dw.h.ptr, 1.0, None)?;
                }
            }
            self.moe_decode(layer)?;
        }
        // Final norm + lm_head with the greedy argmax fused.
        gemv(
            self.lm_head.ptr,
            c.vocab_size,
            d,
            0,
            self.final_norm.ptr,
            dw.logits.ptr,
            0.0,
            Some(vocab_limit),
        )
    }

    /// The MoE block of one token in three launches: router (+ its RMSNorm and the shared
    /// expert's gate), the top-k (picked by every gate/up warp from the logits) with the chosen
    /// and shared experts' gate/up and SwiGLU, and their down projections combined into the
    /// residual.
    fn moe_decode(&self, layer: &LayerW) -> Result<()> {
        let c = &self.config;
        let dw = &self.dws;
        let launch = |name: &str, grid, block, smem, args: &[Arg]| {
            self.gpu
                .launch_ex(name, grid, block, smem, args, self.decode_pdl)
        };
        let (d, e, k, i, is) = (
            c.hidden_size,
            c.num_experts,
            c.experts_per_token,
            c.moe_intermediate,
            c.shared_intermediate,
        );
        launch(
            "moe_router_dec",
            (e.div_ceil(ROUTER_ROWS) as u32 + 1, 1, 1),
            256,
            (router_smem(d) * 4) as u32,
            &[
                Arg::Ptr(dw.h.ptr),
                Arg::Ptr(layer.post_norm.ptr),
                Arg::F(c.rms_norm_eps),
                Arg::I(d as i32),
                Arg::Ptr(layer.router.ptr),
                Arg::I(e as i32),
                Arg::Ptr(layer.shared_gate.ptr),
                Arg::Ptr(dw.xb.ptr),
                Arg::Ptr(dw.router.ptr),
                Arg::Ptr(dw.sgate.ptr),
            ],
        )?;
        launch(
            "moe_gate_up_dec",
            (i.max(is).div_ceil(8) as u32, (k + 1) as u32, 1),
            256,
            (gate_up_dec_smem(d, e, k) * 4) as u32,
            &[
                Arg::Ptr(dw.xb.ptr),
                Arg::I(d as i32),
                Arg::Ptr(dw.router.ptr),
                Arg::I(e as i32),
                Arg::I(k as i32),
                Arg::Ptr(dw.topk_ids.ptr),
                Arg::Ptr(dw.topk_w.ptr),
                Arg::Ptr(layer.gate_up.ptr),
                Arg::I(i as i32),
                Arg::Ptr(layer.shared_gate_up.ptr),
                Arg::I(is as i32),
                Arg::Ptr(dw.act.ptr),
                Arg::I(DecodeWs::act_ld(c) as i32),
                Arg::I(self.moe_down_early as i32),
            ],
        )?;
        launch(
            "moe_down_dec",
            (d.div_ceil(4) as u32, 1, 1),
            (32 * (k + 1)) as u32,
            down_dec_smem(e, k, i, is, self.moe_down_early) as u32,
            &[
                Arg::Ptr(dw.act.ptr),
                Arg::I(DecodeWs::act_ld(c) as i32),
                Arg::Ptr(dw.topk_ids.ptr),
                Arg::Ptr(dw.topk_w.ptr),
                Arg::Ptr(dw.router.ptr),
                Arg::I(e as i32),
                Arg::I(match (self.moe_down_early, self.moe_down_bulk) {
                    (false, _) => 0,
                    (true, false) => 1,
                    (true, true) => 2,
                }),
                Arg::I(k as i32),
                Arg::Ptr(dw.sgate.ptr),
                Arg::Ptr(layer.down.ptr),
                Arg::I(i as i32),
                Arg::Ptr(layer.shared_down.ptr),
                Arg::I(is as i32),
                Arg::Ptr(dw.h.ptr),
                Arg::I(d as i32),
            ],
        )
    }

    /// Decode graphs captured for `state` so far.
    pub fn decode_graphs(&self, state: &CudaState) -> usize {
        state.graphs.len()
    }

    /// Runs one token through the fused decode step (replaying this state's captured graph
    /// when graphs are on); logits land in `dws.logits`, the greedy id in `dws.next`.
    fn decode_step(&self, state: &mut CudaState, token: u32, vocab_limit: usize) -> Result<()> {
        self.gpu
            .copy_to_device(self.dws.step_in.ptr, &[token as i32, state.len as i32])?;
        let nsplit = decode_splits(state.len + 1);
        if self.decode_graph && !self.gpu.profiling() {
            let key = (nsplit, vocab_limit);
            let at = match state.graphs.iter().position(|(k, _)| *k == key) {
                Some(at) => at,
                None => {
                    let graph = self
                        .gpu
                        .capture(|| self.decode_launches(state, nsplit, vocab_limit))?;
                    state.graphs.push((key, DecodeGraph(graph)));
                    state.graphs.len() - 1
                }
            };
            state.graphs[at]
                .1
                .0
                .launch()
                .map_err(|e| anyhow!("launching the decode graph: {e:?}"))?;
            self.gpu.main_tail_not_kernel();
        } else {
            self.decode_launches(state, nsplit, vocab_limit)?;
        }
        state.len += 1;
        Ok(())
    }

    /// One fused decode step of `token` with the decode timeline on: the records of every
    /// 8th and the last block of each decode kernel, `[tag << 48 | grid << 24 | block,
    /// y << 32 | SM, start, wait released (0: none), end, phase 0, 1, 2 (0: not taken)]`, times
    /// in ns of %globaltimer (see common.cuh's TRACE_RECORD). Empty unless the kernels were
    /// compiled with `KESTREL_KERNEL_DEFINES=KESTREL_TRACE`.
    pub fn trace_decode_step(
        &self,
        state: &mut CudaState,
        token: u32,
        vocab_limit: usize,
    ) -> Result<Vec<[u64; TRACE_RECORD]>> {
        const CAP: usize = 1 << 16;
        self.gpu.bind()?;
        self.admit_tokens(state, &[token])?;
        let buf = self.gpu.alloc_zeroed(CAP * TRACE_RECORD * 8)?;
        let set = |ptr: u64, cap: usize| {
            self.gpu.launch(
                "trace_set",
                (1, 1, 1),
                32,
                0,
                &[Arg::Ptr(ptr), Arg::I(cap as i32)],
            )
        };
        set(buf.ptr, CAP)?;
        self.decode_step(state, token, vocab_limit)?;
        set(0, 0)?;
        let mut raw = vec![0u64; CAP * TRACE_RECORD];
        self.gpu.copy_to_host(buf.ptr, &mut raw)?;
        Ok(raw
            .chunks_exact(TRACE_RECORD)
            .filter_map(|r| <[u64; TRACE_RECORD]>::try_from(r).ok())
            .filter(|r| r[2] != 0)
            .collect())
    }

    /// Final norm + lm_head for `n` rows of `ws.h` starting at row `r0`, into `ws.logits`.
    fn logits_rows(&self, ws: &Workspace, r0: usize, n: usize) -> Result<()> {
        let c = &self.config;
        let g = &*self.gpu;
        let d = c.hidden_size;
        g.launch_dep(
            "rmsnorm_zc_bf16",
            (n as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(ws.h.ptr + (r0 * d * 4) as u64),
                Arg::Ptr(self.final_norm.ptr),
                Arg::Ptr(ws.xb.ptr),
                Arg::I(d as i32),
                Arg::F(c.rms_norm_eps),
            ],
        )?;
        g.gemm(
            self.lm_head.ptr,
            c.vocab_size,
            d,
            ws.xb.ptr,
            n,
            ws.logits.ptr,
            c.vocab_size,
            0.0,
        )
    }

    /// Admits `tokens` into `state`: checks them against the vocabulary and the state's
    /// `max_seq`, and gives a snapshot's copy its KV room for them.
    fn admit_tokens(&self, state: &mut CudaState, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        if let Some(bad) = tokens
            .iter()
            .find(|&&id| id as usize >= self.config.vocab_size)
        {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                self.config.vocab_size
            );
        }
        if state.len + tokens.len() > state.max_seq {
            bail!(
                "the sequence would reach {} tokens but the GPU state holds {} (--max-seq)",
                state.len + tokens.len(),
                state.max_seq
            );
        }
        if state.len + tokens.len() > state.kv_room() {
            state.reserve_kv()?;
        }
        Ok(())
    }

    /// Runs `tokens` and returns the greedy next token (argmax over ids `< vocab_limit`),
    /// computed on the device: only 4 bytes come back.
    pub fn forward_greedy(
        &self,
        state: &mut CudaState,
        tokens: &[u32],
        vocab_limit: usize,
    ) -> Result<u32> {
        self.gpu.bind()?;
        self.admit_tokens(state, tokens)?;
        if tokens.len() == 1 && self.fused_decode {
            self.decode_step(state, tokens[0], vocab_limit)?;
            let mut out = [0i32; 1];
            self.gpu.copy_to_host(self.dws.next.ptr, &mut out)?;
            return Ok(out[0] as u32);
        }
        let ws = self.ws.borrow();
        let mut last = 0;
        for piece in tokens.chunks(self.max_chunk) {
            self.forward_chunk(&ws, state, piece)?;
            last = piece.len();
        }
        // The last row's final norm, lm_head and argmax in one launch: the decode step's
        // kernel (1,056 blocks stream lm_head once), not a cuBLAS product into f32 logits and
        // a one-block argmax over them.
        let c = &self.config;
        let h_last = ws.h.ptr + ((last - 1) * c.hidden_size * 4) as u64;
        self.gemv_dec(
            self.lm_head.ptr,
            c.vocab_size,
            c.hidden_size,
            0,
            h_last,
            self.final_norm.ptr,
            self.dws.logits.ptr,
            0.0,
            Some((vocab_limit, 0)),
            false,
        )?;
        let mut out = [0i32; 1];
        self.gpu.copy_to_host(self.dws.next.ptr, &mut out)?;
        Ok(out[0] as u32)
    }
}

impl Engine for CudaModel {
    type State = CudaState;

    fn config(&self) -> &TextConfig {
        &self.config
    }

    fn new_state(&self) -> CudaState {
        self.new_state_checked()
            .expect("GPU memory exhausted allocating a sequence state")
    }

    fn state_len(&self, state: &CudaState) -> usize {
        state.len
    }

    fn state_bytes(&self, state: &CudaState) -> usize {
        // Device memory: a snapshot copies every buffer whole.
        state
            .gdn
            .iter()
            .chain(&state.kv)
            .map(|(a, b)| a.bytes + b.bytes)
            .sum()
    }

    fn state_memory(&self) -> Option<StateMemory> {
        Some(StateMemory {
            free: self.gpu.memory().ok()?.0,
            per_state: Self::state_bytes(&self.config, self.max_seq),
        })
    }

    fn forward_greedy_id(
        &self,
        state: &mut CudaState,
        token: u32,
        vocab_limit: usize,
    ) -> Result<u32> {
        // the kernel's argmax starts from no row (i32::MAX) where the sampler's starts from id 0:
        // only when no logit beats -inf (all NaN or -inf) do they differ
        let id = self.forward_greedy(state, &[token], vocab_limit)?;
        Ok(if (id as usize) < vocab_limit { id } else { 0 })
    }

    fn forward(&self, state: &mut CudaState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        self.gpu.bind()?;
        self.admit_tokens(state, tokens)?;
        let v = self.config.vocab_size;
        if tokens.len() == 1 && self.fused_decode {
            self.decode_step(state, tokens[0], v)?;
            let mut out = vec![0f32; v];
            self.gpu.copy_to_host(self.dws.logits.ptr, &mut out)?;
            return Ok(out);
        }
        let ws = self.ws.borrow();
        let mut out = Vec::new();
        let n_chunks = tokens.len().div_ceil(self.max_chunk);
        for (ci, piece) in tokens.chunks(self.max_chunk).enumerate() {
            self.forward_chunk(&ws, state, piece)?;
            if logits == Logits::All {
                let mut r0 = 0;
                while r0 < piece.len() {
                    let n = LOGITS_ROWS.min(piece.len() - r0);
                    self.logits_rows(&ws, r0, n)?;
                    let mut buf = vec![0f32; n * v];
                    self.gpu.copy_to_host(ws.logits.ptr, &mut buf)?;
                    out.extend(buf);
                    r0 += n;
                }
            } else if ci + 1 == n_chunks {
                self.logits_rows(&ws, piece.len() - 1, 1)?;
                let mut buf = vec![0f32; v];
                self.gpu.copy_to_host(ws.logits.ptr, &mut buf)?;
                out = buf;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_stream_setting_parses_and_falls_back() {
        assert_eq!(gemv_stream_setting(None), Some(GEMV_STREAM));
        assert_eq!(gemv_stream_setting(Some("off")), None);
        assert_eq!(
            gemv_stream_setting(Some("3,2")),
            Some((3, 2, GEMV_STREAM.2))
        );
        assert_eq!(gemv_stream_setting(Some("2, 0, 5")), Some((2, 0, 5)));
        // Out of range or malformed: the default, not an error (a timing knob).
        for bad in ["4,1", "2,3", "2,1,17", "2", "2,1,3,4", "x,1", ""] {
            assert_eq!(gemv_stream_setting(Some(bad)), Some(GEMV_STREAM), "{bad:?}");
        }
    }
}
