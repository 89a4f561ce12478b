//! A multi-turn conversation that keeps its sequence state between turns, so earlier turns
//! are not prefilled again.
//!
//! Every turn renders the whole conversation with the chat template and prefills only what
//! the saved state does not already hold. A state can only be resumed at points where it was
//! saved, so each turn keeps two snapshots:
//!
//! * after the conversation *before* the generation prompt (system + all messages up to the
//!   new user message): the template renders that part the same way next turn, so the next
//!   turn reuses it even though the Qwen template drops old reasoning from history;
//! * after the prompt and the reply (the live state, no copy): reused when the template
//!   renders the reply back exactly as it was generated.
//!
//! The next turn resumes from the longest snapshot whose ids are a prefix of its rendering;
//! with none, it prefills from scratch (its stats then show 0 cached tokens).

use crate::chat::ChatRequest;
use crate::generate::{Channel, Reply, ReplySettings, reply};
use crate::model::Engine;
use crate::sampling::Sampler;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::sync::atomic::AtomicBool;

/// A saved sequence state and the ids it holds.
pub struct Snapshot<S> {
    pub ids: Vec<u32>,
    pub state: S,
}

pub struct Conversation<S> {
    pub system: Option<String>,
    /// The template's `enable_thinking` (`None`: the template's default).
    pub enable_thinking: Option<bool>,
    /// User and assistant messages, OpenAI-style.
    pub messages: Vec<Value>,
    snapshots: Vec<Snapshot<S>>,
}

impl<S> Default for Conversation<S> {
    fn default() -> Self {
        Conversation {
            system: None,
            enable_thinking: None,
            messages: Vec::new(),
            snapshots: Vec::new(),
        }
    }
}

/// The rendered prompt of a turn.
pub struct TurnPrompt {
    pub ids: Vec<u32>,
    /// How many of `ids` are the conversation before the generation prompt, when that part
    /// tokenizes as a prefix of the whole.
    pub history_len: Option<usize>,
}

impl<S> Conversation<S> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets the messages and the saved states (the system prompt and settings stay).
    pub fn reset(&mut self) {
        self.messages.clear();
        self.snapshots.clear();
    }

    /// Ids held by the saved states, longest first.
    pub fn cached_lengths(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.snapshots.iter().map(|s| s.ids.len()).collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        v
    }

    fn request(&self, add_generation_prompt: bool) -> ChatRequest {
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(s) = &self.system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.extend(self.messages.iter().cloned());
        ChatRequest {
            messages,
            add_generation_prompt,
            enable_thinking: self.enable_thinking,
            ..Default::default()
        }
    }

    /// Renders and tokenizes the conversation with the generation prompt.
    pub fn prompt(&self, tokenizer: &Tokenizer) -> Result<TurnPrompt> {
        let template = tokenizer
            .template
            .as_ref()
            .context("the checkpoint has no chat template")?;
        let full = template.render(&self.request(true))?;
        let ids = tokenizer.encode(&full, true)?;
        let history = template.render(&self.request(false))?;
        let history_len = if full.starts_with(&history) && !history.is_empty() {
            let h = tokenizer.encode(&history, true)?;
            (ids.starts_with(&h) && h.len() < ids.len()).then_some(h.len())
        } else {
            None
        };
        Ok(TurnPrompt { ids, history_len })
    }

    /// Removes and returns the longest saved state whose ids are a proper prefix of `ids`;
    /// the other saved states are dropped.
    pub fn take_cache(&mut self, ids: &[u32]) -> Option<Snapshot<S>> {
        let best = self
            .snapshots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.ids.len() < ids.len() && ids.starts_with(&s.ids))
            .max_by_key(|(_, s)| s.ids.len())
            .map(|(i, _)| i);
        let snap = best.map(|i| self.snapshots.swap_remove(i));
        self.snapshots.clear();
        snap
    }

    pub fn save(&mut self, snap: Snapshot<S>) {
        self.snapshots.push(snap);
    }
}

/// Runs one user turn: adds the message, prefills what the saved states do not hold, streams
/// the reply to `on_text`, adds the reply to the conversation and saves the states for the
/// next turn. On an error the user message is taken back and the conversation is as before
/// (minus saved states that may have been consumed).
#[allow(clippy::too_many_arguments)]
pub fn chat_turn<E: Engine>(
    engine: &E,
    tokenizer: &Tokenizer,
    conv: &mut Conversation<E::State>,
    user: &str,
    settings: &ReplySettings,
    sampler: &mut Sampler,
    cancel: &AtomicBool,
    on_text: impl FnMut(Channel, &str) -> std::io::Result<()>,
) -> Result<Reply> {
    conv.messages.push(json!({"role": "user", "content": user}));
    let result = run_turn(engine, tokenizer, conv, settings, sampler, cancel, on_text);
    match result {
        Ok(r) => {
            if r.stats.prefill_complete {
                let mut msg = json!({"role": "assistant", "content": r.answer});
                if !r.reasoning.is_empty() {
                    msg["reasoning_content"] = Value::String(r.reasoning.trim().to_string());
                }
                conv.messages.push(msg);
            } else {
                conv.messages.pop();
            }
            Ok(r)
        }
        Err(e) => {
            conv.messages.pop();
            Err(e)
        }
    }
}

fn run_turn<E: Engine>(
    engine: &E,
    tokenizer: &Tokenizer,
    conv: &mut Conversation<E::State>,
    settings: &ReplySettings,
    sampler: &mut Sampler,
    cancel: &AtomicBool,
    on_text: impl FnMut(Channel, &str) -> std::io::Result<()>,
) -> Result<Reply> {
    let prompt = conv.prompt(tokenizer)?;
    let limit = settings.opts.max_seq;
    if prompt.ids.len() > limit {
        bail!(
            "the prompt is {} tokens but the context limit is {limit} tokens",
            prompt.ids.len()
        );
    }
    let (cached_ids, mut state) = match conv.take_cache(&prompt.ids) {
        Some(s) => (s.ids.len(), s.state),
        None => (0, engine.new_state()?),
    };
    if engine.state_len(&state) != cached_ids {
        bail!(
            "internal: a saved state holds {} tokens, expected {cached_ids}",
            engine.state_len(&state)
        );
    }
    let history = prompt.history_len.filter(|&h| h >= cached_ids);
    if history == Some(cached_ids) {
        conv.save(Snapshot {
            ids: prompt.ids[..cached_ids].to_vec(),
            state: state.clone(),
        });
    }
    let snapshot_at = history.map(|h| h - cached_ids);
    let (reply, snap) = reply(
        engine,
        tokenizer,
        &mut state,
        &prompt.ids,
        snapshot_at,
        settings,
        sampler,
        cancel,
        on_text,
    )?;
    if let (Some(h), Some(s)) = (history, snap) {
        conv.save(Snapshot {
            ids: prompt.ids[..h].to_vec(),
            state: s,
        });
    }
    if reply.stats.prefill_complete {
        let mut ids = prompt.ids;
        ids.extend_from_slice(reply.stats.fed_tokens());
        debug_assert_eq!(engine.state_len(&state), ids.len());
        conv.save(Snapshot { ids, state });
    }
    Ok(reply)
}
