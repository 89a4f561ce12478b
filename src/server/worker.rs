//! The model thread: takes [`Job`]s from a channel in arrival order, runs each through the
//! engine (resuming from the prefix cache), and streams [`Event`]s back to its HTTP handler.
//!
//! Engines are not `Sync` (the CUDA one keeps its workspace in a `RefCell`), so exactly one
//! thread owns the engine and the HTTP side never touches it. The [`Scheduler`] holds the
//! waiting queue and the cache; this round it runs one sequence at a time (`max_running` 1).
//! Batched decode slots in as a `step()` that advances every running sequence by one token
//! per forward call; admission, cancellation and the cache stay as they are.

use super::Shared;
use super::cache::PrefixCache;
use crate::generate::{
    Channel, ReplyDecoder, ReplySettings, StopReason, ends_inside_thinking, generate,
};
use crate::model::{Engine, Logits};
use crate::sampling::{Sampler, SamplingParams, TokenLogprobs, logprobs};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What the model thread reports about one job.
#[derive(Debug)]
pub enum Event {
    /// Prefill is about to start: the prompt's length and how much of it the cache held.
    Started { cached_tokens: usize },
    /// One generated token: the text it completed (possibly none) and its log-probabilities.
    Token {
        pieces: Vec<(Channel, String)>,
        logprobs: Option<TokenLogprobs>,
    },
    Done {
        stop: StopReason,
        completion_tokens: usize,
        reasoning_tokens: usize,
    },
    /// The job failed (`status` for the HTTP response when nothing was sent yet).
    Error { status: u16, message: String },
}

/// One request for the model.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Prompt lengths after which the state is saved to the prefix cache.
    pub snapshot_points: Vec<usize>,
    pub settings: ReplySettings,
    pub params: SamplingParams,
    pub seed: u64,
    /// `Some(top_n)`: report each token's log-probability and the top `top_n`.
    pub logprobs: Option<usize>,
    pub events: UnboundedSender<Event>,
    /// Set when the client has gone away.
    pub cancel: Arc<AtomicBool>,
    pub deadline: Instant,
}

/// Prompt tokens between chunk-boundary snapshots of long prompts.
pub const SNAPSHOT_EVERY: usize = 2048;

pub struct Scheduler<'e, E: Engine> {
    engine: &'e E,
    shared: Arc<Shared>,
    waiting: VecDeque<Job>,
    cache: PrefixCache<E::State>,
    /// Sequences decoded at once (1 this round; see the module docs).
    pub max_running: usize,
}

impl<'e, E: Engine> Scheduler<'e, E> {
    pub fn new(engine: &'e E, shared: Arc<Shared>) -> Self {
        let cap = shared.config.cache_mem;
        Scheduler {
            engine,
            shared,
            waiting: VecDeque::new(),
            cache: PrefixCache::new(cap),
            max_running: 1,
        }
    }

    /// Serves jobs until every sender is gone.
    pub fn run(mut self, rx: Receiver<Job>) {
        self.shared.ready.store(true, Ordering::SeqCst);
        loop {
            if self.waiting.is_empty() {
                match rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(job) => self.waiting.push_back(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(job) = rx.try_recv() {
                self.waiting.push_back(job);
            }
            if let Some(job) = self.waiting.pop_front() {
                self.shared
                    .metrics
                    .queue_depth
                    .fetch_sub(1, Ordering::Relaxed);
                self.shared.metrics.running.fetch_add(1, Ordering::Relaxed);
                self.serve(job);
                self.shared.metrics.running.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    fn serve(&mut self, job: Job) {
        let m = &self.shared.metrics;
        if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
            m.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self.shared.stopping.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Error {
                status: 503,
                message: "the server is shutting down".into(),
            });
            return;
        }
        if Instant::now() >= job.deadline {
            m.timeouts.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(Event::Error {
                status: 504,
                message: "the request timed out waiting for the model".into(),
            });
            return;
        }
        // A panic in the engine fails this request only; the thread keeps serving.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_job(&job)))
            .unwrap_or_else(|p| {
                let what = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(anyhow::anyhow!(
                    "internal error (model thread panicked: {what})"
                ))
            });
        if let Err(e) = outcome {
            let msg = format!("{e:#}");
            let status = if msg.contains("context limit") {
                400
            } else {
                500
            };
            tracing::error!("request failed: {msg}");
            let _ = job.events.send(Event::Error {
                status,
                message: msg,
            });
        }
    }

    fn run_job(&mut self, job: &Job) -> anyhow::Result<()> {
        let engine = self.engine;
        let shared = self.shared.clone();
        let m = &shared.metrics;
        let cfg = engine.config();
        let mut settings = job.settings.clone();
        for id in &cfg.eos_token_ids {
            if !settings.opts.stop_ids.contains(id) {
                settings.opts.stop_ids.push(*id);
            }
        }
        settings.opts.max_seq = settings.opts.max_seq.min(cfg.max_position_embeddings);
        let mut params = job.params.clone();
        params.vocab_limit = params.vocab_limit.min(cfg.vocab_size);
        let vocab_limit = params.vocab_limit;
        let prompt = &job.prompt;
        if prompt.len() >= settings.opts.max_seq {
            anyhow::bail!(
                "the prompt is {} tokens but the context limit is {} tokens",
                prompt.len(),
                settings.opts.max_seq
            );
        }

        // Resume from the longest cached prefix.
        let (mut state, cached) = match self.cache.lookup(prompt) {
            Some((n, s)) => (s.clone(), n),
            None => (engine.new_state(), 0),
        };
        if cached > 0 {
            m.cache_hits.fetch_add(1, Ordering::Relaxed);
        } else {
            m.cache_misses.fetch_add(1, Ordering::Relaxed);
        }
        let _ = job.events.send(Event::Started {
            cached_tokens: cached,
        });
        let t0 = Instant::now();

        // Prefill up to each snapshot point and save the state there.
        let mut points: Vec<usize> = job
            .snapshot_points
            .iter()
            .copied()
            .chain(
                (1..)
                    .map(|k| k * SNAPSHOT_EVERY)
                    .take_while(|&p| p < prompt.len()),
            )
            .filter(|&p| p > cached && p < prompt.len())
            .collect();
        points.sort_unstable();
        points.dedup();
        let chunk = settings.opts.prefill_chunk.max(1);
        for p in points {
            let done = engine.state_len(&state);
            for piece in prompt[done..p].chunks(chunk) {
                if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
                    m.cancelled.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                engine.forward(&mut state, piece, Logits::Last)?;
            }
            self.cache.insert(
                prompt[..p].to_vec(),
                state.clone(),
                engine.state_bytes(&state),
            );
        }
        self.publish_cache();

        // Generate.
        let in_thinking = settings
            .think_ids
            .is_some_and(|(o, c)| ends_inside_thinking(prompt, o, c));
        let mut decoder = ReplyDecoder::new(
            settings.think_ids,
            in_thinking,
            &settings.stop_strings,
            &settings.opts.stop_ids,
        );
        let tok = &shared.tokenizer;
        let decode = |ids: &[u32]| tok.decode(ids, true);
        let mut sampler = Sampler::new(params, job.seed);
        let mut reasoning_tokens = 0usize;
        let mut timed_out = false;
        let mut stopping = false;
        let mut failure = None;
        let mut last = None::<Instant>;
        let done = engine.state_len(&state);
        let generation = generate(
            engine,
            &mut state,
            &prompt[done..],
            in_thinking,
            &settings.opts,
            &mut sampler,
            &job.cancel,
            None,
            |id, logits| {
                let now = Instant::now();
                match last {
                    None => m.ttft.observe((now - t0).as_secs_f64()),
                    Some(t) => m.itl.observe((now - t).as_secs_f64()),
                }
                last = Some(now);
                if decoder.channel() == Channel::Reasoning {
                    reasoning_tokens += 1;
                }
                let hidden = settings.opts.stop_ids.contains(&id);
                let lp = job
                    .logprobs
                    .filter(|_| !hidden)
                    .map(|n| logprobs(logits, vocab_limit, id, n));
                let (pieces, stopped) = match decoder.push(id, decode) {
                    Ok(x) => x,
                    Err(e) => {
                        failure = Some(e);
                        return Some(StopReason::Cancelled);
                    }
                };
                if (!pieces.is_empty() || lp.is_some())
                    && job
                        .events
                        .send(Event::Token {
                            pieces,
                            logprobs: lp,
                        })
                        .is_err()
                {
                    return Some(StopReason::Cancelled);
                }
                if job.events.is_closed() {
                    return Some(StopReason::Cancelled);
                }
                if now >= job.deadline {
                    timed_out = true;
                    return Some(StopReason::Cancelled);
                }
                if shared.stopping.load(Ordering::SeqCst) {
                    stopping = true;
                    return Some(StopReason::Cancelled);
                }
                stopped.then_some(StopReason::StopString)
            },
        )?;
        if let Some(e) = failure {
            return Err(e);
        }
        let stats = generation.stats;
        if stats.stop != StopReason::StopString && stats.stop != StopReason::Cancelled {
            let pieces = decoder.finish(decode)?;
            if !pieces.is_empty() {
                let _ = job.events.send(Event::Token {
                    pieces,
                    logprobs: None,
                });
            }
        }
        m.prompt_tokens
            .fetch_add(prompt.len() as u64, Ordering::Relaxed);
        m.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        m.generated_tokens
            .fetch_add(stats.generated.len() as u64, Ordering::Relaxed);
        if timed_out {
            m.timeouts.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(Event::Error {
                status: 504,
                message: format!(
                    "the request timed out after {} generated tokens",
                    stats.generated.len()
                ),
            });
        } else if stopping {
            let _ = job.events.send(Event::Error {
                status: 503,
                message: "the server is shutting down".into(),
            });
        } else if stats.stop == StopReason::Cancelled {
            m.cancelled.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ = job.events.send(Event::Done {
                stop: stats.stop,
                completion_tokens: stats.generated.len(),
                reasoning_tokens,
            });
        }
        // The state after prompt + reply: the next turn of the conversation may extend it.
        if stats.prefill_complete && stats.stop != StopReason::Cancelled {
            let mut ids = prompt.clone();
            ids.extend_from_slice(stats.fed_tokens());
            if engine.state_len(&state) == ids.len() {
                let bytes = engine.state_bytes(&state);
                self.cache.insert(ids, state, bytes);
            }
        }
        self.publish_cache();
        Ok(())
    }

    fn publish_cache(&self) {
        let m = &self.shared.metrics;
        m.cache_bytes
            .store(self.cache.bytes() as u64, Ordering::Relaxed);
        m.cache_entries
            .store(self.cache.len() as u64, Ordering::Relaxed);
    }
}
