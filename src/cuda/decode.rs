//! The fused one-token decode step, top to bottom: six launches a GDN layer, eight an
//! attention layer, three for the MoE, the final norm + lm_head with the greedy argmax fused;
//! captured once per state (and attention split count) into a CUDA graph whose kernels start
//! early by programmatic dependent launch. Its buffers ([`DecodeWs`]) never move, so a graph
//! stays valid.

use super::attention::{decode_mma_kernel, decode_mma_smem};
use super::model::CudaModel;
use super::state::{CudaState, DecodeGraph};
use super::upload::{LayerW, MixerW};
use super::{Arg, DeviceBuf, Gpu, block_threads};
use crate::config::TextConfig;
use anyhow::{Result, anyhow};

/// Router rows per block of `moe_router_dec` (moe_decode.cu's ROUTER_ROWS).
const ROUTER_ROWS: usize = 2;

/// Shared memory of `moe_router_dec` in floats (moe_decode.cu's router_smem): the staged input, the
/// RMSNorm weight and the shared gate's row.
fn router_smem(d: usize) -> usize {
    3 * d
}

/// Shared memory of `moe_gate_up_dec` in floats (moe_decode.cu's gate_up_dec_smem): the staged input,
/// then for each of the 8 warps the logits, the top-k ids and weights (rounded up to 16 bytes).
fn gate_up_dec_smem(d: usize, e: usize, k: usize) -> usize {
    d + 8 * (e + 2 * k).next_multiple_of(4)
}

pub(super) const DECODE_SPLITS: usize = 256;

/// Output rows per block of the decode GEMVs with inner dimension `k` (as
/// `gemv_rows_per_block` in gemv.cuh; `whole_rows`: `gemv_dec_w`, a warp per row, else
/// `gemv_dec` and `moe_gemv`).
pub(super) fn gemv_rows_per_block(k: usize, whole_rows: bool) -> usize {
    match k {
        0..=2048 => 16,
        4096 if !whole_rows => 4,
        _ => 8,
    }
}

/// At most this many blocks per decode GEMV (8 per SM of an H200): each stages its input
/// once, then walks row groups, so a tall matrix (lm_head) does not restage it per 16 rows.
const GEMV_MAX_BLOCKS: usize = 132 * 8;

/// Attention splits per query head in the fused decode step, by context length: each bucket
/// gets its own captured graph; the kernels derive the chunk length from the position.
fn decode_splits(n: usize) -> usize {
    [4, 16, 64]
        .into_iter()
        .find(|&b| b * 64 >= n)
        .unwrap_or(DECODE_SPLITS)
}

/// Buffers of the fused one-token decode step, apart from the prefill workspace. A captured
/// decode graph holds these pointers, so they never move.
pub(super) struct DecodeWs {
    /// `[token id, position]`: the step's only input, written before each launch (the greedy
    /// argmax also writes the next id into slot 0).
    pub(super) step_in: DeviceBuf,
    pub(super) h: DeviceBuf,
    /// Output of the fused input projection (GDN: qkv|z|b|a; attention: q+gate|k|v).
    pub(super) proj: DeviceBuf,
    pub(super) qkv: DeviceBuf,
    pub(super) q: DeviceBuf,
    pub(super) ob: DeviceBuf,
    pub(super) xb: DeviceBuf,
    pub(super) router: DeviceBuf,
    pub(super) topk_ids: DeviceBuf,
    pub(super) topk_w: DeviceBuf,
    pub(super) sgate: DeviceBuf,
    /// The lm_head argmax's last-block counter (zero between launches).
    pub(super) done: DeviceBuf,
    /// `[k + 1, act_ld]`: the chosen experts' then the shared expert's SwiGLU outputs.
    pub(super) act: DeviceBuf,
    pub(super) part: DeviceBuf,
    pub(super) logits: DeviceBuf,
    pub(super) arg_val: DeviceBuf,
    pub(super) arg_idx: DeviceBuf,
    pub(super) next: DeviceBuf,
}

impl DecodeWs {
    /// Row stride of `act`: the larger of the routed and shared intermediate sizes.
    pub(super) fn act_ld(c: &TextConfig) -> usize {
        c.moe_intermediate.max(c.shared_intermediate)
    }

    /// (name, bytes) of every buffer.
    pub(super) fn sizes(c: &TextConfig) -> Vec<(&'static str, usize)> {
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

    pub(super) fn alloc(gpu: &Gpu, c: &TextConfig) -> Result<Self> {
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
pub(super) fn fused_decode_fits(c: &TextConfig) -> bool {
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
) <= smem
        && c.gdn_value_dim <= 256
}

/// Dynamic shared memory of `gdn_convstep_dec*` in bytes (gdn_decode.cu's `GDN_CONVSTEP_SMEM`): q and
/// k in padded quarters, the warps' sums, v.
fn convstep_smem(dk: usize, dv: usize) -> u32 {
    ((2 * (dk + 16) + 32 + dv) * 4) as u32
}

/// Shared memory of `moe_down_dec` in bytes (moe_decode.cu's down_dec_smem, early mode): the
/// router's logits, the ids and weights, then (expert widths 512) the block's weight rows.
fn down_dec_smem(e: usize, k: usize, inter: usize, s_inter: usize) -> usize {
    let rows = if inter == 512 && s_inter == 512 {
        (k + 1) * (4 * 2 * 32 * 16 + 8) // and a bulk copy's mbarrier a warp
    } else {
        0
    };
    ((e + 2 * k + 3) & !3) * 4 + rows
}

/// `gemv_dec_stream`'s ring: (stages a warp, how many of them are requested before the
/// kernel's griddep_wait, how many units before a warp's end the next kernels may start), its
/// stages filled by bulk copies (docs/DECISIONS.md has the A/Bs that chose these).
pub(super) const GEMV_STREAM: (usize, usize, usize) = (2, 1, 3);

/// Shared memory of `gemv_dec_stream` in bytes (gemv.cu's gemv_stream_smem): the staged input
/// and RMSNorm weight (2 x 2048 floats), then 8 warps' rings of `ns` 8 KiB stages and their
/// mbarriers.
pub(super) fn gemv_stream_smem(ns: usize) -> usize {
    2 * 2048 * 4 + 8 * ns * (8192 + 8)
}

/// u64 a decode-timeline record (trace.cuh's TRACE_RECORD): block id, SM, start, wait release,
/// end, three phase stamps.
pub const TRACE_RECORD: usize = 8;

impl CudaModel {
    /// Decode GEMV: y = beta*y + W·x, x = the bf16 vector `x` or (x = 0) RMSNorm(h) with
    /// weight `norm` (h: f32, `k` values); with `greedy = Some((limit, out2))` also the argmax
    /// over rows < limit into `dws.next` (and into `out2` unless 0: the decode step writes the
    /// next step's input token there).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv_dec(
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
        if let (2048, None) = (k, greedy) {
            let (ns, early, at) = GEMV_STREAM;
            let args: Vec<Arg> = [Arg::Ptr(w), Arg::I(n as i32)]
                .into_iter()
                .chain(io)
                .chain([
                    Arg::I(ns as i32),
                    Arg::I(early as i32),
                    Arg::I(at as i32),
                    Arg::I(1), // the stages filled by bulk copies
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
            "gemv_dec_w",
            (
                n.div_ceil(gemv_rows_per_block(k, true))
                    .min(GEMV_MAX_BLOCKS) as u32,
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
    /// 4 dv threads, one value head a key head, or two (a cluster of two blocks).
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
            && (group == 1 || group == 2);
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
                .launch_ex(name, grid, block, smem, args, self.decode_graph)
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
                Arg::Ptr(self.w.embed.ptr),
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
            self.gemv_dec(
                w,
                n,
                k,
                x,
                dw.h.ptr,
                norm,
                y,
                beta,
                greedy,
                self.decode_graph,
            )
        };
        let (mut gdn_i, mut attn_i) = (0, 0);
        for layer in &self.w.layers {
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
                            Arg::Ptr(self.w.inv_freq.ptr),
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
                    // Split-K attention into dw.part on tensor cores (check_supported: the
                    // shape has a kernel).
                    let kernel = decode_mma_kernel(hd, nq / nkv)
                        .ok_or_else(|| anyhow!("no decode attention kernel for head dim {hd}"))?;
                    let args = [
                        Arg::Ptr(dw.q.ptr),
                        Arg::Ptr(kc.ptr),
                        Arg::Ptr(vc.ptr),
                        Arg::Ptr(dw.part.ptr),
                        Arg::Ptr(pos),
                        Arg::I(nq as i32),
                        Arg::I(nkv as i32),
                        Arg::I(nsplit as i32),
                        Arg::F(1.0 / (hd as f32).sqrt()),
                    ];
                    launch(
                        kernel,
                        (nkv as u32, nsplit as u32, 1),
                        32,
                        decode_mma_smem(hd) as u32,
                        &args,
                    )?;
                    // Merge the splits, normalise, gate: a block per head and 32 dims.
                    let head = [
                        Arg::Ptr(dw.part.ptr),
                        Arg::Ptr(dw.proj.ptr),
                        Arg::Ptr(dw.ob.ptr),
                    ];
                    let tail = [Arg::I(nq as i32), Arg::I(hd as i32), Arg::I(nsplit as i32)];
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
                    gemv(w.o.ptr, d, nq * hd, dw.ob.ptr, 0, dw.h.ptr, 1.0, None)?;
                }
            }
            self.moe_decode(layer)?;
        }
        // Final norm + lm_head with the greedy argmax fused.
        gemv(
            self.w.lm_head.ptr,
            c.vocab_size,
            d,
            0,
            self.w.final_norm.ptr,
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
                .launch_ex(name, grid, block, smem, args, self.decode_graph)
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
                Arg::I(1), // moe_down_dec picks the experts itself (early)
            ],
        )?;
        launch(
            "moe_down_dec",
            (d.div_ceil(4) as u32, 1, 1),
            (32 * (k + 1)) as u32,
            down_dec_smem(e, k, i, is) as u32,
            &[
                Arg::Ptr(dw.act.ptr),
                Arg::I(DecodeWs::act_ld(c) as i32),
                Arg::Ptr(dw.topk_ids.ptr),
                Arg::Ptr(dw.topk_w.ptr),
                Arg::Ptr(dw.router.ptr),
                Arg::I(e as i32),
                // early: the experts from the router's logits and the weight rows by bulk copy
                // before the griddep_wait
                Arg::I(2),
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
    pub(super) fn decode_step(
        &self,
        state: &mut CudaState,
        token: u32,
        vocab_limit: usize,
    ) -> Result<()> {
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
    /// in ns of %globaltimer (see trace.cuh's TRACE_RECORD). Empty unless the kernels were
    /// compiled with `KESTREL_TRACE=1`.
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
}
