//! The forward pass over a chunk of tokens (prefill, and any call the fused decode step does
//! not take), top to bottom like `crate::model::CpuModel::forward`: embedding, then per layer
//! the mixer (GDN or gated attention) and the MoE, then the final norm and lm_head.

use super::attention::{FlashCall, QPrep};
use super::decode::{DECODE_SPLITS, gemv_rows_per_block};
use super::gdn::{ConvRows, DeltaBufs, GdnShape};
use super::model::CudaModel;
use super::moe::{DensePlan, Grouped, GroupedOut, MoePlan};
use super::state::CudaState;
use super::upload::{LayerW, MixerW};
use super::{Arg, DeviceBuf, Gpu, block_threads};
use crate::config::TextConfig;
use anyhow::{Result, anyhow};

/// Rows of logits computed per lm_head call in `Logits::All` mode.
pub(super) const LOGITS_ROWS: usize = 64;

/// Tokens (a warp each) per block of `moe_route` (moe_route.cu's ROUTE_WARPS).
const ROUTE_WARPS: usize = 8;

/// Up to this many (token, expert) rows the MoE runs as per-row GEMVs (decode), reading only
/// the selected experts' weights with 16-byte loads; above it, the grouped tensor-core GEMM.
const MOE_GEMV_MAX_ROWS: usize = 64;

/// Attention splits per query in prefill (bounded workspace); decode may use up to 256.
const PREFILL_SPLITS: usize = 8;

/// Calls with at least this many tokens use the tensor-core flash kernel for attention.
const FLASH_MIN_TOKENS: usize = 16;

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
    pub(super) dense_plan: DeviceBuf,
    pub(super) topk_ids: DeviceBuf,
    pub(super) topk_w: DeviceBuf,
    /// The shared expert's gate per token (moe_route's, for moe_combine).
    pub(super) sgate: DeviceBuf,
    pub(super) sorted_token: DeviceBuf,
    pub(super) slot_row: DeviceBuf,
    pub(super) gu: DeviceBuf,
    pub(super) act: DeviceBuf,
    pub(super) y: DeviceBuf,
    pub(super) sgu: DeviceBuf,
    pub(super) sact: DeviceBuf,
    pub(super) ys: DeviceBuf,
    pub(super) logits: DeviceBuf,
}

impl CudaModel {
    pub(super) fn workspace_floats(
        cfg: &TextConfig,
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
        let max_tiles = super::moe::max_tiles(t * k, e);
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

    pub(super) fn alloc_workspace(gpu: &Gpu, cfg: &TextConfig, t: usize) -> Result<Workspace> {
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

    /// One forward pass over at most `max_chunk` tokens; the last hidden rows stay in `ws.h`.
    pub(super) fn forward_chunk(
        &self,
        ws: &Workspace,
        state: &mut CudaState,
        tokens: &[u32],
    ) -> Result<()> {
        let c = &self.config;
        let g = &*self.gpu;
        let t = tokens.len();
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let past = state.len;
        let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
        g.copy_to_device(ws.ids.ptr, &ids)?;
        if self.shared_on_gemm(t) {
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
                Arg::Ptr(self.w.embed.ptr),
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
        for (li, layer) in self.w.layers.iter().enumerate() {
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
                    // the gates and the gated norm read them in place): one GEMM.
                    let ld = ch + vw + 2 * hv;
                    let at = |col: usize| ws.p.ptr + (col * 4) as u64;
                    g.gemm(w.in_proj.ptr, ld, d, ws.xb.ptr, t, ws.p.ptr, ld, 0.0)?;
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
                    // A warp per (token, head) row (attn_prep_rows; its first head is nq where
                    // attn_flash4 prepares the queries itself, so it writes the KV heads only).
                    let flash = t >= FLASH_MIN_TOKENS;
                    let rot_half = c.rotary_dim / 2;
                    let q_prep =
                        (flash && g.flash_preps_q(nq, nkv, hd, rot_half)).then_some(QPrep {
                            q_norm: w.q_norm.ptr,
                            inv_freq: self.w.inv_freq.ptr,
                            rot_half,
                            eps,
                        });
                    let h0 = if q_prep.is_some() { nq } else { 0 };
                    let grid = ((t * (nq + nkv - h0)).div_ceil(8) as u32, 1, 1);
                    let args = [
                        Arg::Ptr(ws.qg.ptr),
                        Arg::Ptr(ws.k.ptr),
                        Arg::Ptr(ws.v.ptr),
                        Arg::Ptr(w.q_norm.ptr),
                        Arg::Ptr(w.k_norm.ptr),
                        Arg::Ptr(self.w.inv_freq.ptr),
                        Arg::Ptr(ws.q.ptr),
                        Arg::Ptr(kc.ptr),
                        Arg::Ptr(vc.ptr),
                        Arg::I(past as i32),
                        Arg::I(t as i32),
                        Arg::I(nq as i32),
                        Arg::I(nkv as i32),
                        Arg::I(hd as i32),
                        Arg::I(rot_half as i32),
                        Arg::F(eps),
                        Arg::I(h0 as i32),
                    ];
                    g.launch_dep("attn_prep_rows", grid, 256, (8 * hd * 4) as u32, &args)?;
                    if flash {
                        g.attn_flash(&FlashCall {
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
                        })?;
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
            let next_norm = self.w.layers.get(li + 1).map(|l| &l.input_norm);
            self.moe(ws, layer, t, next_norm)?;
        }
        state.len += t;
        Ok(())
    }

    /// Whether a prefill call of `t` tokens runs the shared expert through `moe_gemm6`
    /// ([`Gpu::dense_mlp_aux`], SwiGLU fused) rather than cuBLAS and `swiglu_bf16`: where the
    /// routed experts run on it too (not the GEMV path).
    fn shared_on_gemm(&self, t: usize) -> bool {
        t * self.config.experts_per_token > MOE_GEMV_MAX_ROWS
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
            let plan = DensePlan::plan(ws.dense_plan.ptr, self.max_chunk);
            let gu = Grouped {
                a: ws.xb.ptr,
                gather: 0,
                w: layer.shared_gate_up.ptr,
                out: ws.sact.ptr,
                ndim: 2 * is,
                kdim: d,
            };
            let down = Grouped {
                a: ws.sact.ptr,
                gather: 0,
                w: layer.shared_down.ptr,
                out: ws.ys.ptr,
                ndim: d,
                kdim: is,
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
        // y in bf16 from the grouped GEMM's tiles (16-byte rows of 8 features).
        let y_bf16 = !gemv_path && d % 8 == 0;
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
            g.moe_plan(&plan, e, super::moe::TILE_M)?;
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
                out: ws.act.ptr,
                ndim: 2 * i,
                kdim: d,
            };
            g.moe_grouped(GroupedOut::SwiGlu, &plan, rows, e, &gate_up, false)?;
            let down = Grouped {
                a: ws.act.ptr,
                gather: 0,
                w: layer.down.ptr,
                out: ws.y.ptr,
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

    /// Final norm + lm_head for `n` rows of `ws.h` starting at row `r0`, into `ws.logits`.
    pub(super) fn logits_rows(&self, ws: &Workspace, r0: usize, n: usize) -> Result<()> {
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
                Arg::Ptr(self.w.final_norm.ptr),
                Arg::Ptr(ws.xb.ptr),
                Arg::I(d as i32),
                Arg::F(c.rms_norm_eps),
            ],
        )?;
        g.gemm(
            self.w.lm_head.ptr,
            c.vocab_size,
            d,
            ws.xb.ptr,
            n,
            ws.logits.ptr,
            c.vocab_size,
            0.0,
        )
    }
}
