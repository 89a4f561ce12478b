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
use crate::state::{GdnState, KvCache, LayerState, SequenceState};
use crate::weights::{AttentionWeights, Checkpoint, GdnWeights, Mixer, ModelWeights};
use anyhow::{Result, bail};
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

    fn gdn_layer(&self, x: &[f32], t: usize, w: &GdnWeights, st: &mut GdnState) -> Vec<f32> {
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
        // 2. causal conv over pre-conv inputs (state carries the last kernel-1), SiLU
        let p = causal_conv_silu(&p, t, ch, &mut st.conv, &w.conv, c.conv_kernel);
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
        let mut o = if t > 1 && self.gdn_mode == GdnMode::Auto {
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
}

impl Engine for CpuModel {
    type State = SequenceState;

    fn config(&self) -> &TextConfig {
        &self.config
    }

    fn new_state(&self) -> Result<SequenceState> {
        Ok(SequenceState::new(&self.config))
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

        // Embedding
        let mut h = Vec::with_capacity(t * d);
        for &id in tokens {
            h.extend(self.weights.embed.row_f32(id as usize));
        }

        // Decoder layers: pre-norm mixer and pre-norm MoE, each with a residual add.
        for (layer, st) in self.weights.layers.iter().zip(state.layers.iter_mut()) {
            let a = rms_norm_zero_centred(&h, &layer.input_norm, c.rms_norm_eps);
            let mixed = match (&layer.mixer, st) {
                (Mixer::Gdn(w), LayerState::Gdn(s)) => self.gdn_layer(&a, t, w, s),
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

        // Final norm and lm_head on the positions asked for.
        let (rows, n) = match logits {
            Logits::Last => (&h[(t - 1) * d..], 1),
            Logits::All => (&h[..], t),
        };
        let y = rms_norm_zero_centred(rows, &self.weights.final_norm, c.rms_norm_eps);
        Ok(self.mm(&y, n, &self.weights.lm_head))
    }
}
