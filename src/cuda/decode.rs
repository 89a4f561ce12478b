//! The fused one-token decode step, top to bottom: six launches a GDN layer, eight an
//! attention layer, three for the MoE, the final norm + lm_head with the greedy argmax fused;
//! captured once per state (and attention split count) into a CUDA graph whose kernels start
//! early by programmatic dependent launch. Its buffers ([`DecodeWs`]) never move, so a graph
//! stays valid.

use super::kernels::attn_decode::{AttnCombineDec, AttnDecodeMma, AttnPrep};
use super::kernels::gdn_decode::{GdnConvDec, GdnConvstepDec, GdnStepDec};
use super::kernels::gemv::{self, Argmax, Input};
use super::kernels::misc::EmbedGather;
use super::kernels::moe_decode::{
    MoeDownDec, MoeDownDecFp8, MoeDownDecQ4, MoeGateUpDec, MoeGateUpDecFp8, MoeGateUpDecQ4,
    MoeRouterDec, down_dec_smem, gate_up_dec_smem, router_smem,
};
use super::kernels::trace::TraceSet;
use super::kernels::{Dev, On};
use super::model::CudaModel;
use super::state::{CudaState, DecodeGraph};
use super::upload::{LayerW, MixerW, Wt};
use super::{DeviceBuf, Gpu};
use crate::config::TextConfig;
use anyhow::{Result, anyhow, bail, ensure};

/// Attention splits per query head at most (the partial sums' workspace).
pub(super) const DECODE_SPLITS: usize = 256;

/// Attention splits per query head in the fused decode step, by context length `n` (the new
/// position counted): each bucket gets its own captured graph; the kernels derive the chunk
/// length from the position. (Public for the kernel tests, which run the splits it picks.)
pub fn decode_splits(n: usize) -> usize {
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

/// u64 a decode-timeline record (trace.cuh's TRACE_RECORD): block id, SM, start, wait release,
/// end, three phase stamps.
pub const TRACE_RECORD: usize = 8;

impl CudaModel {
    /// Decode GEMV: y = beta*y + W·input (`W [n, k]`); with `greedy = Some((limit, out2))`
    /// also the argmax over rows < limit into `dws.next` (and into `out2` unless null: the
    /// decode step writes the next step's input token there).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv_dec(
        &self,
        w: &DeviceBuf,
        n: usize,
        k: usize,
        input: Input,
        y: Dev<f32>,
        beta: f32,
        greedy: Option<(usize, Dev<i32>)>,
        pdl: bool,
    ) -> Result<()> {
        let dw = &self.dws;
        let argmax = greedy.map(|(limit, out2)| Argmax {
            val: dw.arg_val.f32(),
            idx: dw.arg_idx.i32(),
            done: dw.done.view(),
            limit,
            out: dw.next.i32(),
            out2,
        });
        gemv::gemv(
            &self.gpu,
            w.bf16(),
            n,
            k,
            input,
            y,
            beta,
            argmax,
            On::Decode(pdl),
        )
    }

    /// A dense projection of the decode step, `y = beta*y + W·input`: bf16 through
    /// [`Self::gemv_dec`], FP8 through `gemv_fp8` (W8A16), 4-bit through `gemv_q4` (W4A16).
    fn dense_dec(
        &self,
        w: &Wt,
        n: usize,
        k: usize,
        input: Input,
        y: Dev<f32>,
        beta: f32,
    ) -> Result<()> {
        let on = On::Decode(self.decode_graph);
        match w {
            Wt::Bf16(b) => self.gemv_dec(b, n, k, input, y, beta, None, self.decode_graph),
            Wt::Fp8 { .. } => {
                let f = w.fp8().expect("an FP8 matrix");
                gemv::gemv_fp8(&self.gpu, f, n, k, input, 1, y, n, beta, None, on)
            }
            Wt::Q4 { .. } => {
                let q = w.q4().expect("a 4-bit matrix");
                gemv::gemv_q4(&self.gpu, q, n, k, input, 1, y, n, beta, None, None, on)
            }
        }
    }

    /// The fused one-token step, top to bottom: every launch reads the token and position
    /// from `dws.step_in` and nothing else changes between steps, so the sequence can be
    /// captured once per state into a CUDA graph. Six launches per GDN layer (in-projection
    /// with the RMSNorm, conv + delta-rule step, out-projection with the residual, router,
    /// experts' gate/up, experts' down with the combine; seven where the conv and the step are
    /// two, see [`GdnConvstepDec::fits`]), eight per attention layer.
    fn decode_launches(&self, state: &CudaState, nsplit: usize, vocab_limit: usize) -> Result<()> {
        let c = &self.config;
        let dw = &self.dws;
        let g = &*self.gpu;
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let on = On::Decode(self.decode_graph);
        let step_in = dw.step_in.i32();
        let pos = step_in.at(1);
        let h = dw.h.f32();
        // Not an early (programmatic) launch: the step starts after the previous one is done,
        // which lets later kernels read their own layer's recurrent state before
        // griddep_wait (nothing in this step writes it before them).
        EmbedGather {
            table: self.w.embed.bf16(),
            ids: step_in,
            out: h,
            d: d as i32,
        }
        .launch(g, 1, On::Decode(false))?;
        let (mut gdn_i, mut attn_i) = (0, 0);
        for layer in &self.w.layers {
            // The mixer's fused input projection (GDN: qkv|z|b|a; attention: q+gate|k|v) of
            // RMSNorm(h) into dw.proj.
            let normed = Input::Norm {
                h,
                w: layer.input_norm.f32(),
                eps,
            };
            let proj = dw.proj.f32();
            match &layer.mixer {
                MixerW::Gdn(w) => {
                    let (st_conv, st_rec) = state.gdn[gdn_i];
                    gdn_i += 1;
                    let (hk, hv, dk, dv) = (
                        c.gdn_num_key_heads,
                        c.gdn_num_value_heads,
                        c.gdn_key_dim,
                        c.gdn_value_dim,
                    );
                    let (ch, vw) = (c.gdn_conv_channels(), c.gdn_v_width());
                    // FP8 and 4-bit (the only formats with b|a apart, bf16): q|k|v|z and b|a in
                    // one launch, b|a as the GEMV's bf16 tail rows
                    let n = ch + vw;
                    let tail = w.in_ba.as_ref().map(|ba| (ba.bf16(), 2 * hv));
                    match (tail, w.in_proj.q4(), w.in_proj.fp8()) {
                        (Some(_), Some(q), _) => gemv::gemv_q4(
                            g,
                            q,
                            n,
                            d,
                            normed,
                            1,
                            proj,
                            n + 2 * hv,
                            0.0,
                            None,
                            tail,
                            on,
                        )?,
                        (Some(_), None, Some(f)) => {
                            gemv::gemv_fp8(g, f, n, d, normed, 1, proj, n + 2 * hv, 0.0, tail, on)?
                        }
                        (Some(_), None, None) => {
                            bail!(
                                "GDN layer {}: b|a apart from a bf16 in-projection",
                                gdn_i - 1
                            )
                        }
                        (None, ..) => {
                            self.dense_dec(&w.in_proj, n + 2 * hv, d, normed, proj, 0.0)?
                        }
                    }
                    let (z, ba) = (proj.at(ch), proj.at(ch + vw));
                    let q_scale = 1.0 / (dk as f32).sqrt();
                    if self.gdn_convstep && GdnConvstepDec::fits(c.conv_kernel, hk, hv, dk, dv) {
                        // conv + step in one launch (a cluster of two blocks a key head where it
                        // has two value heads)
                        GdnConvstepDec {
                            p: proj,
                            conv_state: st_conv,
                            conv_w: w.conv.f32(),
                            z,
                            ba,
                            a_log: w.a_log.f32(),
                            dt_bias: w.dt_bias.f32(),
                            nw: w.norm.f32(),
                            state: st_rec,
                            out: dw.ob.bf16(),
                            c: ch as i32,
                            hk: hk as i32,
                            hv: hv as i32,
                            dv: dv as i32,
                            q_scale,
                            eps,
                            tab: Dev::null(),
                            ldp: 0,
                            ldo: 0,
                        }
                        .launch(g, dk, 1, on)?;
                    } else {
                        GdnConvDec {
                            p: proj,
                            state: st_conv,
                            w: w.conv.f32(),
                            out: dw.qkv.f32(),
                            c: ch as i32,
                            kern: c.conv_kernel as i32,
                            hk: hk as i32,
                            dk: dk as i32,
                            dv: dv as i32,
                            q_scale,
                        }
                        .launch(g, hv, on)?;
                        GdnStepDec {
                            qkv: dw.qkv.f32(),
                            ba,
                            a_log: w.a_log.f32(),
                            dt_bias: w.dt_bias.f32(),
                            z,
                            nw: w.norm.f32(),
                            state: st_rec,
                            out: dw.ob.bf16(),
                            hk: hk as i32,
                            hv: hv as i32,
                            dv: dv as i32,
                            eps,
                        }
                        .launch(g, dk, on)?;
                    }
                    let ob = Input::Bf16(dw.ob.bf16());
                    self.dense_dec(&w.out, d, vw, ob, h, 1.0)?;
                }
                MixerW::Attn(w) => {
                    let (kc, vc) = state.kv_caches(attn_i);
                    attn_i += 1;
                    let (nq, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
                    self.dense_dec(&w.qkv, nq * 2 * hd + 2 * nkv * hd, d, normed, proj, 0.0)?;
                    let kp = proj.at(nq * 2 * hd);
                    AttnPrep {
                        qg: proj,
                        k: kp,
                        v: kp.at(nkv * hd),
                        q_norm: w.q_norm.f32(),
                        k_norm: w.k_norm.f32(),
                        inv_freq: self.w.inv_freq.f32(),
                        q_out: dw.q.f32(),
                        k_cache: kc,
                        v_cache: vc,
                        past: 0,
                        past_dev: pos,
                        nq: nq as i32,
                        nkv: nkv as i32,
                        hd: hd as i32,
                        rot_half: (c.rotary_dim / 2) as i32,
                        eps,
                        tab: Dev::null(),
                    }
                    .launch(g, 1, on)?;
                    // Split-K attention into dw.part on tensor cores (check_supported: the
                    // shape has a kernel).
                    AttnDecodeMma {
                        q: dw.q.f32(),
                        kc,
                        vc,
                        part: dw.part.f32(),
                        past_dev: pos,
                        nq: nq as i32,
                        nkv: nkv as i32,
                        nsplit: nsplit as i32,
                        scale: 1.0 / (hd as f32).sqrt(),
                        tab: Dev::null(),
                    }
                    .launch(g, hd, 1, on)?;
                    // Merge the splits, normalise, gate: a block per head and 32 dims.
                    AttnCombineDec {
                        part: dw.part.f32(),
                        qg: proj,
                        out: dw.ob.bf16(),
                        past_dev: pos,
                        nq: nq as i32,
                        hd: hd as i32,
                        nsplit: nsplit as i32,
                        ldqg: 0,
                    }
                    .launch(g, 1, on)?;
                    let ob = Input::Bf16(dw.ob.bf16());
                    self.dense_dec(&w.o, d, nq * hd, ob, h, 1.0)?;
                }
            }
            self.moe_decode(layer)?;
        }
        // Final norm + lm_head with the greedy argmax fused.
        let normed = Input::Norm {
            h,
            w: self.w.final_norm.f32(),
            eps,
        };
        self.lm_head_greedy(normed, vocab_limit, step_in, self.decode_graph)
    }

    /// lm_head of one row (`input`) into `dws.logits` and its greedy id (over ids <
    /// `vocab_limit`) into `dws.next`, and into `out2` unless null: `gemv_dec_w` (bf16) or
    /// `gemv_q4` (4-bit) with the argmax fused.
    pub(super) fn lm_head_greedy(
        &self,
        input: Input,
        vocab_limit: usize,
        out2: Dev<i32>,
        pdl: bool,
    ) -> Result<()> {
        let (v, d) = (self.config.vocab_size, self.config.hidden_size);
        let dw = &self.dws;
        let logits = dw.logits.f32();
        match &self.w.lm_head {
            Wt::Q4 { .. } => {
                let w = self.w.lm_head.q4().expect("a 4-bit matrix");
                let argmax = Argmax {
                    val: dw.arg_val.f32(),
                    idx: dw.arg_idx.i32(),
                    done: dw.done.view(),
                    limit: vocab_limit,
                    out: dw.next.i32(),
                    out2,
                };
                let on = On::Decode(pdl);
                gemv::gemv_q4(
                    &self.gpu,
                    w,
                    v,
                    d,
                    input,
                    1,
                    logits,
                    v,
                    0.0,
                    Some(argmax),
                    None,
                    on,
                )
            }
            w => {
                let b = w.bf16_buf("lm_head")?;
                self.gemv_dec(b, v, d, input, logits, 0.0, Some((vocab_limit, out2)), pdl)
            }
        }
    }

    /// The MoE block of one token in three launches: router (+ its RMSNorm and the shared
    /// expert's gate), the top-k (picked by every gate/up warp from the logits) with the chosen
    /// and shared experts' gate/up and SwiGLU, and their down projections combined into the
    /// residual.
    fn moe_decode(&self, layer: &LayerW) -> Result<()> {
        let c = &self.config;
        let dw = &self.dws;
        let g = &*self.gpu;
        let on = On::Decode(self.decode_graph);
        let (d, e, k, i, is) = (
            c.hidden_size as i32,
            c.num_experts as i32,
            c.experts_per_token as i32,
            c.moe_intermediate as i32,
            c.shared_intermediate as i32,
        );
        let act_ld = DecodeWs::act_ld(c) as i32;
        MoeRouterDec {
            h: dw.h.f32(),
            nw: layer.post_norm.f32(),
            eps: c.rms_norm_eps,
            d,
            wr: layer.router.bf16(),
            e,
            w_sg: layer.shared_gate.f32(),
            xb: dw.xb.bf16(),
            logits: dw.router.f32(),
            sgate: dw.sgate.f32(),
        }
        .launch(g, on)?;
        if let (Some(gu), Some(dn), Some(sgu), Some(sdn)) = (
            layer.gate_up.fp8(),
            layer.down.fp8(),
            layer.shared_gate_up.fp8(),
            layer.shared_down.fp8(),
        ) {
            MoeGateUpDecFp8 {
                xb: dw.xb.bf16(),
                d,
                logits: dw.router.f32(),
                e,
                k,
                topk_ids: dw.topk_ids.i32(),
                topk_w: dw.topk_w.f32(),
                gate_up: gu.q,
                gu_sc: gu.sc,
                inter: i,
                shared_gate_up: sgu.q,
                sgu_sc: sgu.sc,
                s_inter: is,
                act: dw.act.f32(),
                act_ld,
                late_launch: 0,
            }
            .launch(g, on)?;
            // the experts from topk_ids, after this kernel's wait for gate/up
            return MoeDownDecFp8 {
                act: dw.act.f32(),
                act_ld,
                topk_ids: dw.topk_ids.i32(),
                topk_w: dw.topk_w.f32(),
                k,
                sgate: dw.sgate.f32(),
                down: dn.q,
                down_sc: dn.sc,
                inter: i,
                shared_down: sdn.q,
                sd_sc: sdn.sc,
                s_inter: is,
                h: dw.h.f32(),
                d,
            }
            .launch(g, on);
        }
        if let (Some(gu), Some(dn), Some(sgu), Some(sdn)) = (
            layer.gate_up.q4(),
            layer.down.q4(),
            layer.shared_gate_up.q4(),
            layer.shared_down.q4(),
        ) {
            ensure!(
                [dn.group, sgu.group, sdn.group]
                    .iter()
                    .all(|g| *g == gu.group),
                "the decode MoE: 4-bit experts with different groups ({}, {}, {}, {})",
                gu.group,
                dn.group,
                sgu.group,
                sdn.group
            );
            MoeGateUpDecQ4 {
                xb: dw.xb.bf16(),
                d,
                logits: dw.router.f32(),
                e,
                k,
                topk_ids: dw.topk_ids.i32(),
                topk_w: dw.topk_w.f32(),
                gate_up: gu.q,
                gu_sb: gu.sb,
                inter: i,
                shared_gate_up: sgu.q,
                sgu_sb: sgu.sb,
                s_inter: is,
                group: gu.group as i32,
                act: dw.act.f32(),
                act_ld,
                late_launch: 0,
            }
            .launch(g, on)?;
            // the experts from topk_ids, after this kernel's wait for gate/up
            return MoeDownDecQ4 {
                act: dw.act.f32(),
                act_ld,
                topk_ids: dw.topk_ids.i32(),
                topk_w: dw.topk_w.f32(),
                k,
                sgate: dw.sgate.f32(),
                down: dn.q,
                down_sb: dn.sb,
                inter: i,
                shared_down: sdn.q,
                sd_sb: sdn.sb,
                s_inter: is,
                group: gu.group as i32,
                h: dw.h.f32(),
                d,
            }
            .launch(g, c.num_experts, on);
        }
        let bf16 = |w: &Wt| w.bf16_buf("the decode MoE").map(|b| b.bf16());
        MoeGateUpDec {
            xb: dw.xb.bf16(),
            d,
            logits: dw.router.f32(),
            e,
            k,
            topk_ids: dw.topk_ids.i32(),
            topk_w: dw.topk_w.f32(),
            gate_up: bf16(&layer.gate_up)?,
            inter: i,
            shared_gate_up: bf16(&layer.shared_gate_up)?,
            s_inter: is,
            act: dw.act.f32(),
            act_ld,
            // moe_down_dec picks the experts itself (early), so it may start only after the
            // router is done
            late_launch: 1,
        }
        .launch(g, on)?;
        MoeDownDec {
            act: dw.act.f32(),
            act_ld,
            topk_ids: dw.topk_ids.i32(),
            topk_w: dw.topk_w.f32(),
            logits: dw.router.f32(),
            e,
            // the experts from the router's logits and the weight rows by bulk copy before
            // the griddep_wait
            early: 2,
            k,
            sgate: dw.sgate.f32(),
            down: bf16(&layer.down)?,
            inter: i,
            shared_down: bf16(&layer.shared_down)?,
            s_inter: is,
            h: dw.h.f32(),
            d,
        }
        .launch(g, on)
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
        TraceSet {
            buf: buf.view(),
            cap: CAP as u32,
        }
        .launch(&self.gpu)?;
        self.decode_step(state, token, vocab_limit)?;
        TraceSet {
            buf: Dev::null(),
            cap: 0,
        }
        .launch(&self.gpu)?;
        let mut raw = vec![0u64; CAP * TRACE_RECORD];
        self.gpu.copy_to_host(buf.ptr, &mut raw)?;
        Ok(raw
            .chunks_exact(TRACE_RECORD)
            .filter_map(|r| <[u64; TRACE_RECORD]>::try_from(r).ok())
            .filter(|r| r[2] != 0)
            .collect())
    }
}
