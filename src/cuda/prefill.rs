//! The forward pass over a chunk of tokens (prefill, and any call the fused decode step does
//! not take), top to bottom like `crate::model::CpuModel::forward`: embedding, then per layer
//! the mixer (GDN or gated attention) and the MoE, then the final norm and lm_head.

use super::attention::{FlashCall, QPrep};
use super::decode::DECODE_SPLITS;
use super::gdn::{ConvRows, DeltaBufs, GdnShape};
use super::kernels::attn_decode::{
    AttnCombine, AttnCombineDec, AttnDecodeMma, AttnPrep, AttnSplit,
};
use super::kernels::attn_prefill::AttnPrepRows;
use super::kernels::gdn_decode::{GdnConvstepDec, GdnGatedNorm, GdnGates};
use super::kernels::gemv::{Fp8, Q4};
use super::kernels::gemv::{GEMV_FP8_TOKENS, GEMV_Q4_TOKENS, Input, gemv_fp8, gemv_q4};
use super::kernels::misc::{DequantFp8Bf16, DequantQ4Bf16, EmbedGather};
use super::kernels::moe_gemm::{FP8_GROUPED_MAX_ROWS, MoeGroupedFp8, MoeGroupedQ4};
use super::kernels::moe_route::{
    MoeCombine, MoeCombineBf16, MoeGemvSorted, MoeGemvSortedFp8, MoeGemvSortedQ4, MoeRoute,
    MoeRouteSmall,
};
use super::kernels::norm::RmsnormZcBf16;
use super::kernels::{Dev, On, Untyped};
use super::model::CudaModel;
use super::moe::{DensePlan, Grouped, GroupedOut, MoePlan};
use super::state::CudaState;
use super::upload::{LayerW, MixerW, WeightFormat, Wt, fp8_rows};
use super::{DeviceBuf, Gpu};
use crate::config::TextConfig;
use anyhow::{Result, anyhow};
use half::bf16;

/// Rows of logits computed per lm_head call in `Logits::All` mode.
pub(super) const LOGITS_ROWS: usize = 64;

/// Up to this many (token, expert) rows (16 tokens) the MoE runs as GEMVs over expert-sorted
/// rows (batched decode, short chunks: `moe_gemv_sorted`, 16-byte loads of the chosen experts'
/// rows, an expert's repeats from L2); above it, the grouped tensor-core GEMM. Measured on the
/// H200 (synthetic full, 1,024 a stream): 16 streams 1,486 against the GEMM's 1,405 tok/s, 32
/// streams 1,886 against 2,020.
const MOE_GEMV_MAX_ROWS: usize = 128;

/// [`MOE_GEMV_MAX_ROWS`] for FP8 and 4-bit experts: every batched decode step of up to 64
/// tokens. (Set when FP8 past it dequantised all 256 experts' weights into bf16 each call, ~2.4
/// GB of traffic a layer; not measured again against moe_grouped_fp8, which reads the e4m3
/// words as they are.)
const MOE_GEMV_MAX_ROWS_FP8: usize = 512;

/// The few-row MoE path's limit in routed rows for `format`.
fn moe_gemv_max_rows(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Bf16 => MOE_GEMV_MAX_ROWS,
        WeightFormat::Fp8 | WeightFormat::Int4 => MOE_GEMV_MAX_ROWS_FP8,
    }
}

/// Attention splits per query in prefill (bounded workspace); decode may use up to 256.
const PREFILL_SPLITS: usize = 8;

/// Calls with at least this many tokens use the tensor-core flash kernel for attention.
const FLASH_MIN_TOKENS: usize = 16;

/// Pieces of at most this many tokens run the GDN conv and delta rule token by token (a block
/// a value head) rather than in chunks: the chunked kernels' fixed cost (the prep, the state
/// pass on a block an SM) outweighs a few tokens' sequential steps.
const GDN_RECURRENT_MAX_TOKENS: usize = 32;

/// Sequences a batched decode step takes at most (its tables' rows; also at most the
/// workspace's `max_chunk`).
pub(super) const MAX_BATCH: usize = 256;

/// Attention splits of a batched decode step of `rows` sequences, the longest holding `n`
/// positions: enough (KV head, split) blocks for two a streaming multiprocessor, no split
/// under 64 positions.
fn batch_splits(n: usize, rows: usize, nkv: usize, sms: usize) -> usize {
    (2 * sms).div_ceil(rows * nkv).min(n.div_ceil(64)).max(1)
}

/// Whose state the rows of a forward call advance.
pub(super) enum Seqs<'a, 'b> {
    /// One sequence: the rows are its next tokens, in order.
    One(&'a mut CudaState),
    /// Several sequences' next tokens one after another: rows of `lens[i]` tokens each
    /// (a batched prefill: the weights read once for all of them).
    Many(&'a mut [&'b mut CudaState], &'a [usize]),
    /// A batched decode step: row r is the next token of sequence r, whose position and
    /// per-layer state pointers [`CudaModel::batch_tables`] wrote into `ws.batch_pos` and
    /// `ws.batch_tab`.
    Batch(&'a mut [&'b mut CudaState]),
}

/// Scratch buffers for up to `max_chunk` tokens.
pub(super) struct Workspace {
    pub(super) ids: DeviceBuf,
    pub(super) h: DeviceBuf,
    pub(super) xb: DeviceBuf,
    pub(super) p: DeviceBuf,
    pub(super) qkv: DeviceBuf,
    pub(super) beta: DeviceBuf,
    pub(super) g: DeviceBuf,
    pub(super) o: DeviceBuf,
    /// Scratch of the chunked delta rule (W, Q', U, γ per chunk).
    pub(super) gdn: DeviceBuf,
    pub(super) ob: DeviceBuf,
    pub(super) qg: DeviceBuf,
    pub(super) k: DeviceBuf,
    pub(super) v: DeviceBuf,
    pub(super) q: DeviceBuf,
    pub(super) part: DeviceBuf,
    pub(super) part_floats: usize,
    pub(super) router: DeviceBuf,
    pub(super) counts: DeviceBuf,
    pub(super) offsets: DeviceBuf,
    pub(super) cursor: DeviceBuf,
    pub(super) tile_expert: DeviceBuf,
    pub(super) tile_row: DeviceBuf,
    pub(super) tile_rows: DeviceBuf,
    pub(super) num_tiles: DeviceBuf,
    /// `moe_route_small`'s last-block counter (zero between launches).
    pub(super) route_ticket: DeviceBuf,
    pub(super) dense_plan: DeviceBuf,
    pub(super) topk_ids: DeviceBuf,
    pub(super) topk_w: DeviceBuf,
    /// The shared expert's gate per token (moe_route's, for moe_combine).
    pub(super) sgate: DeviceBuf,
    pub(super) sorted_token: DeviceBuf,
    pub(super) slot_row: DeviceBuf,
    pub(super) act: DeviceBuf,
    pub(super) y: DeviceBuf,
    pub(super) sgu: DeviceBuf,
    pub(super) sact: DeviceBuf,
    pub(super) ys: DeviceBuf,
    pub(super) logits: DeviceBuf,
    /// A batched decode step's tables: per layer `[2, rows]` state pointers (GDN: conv, then
    /// recurrent state of each row; attention: K, then V cache), each row's position, and the
    /// rows' greedy next ids.
    pub(super) batch_tab: DeviceBuf,
    pub(super) batch_pos: DeviceBuf,
    pub(super) batch_next: DeviceBuf,
    /// FP8 and 4-bit weights: a dense product's matrix dequantised to bf16 (main and second
    /// stream).
    pub(super) dq: DeviceBuf,
    pub(super) dq_aux: DeviceBuf,
    /// FP8 weights: a layer's experts (gate/up, then down) dequantised to bf16 for the calls
    /// past [`FP8_GROUPED_MAX_ROWS`].
    pub(super) dq_experts: DeviceBuf,
}

impl CudaModel {
    pub(super) fn workspace_floats(
        cfg: &TextConfig,
        format: WeightFormat,
        t: usize,
    ) -> (Vec<(&'static str, usize, usize)>, usize) {
        let d = cfg.hidden_size;
        let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
        let hv = cfg.gdn_num_value_heads;
        let (e, k, i, is) = (
            cfg.num_experts,
            cfg.experts_per_token,
            cfg.moe_intermediate,
            cfg.shared_intermediate,
        );
        // the few-row path's plan has a tile a row
        let max_tiles = super::moe::max_tiles(t * k, e).max(moe_gemv_max_rows(format).min(t * k));
        // FP8 and 4-bit: the dequantised bf16 matrix of a dense product past the GEMVs' tokens
        // (one for each stream); FP8: a layer's experts where a call passes
        // FP8_GROUPED_MAX_ROWS (below it moe_grouped_fp8 reads them as they are, as
        // moe_grouped_q4 always does)
        let fp8 = format == WeightFormat::Fp8;
        let int4 = format == WeightFormat::Int4;
        let dense_max = [
            (cfg.gdn_conv_channels() + cfg.gdn_v_width()) * d,
            d * cfg.gdn_v_width(),
            (nq * 2 * hd + 2 * nkv * hd) * d,
            d * nq * hd,
            2 * is * d,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let dq = if (fp8 && t > GEMV_FP8_TOKENS) || (int4 && t > GEMV_Q4_TOKENS) {
            dense_max
        } else {
            0
        };
        let dq_experts = if fp8 && t * k > FP8_GROUPED_MAX_ROWS {
            e * 3 * i * d
        } else {
            0
        };
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
            // moe_route_small's last-block counter (zero between launches)
            ("route_ticket", 1, 4),
            // the shared expert's one-expert plan (DensePlan): tiles, their count, a counter
            ("dense_plan", DensePlan::ints(t), 4),
            ("topk_ids", t * k, 4),
            ("topk_w", t * k, 4),
            ("sgate", t, 4),
            ("sorted_token", t * k, 4),
            ("slot_row", t * k, 4),
            ("act", t * k * i, 2),
            ("y", t * k * d, 4),
            ("sgu", t * 2 * is, 4),
            ("sact", t * is, 2),
            ("ys", t * d, 4),
            ("logits", LOGITS_ROWS.min(t.max(1)) * cfg.vocab_size, 4),
            ("batch_tab", cfg.num_layers * 2 * t.min(MAX_BATCH), 8),
            ("batch_pos", t.min(MAX_BATCH), 4),
            ("batch_next", t.min(MAX_BATCH), 4),
            ("dq", dq, 2),
            ("dq_aux", dq, 2),
            ("dq_experts", dq_experts, 2),
        ];
        let total = list.iter().map(|(_, n, b)| n * b).sum();
        (list, total)
    }

    pub(super) fn alloc_workspace(
        gpu: &Gpu,
        cfg: &TextConfig,
        format: WeightFormat,
        t: usize,
    ) -> Result<Workspace> {
        let (list, _) = Self::workspace_floats(cfg, format, t);
        let mut bufs: std::collections::HashMap<&str, DeviceBuf> = std::collections::HashMap::new();
        let mut part_floats = 0;
        for (name, n, b) in list {
            if name == "part" {
                part_floats = n;
            }
            let bytes = (n * b).max(4);
            // the last-block counter starts at zero (each launch leaves it so)
            let buf = if name == "route_ticket" {
                gpu.alloc_zeroed(bytes)?
            } else {
                gpu.alloc(bytes)?
            };
            bufs.insert(name, buf);
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
            route_ticket: take("route_ticket")?,
            dense_plan: take("dense_plan")?,
            topk_ids: take("topk_ids")?,
            topk_w: take("topk_w")?,
            sgate: take("sgate")?,
            sorted_token: take("sorted_token")?,
            slot_row: take("slot_row")?,
            act: take("act")?,
            y: take("y")?,
            sgu: take("sgu")?,
            sact: take("sact")?,
            ys: take("ys")?,
            logits: take("logits")?,
            batch_tab: take("batch_tab")?,
            batch_pos: take("batch_pos")?,
            batch_next: take("batch_next")?,
            dq: take("dq")?,
            dq_aux: take("dq_aux")?,
            dq_experts: take("dq_experts")?,
        })
    }

    /// Writes a batched decode step's tables (`ws.batch_tab`, `ws.batch_pos`) for `states`,
    /// one row each: per layer the state pointers, and each sequence's position.
    pub(super) fn batch_tables(&self, ws: &Workspace, states: &[&mut CudaState]) -> Result<()> {
        let rows = states.len();
        let mut tab = Vec::with_capacity(self.config.num_layers * 2 * rows);
        let (mut gdn_i, mut attn_i) = (0, 0);
        for layer in &self.w.layers {
            let pair = |s: &CudaState| match &layer.mixer {
                MixerW::Gdn(_) => (s.gdn[gdn_i].0.ptr, s.gdn[gdn_i].1.ptr),
                MixerW::Attn(_) => {
                    let (k, v) = s.kv_caches(attn_i);
                    (k.ptr, v.ptr)
                }
            };
            tab.extend(states.iter().map(|s| pair(s).0));
            tab.extend(states.iter().map(|s| pair(s).1));
            match &layer.mixer {
                MixerW::Gdn(_) => gdn_i += 1,
                MixerW::Attn(_) => attn_i += 1,
            }
        }
        let pos: Vec<i32> = states.iter().map(|s| s.len as i32).collect();
        self.gpu.copy_to_device(ws.batch_tab.ptr, &tab)?;
        self.gpu.copy_to_device(ws.batch_pos.ptr, &pos)
    }

    /// One forward pass over at most `max_chunk` rows: one sequence's next tokens, several
    /// sequences' next tokens one after another, or, batched, one token of each of several
    /// sequences ([`Seqs`]); the last hidden rows stay in `ws.h`.
    pub(super) fn forward_chunk(
        &self,
        ws: &Workspace,
        seqs: &mut Seqs,
        tokens: &[u32],
    ) -> Result<()> {
        let c = &self.config;
        let g = &*self.gpu;
        let t = tokens.len();
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        // Rows [r0, r0 + n) are a sequence's own next tokens (prefill): the token-mixing ops
        // run on each such segment with its state; a batched decode step has one row a state.
        let mut segs: Vec<(&mut CudaState, usize, usize)> = Vec::new();
        // a batched step's longest sequence (positions, the new one included)
        let mut batch: Option<usize> = None;
        match seqs {
            Seqs::One(state) => segs.push((&mut **state, 0, t)),
            Seqs::Many(states, lens) => {
                anyhow::ensure!(
                    lens.iter().sum::<usize>() == t
                        && states.len() == lens.len()
                        && lens.iter().all(|&n| n > 0),
                    "a forward of {t} tokens for pieces of {lens:?}"
                );
                let mut r0 = 0;
                for (s, &n) in states.iter_mut().zip(lens.iter()) {
                    segs.push((&mut **s, r0, n));
                    r0 += n;
                }
            }
            Seqs::Batch(states) => {
                anyhow::ensure!(
                    states.len() == t && t <= MAX_BATCH.min(self.max_chunk),
                    "a batched step of {t} tokens for {} sequences (at most {})",
                    states.len(),
                    MAX_BATCH.min(self.max_chunk)
                );
                batch = Some(states.iter().map(|s| s.len + 1).max().unwrap_or(1));
            }
        }
        // The table of layer `li` in a batched step: [2, t] state pointers.
        let layer_tab = |li: usize| ws.batch_tab.view::<u64>().at(li * 2 * t);
        let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        g.copy_to_device(ws.ids.ptr, &ids)?;
        if self.shared_on_gemm(t) {
            let plan = DensePlan::contents(self.max_chunk, t)?;
            g.copy_to_device(ws.dense_plan.ptr, &plan)?;
        }
        let di = d as i32;

        // Embedding
        EmbedGather {
            table: self.w.embed.bf16(),
            ids: ws.ids.i32(),
            out: ws.h.f32(),
            d: di,
        }
        .launch(g, t, On::Plain)?;
        let (mut gdn_i, mut attn_i) = (0, 0);
        for (li, layer) in self.w.layers.iter().enumerate() {
            // From the second layer on, the previous layer's moe_combine wrote the normalised
            // input already.
            if li == 0 {
                RmsnormZcBf16 {
                    x: ws.h.f32(),
                    w: layer.input_norm.f32(),
                    out: ws.xb.bf16(),
                    d: di,
                    eps,
                }
                .launch(g, t, On::Prefill)?;
            }
            match &layer.mixer {
                MixerW::Gdn(w) => {
                    let sh = GdnShape::of(c, t);
                    let (hv, dv) = (sh.hv, sh.dv);
                    let (ch, vw) = (c.gdn_conv_channels(), c.gdn_v_width());
                    // The in-projection's q|k|v, z and b|a side by side in p's rows (the conv,
                    // the gates and the gated norm read them in place): one GEMM.
                    let ld = ch + vw + 2 * hv;
                    match &w.in_ba {
                        // FP8 and 4-bit: q|k|v|z, then b|a (bf16 beside) into their columns
                        Some(ba) => {
                            let qz = ch + vw;
                            self.dense(
                                ws, &w.in_proj, 0, qz, d, ws.xb.ptr, t, ws.p.ptr, ld, 0.0, false,
                            )?;
                            let p_ba = ws.p.ptr + (qz * 4) as u64;
                            g.gemm(ba.ptr, 2 * hv, d, ws.xb.ptr, t, p_ba, ld, 0.0)?;
                        }
                        None => self.dense(
                            ws, &w.in_proj, 0, ld, d, ws.xb.ptr, t, ws.p.ptr, ld, 0.0, false,
                        )?,
                    }
                    let p = ws.p.f32();
                    let (z, ba) = (p.at(ch), p.at(ch + vw));
                    if batch.is_some() {
                        // each row's conv + delta-rule step on its own states (the decode
                        // step's kernel, a grid row a sequence)
                        GdnConvstepDec {
                            p,
                            conv_state: Dev::null(),
                            conv_w: w.conv.f32(),
                            z,
                            ba,
                            a_log: w.a_log.f32(),
                            dt_bias: w.dt_bias.f32(),
                            nw: w.norm.f32(),
                            state: Dev::null(),
                            out: ws.ob.bf16(),
                            c: ch as i32,
                            hk: sh.hk as i32,
                            hv: hv as i32,
                            dv: dv as i32,
                            q_scale: 1.0 / (sh.dk as f32).sqrt(),
                            eps,
                            tab: layer_tab(li),
                            ldp: ld as i32,
                            ldo: vw as i32,
                        }
                        .launch(g, sh.dk, t, On::Plain)?;
                    }
                    if !segs.is_empty() {
                        // row by row: every piece's gates at once
                        GdnGates {
                            b: ba,
                            a: ba.at(hv),
                            ld: ld as i32,
                            a_log: w.a_log.f32(),
                            dt_bias: w.dt_bias.f32(),
                            beta: ws.beta.f32(),
                            g: ws.g.f32(),
                            t: t as i32,
                            hv: hv as i32,
                        }
                        .launch(g, On::Prefill)?;
                    }
                    for (state, r0, n) in &mut segs {
                        let (r0, n) = (*r0, *n);
                        let (st_conv, st_rec) = state.gdn[gdn_i];
                        let sh = GdnShape::of(c, n);
                        let p = p.at(r0 * ld);
                        let (qkv, beta, gg, o) = (
                            ws.qkv.f32().at(r0 * ch),
                            ws.beta.f32().at(r0 * hv),
                            ws.g.f32().at(r0 * hv),
                            ws.o.f32().at(r0 * vw),
                        );
                        let conv_in = ConvRows { p, ld };
                        let chunked = n > GDN_RECURRENT_MAX_TOKENS
                            && self.gdn_chunked
                            && sh.chunked_fits(g.max_smem_per_block, g.sm_count);
                        let conv = if chunked {
                            Gpu::gdn_conv_prefill
                        } else {
                            Gpu::gdn_conv_sequential
                        };
                        let (conv_w, conv_st) = (w.conv.f32(), st_conv);
                        conv(g, &sh, c.conv_kernel, conv_in, conv_st, conv_w, qkv)?;
                        let bufs = DeltaBufs {
                            qkv,
                            g: gg,
                            beta,
                            state: st_rec,
                            o,
                        };
                        if chunked {
                            g.gdn_delta_chunked(&sh, &bufs, ws.gdn.f32())?;
                        } else {
                            g.gdn_delta_recurrent(&sh, &bufs)?;
                        }
                    }
                    if !segs.is_empty() {
                        // row by row: the gated norm of every piece's rows at once
                        GdnGatedNorm {
                            o: ws.o.f32(),
                            z_in: z,
                            w: w.norm.f32(),
                            out: ws.ob.bf16(),
                            rows: (t * hv) as i32,
                            dv: dv as i32,
                            hv: hv as i32,
                            ldz: ld as i32,
                            eps,
                        }
                        .launch(g, On::Prefill)?;
                    }
                    gdn_i += 1;
                    // Residual add fused into the GEMM (beta = 1).
                    self.dense(ws, &w.out, 0, d, vw, ws.ob.ptr, t, ws.h.ptr, d, 1.0, false)?;
                }
                MixerW::Attn(w) => {
                    let (nq, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
                    let (q_rows, kv_rows) = (nq * 2 * hd, nkv * hd);
                    let xb = ws.xb.ptr;
                    // k and v on the second stream beside the q|gate product
                    g.fork_aux()?;
                    let (k_ptr, v_ptr) = (ws.k.ptr, ws.v.ptr);
                    self.dense(
                        ws, &w.qkv, q_rows, kv_rows, d, xb, t, k_ptr, kv_rows, 0.0, true,
                    )?;
                    let v_row0 = q_rows + kv_rows;
                    self.dense(
                        ws, &w.qkv, v_row0, kv_rows, d, xb, t, v_ptr, kv_rows, 0.0, true,
                    )?;
                    self.dense(
                        ws, &w.qkv, 0, q_rows, d, xb, t, ws.qg.ptr, q_rows, 0.0, false,
                    )?;
                    g.join_aux()?;
                    let rot_half = c.rotary_dim / 2;
                    if let Some(longest) = batch {
                        // batched: the decode step's kernels, a grid row a sequence at its own
                        // position, the caches through the layer's table
                        let (tab, pos) = (layer_tab(li), ws.batch_pos.i32());
                        AttnPrep {
                            qg: ws.qg.f32(),
                            k: ws.k.f32(),
                            v: ws.v.f32(),
                            q_norm: w.q_norm.f32(),
                            k_norm: w.k_norm.f32(),
                            inv_freq: self.w.inv_freq.f32(),
                            q_out: ws.q.f32(),
                            k_cache: Dev::null(),
                            v_cache: Dev::null(),
                            past: 0,
                            past_dev: pos,
                            nq: nq as i32,
                            nkv: nkv as i32,
                            hd: hd as i32,
                            rot_half: rot_half as i32,
                            eps,
                            tab,
                        }
                        .launch(g, t, On::Prefill)?;
                        let cap = ws.part_floats / (t * nq * (hd + 2));
                        let nsplit = batch_splits(longest, t, nkv, g.sm_count).min(cap).max(1);
                        AttnDecodeMma {
                            q: ws.q.f32(),
                            kc: Dev::null(),
                            vc: Dev::null(),
                            part: ws.part.f32(),
                            past_dev: pos,
                            nq: nq as i32,
                            nkv: nkv as i32,
                            nsplit: nsplit as i32,
                            scale: 1.0 / (hd as f32).sqrt(),
                            tab,
                        }
                        .launch(g, hd, t, On::Prefill)?;
                        AttnCombineDec {
                            part: ws.part.f32(),
                            qg: ws.qg.f32(),
                            out: ws.ob.bf16(),
                            past_dev: pos,
                            nq: nq as i32,
                            hd: hd as i32,
                            nsplit: nsplit as i32,
                            ldqg: (nq * 2 * hd) as i32,
                        }
                        .launch(g, t, On::Prefill)?;
                    }
                    for (state, r0, n) in &mut segs {
                        let (r0, n) = (*r0, *n);
                        let (kc, vc) = state.kv_caches(attn_i);
                        let past = state.len;
                        let (qg, q, out) = (
                            ws.qg.f32().at(r0 * nq * 2 * hd),
                            ws.q.f32().at(r0 * nq * hd),
                            ws.ob.bf16().at(r0 * nq * hd),
                        );
                        // A warp per (token, head) row (attn_prep_rows; its first head is nq
                        // where attn_flash4 prepares the queries itself, so it writes the KV
                        // heads only).
                        let flash = n >= FLASH_MIN_TOKENS;
                        let h0 = if flash { nq } else { 0 };
                        let (k_cache, v_cache) = (kc, vc);
                        AttnPrepRows {
                            qg,
                            k: ws.k.f32().at(r0 * nkv * hd),
                            v: ws.v.f32().at(r0 * nkv * hd),
                            q_norm: w.q_norm.f32(),
                            k_norm: w.k_norm.f32(),
                            inv_freq: self.w.inv_freq.f32(),
                            q_out: q,
                            k_cache,
                            v_cache,
                            past: past as i32,
                            t: n as i32,
                            nq: nq as i32,
                            nkv: nkv as i32,
                            hd: hd as i32,
                            rot_half: rot_half as i32,
                            eps,
                            h0: h0 as i32,
                        }
                        .launch(g, On::Prefill)?;
                        if flash {
                            g.attn_flash(&FlashCall {
                                q_prep: QPrep {
                                    q_norm: w.q_norm.f32(),
                                    inv_freq: self.w.inv_freq.f32(),
                                    rot_half,
                                    eps,
                                },
                                k_cache,
                                v_cache,
                                qg,
                                out,
                                t: n,
                                past,
                                nq,
                                nkv,
                                hd,
                            })?;
                        } else {
                            let n_max = past + n;
                            let cap =
                                (ws.part_floats / (n * nq * (hd + 2))).clamp(1, DECODE_SPLITS);
                            let chunk = n_max.div_ceil(cap).max(64);
                            let nsplit = n_max.div_ceil(chunk);
                            AttnSplit {
                                q,
                                k_cache,
                                v_cache,
                                part: ws.part.f32(),
                                past: past as i32,
                                past_dev: Dev::null(),
                                nq: nq as i32,
                                nkv: nkv as i32,
                                hd: hd as i32,
                                nsplit: nsplit as i32,
                                chunk: chunk as i32,
                                scale: 1.0 / (hd as f32).sqrt(),
                            }
                            .launch(g, n, On::Plain)?;
                            AttnCombine {
                                part: ws.part.f32(),
                                qg,
                                out,
                                past: past as i32,
                                past_dev: Dev::null(),
                                nq: nq as i32,
                                hd: hd as i32,
                                nsplit: nsplit as i32,
                                chunk: chunk as i32,
                            }
                            .launch(g, n, On::Plain)?;
                        }
                    }
                    attn_i += 1;
                    self.dense(
                        ws,
                        &w.o,
                        0,
                        d,
                        nq * hd,
                        ws.ob.ptr,
                        t,
                        ws.h.ptr,
                        d,
                        1.0,
                        false,
                    )?;
                }
            }
            RmsnormZcBf16 {
                x: ws.h.f32(),
                w: layer.post_norm.f32(),
                out: ws.xb.bf16(),
                d: di,
                eps,
            }
            .launch(g, t, On::Prefill)?;
            let next_norm = self.w.layers.get(li + 1).map(|l| &l.input_norm);
            self.moe(ws, layer, t, next_norm)?;
        }
        for (s, _, n) in segs {
            s.len += n;
        }
        if let Seqs::Batch(states) = seqs {
            states.iter_mut().for_each(|s| s.len += 1);
        }
        Ok(())
    }

    /// Whether a prefill call of `t` tokens runs the shared expert through `moe_gemm6`
    /// ([`Gpu::dense_mlp_aux`], SwiGLU fused) rather than cuBLAS and `swiglu_bf16`: where the
    /// routed experts run on it too (not the GEMV path).
    fn shared_on_gemm(&self, t: usize) -> bool {
        self.w.format == WeightFormat::Bf16 && t * self.config.experts_per_token > MOE_GEMV_MAX_ROWS
    }

    /// `y [t, ldy] = beta·y + x · W[row0..row0 + n]ᵀ` for the bf16 rows `x [t, k]`: bf16 `W`
    /// by cuBLASLt; FP8 by `gemv_fp8` (W8A16) up to [`GEMV_FP8_TOKENS`] tokens and 4-bit by
    /// `gemv_q4` (W4A16) up to [`GEMV_Q4_TOKENS`], else dequantised into the workspace's `dq`
    /// (`dq_aux` on the second stream) for cuBLASLt.
    #[allow(clippy::too_many_arguments)]
    fn dense(
        &self,
        ws: &Workspace,
        w: &Wt,
        row0: usize,
        n: usize,
        k: usize,
        x: u64,
        t: usize,
        y: u64,
        ldy: usize,
        beta: f32,
        aux: bool,
    ) -> Result<()> {
        let g = &*self.gpu;
        let gemm = |wp: u64| g.gemm_on(aux, wp, n, k, x, t, y, ldy, beta);
        if let Some(q) = w.q4() {
            let q = q.rows_from(row0, k)?;
            let on = if aux { On::Aux } else { On::Prefill };
            if t <= GEMV_Q4_TOKENS {
                let (x, y) = (Dev::new(x, t * k), Dev::new(y, (t - 1) * ldy + n));
                return gemv_q4(g, q, n, k, Input::Bf16(x), t, y, ldy, beta, None, None, on);
            }
            let dq = if aux { &ws.dq_aux } else { &ws.dq };
            DequantQ4Bf16 {
                q: q.q,
                sb: q.sb,
                group: q.group as i32,
                n: n as u64,
                k: k as i32,
                out: dq.bf16(),
            }
            .launch(g, on)?;
            return gemm(dq.ptr);
        }
        let Some(f) = w.fp8() else {
            let b = w.bf16_buf("a dense product")?;
            return gemm(b.ptr + (row0 * k * 2) as u64);
        };
        let f = fp8_rows(f, k, row0)?;
        let on = if aux { On::Aux } else { On::Prefill };
        if t <= GEMV_FP8_TOKENS {
            let (x, y) = (Dev::new(x, t * k), Dev::new(y, (t - 1) * ldy + n));
            return gemv_fp8(g, f, n, k, Input::Bf16(x), t, y, ldy, beta, None, on);
        }
        let dq = if aux { &ws.dq_aux } else { &ws.dq };
        DequantFp8Bf16 {
            q: f.q,
            sc: f.sc,
            n: n as u64,
            k: k as i32,
            out: dq.view(),
        }
        .launch(g, on)?;
        gemm(dq.ptr)
    }

    /// The MoE block of `layer` on the `t` rows of `ws.xb`, added into `ws.h`; with
    /// `next_norm`, `ws.xb` then holds the next layer's normalised input (moe_combine's
    /// fused RMSNorm).
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
        if self.shared_on_gemm(t) {
            // moe_gemm6 with the SwiGLU fused, over the dense plan forward_chunk uploaded
            let plan = DensePlan::plan(ws.dense_plan.i32(), self.max_chunk);
            let gu = Grouped {
                a: ws.xb.bf16(),
                gather: Dev::null(),
                w: layer
                    .shared_gate_up
                    .bf16_buf("the shared expert's GEMM")?
                    .bf16(),
                out: ws.sact.bf16().into(),
                ndim: 2 * is,
                kdim: d,
            };
            let down = Grouped {
                a: ws.sact.bf16(),
                gather: Dev::null(),
                w: layer
                    .shared_down
                    .bf16_buf("the shared expert's GEMM")?
                    .bf16(),
                out: ws.ys.f32().into(),
                ndim: d,
                kdim: is,
            };
            g.dense_mlp_aux(&plan, t, &gu, &down)?;
        } else {
            let (xb, sgu, sact, ys) = (ws.xb.ptr, ws.sgu.ptr, ws.sact.ptr, ws.ys.ptr);
            self.dense(
                ws,
                &layer.shared_gate_up,
                0,
                2 * is,
                d,
                xb,
                t,
                sgu,
                2 * is,
                0.0,
                true,
            )?;
            g.swiglu_bf16_aux(ws.sgu.f32(), ws.sact.bf16(), t, is)?;
            self.dense(ws, &layer.shared_down, 0, d, is, sact, t, ys, d, 0.0, true)?;
        }
        let gemv_path = rows <= moe_gemv_max_rows(self.w.format);
        // y in bf16 from the bf16 grouped GEMM's tiles (16-byte rows of 8 features); the 4-bit
        // and FP8 grouped kernels write f32.
        let q4 = layer.gate_up.q4().zip(layer.down.q4());
        let fp8 = layer.gate_up.fp8().zip(layer.down.fp8());
        let fp8_grouped = fp8.filter(|_| rows <= FP8_GROUPED_MAX_ROWS);
        let y_bf16 = !gemv_path && d % 8 == 0 && q4.is_none() && fp8_grouped.is_none();
        let counts = ws.counts.i32();
        let plan = MoePlan {
            counts,
            offsets: ws.offsets.i32(),
            cursor: ws.cursor.i32(),
            tile_expert: ws.tile_expert.i32(),
            tile_row: ws.tile_row.i32(),
            tile_rows: ws.tile_rows.i32(),
            num_tiles: ws.num_tiles.i32(),
            claim: counts.at(e),
        };
        if gemv_path {
            // the router, top-k, gates and the sorted order in one launch; tile_expert is each
            // sorted row's expert
            MoeRouteSmall {
                x: ws.xb.bf16(),
                t: t as i32,
                d: d as i32,
                wr: layer.router.bf16(),
                e: e as i32,
                k: k as i32,
                w_sg: layer.shared_gate.f32(),
                logits: ws.router.f32(),
                topk_ids: ws.topk_ids.i32(),
                topk_w: ws.topk_w.f32(),
                sgate: ws.sgate.f32(),
                row_expert: plan.tile_expert,
                sorted_token: ws.sorted_token.i32(),
                slot_row: ws.slot_row.i32(),
                ticket: ws.route_ticket.view(),
            }
            .launch(g)?;
            let gemv = |a: Dev<bf16>, gather: Dev<i32>, w: &Wt, out: Untyped, nf, kdim, swiglu| {
                let expert = plan.tile_expert;
                let (nf, kdim) = (nf as i32, kdim as i32);
                if let Some(q) = w.q4() {
                    return MoeGemvSortedQ4 {
                        a,
                        gather,
                        w: q.q,
                        sb: q.sb,
                        group: q.group as i32,
                        out,
                        expert,
                        rows: rows as i32,
                        nf,
                        kdim,
                    }
                    .launch(g, swiglu, e);
                }
                match w.fp8() {
                    Some(f) => MoeGemvSortedFp8 {
                        a,
                        gather,
                        w: f.q,
                        sc: f.sc,
                        out,
                        expert,
                        nf,
                        kdim,
                    }
                    .launch(g, swiglu, rows, e),
                    None => MoeGemvSorted {
                        a,
                        gather,
                        w: w.bf16_buf("the few-row MoE")?.bf16(),
                        out,
                        expert,
                        nf,
                        kdim,
                    }
                    .launch(g, swiglu, rows, e),
                }
            };
            let (xb, act) = (ws.xb.bf16(), ws.act.bf16());
            gemv(
                xb,
                ws.sorted_token.i32(),
                &layer.gate_up,
                act.into(),
                i,
                d,
                true,
            )?;
            gemv(
                act,
                Dev::null(),
                &layer.down,
                ws.y.f32().into(),
                d,
                i,
                false,
            )?;
        } else {
            g.gemm(layer.router.ptr, e, d, ws.xb.ptr, t, ws.router.ptr, e, 0.0)?;
            g.memset_zero(ws.counts.ptr, (e + 1) * 4)?;
            MoeRoute {
                logits: ws.router.f32(),
                e: e as i32,
                k: k as i32,
                topk_ids: ws.topk_ids.i32(),
                topk_w: ws.topk_w.f32(),
                counts,
                x: ws.xb.bf16(),
                w_sg: layer.shared_gate.f32(),
                sgate: ws.sgate.f32(),
                d: d as i32,
                t: t as i32,
            }
            .launch(g, On::Prefill)?;
            g.moe_plan(&plan, e, super::moe::TILE_M)?;
            g.moe_scatter(
                ws.topk_ids.i32(),
                rows,
                k,
                ws.cursor.i32(),
                ws.sorted_token.i32(),
                ws.slot_row.i32(),
            )?;
            if let Some((gu, dn)) = q4 {
                // 4-bit: the grouped products on the q4 tiles themselves
                let tiles = super::moe::max_tiles(rows, e);
                let grouped =
                    |a: Dev<bf16>, gather: Dev<i32>, w: Q4, out: Untyped, nf, kdim| MoeGroupedQ4 {
                        a,
                        gather,
                        w: w.q,
                        sb: w.sb,
                        group: w.group as i32,
                        out,
                        tile_expert: plan.tile_expert,
                        tile_row: plan.tile_row,
                        tile_rows: plan.tile_rows,
                        num_tiles: plan.num_tiles,
                        nf: nf as i32,
                        kdim: kdim as i32,
                    };
                let sorted = ws.sorted_token.i32();
                grouped(ws.xb.bf16(), sorted, gu, ws.act.bf16().into(), i, d)
                    .launch(g, true, tiles, rows, e)?;
                grouped(ws.act.bf16(), Dev::null(), dn, ws.y.f32().into(), d, i)
                    .launch(g, false, tiles, rows, e)?;
            } else if let Some((gu, dn)) = fp8_grouped {
                // FP8: the grouped products on the e4m3 words and block scales themselves
                let tiles = super::moe::max_tiles(rows, e);
                let grouped = |a: Dev<bf16>, gather: Dev<i32>, w: Fp8, out: Untyped, nf, kdim| {
                    MoeGroupedFp8 {
                        a,
                        gather,
                        w: w.q,
                        sc: w.sc,
                        out,
                        tile_expert: plan.tile_expert,
                        tile_row: plan.tile_row,
                        tile_rows: plan.tile_rows,
                        num_tiles: plan.num_tiles,
                        nf: nf as i32,
                        kdim: kdim as i32,
                    }
                };
                let sorted = ws.sorted_token.i32();
                grouped(ws.xb.bf16(), sorted, gu, ws.act.bf16().into(), i, d)
                    .launch(g, true, tiles, rows, e)?;
                grouped(ws.act.bf16(), Dev::null(), dn, ws.y.f32().into(), d, i)
                    .launch(g, false, tiles, rows, e)?;
            } else {
                let (w_gu, w_down) = match fp8 {
                    // FP8 past FP8_GROUPED_MAX_ROWS: the layer's experts dequantised to bf16
                    // first (gate/up, then down)
                    Some((gu, dn)) => {
                        let dq = ws.dq_experts.bf16();
                        for (f, n, kk, out) in
                            [(gu, e * 2 * i, d, dq), (dn, e * d, i, dq.at(e * 2 * i * d))]
                        {
                            DequantFp8Bf16 {
                                q: f.q,
                                sc: f.sc,
                                n: n as u64,
                                k: kk as i32,
                                out: Dev::new(out.ptr, out.len / 8),
                            }
                            .launch(g, On::Prefill)?;
                        }
                        (dq, dq.at(e * 2 * i * d))
                    }
                    None => (
                        layer.gate_up.bf16_buf("the grouped MoE")?.bf16(),
                        layer.down.bf16_buf("the grouped MoE")?.bf16(),
                    ),
                };
                let gate_up = Grouped {
                    a: ws.xb.bf16(),
                    gather: ws.sorted_token.i32(),
                    w: w_gu,
                    out: ws.act.bf16().into(),
                    ndim: 2 * i,
                    kdim: d,
                };
                g.moe_grouped(GroupedOut::SwiGlu, &plan, rows, e, &gate_up, false)?;
                let down = Grouped {
                    a: ws.act.bf16(),
                    gather: Dev::null(),
                    w: w_down,
                    out: ws.y.f32().into(),
                    ndim: d,
                    kdim: i,
                };
                let out = if y_bf16 {
                    GroupedOut::Bf16
                } else {
                    GroupedOut::F32
                };
                g.moe_grouped(out, &plan, rows, e, &down, false)?;
            }
        }
        g.join_aux()?;
        let slot_row = ws.slot_row.i32();
        let norm_w = next_norm.map_or(Dev::null(), |w| w.f32());
        let (topk_w, ys, sgate, h, xb) = (
            ws.topk_w.f32(),
            ws.ys.f32(),
            ws.sgate.f32(),
            ws.h.f32(),
            ws.xb.bf16(),
        );
        let (k, d, eps) = (k as i32, d as i32, c.rms_norm_eps);
        if y_bf16 {
            MoeCombineBf16 {
                y: ws.y.bf16(),
                slot_row,
                topk_w,
                ys,
                sgate,
                h,
                k,
                d,
                norm_w,
                xb,
                eps,
            }
            .launch(g, t, On::Prefill)
        } else {
            MoeCombine {
                y: ws.y.f32(),
                slot_row,
                topk_w,
                ys,
                sgate,
                h,
                k,
                d,
                norm_w,
                xb,
                eps,
            }
            .launch(g, t, On::Prefill)
        }
    }

    /// Final norm + lm_head for `n` hidden rows from `x` (rows of `ws.h`, or gathered ones),
    /// into `ws.logits`.
    pub(super) fn logits_rows(&self, ws: &Workspace, x: Dev<f32>, n: usize) -> Result<()> {
        let c = &self.config;
        let g = &*self.gpu;
        let d = c.hidden_size;
        RmsnormZcBf16 {
            x,
            w: self.w.final_norm.f32(),
            out: ws.xb.bf16(),
            d: d as i32,
            eps: c.rms_norm_eps,
        }
        .launch(g, n, On::Prefill)?;
        let v = c.vocab_size;
        if let Some(w) = self.w.lm_head.q4() {
            // 4-bit: GEMVs of up to 16 rows
            for r0 in (0..n).step_by(GEMV_Q4_TOKENS) {
                let m = (n - r0).min(GEMV_Q4_TOKENS);
                let x = ws.xb.bf16().at(r0 * d);
                let y = ws.logits.f32().at(r0 * v);
                gemv_q4(
                    g,
                    w,
                    v,
                    d,
                    Input::Bf16(x),
                    m,
                    y,
                    v,
                    0.0,
                    None,
                    None,
                    On::Prefill,
                )?;
            }
            return Ok(());
        }
        let w = self.w.lm_head.bf16_buf("lm_head")?;
        g.gemm(w.ptr, v, d, ws.xb.ptr, n, ws.logits.ptr, v, 0.0)
    }
}
