//! The generation loop: prefill the prompt, then decode one token at a time until an end
//! token or the token limit. Backend-agnostic (any [`Engine`]).

use crate::model::{Engine, Logits};
use crate::ops::argmax;
use anyhow::{Result, bail};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// Generation stops after emitting any of these ids (not included in the text).
    pub stop_ids: Vec<u32>,
    /// Only ids below this are ever chosen (the vocabulary's padding rows are excluded).
    pub vocab_limit: usize,
    /// Prompt tokens per prefill call.
    pub prefill_chunk: usize,
    /// The context limit: prompt + generated tokens never exceed it.
    pub max_seq: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    EndToken,
    MaxTokens,
    ContextFull,
    Cancelled,
}

#[derive(Clone, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated: Vec<u32>,
    pub time_to_first_token: Duration,
    pub decode_time: Duration,
    pub stop: StopReason,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.time_to_first_token.as_secs_f64().max(1e-9)
    }
    /// Decode rate over the tokens after the first.
    pub fn decode_tok_s(&self) -> f64 {
        let n = self.generated.len().saturating_sub(1);
        n as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Greedy choice over the allowed ids.
pub fn greedy(logits: &[f32], vocab_limit: usize) -> u32 {
    argmax(&logits[..vocab_limit.min(logits.len())]).unwrap_or(0) as u32
}

/// Runs `prompt` through `engine` from `state` and decodes greedily. `on_token` sees every
/// generated id (end tokens included) and returns `false` to stop.
pub fn generate_greedy<E: Engine>(
    engine: &E,
    state: &mut E::State,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats> {
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let start_len = engine.state_len(state);
    if start_len + prompt.len() > opts.max_seq {
        bail!(
            "the prompt is {} tokens (plus {} already in context) but the context limit is {} tokens",
            prompt.len(),
            start_len,
            opts.max_seq
        );
    }
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for piece in prompt.chunks(opts.prefill_chunk.max(1)) {
        logits = engine.forward(state, piece, Logits::Last)?;
    }
    let mut next = greedy(&logits, opts.vocab_limit);
    let ttft = t0.elapsed();
    let t1 = Instant::now();
    let mut generated = Vec::new();
    let stop = loop {
        generated.push(next);
        if !on_token(next) {
            break StopReason::Cancelled;
        }
        if opts.stop_ids.contains(&next) {
            break StopReason::EndToken;
        }
        if generated.len() >= opts.max_tokens {
            break StopReason::MaxTokens;
        }
        if engine.state_len(state) + 1 > opts.max_seq {
            break StopReason::ContextFull;
        }
        logits = engine.forward(state, &[next], Logits::Last)?;
        next = greedy(&logits, opts.vocab_limit);
    };
    Ok(GenerationStats {
        prompt_tokens: prompt.len(),
        generated,
        time_to_first_token: ttft,
        decode_time: t1.elapsed(),
        stop,
    })
}

/// Incremental detokenization: yields only text that is complete (no split UTF-8
/// characters), however the bytes fall across tokens.
pub struct TextStream {
    ids: Vec<u32>,
    emitted: usize,
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
            emitted: 0,
        }
    }

    /// Adds one id; returns newly completed text (possibly empty).
    pub fn push(&mut self, id: u32, decode: impl Fn(&[u32]) -> Result<String>) -> Result<String> {
        self.ids.push(id);
        let text = decode(&self.ids)?;
        // A trailing U+FFFD means an incomplete multi-byte character: wait for more bytes.
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new = text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = text.len();
        Ok(new)
    }
}
