//! The Qwen3.5/3.6-MoE text forward pass on the CPU, top to bottom in one place.
//!
//! f32 math on stored (bf16/f16/f32) weights. This is the reference every GPU path is
//! checked against; see `../shared/docs/model-spec.md` §3 for the equations.

use crate::config::TextConfig;
use crate::ops::attention::{apply_rope, causal_attention, rope_inv_freq};
use crate::ops::gdn::{DeltaInputs, causal_conv_silu, delta_rule_chunked, delta_rule_step};
use crate::ops::gemm::{matmul_act, round_bf16};
use crate::ops::moe::moe_forward;
use crate::ops::norm::{
    gated_rms_norm, l2_normalize, rms_norm_zero_centred, rms_norm_zero_centred_inplace,
};
use crate::ops::{sigmoid, softplus};
use crate::state::{GdnState, KvCache, LayerState, SequenceState, Verified};
use crate::weights::{AttentionWeights, Checkpoint, GdnWeights, Mixer, ModelWeights, MtpWeights};
use anyhow::{Context, Result, bail};
use std::path::Path;

/// Which logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's `[vocab]` (prefill and decode).
    Last,
    /// Every position's, `[t, vocab]` (tests, speculative verification).
    All,
}

/// How the GDN recurrence runs for multi-token calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnMode {
    /// Chunked WY form for `t > 1`, step form for `t == 1` (the default).
    Auto,
    /// Always the step form (a cross-check of the chunked one).
    Step,
}

/// The interface every backend implements (CPU now; CUDA behind the same calls).
pub trait Engine {
    type State: Clone;
    fn config(&self) -> &TextConfig;
    /// A fresh, empty sequence state (an error where its memory cannot be had: the GPU's KV
    /// cache and GDN state are allocated here).
    fn new_state(&self) -> Result<Self::State>;
    /// Tokens already processed by `state`.
    fn state_len(&self, state: &Self::State) -> usize;
    /// Runs `tokens` through the model, appending them to `state`.
    fn forward(&self, state: &mut Self::State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>>;
    /// Runs one token and returns the greedy next id, [`crate::sampling::greedy_id`] of its
    /// logits (what the sampler picks at temperature 0 without penalties). The GPU engine takes
    /// it from its fused argmax and copies one id instead of the vocabulary's logits.
    fn forward_greedy_id(
        &self,
        state: &mut Self::State,
        token: u32,
        vocab_limit: usize,
    ) -> Result<u32> {
        let logits = self.forward(state, &[token], Logits::Last)?;
        Ok(crate::sampling::greedy_id(&logits, vocab_limit))
    }
    /// One decode step of several sequences: `tokens[r]` appended to `states[r]`; the logits
    /// of every row, one vocabulary each, concatenated. The GPU runs the rows as one batch
    /// (each weight read once for all of them); this default, the CPU's and the oracle, runs
    /// them one after another ([`forward_rows`]).
    fn forward_batch(&self, states: &mut [&mut Self::State], tokens: &[u32]) -> Result<Vec<f32>> {
        forward_rows(self, states, tokens)
    }
    /// [`Engine::forward_batch`] returning each row's greedy next id (argmax below
    /// `vocab_limit`, as [`Engine::forward_greedy_id`]).
    fn forward_batch_greedy(
        &self,
        states: &mut [&mut Self::State],
        tokens: &[u32],
        vocab_limit: usize,
    ) -> Result<Vec<u32>> {
        forward_rows_greedy(self, states, tokens, vocab_limit)
    }
    /// [`Engine::forward_batch`] returning each row's draw: the id its sampler would pick from
    /// the row's logits with `draws[r].u` (and the log-probabilities it asks for). The GPU
    /// draws on the device, so only ids cross to the host; this default, the CPU's and the
    /// oracle, draws on the host from the logits ([`crate::sampling::Draw::on_host`]).
    fn forward_batch_draw(
        &self,
        states: &mut [&mut Self::State],
        tokens: &[u32],
        draws: &[crate::sampling::Draw],
    ) -> Result<Vec<crate::sampling::Drawn>> {
        forward_rows_draw(self, states, tokens, draws)
    }
    /// Several sequences' next tokens at once (prefill pieces): `pieces[i]` appended to
    /// `states[i]`; the logits of each piece's last position. The GPU runs pieces that fit one
    /// call together (each weight read once for all of them); this default, the CPU's and
    /// the oracle, runs them one after another.
    fn forward_many(
        &self,
        states: &mut [&mut Self::State],
        pieces: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>> {
        check_pieces(states.len(), pieces.len())?;
        states
            .iter_mut()
            .zip(pieces)
            .map(|(s, p)| self.forward(s, p, Logits::Last))
            .collect()
    }
    /// Memory a state holds (what a cached snapshot of it costs), in bytes.
    fn state_bytes(&self, state: &Self::State) -> usize;
    /// Where states live in a fixed device memory (the GPU): what is still free there and
    /// what a state of so many positions takes. `None` (the CPU): states live in host memory and grow as
    /// they fill.
    fn state_memory(&self) -> Option<StateMemory> {
        None
    }
    /// KV blocks the live states and snapshots hold now (where states live in device memory,
    /// [`Engine::state_memory`]); `None` on the CPU.
    fn kv_blocks_in_use(&self) -> Option<usize> {
        None
    }

    // --- MTP speculative decoding (issue 40). The loop ([`crate::generate::DecodeLoop`])
    // calls: [`mtp_draft`](Engine::mtp_draft) after picking a token, then one
    // [`spec_verify`](Engine::spec_verify) of that token and the drafts, then
    // [`spec_keep`](Engine::spec_keep) with the tokens it accepted. A backend that keeps a
    // GDN state slot per draft position makes `spec_keep` a slot switch; the CPU keeps
    // copies.

    /// Ok where this engine can draft with the checkpoint's MTP head (it has one, and this
    /// backend implements speculation).
    fn mtp_check(&self) -> Result<()> {
        bail!("MTP speculation is not built for this backend (issue 40)")
    }
    /// Drafts `k` tokens after `next` (the id just picked, not yet run through the model)
    /// with the MTP head: the first from the main model's last hidden state paired with
    /// `next`, each further one chained on the head's own output and the previous draft.
    /// `pick(logits, drafts_so_far)` chooses each draft from the head's logits. The state's
    /// main part is unchanged; its MTP KV advances by the positions the main model verified.
    fn mtp_draft(
        &self,
        _state: &mut Self::State,
        _next: u32,
        _k: usize,
        _pick: &mut dyn FnMut(&[f32], &[u32]) -> u32,
    ) -> Result<Vec<u32>> {
        bail!("MTP speculation is not built for this backend (issue 40)")
    }
    /// One verification step: `tokens` (the picked id and the drafts) appended to the state
    /// in one forward, every position's logits returned (`[tokens.len(), vocab]`), each
    /// position's recurrent state kept until the next forward so [`Engine::spec_keep`] can
    /// roll back. The logits equal what one-token steps would give.
    fn spec_verify(&self, _state: &mut Self::State, _tokens: &[u32]) -> Result<Vec<f32>> {
        bail!("MTP speculation is not built for this backend (issue 40)")
    }
    /// Keeps the first `keep` tokens of the last verification step (`1..=` those still held)
    /// and rolls back the rest: GDN state to that position's slot, KV truncated (the MTP
    /// head's pending rows too). May be called again with a smaller `keep` until the next
    /// forward.
    fn spec_keep(&self, _state: &mut Self::State, _keep: usize) -> Result<()> {
        bail!("MTP speculation is not built for this backend (issue 40)")
    }
    /// Frees the last verification step's roll-back slots (after its final `spec_keep`).
    fn spec_release(&self, _state: &mut Self::State) {}
}

/// Checks a batched prefill's shape: one piece a state.
pub fn check_pieces(states: usize, pieces: usize) -> Result<()> {
    anyhow::ensure!(states == pieces, "{pieces} pieces for {states} sequences");
    Ok(())
}

/// Checks a batched step's rows: as many tokens as states, every id in the vocabulary (so that
/// a bad token fails the step before any state has moved).
pub fn check_rows<E: Engine + ?Sized>(e: &E, states: usize, tokens: &[u32]) -> Result<()> {
    anyhow::ensure!(
        states == tokens.len(),
        "a batched step of {} tokens for {states} sequences",
        tokens.len()
    );
    let v = e.config().vocab_size;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= v) {
        anyhow::bail!("token id {bad} is outside the vocabulary (size {v})");
    }
    Ok(())
}

/// A batched step row by row: [`Engine::forward`] of each row's token, the logits
/// concatenated (the reference for every batched implementation).
pub fn forward_rows<E: Engine + ?Sized>(
    e: &E,
    states: &mut [&mut E::State],
    tokens: &[u32],
) -> Result<Vec<f32>> {
    check_rows(e, states.len(), tokens)?;
    let mut out = Vec::with_capacity(tokens.len() * e.config().vocab_size);
    for (s, &t) in states.iter_mut().zip(tokens) {
        out.extend(e.forward(s, &[t], Logits::Last)?);
    }
    Ok(out)
}

/// [`Engine::forward_batch_draw`] row by row on the host: the default, and the path of a
/// backend that cannot draw on the device.
pub fn forward_rows_draw<E: Engine + ?Sized>(
    e: &E,
    states: &mut [&mut E::State],
    tokens: &[u32],
    draws: &[crate::sampling::Draw],
) -> Result<Vec<crate::sampling::Drawn>> {
    check_draws(tokens.len(), draws.len())?;
    let logits = e.forward_batch(states, tokens)?;
    let v = e.config().vocab_size;
    Ok(draws
        .iter()
        .zip(logits.chunks_exact(v))
        .map(|(d, l)| d.on_host(l))
        .collect())
}

/// A batched draw needs one [`crate::sampling::Draw`] a token.
pub fn check_draws(tokens: usize, draws: usize) -> Result<()> {
    anyhow::ensure!(
        tokens == draws,
        "a batched step of {tokens} tokens with {draws} draws"
    );
    Ok(())
}

/// A batched greedy step row by row ([`Engine::forward_greedy_id`] of each row).
pub fn forward_rows_greedy<E: Engine + ?Sized>(
    e: &E,
    states: &mut [&mut E::State],
    tokens: &[u32],
    vocab_limit: usize,
) -> Result<Vec<u32>> {
    check_rows(e, states.len(), tokens)?;
    states
        .iter_mut()
        .zip(tokens)
        .map(|(s, &t)| e.forward_greedy_id(s, t, vocab_limit))
        .collect()
}

/// Device memory for sequence states, see [`Engine::state_memory`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateMemory {
    /// Bytes free on the device now.
    pub free: usize,
    /// Bytes of a state besides its KV cache (the GDN conv and recurrent states).
    pub fixed: usize,
    /// Bytes of one KV block: `block_tokens` positions of every attention layer's K and V
    /// (on the GPU one page in each layer's K and V range).
    pub block_bytes: usize,
    pub block_tokens: usize,
}

impl StateMemory {
    /// KV blocks a state holding `tokens` positions maps.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens.max(1))
    }

    /// Bytes a state holding `tokens` positions takes (a snapshot of it at most the same: it
    /// shares the full pages).
    pub fn bytes_for(&self, tokens: usize) -> usize {
        self.fixed + self.blocks_for(tokens) * self.block_bytes
    }
}

pub struct CpuModel {
    pub config: TextConfig,
    pub weights: ModelWeights,
    pub gdn_mode: GdnMode,
    /// Round every GEMM input and the KV cache to bf16, as the GPU backend does (so the two
    /// can be compared tightly); off by default (pure f32 reference).
    pub bf16_activations: bool,
    inv_freq: Vec<f32>,
}

impl CpuModel {
    pub fn new(config: TextConfig, weights: ModelWeights) -> Self {
        let inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta);
        CpuModel {
            config,
            weights,
            gdn_mode: GdnMode::Auto,
            bf16_activations: false,
            inv_freq,
        }
    }

    /// Loads `config.json` and the safetensors weights of a checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let config = TextConfig::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open(dir)?;
        let weights = ModelWeights::from_checkpoint(&ck, &config)?;
        Ok(Self::new(config, weights))
    }

    /// Prefill in chunks of at most `chunk` tokens; returns the last position's logits.
    pub fn prefill(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        for piece in tokens.chunks(chunk.max(1)) {
            logits = self.forward(state, piece, Logits::Last)?;
        }
        Ok(logits)
    }

    fn mm(&self, x: &[f32], t: usize, w: &crate::tensor::Mat) -> Vec<f32> {
        matmul_act(x, t, w, self.bf16_activations)
    }

    /// A GDN layer over `t` rows. With `slots`, the conv and the delta rule run one position
    /// at a time in the step form (what `t` one-token calls compute) and the state after each
    /// position is pushed there (speculative verification's roll-back points).
    fn gdn_layer(
        &self,
        x: &[f32],
        t: usize,
        w: &GdnWeights,
        st: &mut GdnState,
        slots: Option<&mut Vec<GdnState>>,
    ) -> Vec<f32> {
        let c = &self.config;
        let (hk, hv, dk, dv) = (
            c.gdn_num_key_heads,
            c.gdn_num_value_heads,
            c.gdn_key_dim,
            c.gdn_value_dim,
        );
        let (qk, ch) = (c.gdn_qk_width(), c.gdn_conv_channels());
        // 1. projections
        let p = self.mm(x, t, &w.in_qkv);
        let z = self.mm(x, t, &w.in_z);
        let b = self.mm(x, t, &w.in_b);
        let a = self.mm(x, t, &w.in_a);
        // 2. causal conv over pre-conv inputs (state carries the last kernel-1), SiLU. With
        // slots, position by position, keeping each position's conv state.
        let mut convs = Vec::new();
        let p = if slots.is_some() {
            let mut out = Vec::with_capacity(t * ch);
            for row in p.chunks_exact(ch) {
                out.extend(causal_conv_silu(
                    row,
                    1,
                    ch,
                    &mut st.conv,
                    &w.conv,
                    c.conv_kernel,
                ));
                convs.push(st.conv.clone());
            }
            out
        } else {
            causal_conv_silu(&p, t, ch, &mut st.conv, &w.conv, c.conv_kernel)
        };
        // 3-5. split, L2-normalise q and k, scale q
        let scale = 1.0 / (dk as f32).sqrt();
        let mut q = Vec::with_capacity(t * qk);
        let mut k = Vec::with_capacity(t * qk);
        let mut v = Vec::with_capacity(t * c.gdn_v_width());
        for row in p.chunks_exact(ch) {
            q.extend_from_slice(&row[..qk]);
            k.extend_from_slice(&row[qk..2 * qk]);
            v.extend_from_slice(&row[2 * qk..]);
        }
        for h in q.chunks_exact_mut(dk) {
            l2_normalize(h, 1e-6);
            h.iter_mut().for_each(|x| *x *= scale);
        }
        for h in k.chunks_exact_mut(dk) {
            l2_normalize(h, 1e-6);
        }
        // 6. write strength and log-decay
        let beta: Vec<f32> = b.iter().map(|x| sigmoid(*x)).collect();
        let g: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let j = i % hv;
                -w.a_log[j].exp() * softplus(x + w.dt_bias[j])
            })
            .collect();
        // 7-8. delta rule
        let inp = DeltaInputs {
            t,
            num_value_heads: hv,
            group: hv / hk,
            dk,
            dv,
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        let mut o = if let Some(slots) = slots {
            let (qk_row, v_row) = (hk * dk, hv * dv);
            let mut o = Vec::with_capacity(t * v_row);
            for (s, conv) in convs.into_iter().enumerate() {
                let one = DeltaInputs {
                    t: 1,
                    q: &q[s * qk_row..(s + 1) * qk_row],
                    k: &k[s * qk_row..(s + 1) * qk_row],
                    v: &v[s * v_row..(s + 1) * v_row],
                    g: &g[s * hv..(s + 1) * hv],
                    beta: &beta[s * hv..(s + 1) * hv],
                    ..inp
                };
                o.extend(delta_rule_step(&one, &mut st.recurrent));
                slots.push(GdnState {
                    conv,
                    recurrent: st.recurrent.clone(),
                });
            }
            o
        } else if t > 1 && self.gdn_mode == GdnMode::Auto {
            delta_rule_chunked(&inp, &mut st.recurrent)
        } else {
            delta_rule_step(&inp, &mut st.recurrent)
        };
        // 9. gated RMSNorm per value head, 10. output projection
        for (oh, zh) in o.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
            gated_rms_norm(oh, zh, &w.norm, c.rms_norm_eps);
        }
        self.mm(&o, t, &w.out)
    }

    fn attention_layer(
        &self,
        x: &[f32],
        t: usize,
        w: &AttentionWeights,
        kv: &mut KvCache,
        past: usize,
    ) -> Vec<f32> {
        let c = &self.config;
        let (nq, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        let eps = c.rms_norm_eps;
        // q_proj holds per-head [query | gate] blocks of 2*hd.
        let qg = self.mm(x, t, &w.q);
        let mut k = self.mm(x, t, &w.k);
        let v = self.mm(x, t, &w.v);
        let mut q = Vec::with_capacity(t * nq * hd);
        let mut gate = Vec::with_capacity(t * nq * hd);
        for block in qg.chunks_exact(2 * hd) {
            q.extend_from_slice(&block[..hd]);
            gate.extend_from_slice(&block[hd..]);
        }
        rms_norm_zero_centred_inplace(&mut q, &w.q_norm, eps);
        rms_norm_zero_centred_inplace(&mut k, &w.k_norm, eps);
        for s in 0..t {
            for h in q[s * nq * hd..(s + 1) * nq * hd].chunks_exact_mut(hd) {
                apply_rope(h, past + s, &self.inv_freq);
            }
            for h in k[s * nkv * hd..(s + 1) * nkv * hd].chunks_exact_mut(hd) {
                apply_rope(h, past + s, &self.inv_freq);
            }
        }
        if self.bf16_activations {
            kv.k.extend(round_bf16(&k));
            kv.v.extend(round_bf16(&v));
        } else {
            kv.k.extend_from_slice(&k);
            kv.v.extend_from_slice(&v);
        }
        let mut o = causal_attention(&q, t, past, &kv.k, &kv.v, nq, nkv, hd);
        for (oi, gi) in o.iter_mut().zip(&gate) {
            *oi *= sigmoid(*gi);
        }
        self.mm(&o, t, &w.o)
    }

    /// The forward pass. With `verify` (a speculative verification step), GDN layers run
    /// position by position and keep each position's state ([`SequenceState::verified`]) so
    /// [`Engine::spec_keep`] can roll back; otherwise the roll-back slots are dropped. Where
    /// the state has an MTP part, the final-normed hidden state of every row is kept for the
    /// head ([`crate::state::MtpState`]).
    fn run(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        logits: Logits,
        verify: bool,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (t, d) = (tokens.len(), c.hidden_size);
        if t == 0 {
            bail!("forward called with no tokens");
        }
        if let Some(bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                c.vocab_size
            );
        }
        let past = state.len;
        state.verified = None;
        let gdn_layers = state
            .layers
            .iter()
            .filter(|l| matches!(l, LayerState::Gdn(_)))
            .count();
        let mut slots: Vec<Vec<GdnState>> = Vec::with_capacity(if verify { gdn_layers } else { 0 });

        // Embedding
        let mut h = Vec::with_capacity(t * d);
        for &id in tokens {
            h.extend(self.weights.embed.row_f32(id as usize));
        }

        // Decoder layers: pre-norm mixer and pre-norm MoE, each with a residual add.
        for (layer, st) in self.weights.layers.iter().zip(state.layers.iter_mut()) {
            let a = rms_norm_zero_centred(&h, &layer.input_norm, c.rms_norm_eps);
            let mixed = match (&layer.mixer, st) {
                (Mixer::Gdn(w), LayerState::Gdn(s)) => {
                    let slot = verify.then(|| {
                        slots.push(Vec::with_capacity(t));
                        slots.last_mut().unwrap()
                    });
                    self.gdn_layer(&a, t, w, s, slot)
                }
                (Mixer::Attention(w), LayerState::Attention(kv)) => {
                    self.attention_layer(&a, t, w, kv, past)
                }
                _ => bail!("sequence state does not match the model's layer pattern"),
            };
            h.iter_mut().zip(&mixed).for_each(|(x, m)| *x += m);
            let b = rms_norm_zero_centred(&h, &layer.post_attention_norm, c.rms_norm_eps);
            let ffn = moe_forward(
                &b,
                t,
                d,
                &layer.moe,
                c.experts_per_token,
                self.bf16_activations,
            );
            h.iter_mut().zip(&ffn).for_each(|(x, m)| *x += m);
        }
        state.len += t;
        if verify {
            // slots[layer][position] -> verified.gdn[position][layer]
            let mut gdn: Vec<Vec<GdnState>> =
                (0..t).map(|_| Vec::with_capacity(gdn_layers)).collect();
            for layer in slots {
                for (pos, s) in layer.into_iter().enumerate() {
                    gdn[pos].push(s);
                }
            }
            state.verified = Some(Verified { base: past, gdn });
        }

        // Final norm and lm_head on the positions asked for. The MTP head takes the hidden
        // state *after* the final norm, the vector that feeds lm_head: vLLM's and SGLang's
        // Qwen3.5/Qwen3-Next models return `norm(hidden)` from their forward, and their MTP
        // proposers pass exactly those target hidden states to `pre_fc_norm_hidden`
        // (model-spec §4.2, `y_t`).
        if let Some(m) = &mut state.mtp {
            let y = rms_norm_zero_centred(&h, &self.weights.final_norm, c.rms_norm_eps);
            if !m.hidden.is_empty() {
                m.next.push(tokens[0]);
            }
            m.next.extend_from_slice(&tokens[1..]);
            m.hidden.extend_from_slice(&y);
            return Ok(match logits {
                Logits::Last => self.mm(&y[(t - 1) * d..], 1, &self.weights.lm_head),
                Logits::All => self.mm(&y, t, &self.weights.lm_head),
            });
        }
        let (rows, n) = match logits {
            Logits::Last => (&h[(t - 1) * d..], 1),
            Logits::All => (&h[..], t),
        };
        let y = rms_norm_zero_centred(rows, &self.weights.final_norm, c.rms_norm_eps);
        Ok(self.mm(&y, n, &self.weights.lm_head))
    }

    /// The MTP head over `t` rows (spec §4.2): `hidden [t, D]` (main-model final-normed hidden
    /// states, or the head's own previous output when chaining drafts) paired with `tokens`
    /// (the token after each), at the positions after what `kv` holds. Returns the head's
    /// output rows after `mtp.norm` (what a chained draft step takes as its hidden state)
    /// and the last row's logits through the shared lm_head.
    fn mtp_rows(
        &self,
        w: &MtpWeights,
        kv: &mut KvCache,
        hidden: &[f32],
        tokens: &[u32],
    ) -> (Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let (t, d, eps) = (tokens.len(), c.hidden_size, c.rms_norm_eps);
        let past = kv.positions(c.num_kv_heads * c.head_dim);
        let mut e = Vec::with_capacity(t * d);
        for &id in tokens {
            e.extend(self.weights.embed.row_f32(id as usize));
        }
        let e = rms_norm_zero_centred(&e, &w.pre_fc_norm_embedding, eps);
        let hn = rms_norm_zero_centred(hidden, &w.pre_fc_norm_hidden, eps);
        // [embedding | hidden], the column order of mtp.fc
        let mut cat = Vec::with_capacity(t * 2 * d);
        for (er, hr) in e.chunks_exact(d).zip(hn.chunks_exact(d)) {
            cat.extend_from_slice(er);
            cat.extend_from_slice(hr);
        }
        let mut h = self.mm(&cat, t, &w.fc);
        let layer = &w.layer;
        let a = rms_norm_zero_centred(&h, &layer.input_norm, eps);
        let Mixer::Attention(aw) = &layer.mixer else {
            unreachable!("the MTP layer is a full-attention layer")
        };
        let mixed = self.attention_layer(&a, t, aw, kv, past);
        h.iter_mut().zip(&mixed).for_each(|(x, m)| *x += m);
        let b = rms_norm_zero_centred(&h, &layer.post_attention_norm, eps);
        let ffn = moe_forward(
            &b,
            t,
            d,
            &layer.moe,
            c.experts_per_token,
            self.bf16_activations,
        );
        h.iter_mut().zip(&ffn).for_each(|(x, m)| *x += m);
        let out = rms_norm_zero_centred(&h, &w.norm, eps);
        let logits = self.mm(&out[(t - 1) * d..], 1, &self.weights.lm_head);
        (out, logits)
    }

    /// The MTP head over explicit rows (tests: the head's numerics against an independent
    /// reference): `hidden [t, D]` paired with `tokens`, at positions `0..t` of a fresh KV
    /// cache; every row's logits.
    pub fn mtp_logits(&self, hidden: &[f32], tokens: &[u32]) -> Result<Vec<f32>> {
        let w = self
            .weights
            .mtp
            .as_ref()
            .context("the model has no MTP head")?;
        let d = self.config.hidden_size;
        anyhow::ensure!(hidden.len() == tokens.len() * d, "hidden is not [t, D]");
        let mut kv = KvCache::default();
        let mut out = Vec::with_capacity(tokens.len() * self.config.vocab_size);
        // One call over every row (causal attention over the earlier rows), then the
        // logits of each row from the head's output.
        let (rows, _) = self.mtp_rows(w, &mut kv, hidden, tokens);
        for r in rows.chunks_exact(d) {
            out.extend(self.mm(r, 1, &self.weights.lm_head));
        }
        Ok(out)
    }

    /// Attaches the MTP head: states made afterwards carry its KV, and the engine can draft
    /// ([`Engine::mtp_draft`]).
    pub fn attach_mtp(&mut self, mtp: MtpWeights) {
        self.weights.mtp = Some(mtp);
    }
}

impl Engine for CpuModel {
    type State = SequenceState;

    fn config(&self) -> &TextConfig {
        &self.config
    }

    fn new_state(&self) -> Result<SequenceState> {
        let mut s = SequenceState::new(&self.config);
        if self.weights.mtp.is_some() {
            s.mtp = Some(Default::default());
        }
        Ok(s)
    }

    fn state_len(&self, state: &SequenceState) -> usize {
        state.len
    }

    fn state_bytes(&self, state: &SequenceState) -> usize {
        state.memory_bytes()
    }

    fn forward(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        self.run(state, tokens, logits, false)
    }

    fn mtp_check(&self) -> Result<()> {
        if self.weights.mtp.is_none() {
            bail!(
                "--speculative mtp needs the checkpoint's MTP head, and this model was loaded \
                 without one"
            );
        }
        Ok(())
    }

    fn mtp_draft(
        &self,
        state: &mut SequenceState,
        next: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32], &[u32]) -> u32,
    ) -> Result<Vec<u32>> {
        let w = self
            .weights
            .mtp
            .as_ref()
            .context("the model has no MTP head")?;
        let c = &self.config;
        let d = c.hidden_size;
        let row = c.num_kv_heads * c.head_dim;
        if next as usize >= c.vocab_size {
            bail!(
                "token id {next} is outside the vocabulary (size {})",
                c.vocab_size
            );
        }
        let len = state.len;
        let m = state
            .mtp
            .as_mut()
            .context("this sequence state has no MTP part (made before the head was loaded)")?;
        let rows = m.hidden.len() / d;
        let kv_len = m.kv.positions(row);
        anyhow::ensure!(
            rows > 0 && kv_len + rows == len && m.next.len() + 1 == rows,
            "the MTP state is out of step with the sequence ({kv_len} MTP positions, {rows} \
             pending rows, {} tokens)",
            len
        );
        // First pass: every pending (hidden state, next token) pair at its own position, the
        // last one paired with `next`; its logits give the first draft.
        let mut ids = std::mem::take(&mut m.next);
        ids.push(next);
        let hidden = std::mem::take(&mut m.hidden);
        let (mut out, mut logits) = self.mtp_rows(w, &mut m.kv, &hidden, &ids);
        // The chained steps' KV entries (from the head's own output, not the main model's)
        // are dropped afterwards: the next round writes those positions from the main
        // model's hidden states.
        let kept = m.kv.positions(row);
        let mut drafts = Vec::with_capacity(k);
        while drafts.len() < k {
            let id = pick(&logits, &drafts);
            anyhow::ensure!(
                (id as usize) < c.vocab_size,
                "draft id {id} is outside the vocabulary"
            );
            drafts.push(id);
            if drafts.len() == k {
                break;
            }
            let last = out[out.len() - d..].to_vec();
            (out, logits) = self.mtp_rows(w, &mut m.kv, &last, &[id]);
        }
        m.kv.truncate(kept, row);
        Ok(drafts)
    }

    fn spec_verify(&self, state: &mut SequenceState, tokens: &[u32]) -> Result<Vec<f32>> {
        self.run(state, tokens, Logits::All, true)
    }

    fn spec_keep(&self, state: &mut SequenceState, keep: usize) -> Result<()> {
        let c = &self.config;
        let row = c.num_kv_heads * c.head_dim;
        let v = state
            .verified
            .as_ref()
            .context("no verification step to roll back")?;
        let held = state.len - v.base;
        anyhow::ensure!(
            (1..=held).contains(&keep),
            "cannot keep {keep} of the {held} verified tokens still held"
        );
        let drop = held - keep;
        if drop == 0 {
            return Ok(());
        }
        let slot = &v.gdn[keep - 1];
        let mut gdn = slot.iter();
        let len = v.base + keep;
        for l in state.layers.iter_mut() {
            match l {
                LayerState::Gdn(g) => g.clone_from(gdn.next().context("GDN slot count")?),
                LayerState::Attention(kv) => kv.truncate(len, row),
            }
        }
        if let Some(m) = &mut state.mtp {
            let d = c.hidden_size;
            m.hidden.truncate(m.hidden.len() - drop * d);
            m.next.truncate(m.next.len() - drop);
        }
        state.len = len;
        Ok(())
    }

    fn spec_release(&self, state: &mut SequenceState) {
        state.verified = None;
    }
}
