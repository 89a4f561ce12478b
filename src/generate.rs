//! The generation loop and what turns its ids into text, all backend-agnostic (any
//! [`Engine`]):
//!
//! * [`generate`]: prefill the prompt (after whatever the state already holds), then sample one
//!   token at a time until an end token, a stop, the token limit, the context limit or a
//!   cancel; optionally closes the thinking block after a token budget.
//! * [`TextStream`]: incremental, UTF-8-safe detokenization in O(1) per token.
//! * [`StopMatcher`]: stop strings caught across token boundaries, never printed.
//! * [`ReplyDecoder`]: the three above per reply, with the reasoning (`<think>...</think>`)
//!   and the answer separated into two channels.

use crate::model::{Engine, Logits};
use crate::sampling::Sampler;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The `<think>` / `</think>` ids and what to do about the thinking block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThinkingControl {
    pub open_id: u32,
    pub close_id: u32,
    /// After this many tokens inside a thinking block, `close_ids` are fed instead of
    /// sampled tokens.
    pub budget: Option<usize>,
    /// The ids of `</think>\n\n`.
    pub close_ids: Vec<u32>,
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// Generation stops after emitting any of these ids (not included in the text).
    pub stop_ids: Vec<u32>,
    /// Prompt tokens per prefill call.
    pub prefill_chunk: usize,
    /// The context limit: prompt + generated tokens never exceed it.
    pub max_seq: usize,
    pub thinking: Option<ThinkingControl>,
    /// With a plain greedy sampler ([`Sampler::is_plain_greedy`]), take each decoded id from
    /// the engine's own argmax ([`Engine::forward_greedy_id`]: on the GPU one id crosses to
    /// the host instead of the vocabulary's logits); `on_token` then sees empty logits after
    /// the first id. Off for callers that need the logits; the server's worker also keeps
    /// them for a request that asks for logprobs.
    pub device_greedy: bool,
    /// MTP speculative decoding (`--speculative mtp`); `None`: one token a step.
    pub speculative: Option<Speculative>,
}

/// Speculative decoding with the checkpoint's MTP head: after each picked id the head drafts
/// `draft_tokens` more, the main model verifies them in one step, and the loop emits the
/// accepted drafts plus one token from the target (greedy: while the draft is the target's
/// argmax; sampling: rejection sampling, so the output has the target's distribution).
/// Where the answer is constrained (structured outputs, strict tools) or a thinking budget is
/// set, the loop decodes one token a step instead.
#[derive(Clone, Debug, PartialEq)]
pub struct Speculative {
    pub draft_tokens: usize,
    /// Forced acceptance (bench only, the best case): the draft for generated index `i` is
    /// `forced[i]` (the target's own continuation from a plain greedy run of the same prompt)
    /// instead of the head's, which still runs.
    pub forced: Option<std::sync::Arc<Vec<u32>>>,
}

/// What speculation did over a reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Verification steps.
    pub steps: usize,
    /// Draft tokens proposed and accepted.
    pub drafted: usize,
    pub accepted: usize,
}

impl SpecStats {
    /// Accepted drafts over proposed ones.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
    /// Tokens a verification step emitted (accepted drafts + the target's token).
    pub fn tokens_per_step(&self) -> f64 {
        (self.accepted + self.steps) as f64 / self.steps.max(1) as f64
    }
    pub fn add(&mut self, o: &SpecStats) {
        self.steps += o.steps;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
    }
}

/// Whether greedy decoding may take its ids from the engine's own argmax (the CLI's and the
/// server's [`GenerateOptions::device_greedy`]): yes unless
/// the test oracle `KESTREL_HOST_SAMPLING` is set, which keeps every step's logits on the host
/// (the check that both paths pick the same ids, `scripts/gpu_cli_check.py`).
pub fn device_greedy_allowed() -> bool {
    !crate::settings::Settings::get().host_sampling
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    EndToken,
    MaxTokens,
    ContextFull,
    StopString,
    Cancelled,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StopReason::EndToken => "end token",
            StopReason::MaxTokens => "max tokens",
            StopReason::ContextFull => "context full",
            StopReason::StopString => "stop string",
            StopReason::Cancelled => "cancelled",
        })
    }
}

#[derive(Clone, Debug)]
pub struct GenerationStats {
    /// Tokens of the whole prompt, including those reused from the state.
    pub prompt_tokens: usize,
    /// Prompt tokens the state already held (not prefilled again).
    pub cached_tokens: usize,
    /// Every generated id, end token and forced ids included.
    pub generated: Vec<u32>,
    /// Ids fed by the thinking budget rather than sampled.
    pub forced_tokens: usize,
    /// Prefill time up to the first sampled token.
    pub time_to_first_token: Duration,
    pub decode_time: Duration,
    pub stop: StopReason,
    /// False when a cancel interrupted the prefill: the state then holds part of the prompt.
    pub prefill_complete: bool,
    /// Speculative decoding's counts (zero without it).
    pub spec: SpecStats,
}

impl GenerationStats {
    /// Prompt tokens actually run through the model.
    pub fn prefilled_tokens(&self) -> usize {
        self.prompt_tokens - self.cached_tokens
    }
    pub fn prefill_tok_s(&self) -> f64 {
        self.prefilled_tokens() as f64 / self.time_to_first_token.as_secs_f64().max(1e-9)
    }
    /// Decode rate over the tokens after the first.
    pub fn decode_tok_s(&self) -> f64 {
        let n = self.generated.len().saturating_sub(1);
        n as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
    /// Ids the state holds beyond the prompt: all generated ids but the last, which was
    /// sampled and never run through the model.
    pub fn fed_tokens(&self) -> &[u32] {
        &self.generated[..self.generated.len().saturating_sub(1)]
    }
}

/// What one [`generate`] call returns: the stats and, if asked, a copy of the state taken
/// right after the first `snapshot_at` prompt tokens.
pub struct Generation<S> {
    pub stats: GenerationStats,
    pub snapshot: Option<S>,
}

/// True when the last `<think>` in `ids` is not followed by a `</think>`, i.e. the model
/// continues inside a thinking block.
pub fn ends_inside_thinking(ids: &[u32], open_id: u32, close_id: u32) -> bool {
    let open = ids.iter().rposition(|&x| x == open_id);
    let close = ids.iter().rposition(|&x| x == close_id);
    match (open, close) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Runs `prompt` through `engine` after what `state` already holds and generates.
///
/// `full_prompt_len` is the whole prompt's length (the state's tokens plus `prompt`) and is
/// only used for the stats and the thinking check; `in_thinking` says whether the prompt ends
/// inside a thinking block. `on_token` sees every generated id (end tokens included) with the
/// logits it was chosen from (for logprobs), and returns a reason to stop, if any. `cancel` is polled before every forward call. With
/// `snapshot_at = Some(n)`, the state is copied after `n` of `prompt`'s tokens (`0 < n <
/// prompt.len()`).
#[allow(clippy::too_many_arguments)]
pub fn generate<E: Engine>(
    engine: &E,
    state: &mut E::State,
    prompt: &[u32],
    in_thinking: bool,
    opts: &GenerateOptions,
    sampler: &mut Sampler,
    cancel: &AtomicBool,
    snapshot_at: Option<usize>,
    mut on_token: impl FnMut(u32, &[f32]) -> Option<StopReason>,
) -> Result<Generation<E::State>> {
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let cached = engine.state_len(state);
    if cached + prompt.len() > opts.max_seq {
        if cached == 0 {
            bail!(
                "the prompt is {} tokens but the context limit is {} tokens",
                prompt.len(),
                opts.max_seq
            );
        }
        bail!(
            "the prompt is {} tokens ({} new, {} already in context) but the context limit is {} tokens",
            cached + prompt.len(),
            prompt.len(),
            cached,
            opts.max_seq
        );
    }
    let t0 = Instant::now();
    let mut stats = GenerationStats {
        prompt_tokens: cached + prompt.len(),
        cached_tokens: cached,
        generated: Vec::new(),
        forced_tokens: 0,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
        stop: StopReason::Cancelled,
        prefill_complete: false,
        spec: SpecStats::default(),
    };
    let mut snapshot = None;
    let split = snapshot_at.filter(|&n| n > 0 && n < prompt.len());
    let parts: [&[u32]; 2] = match split {
        Some(n) => [&prompt[..n], &prompt[n..]],
        None => [prompt, &[]],
    };
    let mut logits = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        for piece in part.chunks(opts.prefill_chunk.max(1)) {
            if cancel.load(Ordering::SeqCst) {
                stats.time_to_first_token = t0.elapsed();
                return Ok(Generation { stats, snapshot });
            }
            logits = engine.forward(state, piece, Logits::Last)?;
        }
        if i == 0 && split.is_some() {
            snapshot = Some(state.clone());
        }
    }
    stats.prefill_complete = true;

    let mut dl = DecodeLoop::new(stats, in_thinking, logits, t0);
    let stop = loop {
        let next = dl.pick(opts, sampler);
        if let Some(reason) = on_token(next, &dl.logits) {
            break reason;
        }
        if let Some(reason) = dl.check(opts, engine.state_len(state)) {
            break reason;
        }
        if cancel.load(Ordering::SeqCst) {
            break StopReason::Cancelled;
        }
        dl.feed(engine, state, next, opts, sampler)?;
    };
    dl.settle(engine, state)?;
    let stats = dl.finish(stop);
    Ok(Generation { stats, snapshot })
}

/// The decode loop of [`generate`] one token at a time, for callers that interleave
/// several sequences (the server's scheduler). Per token: [`pick`](Self::pick) the next id
/// (sampled, or forced by the thinking budget), report it, [`check`](Self::check) the
/// limits, then run the id through the model and store the new `logits`.
pub struct DecodeLoop {
    pub stats: GenerationStats,
    /// The logits the next id is chosen from.
    pub logits: Vec<f32>,
    /// The next id when the engine already chose it (greedy on the device), in place of
    /// sampling `logits`; a forced id (the thinking budget) still comes first.
    device_next: Option<u32>,
    thinking: bool,
    thinking_tokens: usize,
    forced: std::collections::VecDeque<u32>,
    t0: Instant,
    t_decode: Option<Instant>,
    /// The structured-output constraint of the answer ([`Self::constrain`]).
    guide: Option<crate::grammar::Guide>,
    /// Strict tool calls ([`Self::constrain_tools`]), where the answer has no `guide`.
    tools: Option<crate::grammar::ToolGate>,
    /// What the masks the ids were picked under cost.
    pub mask_cost: crate::grammar::MaskCost,
    /// Whether the constraint already has `device_next` ([`Self::set_drawn`]).
    committed: bool,
    /// Ids a speculative step chose, not picked yet, each with the target's logits at its
    /// position.
    spec_queue: std::collections::VecDeque<(u32, Vec<f32>)>,
    /// Of those, how many the state already holds (accepted drafts): their `feed` runs
    /// nothing; where the reply ends first, [`settle`](Self::settle) rolls them back.
    ahead: usize,
    /// Tokens of the last verification step the state holds.
    held: usize,
}

impl DecodeLoop {
    /// After a complete prefill: `logits` are the prompt's last position's, `t0` when the
    /// request started (for the time to first token).
    pub fn new(stats: GenerationStats, in_thinking: bool, logits: Vec<f32>, t0: Instant) -> Self {
        DecodeLoop {
            stats,
            logits,
            device_next: None,
            thinking: in_thinking,
            thinking_tokens: 0,
            forced: Default::default(),
            t0,
            t_decode: None,
            guide: None,
            tools: None,
            mask_cost: Default::default(),
            committed: false,
            spec_queue: Default::default(),
            ahead: 0,
            held: 0,
        }
    }

    /// Whether [`feed`](Self::feed) of the id just picked is a speculative one (an accepted
    /// draft already in the state, or a new draft + verification step), which a batching
    /// caller runs on its own rather than in a batched step.
    pub fn speculates_next(&self, opts: &GenerateOptions) -> bool {
        self.ahead > 0 || self.speculates(opts)
    }

    /// Whether speculation may run for the next id: asked for, and no constraint, forced id
    /// or thinking budget that the loop would have to apply token by token.
    fn speculates(&self, opts: &GenerateOptions) -> bool {
        opts.speculative.is_some()
            && self.guide.is_none()
            && self.tools.is_none()
            && self.forced.is_empty()
            && opts.thinking.as_ref().is_none_or(|t| t.budget.is_none())
    }

    /// After the last id was picked and reported, before the stats are read or the state is
    /// reused: rolls back tokens a speculative step put in the state beyond the ones the
    /// loop fed (the reply ended among its accepted drafts), so the state holds the prompt
    /// and every generated id but the last, as without speculation.
    pub fn settle<E: Engine>(&mut self, engine: &E, state: &mut E::State) -> Result<()> {
        if self.ahead > 0 {
            engine.spec_keep(state, self.held - self.ahead)?;
            self.held -= self.ahead;
            self.ahead = 0;
        }
        self.spec_queue.clear();
        if self.held > 0 {
            engine.spec_release(state);
            self.held = 0;
        }
        Ok(())
    }

    /// One speculative step for the picked `id`: draft with the MTP head, verify `id` and the
    /// drafts in one forward, accept (greedy match or rejection sampling), roll the state back
    /// to the accepted tokens and queue them with the target's token for `pick`.
    fn spec_step<E: Engine>(
        &mut self,
        engine: &E,
        state: &mut E::State,
        id: u32,
        opts: &GenerateOptions,
        sampler: &mut Sampler,
    ) -> Result<()> {
        let spec = opts.speculative.as_ref().expect("speculates");
        let g = self.stats.generated.len();
        let len = engine.state_len(state);
        // Room for the verified tokens in the context, and no drafts past the token limit.
        let k = spec
            .draft_tokens
            .min(opts.max_seq.saturating_sub(len + 1))
            .min(opts.max_tokens.saturating_sub(g + 1));
        if k == 0 {
            self.set_logits(engine.forward(state, &[id], Logits::Last)?);
            return Ok(());
        }
        let params = sampler.params().clone();
        let history = self.stats.generated.clone();
        let mut qs: Vec<Vec<(u32, f64)>> = Vec::with_capacity(k);
        let forced = spec.forced.clone();
        let drafts = engine.mtp_draft(state, id, k, &mut |logits, prev| {
            if let Some(&f) = forced.as_ref().and_then(|f| f.get(g + prev.len())) {
                qs.push(vec![(f, 1.0)]);
                return f;
            }
            let mut h = history.clone();
            h.extend_from_slice(prev);
            let q = crate::sampling::distribution(&params, logits, &h);
            let d = crate::sampling::sample_from(&q, sampler.uniform());
            qs.push(q);
            d
        })?;
        let mut tokens = Vec::with_capacity(k + 1);
        tokens.push(id);
        tokens.extend_from_slice(&drafts);
        let logits = engine.spec_verify(state, &tokens)?;
        let v = engine.config().vocab_size;
        anyhow::ensure!(
            logits.len() == (k + 1) * v,
            "a verification step gave {} logits",
            logits.len()
        );
        let mut h = history;
        let mut accepted = 0;
        for (i, row) in logits.chunks_exact(v).enumerate() {
            let p = crate::sampling::distribution(&params, row, &h);
            if i == k {
                let t = crate::sampling::sample_from(&p, sampler.uniform());
                self.spec_queue.push_back((t, row.to_vec()));
                break;
            }
            let u = sampler.uniform();
            let (t, ok) =
                crate::sampling::speculative_step(&p, &qs[i], drafts[i], u, || sampler.uniform());
            self.spec_queue.push_back((t, row.to_vec()));
            if !ok {
                break;
            }
            accepted += 1;
            h.push(t);
        }
        engine.spec_keep(state, accepted + 1)?;
        self.held = accepted + 1;
        self.ahead = accepted;
        self.stats.spec.steps += 1;
        self.stats.spec.drafted += k;
        self.stats.spec.accepted += accepted;
        self.logits.clear();
        self.device_next = None;
        Ok(())
    }

    /// Constrains the answer (every id picked outside the thinking block, forced ids
    /// aside) to `guide`'s grammar.
    pub fn constrain(&mut self, guide: crate::grammar::Guide) {
        self.guide = Some(guide);
    }

    /// The mask the next id is picked under, if the constraint applies to it: outside the
    /// thinking block and with no forced id due. Valid after [`pick`](Self::pick), for the
    /// draw that chooses the id after the one picked (before the pick of an engine's id
    /// the constraint already took, it is the mask after that id).
    pub fn next_mask(&self) -> Option<&crate::grammar::PendingMask> {
        if self.thinking || !self.forced.is_empty() {
            return None;
        }
        match (&self.guide, &self.tools) {
            (Some(g), _) => Some(g.next_mask()),
            (None, Some(t)) => t.next_mask(),
            (None, None) => None,
        }
    }

    /// Constrains the arguments of the answer's tool calls (strict tools) to `gate`.
    pub fn constrain_tools(&mut self, gate: crate::grammar::ToolGate) {
        self.tools = Some(gate);
    }

    /// Runs the picked `id` through the model for the next [`pick`](Self::pick). With
    /// `opts.device_greedy` the engine chooses the next id itself and `logits` is left empty:
    /// a plain greedy sampler by its argmax ([`Engine::forward_greedy_id`]), any other by a
    /// draw from the sampler's next uniform ([`Engine::forward_batch_draw`]); on the GPU one
    /// id crosses to the host, not the vocabulary's logits. Otherwise (the test oracle) the
    /// new logits.
    pub fn feed<E: Engine>(
        &mut self,
        engine: &E,
        state: &mut E::State,
        id: u32,
        opts: &GenerateOptions,
        sampler: &mut Sampler,
    ) -> Result<()> {
        if self.ahead > 0 {
            // an accepted draft: the verification step already ran it
            self.ahead -= 1;
            return Ok(());
        }
        if self.speculates(opts) {
            return self.spec_step(engine, state, id, opts, sampler);
        }
        if !opts.device_greedy {
            self.set_logits(engine.forward(state, &[id], Logits::Last)?);
        } else if sampler.is_plain_greedy() && self.next_mask().is_none() {
            let limit = sampler.params().vocab_limit;
            self.set_next(engine.forward_greedy_id(state, id, limit)?);
        } else {
            let u = sampler.uniform();
            let draw = crate::sampling::Draw {
                params: sampler.params(),
                u,
                history: &self.stats.generated,
                top_logprobs: None,
                want_logits: false,
                mask: self.next_mask(),
            };
            let mut drawn = engine.forward_batch_draw(&mut [state], &[id], &[draw])?;
            let d = drawn.pop().context("a draw of one row gave none")?;
            self.set_drawn(d.id, d.logits);
        }
        Ok(())
    }

    /// What [`feed`](Self::feed) does with the engine's greedy id, for a caller that ran the
    /// forward itself (the server's batched step).
    pub fn set_next(&mut self, id: u32) {
        self.logits.clear();
        self.take_device_id(id);
    }

    /// What a batched step's draw gives (the server's): the next id, chosen on the device from
    /// the sampler's uniform, and the logits where they were asked for.
    pub fn set_drawn(&mut self, id: u32, logits: Option<Vec<f32>>) {
        self.logits = logits.unwrap_or_default();
        self.take_device_id(id);
    }

    /// Whether the constraint applies to the next picked id: outside the thinking block,
    /// with no forced id due.
    fn constrainable(&self) -> bool {
        !self.thinking && self.forced.is_empty()
    }

    /// The engine's id for the next [`pick`](Self::pick). Where the constraint applies to it
    /// the pick cannot choose another (a forced id or the thinking budget would have made it
    /// unconstrained; speculation is off under a constraint), so the constraint gets it now:
    /// the next mask starts computing at once, not after the caller reported the token (in
    /// the server's round: after every earlier sequence's pick).
    fn take_device_id(&mut self, id: u32) {
        self.device_next = Some(id);
        self.committed = false;
        if self.spec_queue.is_empty() && self.constrainable() {
            self.constrain_id(id, true);
            self.committed = true;
        }
    }

    /// Records `next`, picked under the constraint's current mask (counted; `device`: chosen
    /// by the engine, so only checked against it), with the constraint.
    fn constrain_id(&mut self, next: u32, device: bool) {
        let pending = match (&self.guide, &self.tools) {
            (Some(g), _) => Some(g.next_mask()),
            (None, Some(t)) => t.next_mask(),
            (None, None) => None,
        };
        if let Some(m) = pending {
            self.mask_cost.add(m);
            if device && !crate::grammar::allowed(m.get(), next) {
                tracing::warn!("the engine's draw chose id {next}, which the mask refuses");
            }
        }
        if let Some(g) = &mut self.guide {
            g.commit(next);
        } else if let Some(t) = &mut self.tools {
            t.observe(next);
        }
    }

    /// What [`feed`](Self::feed) does with the new logits (see [`set_next`](Self::set_next)).
    pub fn set_logits(&mut self, logits: Vec<f32>) {
        self.logits = logits;
    }

    /// Chooses and records the next id.
    pub fn pick(&mut self, opts: &GenerateOptions, sampler: &mut Sampler) -> u32 {
        let budget_hit = opts.thinking.as_ref().is_some_and(|t| {
            self.thinking
                && self.forced.is_empty()
                && t.budget.is_some_and(|b| self.thinking_tokens >= b)
        });
        if budget_hit && let Some(t) = &opts.thinking {
            self.forced.extend(&t.close_ids);
        }
        let was_forced = !self.forced.is_empty();
        if let Some((id, row)) = self.spec_queue.pop_front() {
            // chosen by the last speculative step, against these target logits
            self.logits = row;
            self.device_next = Some(id);
        }
        let device_next = self.device_next.take();
        let committed = std::mem::take(&mut self.committed);
        let next = match (self.forced.pop_front(), device_next) {
            (Some(id), _) => {
                self.stats.forced_tokens += 1;
                id
            }
            // the constraint has it already (`take_device_id`), or does not apply to it
            (None, Some(id)) if committed || !self.constrainable() => id,
            (None, Some(id)) => {
                self.constrain_id(id, true);
                id
            }
            (None, None) => {
                // on the host, under the constraint's mask where it applies
                let pending = match (&self.guide, &self.tools) {
                    _ if !self.constrainable() => None,
                    (Some(g), _) => Some(g.next_mask()),
                    (None, Some(t)) => t.next_mask(),
                    (None, None) => None,
                };
                let id = match pending {
                    Some(m) => sampler.sample_masked(&self.logits, &self.stats.generated, m.get()),
                    None => sampler.sample(&self.logits, &self.stats.generated),
                };
                if self.constrainable() {
                    self.constrain_id(id, false);
                }
                id
            }
        };
        if self.t_decode.is_none() {
            self.stats.time_to_first_token = self.t0.elapsed();
            self.t_decode = Some(Instant::now());
        }
        self.stats.generated.push(next);
        if let Some(t) = &opts.thinking {
            if next == t.open_id {
                self.thinking = true;
            } else if next == t.close_id {
                self.thinking = false;
                if !was_forced {
                    self.forced.clear();
                }
            } else if self.thinking {
                self.thinking_tokens += 1;
            }
        }
        next
    }

    /// After the last picked id was reported: the reason to stop, if any (end token, token
    /// limit, context limit), given how many tokens the state holds.
    pub fn check(&self, opts: &GenerateOptions, state_len: usize) -> Option<StopReason> {
        let next = *self.stats.generated.last()?;
        if opts.stop_ids.contains(&next) {
            Some(StopReason::EndToken)
        } else if self.stats.generated.len() >= opts.max_tokens {
            Some(StopReason::MaxTokens)
        } else if state_len.saturating_sub(self.ahead) + 1 > opts.max_seq {
            Some(StopReason::ContextFull)
        } else {
            None
        }
    }

    /// The final stats.
    pub fn finish(mut self, stop: StopReason) -> GenerationStats {
        self.stats.stop = stop;
        self.stats.decode_time = self.t_decode.map_or(Duration::ZERO, |t| t.elapsed());
        self.stats
    }
}

/// Incremental detokenization: yields only complete text (no split UTF-8 characters),
/// however the bytes fall across tokens, at O(1) cost per token.
///
/// It keeps two offsets into the ids: `prefix` starts a short window of already-emitted ids
/// that gives the decoder context, and `read` is where the unemitted ids begin. Each push
/// decodes `ids[prefix..read]` and `ids[prefix..]`; the new text is the difference, emitted
/// only when it does not end in U+FFFD (an incomplete character), after which the window
/// slides forward. Windows stay a few ids long, so the cost does not grow with the reply.
pub struct TextStream {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}

impl TextStream {
    pub fn new() -> Self {
        TextStream {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one id; returns newly completed text (possibly empty).
    pub fn push(&mut self, id: u32, decode: impl Fn(&[u32]) -> Result<String>) -> Result<String> {
        self.ids.push(id);
        let before = decode(&self.ids[self.prefix..self.read])?;
        let now = decode(&self.ids[self.prefix..])?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new = now.get(before.len()..).unwrap_or("").to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        if self.prefix > 256 {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
        Ok(new)
    }

    /// The text still held back (an incomplete character at the end), decoded lossily; the
    /// stream is empty afterwards.
    pub fn finish(&mut self, decode: impl Fn(&[u32]) -> Result<String>) -> Result<String> {
        let before = decode(&self.ids[self.prefix..self.read])?;
        let now = decode(&self.ids[self.prefix..])?;
        let rest = now.get(before.len()..).unwrap_or("").to_string();
        *self = TextStream::new();
        Ok(rest)
    }
}

/// Catches stop strings in streamed text, also when they are split across pieces. Text that
/// could be the start of a stop string is held back until it is known not to be one, so a
/// stop string is never emitted.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    /// The stop string that ended the text (the earliest found; of two at one place, the
    /// first given).
    pub matched: Option<String>,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            matched: None,
        }
    }

    /// Feeds a piece; returns the text safe to emit and whether a stop string was found
    /// (the text is then everything before it, and the rest is dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (piece.to_string(), false);
        }
        self.pending.push_str(piece);
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = first {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            self.matched = Some(self.stops[i].clone());
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let len = self.pending.len();
        let bytes = self.pending.as_bytes();
        let hold = self
            .stops
            .iter()
            .filter_map(|s| {
                (1..s.len().min(len + 1)).rev().find(|&n| {
                    self.pending.is_char_boundary(len - n)
                        && s.as_bytes().starts_with(&bytes[len - n..])
                })
            })
            .max()
            .unwrap_or(0);
        let out = self.pending[..len - hold].to_string();
        self.pending.drain(..len - hold);
        (out, false)
    }

    /// The held-back text (the reply ended without completing a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Which part of a reply a piece of text belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// Inside `<think>...</think>`.
    Reasoning,
    Answer,
}

/// Turns a reply's ids into reasoning and answer text as they arrive: incremental
/// detokenization per channel, stop strings, end tokens hidden, the `<think>` markers
/// themselves turned into channel switches, and the newlines that follow them (the template's
/// `<think>\n` ... `</think>\n\n`) dropped from the start of each channel.
pub struct ReplyDecoder {
    think: Option<(u32, u32)>,
    hidden: Vec<u32>,
    channel: Channel,
    stream: TextStream,
    stop: StopMatcher,
    /// Whether the current channel has shown text (its leading newlines are dropped).
    started: bool,
    /// Everything emitted so far, per channel.
    pub reasoning: String,
    pub answer: String,
}

impl ReplyDecoder {
    /// `think`: the `<think>` / `</think>` ids; `in_thinking`: whether the prompt leaves the
    /// model inside a thinking block; `hidden`: ids never shown (end tokens).
    pub fn new(
        think: Option<(u32, u32)>,
        in_thinking: bool,
        stops: &[String],
        hidden: &[u32],
    ) -> Self {
        ReplyDecoder {
            think,
            hidden: hidden.to_vec(),
            channel: if in_thinking && think.is_some() {
                Channel::Reasoning
            } else {
                Channel::Answer
            },
            stream: TextStream::new(),
            stop: StopMatcher::new(stops),
            started: false,
            reasoning: String::new(),
            answer: String::new(),
        }
    }

    pub fn channel(&self) -> Channel {
        self.channel
    }

    /// The stop string that ended the reply, if one did.
    pub fn stop_matched(&self) -> Option<&str> {
        self.stop.matched.as_deref()
    }

    fn emit(&mut self, text: String, out: &mut Vec<(Channel, String)>) {
        let text = if self.started {
            text
        } else {
            let t = text.trim_start_matches(['\n', '\r']);
            self.started = !t.is_empty();
            t.to_string()
        };
        if text.is_empty() {
            return;
        }
        match self.channel {
            Channel::Reasoning => self.reasoning.push_str(&text),
            Channel::Answer => self.answer.push_str(&text),
        }
        out.push((self.channel, text));
    }

    /// Ends the current channel's text (a stop string can still complete in what was held
    /// back) and continues in `to`. Returns whether a stop string was found.
    fn switch(
        &mut self,
        to: Channel,
        decode: &impl Fn(&[u32]) -> Result<String>,
        out: &mut Vec<(Channel, String)>,
    ) -> Result<bool> {
        let rest = self.stream.finish(decode)?;
        let (text, stopped) = self.stop.push(&rest);
        self.emit(text, out);
        if stopped {
            return Ok(true);
        }
        let held = self.stop.flush();
        self.emit(held, out);
        self.channel = to;
        self.started = false;
        Ok(false)
    }

    /// Adds one id. Returns the new text pieces and whether a stop string ended the reply.
    pub fn push(
        &mut self,
        id: u32,
        decode: impl Fn(&[u32]) -> Result<String>,
    ) -> Result<(Vec<(Channel, String)>, bool)> {
        let mut out = Vec::new();
        if self.hidden.contains(&id) {
            return Ok((out, false));
        }
        if let Some((open, close)) = self.think
            && (id == open || id == close)
        {
            let to = if id == open {
                Channel::Reasoning
            } else {
                Channel::Answer
            };
            let stopped = self.switch(to, &decode, &mut out)?;
            return Ok((out, stopped));
        }
        let piece = self.stream.push(id, &decode)?;
        let (text, stopped) = self.stop.push(&piece);
        self.emit(text, &mut out);
        Ok((out, stopped))
    }

    /// Emits what is still held back when the reply ends without a stop string.
    pub fn finish(
        &mut self,
        decode: impl Fn(&[u32]) -> Result<String>,
    ) -> Result<Vec<(Channel, String)>> {
        let mut out = Vec::new();
        let rest = self.stream.finish(&decode)?;
        let (text, stopped) = self.stop.push(&rest);
        self.emit(text, &mut out);
        if !stopped {
            let held = self.stop.flush();
            self.emit(held, &mut out);
        }
        Ok(out)
    }
}

/// Everything about a reply besides the prompt: the loop's options, stop strings, and the
/// thinking markers.
#[derive(Clone, Debug)]
pub struct ReplySettings {
    pub opts: GenerateOptions,
    pub stop_strings: Vec<String>,
    /// The `<think>` / `</think>` ids (`None`: no reasoning channel).
    pub think_ids: Option<(u32, u32)>,
}

/// One finished reply.
#[derive(Clone, Debug)]
pub struct Reply {
    pub stats: GenerationStats,
    pub reasoning: String,
    pub answer: String,
}

/// Generates a reply to `prompt` (the whole prompt; `state` already holds its first
/// `engine.state_len(state)` ids) and streams its text to `on_text` as it is decoded. An
/// error from `on_text` (say, a closed pipe) stops the reply and is returned.
#[allow(clippy::too_many_arguments)]
pub fn reply<E: Engine>(
    engine: &E,
    tokenizer: &Tokenizer,
    state: &mut E::State,
    prompt: &[u32],
    snapshot_at: Option<usize>,
    settings: &ReplySettings,
    sampler: &mut Sampler,
    cancel: &AtomicBool,
    mut on_text: impl FnMut(Channel, &str) -> std::io::Result<()>,
) -> Result<(Reply, Option<E::State>)> {
    let cached = engine.state_len(state);
    if prompt.is_empty() {
        bail!("the prompt is empty (nothing to generate from)");
    }
    if cached >= prompt.len() {
        bail!(
            "the state already holds {cached} tokens but the prompt is {} tokens",
            prompt.len()
        );
    }
    let in_thinking = settings
        .think_ids
        .is_some_and(|(o, c)| ends_inside_thinking(prompt, o, c));
    let mut decoder = ReplyDecoder::new(
        settings.think_ids,
        in_thinking,
        &settings.stop_strings,
        &settings.opts.stop_ids,
    );
    let decode = |ids: &[u32]| tokenizer.decode(ids, true);
    let mut failure: Option<anyhow::Error> = None;
    let mut send = |pieces: Vec<(Channel, String)>, failure: &mut Option<anyhow::Error>| {
        for (ch, text) in pieces {
            if let Err(e) = on_text(ch, &text) {
                *failure = Some(e.into());
                return false;
            }
        }
        true
    };
    let generation = generate(
        engine,
        state,
        &prompt[cached..],
        in_thinking,
        &settings.opts,
        sampler,
        cancel,
        snapshot_at,
        |id, _| match decoder.push(id, decode) {
            Ok((pieces, stopped)) => {
                if !send(pieces, &mut failure) {
                    Some(StopReason::Cancelled)
                } else if stopped {
                    Some(StopReason::StopString)
                } else {
                    None
                }
            }
            Err(e) => {
                failure = Some(e);
                Some(StopReason::Cancelled)
            }
        },
    )?;
    if let Some(e) = failure {
        return Err(e);
    }
    let mut generation = generation;
    if generation.stats.stop != StopReason::StopString {
        let pieces = decoder.finish(decode)?;
        let mut failure = None;
        send(pieces, &mut failure);
        if let Some(e) = failure {
            return Err(e);
        }
    }
    let snapshot = generation.snapshot.take();
    Ok((
        Reply {
            stats: generation.stats,
            reasoning: decoder.reasoning,
            answer: decoder.answer,
        },
        snapshot,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_stops(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (t, stop) = m.push(p);
            out.push_str(&t);
            if stop {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_strings_split_across_pieces() {
        assert_eq!(
            run_stops(&["STOP"], &["abc S", "T", "OP tail"]),
            ("abc ".into(), true)
        );
        assert_eq!(run_stops(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        // a prefix that turns out not to be a stop is emitted in full
        assert_eq!(
            run_stops(&["STOP"], &["ST", "OOP", "!"]),
            ("STOOP!".into(), false)
        );
        // the earliest of several stops wins, even if another completes in the same piece
        assert_eq!(
            run_stops(&["world", "lo w"], &["hel", "lo world"]),
            ("hel".into(), true)
        );
        // multi-byte stop split inside a character's bytes' pieces
        assert_eq!(
            run_stops(&["終わり"], &["これで終", "わ", "り。"]),
            ("これで".into(), true)
        );
        assert_eq!(run_stops(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn the_stop_string_that_matched_is_named() {
        let stops: Vec<String> = ["zzz", "lo w", "world"].map(String::from).to_vec();
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("a b"), ("a b".into(), false));
        assert_eq!(m.matched, None);
        assert_eq!(m.push("hello world"), ("hel".into(), true));
        // the earliest in the text, not the first in the list
        assert_eq!(m.matched.as_deref(), Some("lo w"));
        let mut m = StopMatcher::new(&["ab".to_string(), "a".to_string()]);
        m.push("xab");
        // two at the same place: the first given
        assert_eq!(m.matched.as_deref(), Some("ab"));
    }

    #[test]
    fn held_back_text_is_released_as_soon_as_it_cannot_match() {
        let mut m = StopMatcher::new(&["<END>".to_string()]);
        assert_eq!(m.push("x <E"), ("x ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("X"), ("<ENX".to_string(), false));
    }

    #[test]
    fn thinking_state_of_a_prompt() {
        assert!(ends_inside_thinking(&[1, 5, 2], 5, 6));
        assert!(!ends_inside_thinking(&[1, 5, 2, 6, 3], 5, 6));
        assert!(ends_inside_thinking(&[5, 6, 5], 5, 6));
        assert!(!ends_inside_thinking(&[1, 2], 5, 6));
    }
}
