//! The model thread: takes [`Job`]s from a channel in arrival order, runs each through the
//! engine (resuming from the prefix cache), and streams [`Event`]s back to its HTTP handler.
//!
//! Engines are not `Sync` (the CUDA one keeps its workspace in a `RefCell`), so exactly one
//! thread owns the engine and the HTTP side never touches it.
//!
//! The [`Scheduler`] admits waiting jobs in arrival order up to `max_running` sequences
//! (admission = checks + prefix-cache lookup), then advances every running sequence by one
//! step per round ([`Scheduler::step`]): a prefill chunk (saving snapshots at their points)
//! or one decode token. The decoding sequences' tokens of a round then go through the model
//! together, one batched step ([`Engine::forward_batch_greedy`] for those decoded greedily on
//! the device, [`Engine::forward_batch`] for those that sample or want log-probabilities):
//! on the GPU each weight is read once for all of them.

use super::Shared;
use super::cache::PrefixCache;
use crate::cuda::GpuError;
use crate::generate::{
    Channel, DecodeLoop, GenerationStats, ReplyDecoder, ReplySettings, StopReason,
    ends_inside_thinking,
};
use crate::model::{Engine, StateMemory};
use crate::sampling::{Draw, Sampler, SamplingParams, TokenLogprobs, logprobs};
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
        /// The stop string that ended the reply (`stop` is then [`StopReason::StopString`]).
        stop_string: Option<String>,
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
    /// `prompt_cache_key`: states this request saves are tagged with it, and when the cache
    /// must evict, it evicts other keys' states before this key's.
    pub cache_key: Option<String>,
    pub events: UnboundedSender<Event>,
    /// Set when the client has gone away.
    pub cancel: Arc<AtomicBool>,
    pub deadline: Instant,
    /// When the request arrived at the server (its headers read): queue time, time to first
    /// token and end-to-end latency count from here.
    pub arrived: Instant,
    /// Where the access log reads the request's token counts.
    pub log: Option<Arc<super::access::Tokens>>,
    /// The structured-output constraint of the answer, taken by the decode loop.
    pub guide: std::sync::Mutex<Option<crate::grammar::Guide>>,
    /// Strict tools' calls, taken by the decode loop.
    pub tool_gate: std::sync::Mutex<Option<crate::grammar::ToolGate>>,
}

/// Prompt tokens between chunk-boundary snapshots of long prompts.
pub const SNAPSHOT_EVERY: usize = 2048;

/// A sequence being decoded: its job and its decoding state.
struct Running<S> {
    job: Job,
    seq: Seq<S>,
    /// Device memory it reserved ([`StateBudget`]).
    reserved: usize,
}

struct Seq<S> {
    settings: ReplySettings,
    state: S,
    sampler: Sampler,
    decoder: ReplyDecoder,
    /// Prompt lengths still to reach: snapshot points, then the whole prompt.
    points: VecDeque<usize>,
    /// `None` while the prompt is being prefilled.
    dl: Option<DecodeLoop>,
    in_thinking: bool,
    cached: usize,
    vocab_limit: usize,
    reasoning_tokens: usize,
    t0: Instant,
    last: Option<Instant>,
    /// The next id, when [`pick_all`] chose it ahead of the round's bookkeeping.
    picked: Option<u32>,
    /// The uniform of the next draw, taken from the sampler once per token (kept when a
    /// batched step fails and its rows run again).
    u: Option<f64>,
    /// The log-probabilities the device's draw reported with the next id.
    drawn_logprobs: Option<TokenLogprobs>,
}

/// What one round did with a sequence.
enum Advanced {
    /// Its prompt is being prefilled: the next piece would end at prompt position `end`
    /// (the caller runs the round's pieces together, within the round's token budget).
    Prefill { end: usize },
    /// It picked `id`, to run through the model with the round's others: greedily on the
    /// device (`greedy`, argmax below `vocab_limit`) or for its logits.
    Feed {
        id: u32,
        greedy: bool,
        vocab_limit: usize,
    },
    /// It picked an id and already ran it (MTP speculation: each such sequence runs its own
    /// draft and verification step, outside the round's batched step).
    Fed,
    /// It is done.
    End(End),
}

/// Why a sequence left the running set.
enum End {
    Stop(StopReason),
    TimedOut,
    ShuttingDown,
    Gone,
}

pub struct Scheduler<'e, E: Engine> {
    engine: &'e E,
    shared: Arc<Shared>,
    waiting: VecDeque<Job>,
    running: Vec<Running<E::State>>,
    cache: PrefixCache<E::State>,
    /// The prefix cache's byte limit (`--cache-mem`; on the GPU also what the running
    /// sequences leave).
    cache_cap: usize,
    /// Sequences decoded at once (one batched step a token).
    pub max_running: usize,
    /// Where states live in device memory: what the running sequences reserve of it.
    pub budget: Option<StateBudget>,
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> anyhow::Error {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    anyhow::anyhow!("internal error (model thread panicked: {what})")
}

/// The HTTP status of a request that failed on the model thread.
fn error_status(e: &anyhow::Error, msg: &str) -> u16 {
    if msg.contains("context limit") {
        400
    } else if matches!(GpuError::of(e), Some(GpuError::OutOfMemory { .. })) {
        503 // out of device memory for one more state: the server's limit, not the client's
    } else {
        500
    }
}

fn fail(job: &Job, e: anyhow::Error) {
    let msg = format!("{e:#}");
    let status = error_status(&e, &msg);
    tracing::error!("request failed: {msg}");
    let _ = job.events.send(Event::Error {
        status,
        message: msg,
    });
}

/// Device memory kept free beside the sequence states (cuBLAS workspaces, decode graphs,
/// the batch workspaces, the KV pool's spare pages).
pub const DEVICE_HEADROOM: usize = 1 << 30;

/// The device memory sequence states and the prefix cache's snapshots share, and how much
/// of it the running sequences have reserved.
///
/// A sequence reserves, when it is admitted, the bytes its state takes at its longest (its
/// prompt and `max_tokens`, at most the context limit: its GDN state and the KV blocks of that
/// many positions), and returns them when it leaves; it maps its KV blocks as it fills them, so a
/// reply that stops early never held the rest. The prefix cache's snapshots live in what
/// no running sequence reserved: admission evicts them (least recently used first) before it
/// makes a request wait. A request that does not fit waits in the queue for running ones
/// to finish; admission never overcommits, so a step cannot run out of device memory.
#[derive(Clone, Copy, Debug)]
pub struct StateBudget {
    pub mem: StateMemory,
    /// Bytes states and snapshots may take in all: what was free after the weights, less
    /// [`DEVICE_HEADROOM`].
    pub total: usize,
    /// Bytes the running sequences have reserved.
    pub reserved: usize,
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl StateBudget {
    /// The budget of device memory `mem`, where one sequence may hold up to `max_seq`
    /// positions: an error with the numbers if not even one such sequence fits.
    pub fn new(mem: StateMemory, max_seq: usize) -> anyhow::Result<Self> {
        let total = mem.free.saturating_sub(DEVICE_HEADROOM);
        let one = mem.bytes_for(max_seq);
        if one > total {
            anyhow::bail!(
                "not enough GPU memory for one sequence of --max-seq {max_seq}: its state takes {:.2} GiB (GDN state {:.0} MiB + {} KV blocks of {:.0} MiB), {:.2} GiB is free after the weights and {:.2} GiB is kept as headroom; lower --max-seq",
                gib(one),
                mem.fixed as f64 / (1u64 << 20) as f64,
                mem.blocks_for(max_seq),
                mem.block_bytes as f64 / (1u64 << 20) as f64,
                gib(mem.free),
                gib(DEVICE_HEADROOM)
            );
        }
        Ok(StateBudget {
            mem,
            total,
            reserved: 0,
        })
    }

    /// What a sequence of `tokens` positions at its longest reserves.
    pub fn need(&self, tokens: usize) -> usize {
        self.mem.bytes_for(tokens)
    }

    /// Bytes no running sequence has reserved (the prefix cache's at most).
    pub fn unreserved(&self) -> usize {
        self.total.saturating_sub(self.reserved)
    }

    /// Sequences of `tokens` positions each that fit at once.
    pub fn sequences_of(&self, tokens: usize) -> usize {
        self.total / self.need(tokens).max(1)
    }

    /// The startup line: what the budget holds.
    pub fn describe(&self, max_seq: usize) -> String {
        let m = &self.mem;
        format!(
            "{:.2} GiB of GPU memory for sequence states and the prefix cache ({:.2} GiB free after the weights, {:.2} GiB headroom): {:.1} MiB of GDN state a sequence, KV paged in blocks of {} positions ({:.0} MiB each), reserved per request for prompt + max_tokens; {} sequences of 4,096 positions or {} of --max-seq {max_seq} fit at once",
            gib(self.total),
            gib(m.free),
            gib(DEVICE_HEADROOM),
            m.fixed as f64 / (1u64 << 20) as f64,
            m.block_tokens,
            m.block_bytes as f64 / (1u64 << 20) as f64,
            self.sequences_of(4096),
            self.sequences_of(max_seq),
        )
    }
}

/// The most sequences the default `--max-running` takes (where aggregate decode throughput
/// has grown flat on the H200: 2,963 tok/s at 64 streams of the full model); how many run at
/// once below it follows the memory the requests reserve ([`StateBudget`]).
pub const MAX_RUNNING_DEFAULT: usize = 64;

impl<'e, E: Engine> Scheduler<'e, E> {
    /// A scheduler whose prefix cache holds at most `cache_cap` bytes of snapshots.
    pub fn new(engine: &'e E, shared: Arc<Shared>, cache_cap: usize) -> Self {
        let cap = cache_cap;
        let max_running = shared.config.max_running.unwrap_or(4).max(1);
        Scheduler {
            engine,
            shared,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: PrefixCache::new(cap),
            cache_cap: cap,
            max_running,
            budget: None,
        }
    }

    /// Device memory `job` reserves when it is admitted: its state at its longest (0 where
    /// states live in host memory, and for a job admission will only report on).
    fn reservation(&self, job: &Job) -> usize {
        let Some(b) = &self.budget else { return 0 };
        if job.cancel.load(Ordering::SeqCst)
            || job.events.is_closed()
            || self.shared.stopping.load(Ordering::SeqCst)
            || Instant::now() >= job.deadline
        {
            return 0;
        }
        let limit = job
            .settings
            .opts
            .max_seq
            .min(self.engine.config().max_position_embeddings);
        if job.prompt.is_empty() || job.prompt.len() >= limit {
            return 0; // refused by `admit`
        }
        b.need((job.prompt.len() + job.settings.opts.max_tokens).min(limit))
    }

    /// Makes `need` bytes free for `prompt`'s sequence: evicts cached snapshots, least
    /// recently used first (those a prefix of `prompt` last), until the running sequences'
    /// reservations, the cache and `need` fit the budget. `false`: they do not even with
    /// the cache empty (the job waits for running sequences to finish).
    fn make_room(&mut self, need: usize, prompt: &[u32]) -> bool {
        let Some(b) = self.budget else { return true };
        if need == 0 {
            return true;
        }
        if b.reserved + need > b.total {
            // Nothing running: it is admitted anyway (it fits alone, `StateBudget::new`).
            return self.running.is_empty();
        }
        while b.reserved + need + self.cache.bytes() > b.total {
            if !self.cache.evict_lru(prompt) {
                break;
            }
        }
        self.publish_cache();
        true
    }

    /// Reserves (`sign` 1) or returns (`sign` -1) `bytes` of the budget, and sets the
    /// cache's limit to what the running sequences leave.
    fn reserve(&mut self, bytes: usize, sign: i8) {
        let Some(b) = &mut self.budget else { return };
        if sign > 0 {
            b.reserved += bytes;
        } else {
            b.reserved = b.reserved.saturating_sub(bytes);
        }
        let cap = self.cache_cap.min(b.unreserved());
        self.cache.set_capacity(cap);
        self.publish_cache();
    }

    /// Takes running sequence `i` out of the running set, returning its reservation.
    fn leave(&mut self, i: usize) -> Running<E::State> {
        let r = self.running.remove(i);
        self.shared.metrics.running.fetch_sub(1, Ordering::Relaxed);
        self.reserve(r.reserved, -1);
        r
    }

    /// Serves jobs until every sender is gone and nothing is left to do.
    pub fn run(mut self, rx: Receiver<Job>) {
        self.shared.ready.store(true, Ordering::SeqCst);
        loop {
            if self.waiting.is_empty() && self.running.is_empty() {
                match rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(job) => self.waiting.push_back(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(job) = rx.try_recv() {
                self.waiting.push_back(job);
            }
            let (t_admit, before) = (Instant::now(), self.running.len());
            while self.running.len() < self.max_running {
                let Some(job) = self.waiting.pop_front() else {
                    break;
                };
                // It waits (first in line) until the memory its state may take is free.
                let need = self.reservation(&job);
                if !self.make_room(need, &job.prompt) {
                    self.waiting.push_front(job);
                    break;
                }
                let shared = self.shared.clone();
                let m = &shared.metrics;
                m.queue_depth.fetch_sub(1, Ordering::Relaxed);
                // A panic in the engine fails this request only; the thread keeps serving.
                let admitted =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.admit(&job)))
                        .unwrap_or_else(|p| Err(panic_message(p)));
                match admitted {
                    Ok(Some(seq)) => {
                        self.reserve(need, 1);
                        self.running.push(Running {
                            job,
                            seq,
                            reserved: need,
                        });
                        m.running.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(None) => {}
                    Err(e) => fail(&job, e),
                }
            }
            if self.running.len() > before {
                tracing::debug!(
                    "admitted {} in {:.1} ms",
                    self.running.len() - before,
                    t_admit.elapsed().as_secs_f64() * 1e3
                );
            }
            self.step();
        }
    }

    /// Checks a job, resumes it from the cache and prefills its prompt. `None`: nothing to
    /// run (the reason was reported).
    fn admit(&mut self, job: &Job) -> anyhow::Result<Option<Seq<E::State>>> {
        let m = &self.shared.metrics;
        if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
            m.cancelled.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        if self.shared.stopping.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Error {
                status: 503,
                message: "the server is shutting down".into(),
            });
            return Ok(None);
        }
        if Instant::now() >= job.deadline {
            m.timeouts.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(Event::Error {
                status: 504,
                message: "the request timed out waiting for the model".into(),
            });
            return Ok(None);
        }
        let engine = self.engine;
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
        if prompt.is_empty() || prompt.len() >= settings.opts.max_seq {
            anyhow::bail!(
                "the prompt is {} tokens but the context limit is {} tokens",
                prompt.len(),
                settings.opts.max_seq
            );
        }

        // Resume from the longest cached prefix.
        let (state, cached) = match self.cache.lookup(prompt) {
            Some((n, s)) => (s.clone(), n),
            None => (engine.new_state()?, 0),
        };
        if cached > 0 {
            m.cache_hits.fetch_add(1, Ordering::Relaxed);
        } else {
            m.cache_misses.fetch_add(1, Ordering::Relaxed);
        }
        m.queue_time.observe(job.arrived.elapsed().as_secs_f64());
        let _ = job.events.send(Event::Started {
            cached_tokens: cached,
        });
        let t0 = Instant::now();

        // Snapshot points (the prefill itself runs in `advance`, a chunk per round).
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
        points.push(prompt.len());

        let in_thinking = settings
            .think_ids
            .is_some_and(|(o, c)| ends_inside_thinking(prompt, o, c));
        let decoder = ReplyDecoder::new(
            settings.think_ids,
            in_thinking,
            &settings.stop_strings,
            &settings.opts.stop_ids,
        );
        Ok(Some(Seq {
            settings,
            state,
            sampler: Sampler::new(params, job.seed),
            decoder,
            points: points.into(),
            dl: None,
            in_thinking,
            cached,
            vocab_limit,
            reasoning_tokens: 0,
            t0,
            last: None,
            picked: None,
            u: None,
            drawn_logprobs: None,
        }))
    }

    /// One round: every running sequence, in admission order, runs a prefill chunk or picks
    /// and reports its next token; finished ones leave; then the picked tokens go through the
    /// model in one batched step per kind ([`Scheduler::feed`]).
    pub fn step(&mut self) {
        let start = Instant::now();
        let mut feeds = Vec::new();
        // (running index, prompt position, the piece's end) of each sequence prefilling
        let mut wants = Vec::new();
        pick_all(&mut self.running);
        let mut i = 0;
        while i < self.running.len() {
            let Running { job, seq, .. } = &mut self.running[i];
            let (engine, shared) = (self.engine, &self.shared);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                advance(engine, shared, job, seq)
            }))
            .unwrap_or_else(|p| Err(panic_message(p)));
            match outcome {
                Ok(Advanced::Prefill { end }) => {
                    let done = self.engine.state_len(&self.running[i].seq.state);
                    wants.push((i, done, end));
                    i += 1;
                }
                Ok(Advanced::Feed {
                    id,
                    greedy,
                    vocab_limit,
                }) => {
                    feeds.push((i, id, greedy, vocab_limit));
                    i += 1;
                }
                Ok(Advanced::Fed) => i += 1,
                Ok(Advanced::End(end)) => {
                    let r = self.leave(i);
                    self.finish(r, end);
                }
                Err(e) => {
                    let r = self.leave(i);
                    fail(&r.job, e);
                }
            }
        }
        // Prefill pieces first (together), then the decode step; both only report failures,
        // so the indices stay valid until the failed sequences leave, last index first.
        // Prompt tokens a round prefills at most: the running sequences' next token waits for
        // at most this much prefill.
        let prefills = share_prefill(&wants, self.shared.config.prefill_chunk.max(1));
        let (t0, rows, pieces) = (Instant::now(), feeds.len(), prefills.len());
        let prefill_tokens: usize = prefills.iter().map(|p| p.1).sum::<usize>()
            - wants
                .iter()
                .filter(|w| prefills.iter().any(|p| p.0 == w.0))
                .map(|w| w.1)
                .sum::<usize>();
        let mut failed = self.prefill(prefills);
        let t1 = Instant::now();
        failed.extend(self.feed(feeds));
        tracing::debug!(
            "round: picks {:.1} ms, {pieces} prefill pieces ({prefill_tokens} tokens) {:.1} ms, {rows} decode rows {:.1} ms, {} running, {} waiting",
            (t0 - start).as_secs_f64() * 1e3,
            (t1 - t0).as_secs_f64() * 1e3,
            t1.elapsed().as_secs_f64() * 1e3,
            self.running.len(),
            self.waiting.len()
        );
        failed.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, e) in failed {
            let r = self.leave(i);
            fail(&r.job, e);
        }
        if let Some(used) = self.engine.kv_blocks_in_use() {
            let m = &self.shared.metrics;
            m.kv_blocks_used.store(used as u64, Ordering::Relaxed);
        }
    }

    /// Runs the round's prefill pieces (`(running index, prompt end)`, ascending) in one
    /// [`Engine::forward_many`], then saves the snapshots and starts the decode loops of the
    /// completed prompts. Where the call fails, the pieces run one by one, so that only a
    /// sequence that fails alone fails: returned (running index, error) for [`Self::step`].
    fn prefill(&mut self, pieces: Vec<(usize, usize)>) -> Vec<(usize, anyhow::Error)> {
        if pieces.is_empty() {
            return Vec::new();
        }
        let engine = self.engine;
        let mut run = |rows: &[(usize, usize)]| -> anyhow::Result<Vec<Vec<f32>>> {
            let mut seqs: Vec<&mut Running<E::State>> = self
                .running
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| rows.iter().any(|r| r.0 == *i))
                .map(|(_, r)| r)
                .collect();
            let (pieces, mut states): (Vec<&[u32]>, Vec<&mut E::State>) = seqs
                .iter_mut()
                .zip(rows)
                .map(|(r, &(_, end))| {
                    let Running { job, seq, .. } = &mut **r;
                    let done = engine.state_len(&seq.state);
                    (&job.prompt[done..end], &mut seq.state)
                })
                .unzip();
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.forward_many(&mut states, &pieces)
            }))
            .unwrap_or_else(|p| Err(panic_message(p)))
        };
        let mut done: Vec<(usize, anyhow::Result<Vec<f32>>)> = match run(&pieces) {
            Ok(logits) => pieces
                .iter()
                .map(|p| p.0)
                .zip(logits.into_iter().map(Ok))
                .collect(),
            Err(e) => {
                tracing::warn!(
                    "a batched prefill of {} sequences failed ({e:#}); running them one by one",
                    pieces.len()
                );
                pieces
                    .iter()
                    .map(|&p| (p.0, run(&[p]).map(|mut l| l.remove(0))))
                    .collect()
            }
        };
        let mut failed = Vec::new();
        for (i, logits) in done.drain(..) {
            let Running { job, seq, .. } = &mut self.running[i];
            let r =
                logits.and_then(|l| prefilled(engine, &self.shared, &mut self.cache, job, seq, l));
            if let Err(e) = r {
                failed.push((i, e));
            }
        }
        failed
    }

    /// Runs the round's picked tokens (`(running index, id, greedy, vocab limit)`) through the
    /// model in one batched step: where every row is greedy (an argmax, no logprobs), one
    /// greedy step per vocabulary limit; otherwise one step that draws every row's next id
    /// on the device ([`Engine::forward_batch_draw`]). Where a batched step fails, its rows
    /// run one by one, so that only a sequence that fails alone fails: returned (running
    /// index, error) for [`Self::step`].
    fn feed(&mut self, feeds: Vec<(usize, u32, bool, usize)>) -> Vec<(usize, anyhow::Error)> {
        let mut groups: Vec<Option<usize>> = if feeds.iter().all(|f| f.2) {
            feeds.iter().map(|f| Some(f.3)).collect()
        } else {
            vec![None]
        };
        groups.sort_unstable();
        groups.dedup();
        let mut failed: Vec<(usize, anyhow::Error)> = Vec::new();
        for greedy in groups {
            let rows: Vec<(usize, u32)> = feeds
                .iter()
                .filter(|f| greedy.is_none() || greedy == Some(f.3))
                .map(|f| (f.0, f.1))
                .collect();
            if let Err(e) = self.feed_rows(&rows, greedy) {
                tracing::warn!(
                    "a batched step of {} sequences failed ({e:#}); running them one by one",
                    rows.len()
                );
                for &row in &rows {
                    if let Err(e) = self.feed_rows(&[row], greedy) {
                        failed.push((row.0, e));
                    }
                }
            }
        }
        failed
    }

    /// One batched step of `rows` (`(running index, id)`, indices ascending): each row's state
    /// advances by its id and its decode loop gets the next id, the device's argmax below the
    /// limit (`greedy`) or each row's draw.
    fn feed_rows(&mut self, rows: &[(usize, u32)], greedy: Option<usize>) -> anyhow::Result<()> {
        let engine = self.engine;
        let ids: Vec<u32> = rows.iter().map(|r| r.1).collect();
        let mut seqs: Vec<(&Job, &mut Seq<E::State>)> = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| rows.iter().any(|r| r.0 == *i))
            .map(|(_, r)| (&r.job, &mut r.seq))
            .collect();
        if greedy.is_none() {
            for (_, s) in seqs.iter_mut() {
                if s.u.is_none() {
                    s.u = Some(s.sampler.uniform());
                }
            }
        }
        let out = {
            let mut states = Vec::with_capacity(seqs.len());
            let mut draws = Vec::with_capacity(seqs.len());
            for (job, s) in seqs.iter_mut() {
                let Seq {
                    state,
                    sampler,
                    dl,
                    settings,
                    u,
                    ..
                } = &mut **s;
                let opts = &settings.opts;
                // The thinking budget may replace the drawn id by a forced one, whose
                // log-probability needs the logits; the test oracle keeps every row's
                // logits on the host.
                let forced_maybe = opts.thinking.as_ref().is_some_and(|t| t.budget.is_some());
                draws.push(Draw {
                    params: sampler.params(),
                    u: u.unwrap_or(0.0),
                    history: dl.as_ref().map_or(&[][..], |d| &d.stats.generated[..]),
                    top_logprobs: job.logprobs,
                    want_logits: !opts.device_greedy || (forced_maybe && job.logprobs.is_some()),
                    mask: dl.as_ref().and_then(|d| d.next_mask()),
                });
                states.push(state);
            }
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match greedy {
                Some(limit) => engine
                    .forward_batch_greedy(&mut states, &ids, limit)
                    .map(|n| n.into_iter().map(|id| (id, None, None)).collect::<Vec<_>>()),
                None => engine
                    .forward_batch_draw(&mut states, &ids, &draws)
                    .map(|d| {
                        d.into_iter()
                            .map(|d| (d.id, d.logprobs, d.logits))
                            .collect::<Vec<_>>()
                    }),
            }))
            .unwrap_or_else(|p| Err(panic_message(p)))
        };
        let next = out?;
        for ((_, s), (id, lp, logits)) in seqs.iter_mut().zip(next) {
            s.u = None;
            s.drawn_logprobs = lp;
            let Some(dl) = &mut s.dl else { continue };
            dl.set_drawn(id, logits);
        }
        Ok(())
    }

    /// Reports how `r` (out of the running set, [`Self::leave`]) ended; a finished reply's
    /// state goes to the prefix cache.
    fn finish(&mut self, r: Running<E::State>, end: End) {
        let m = &self.shared.metrics;
        let Running {
            job,
            seq:
                Seq {
                    mut state,
                    mut decoder,
                    mut dl,
                    reasoning_tokens,
                    cached,
                    ..
                },
            ..
        } = r;
        let stop = match end {
            End::Stop(s) => s,
            _ => StopReason::Cancelled,
        };
        if let Some(c) = dl.as_ref().map(|d| d.mask_cost).filter(|c| c.masks > 0) {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            tracing::info!(
                "structured output: {} masks, compute mean {:.3} ms, draw waited mean {:.3} ms max {:.3} ms",
                c.masks,
                ms(c.compute) / c.masks as f64,
                ms(c.waited) / c.masks as f64,
                ms(c.max_waited)
            );
        }
        // Tokens a speculative step ran beyond the reply's end are rolled back, so the state
        // holds prompt + reply as the prefix cache expects.
        if let Some(d) = dl.as_mut()
            && let Err(e) = d.settle(self.engine, &mut state)
        {
            tracing::warn!("rolling back a speculative step failed: {e:#}");
        }
        let stats = match dl {
            Some(dl) => dl.finish(stop),
            // stopped during the prefill
            None => GenerationStats {
                prompt_tokens: job.prompt.len(),
                cached_tokens: cached,
                generated: Vec::new(),
                forced_tokens: 0,
                time_to_first_token: Duration::ZERO,
                decode_time: Duration::ZERO,
                stop,
                prefill_complete: false,
                spec: Default::default(),
            },
        };
        if matches!(end, End::Stop(s) if s != StopReason::StopString) {
            let tok = &self.shared.tokenizer;
            match decoder.finish(|ids: &[u32]| tok.decode(ids, true)) {
                Ok(pieces) if !pieces.is_empty() => {
                    let _ = job.events.send(Event::Token {
                        pieces,
                        logprobs: None,
                    });
                }
                Ok(_) => {}
                Err(e) => return fail(&job, e),
            }
        }
        m.e2e.observe(job.arrived.elapsed().as_secs_f64());
        if let Some(log) = &job.log {
            log.set(stats.prompt_tokens, stats.generated.len());
        }
        m.prompt_tokens
            .fetch_add(stats.prompt_tokens as u64, Ordering::Relaxed);
        m.cached_tokens
            .fetch_add(stats.cached_tokens as u64, Ordering::Relaxed);
        m.generated_tokens
            .fetch_add(stats.generated.len() as u64, Ordering::Relaxed);
        m.spec_steps
            .fetch_add(stats.spec.steps as u64, Ordering::Relaxed);
        m.spec_drafted
            .fetch_add(stats.spec.drafted as u64, Ordering::Relaxed);
        m.spec_accepted
            .fetch_add(stats.spec.accepted as u64, Ordering::Relaxed);
        match end {
            End::TimedOut => {
                m.timeouts.fetch_add(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Error {
                    status: 504,
                    message: format!(
                        "the request timed out after {} generated tokens",
                        stats.generated.len()
                    ),
                });
            }
            End::ShuttingDown => {
                let _ = job.events.send(Event::Error {
                    status: 503,
                    message: "the server is shutting down".into(),
                });
            }
            End::Gone => {
                m.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            End::Stop(stop) => {
                let _ = job.events.send(Event::Done {
                    stop,
                    completion_tokens: stats.generated.len(),
                    reasoning_tokens,
                    stop_string: decoder.stop_matched().map(str::to_string),
                });
                // The state after prompt + reply: the next turn of the conversation may
                // extend it.
                let mut ids = job.prompt.clone();
                ids.extend_from_slice(stats.fed_tokens());
                if self.engine.state_len(&state) == ids.len() {
                    let bytes = self.engine.state_bytes(&state);
                    self.cache
                        .insert(ids, state, bytes, job.cache_key.as_deref());
                }
            }
        }
        self.publish_cache();
    }

    fn publish_cache(&self) {
        let m = &self.shared.metrics;
        m.cache_bytes
            .store(self.cache.bytes() as u64, Ordering::Relaxed);
        m.cache_entries
            .store(self.cache.len() as u64, Ordering::Relaxed);
        if let Some(b) = &self.budget {
            let block = b.mem.block_bytes.max(1);
            let free = b.unreserved().saturating_sub(self.cache.bytes()) / block;
            m.kv_blocks_free.store(free as u64, Ordering::Relaxed);
            m.kv_blocks_reserved
                .store((b.reserved / block) as u64, Ordering::Relaxed);
            m.kv_paged.store(true, Ordering::Relaxed);
        }
        if let Some(used) = self.engine.kv_blocks_in_use() {
            m.kv_blocks_used.store(used as u64, Ordering::Relaxed);
        }
    }
}

/// A round's prefill: of `budget` prompt tokens, the oldest prefilling sequence (the first of
/// `wants`, `(running index, prompt position, piece end)` in admission order) is sure of a
/// quarter, then the others get their pieces shortest first, then the oldest the rest. So a
/// short prompt arriving behind a long one is prefilled in the next round instead of after
/// the whole long prompt, and a stream of short prompts cannot starve the long one. Returns
/// `(running index, piece end)` ascending, the pieces that got tokens.
fn share_prefill(wants: &[(usize, usize, usize)], budget: usize) -> Vec<(usize, usize)> {
    let Some(&(_, done0, end0)) = wants.first() else {
        return Vec::new();
    };
    let mut given = vec![0usize; wants.len()];
    given[0] = (end0 - done0).min(budget.div_ceil(4));
    let mut left = budget - given[0];
    let mut order: Vec<usize> = (1..wants.len()).collect();
    order.sort_by_key(|&k| (wants[k].2 - wants[k].1, k));
    for k in order {
        let n = (wants[k].2 - wants[k].1).min(left);
        given[k] = n;
        left -= n;
    }
    given[0] += (end0 - done0 - given[0]).min(left);
    wants
        .iter()
        .zip(given)
        .filter(|(_, n)| *n > 0)
        .map(|(w, n)| (w.0, w.1 + n))
        .collect()
}

/// Sampling rows of a round below which [`pick_all`] leaves the picks to [`advance`].
const PARALLEL_PICKS_MIN: usize = 4;

/// Picks the next id of every decoding sequence that samples on the host (its logits came
/// back), on several threads at once: each sequence's sampler is its own, so the ids are the
/// ones it would pick alone, and a round of 64 sampled rows (a vocabulary-wide top-k scan
/// each) does not wait for them one after another.
fn pick_all<S>(running: &mut [Running<S>]) {
    // (decode loop, options, sampler, where the id goes) of each sequence that samples
    let mut rows: Vec<_> = running
        .iter_mut()
        .filter_map(|r| {
            let Seq {
                dl: Some(dl),
                settings,
                sampler,
                picked,
                ..
            } = &mut r.seq
            else {
                return None;
            };
            (!dl.logits.is_empty() && picked.is_none()).then_some((
                dl,
                &settings.opts,
                sampler,
                picked,
            ))
        })
        .collect();
    if rows.len() < PARALLEL_PICKS_MIN {
        return;
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8);
    let per = rows.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for part in rows.chunks_mut(per) {
            scope.spawn(move || {
                for (dl, opts, sampler, picked) in part {
                    **picked = Some(dl.pick(opts, sampler));
                }
            });
        }
    });
}

/// After a prefill piece of `job`'s sequence `r` ran (`logits`: its last position's): at a
/// snapshot point the state goes to the prefix cache; at the prompt's end the decode loop
/// starts.
fn prefilled<E: Engine>(
    engine: &E,
    shared: &Shared,
    cache: &mut PrefixCache<E::State>,
    job: &Job,
    r: &mut Seq<E::State>,
    logits: Vec<f32>,
) -> anyhow::Result<()> {
    let m = &shared.metrics;
    let prompt = &job.prompt;
    let p = *r.points.front().unwrap_or(&prompt.len());
    if engine.state_len(&r.state) != p {
        return Ok(());
    }
    r.points.pop_front();
    // What the snapshot holds (on the GPU its KV only as far as it is filled, sharing the
    // state's full blocks); not taken where the cache could not keep it.
    if p < prompt.len() && engine.state_bytes(&r.state) <= cache.capacity() {
        let snapshot = r.state.clone();
        let bytes = engine.state_bytes(&snapshot);
        cache.insert(
            prompt[..p].to_vec(),
            snapshot,
            bytes,
            job.cache_key.as_deref(),
        );
        m.cache_bytes.store(cache.bytes() as u64, Ordering::Relaxed);
        m.cache_entries.store(cache.len() as u64, Ordering::Relaxed);
    } else if p == prompt.len() {
        let stats = GenerationStats {
            prompt_tokens: prompt.len(),
            cached_tokens: r.cached,
            generated: Vec::new(),
            forced_tokens: 0,
            time_to_first_token: Duration::ZERO,
            decode_time: Duration::ZERO,
            stop: StopReason::Cancelled,
            prefill_complete: true,
            spec: Default::default(),
        };
        let mut dl = DecodeLoop::new(stats, r.in_thinking, logits, r.t0);
        if let Some(g) = job.guide.lock().unwrap_or_else(|p| p.into_inner()).take() {
            dl.constrain(g);
        }
        if let Some(t) = job
            .tool_gate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            dl.constrain_tools(t);
        }
        r.dl = Some(dl);
    }
    Ok(())
}

/// One round of `job`'s sequence `r`: a prefill chunk, or pick a token, report it and check
/// the limits (the caller then runs the token through the model with the round's others).
fn advance<E: Engine>(
    engine: &E,
    shared: &Shared,
    job: &Job,
    r: &mut Seq<E::State>,
) -> anyhow::Result<Advanced> {
    let m = &shared.metrics;
    let opts = &r.settings.opts;
    if job.events.is_closed() || job.cancel.load(Ordering::SeqCst) {
        return Ok(Advanced::End(End::Gone));
    }
    let Some(dl) = &mut r.dl else {
        // Prefill: a piece per round (with the round's other sequences' pieces), so running
        // sequences keep decoding meanwhile.
        if Instant::now() >= job.deadline {
            return Ok(Advanced::End(End::TimedOut));
        }
        if shared.stopping.load(Ordering::SeqCst) {
            return Ok(Advanced::End(End::ShuttingDown));
        }
        let done = engine.state_len(&r.state);
        let p = *r.points.front().unwrap_or(&job.prompt.len());
        return Ok(Advanced::Prefill {
            end: p.min(done + opts.prefill_chunk.max(1)),
        });
    };
    let id = match r.picked.take() {
        Some(id) => id,
        None => dl.pick(opts, &mut r.sampler),
    };
    let now = Instant::now();
    match r.last {
        None => {
            m.ttft.observe((now - job.arrived).as_secs_f64());
            m.ttft_admitted.observe((now - r.t0).as_secs_f64());
        }
        Some(t) => m.itl.observe((now - t).as_secs_f64()),
    }
    r.last = Some(now);
    if r.decoder.channel() == Channel::Reasoning {
        r.reasoning_tokens += 1;
    }
    let hidden = opts.stop_ids.contains(&id);
    // The device's draw reported them with its id; a forced id (or the first one, from the
    // prefill's logits) takes them from the logits.
    let drawn = r.drawn_logprobs.take().filter(|lp| lp.id == id);
    let lp = job
        .logprobs
        .filter(|_| !hidden)
        .map(|n| drawn.unwrap_or_else(|| logprobs(&dl.logits, r.vocab_limit, id, n)));
    let tok = &shared.tokenizer;
    let (pieces, stopped) = r.decoder.push(id, |ids: &[u32]| tok.decode(ids, true))?;
    if (!pieces.is_empty() || lp.is_some())
        && job
            .events
            .send(Event::Token {
                pieces,
                logprobs: lp,
            })
            .is_err()
    {
        return Ok(Advanced::End(End::Gone));
    }
    if job.events.is_closed() || job.cancel.load(Ordering::SeqCst) {
        return Ok(Advanced::End(End::Gone));
    }
    if now >= job.deadline {
        return Ok(Advanced::End(End::TimedOut));
    }
    if shared.stopping.load(Ordering::SeqCst) {
        return Ok(Advanced::End(End::ShuttingDown));
    }
    if stopped {
        return Ok(Advanced::End(End::Stop(StopReason::StopString)));
    }
    if let Some(stop) = dl.check(opts, engine.state_len(&r.state)) {
        return Ok(Advanced::End(End::Stop(stop)));
    }
    if dl.speculates_next(opts) {
        dl.feed(engine, &mut r.state, id, opts, &mut r.sampler)?;
        return Ok(Advanced::Fed);
    }
    // logprobs need the logits; a constrained id is drawn under its mask
    let greedy = opts.device_greedy
        && job.logprobs.is_none()
        && r.sampler.is_plain_greedy()
        && dl.next_mask().is_none();
    Ok(Advanced::Feed {
        id,
        greedy,
        vocab_limit: r.vocab_limit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    #[test]
    fn gpu_out_of_memory_is_503_and_found_through_context() {
        let oom = anyhow::Error::from(GpuError::OutOfMemory {
            bytes: 3 * GIB / 2,
            driver: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        })
        .context("allocating a sequence state");
        let msg = format!("{oom:#}");
        assert!(
            msg.contains("GPU out of memory allocating 1.50 GiB"),
            "{msg}"
        );
        assert_eq!(error_status(&oom, &msg), 503);
        let other = anyhow::Error::from(GpuError::Driver {
            op: "device copy",
            driver: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
        });
        assert_eq!(error_status(&other, &format!("{other:#}")), 500);
        let limit = anyhow::anyhow!("the prompt is 9 tokens but the context limit is 8 tokens");
        assert_eq!(error_status(&limit, &format!("{limit:#}")), 400);
    }

    /// The full model's state memory (bf16 KV of 10 attention layers, 2,048-position blocks
    /// of 40 MiB, ~63 MiB of GDN state) with `free` bytes free.
    fn full(free: usize) -> StateMemory {
        StateMemory {
            free,
            fixed: 63 << 20,
            block_bytes: 40 << 20,
            block_tokens: 2048,
        }
    }

    #[test]
    fn a_round_shares_its_prefill_budget_shortest_first_oldest_assured() {
        // (running index, position, piece end)
        // a long prompt first: alone it takes the whole budget
        assert_eq!(share_prefill(&[(0, 0, 30_000)], 8192), vec![(0, 8192)]);
        // two short prompts behind it: both whole, the long one the rest
        assert_eq!(
            share_prefill(&[(0, 8192, 30_000), (2, 0, 300), (3, 0, 40)], 8192),
            vec![(0, 8192 + 8192 - 340), (2, 300), (3, 40)]
        );
        // many short ones: the oldest keeps its quarter; shortest first, the last cut
        let wants: Vec<_> = (0..10)
            .map(|i| (i, 0, if i == 0 { 9000 } else { 1000 + i }))
            .collect();
        let got = share_prefill(&wants, 8192);
        assert_eq!(got[0], (0, 2048));
        assert_eq!(
            &got[1..6],
            &[(1, 1001), (2, 1002), (3, 1003), (4, 1004), (5, 1005)][..]
        );
        assert_eq!(got[6], (6, 1006));
        assert_eq!(got[7], (7, 8192 - 2048 - 5015 - 1006));
        assert_eq!(got.len(), 8);
        // every piece within its want, the total within the budget
        let total: usize = got.iter().map(|g| g.1 - wants[g.0].1).sum();
        assert_eq!(total, 8192);
        // a short oldest prompt takes only what it wants; nothing prefilling, nothing run
        assert_eq!(
            share_prefill(&[(1, 5, 9), (4, 0, 3)], 8192),
            vec![(1, 9), (4, 3)]
        );
        assert!(share_prefill(&[], 8192).is_empty());
    }

    #[test]
    fn state_budget_sizes_sequences_by_their_tokens() {
        let b = StateBudget::new(full(71 * GIB), 262_144).unwrap();
        assert_eq!(b.total, 70 * GIB);
        // 4,096 positions: 2 blocks + the GDN state
        assert_eq!(b.need(4096), (63 << 20) + 2 * (40 << 20));
        assert_eq!(b.need(4097), (63 << 20) + 3 * (40 << 20));
        assert_eq!(b.sequences_of(4096), 70 * 1024 / (63 + 80));
        // a whole 262,144-position sequence: 128 blocks, 5.06 GiB; 13 fit
        assert_eq!(b.sequences_of(262_144), 13);
        let line = b.describe(262_144);
        assert!(
            line.contains("blocks of 2048 positions (40 MiB each)"),
            "{line}"
        );
        assert!(
            line.contains("501 sequences of 4,096 positions or 13 of --max-seq 262144"),
            "{line}"
        );
    }

    #[test]
    fn state_budget_refuses_a_card_too_small_for_one_sequence() {
        // 4 GiB free, 1 GiB headroom: a 262,144-position sequence (5.06 GiB) does not fit
        let e = StateBudget::new(full(4 * GIB), 262_144)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--max-seq 262144") && e.contains("lower --max-seq"),
            "{e}"
        );
        assert!(
            e.contains("128 KV blocks of 40 MiB") && e.contains("4.00 GiB is free"),
            "{e}"
        );
        assert!(StateBudget::new(full(4 * GIB), 32_768).is_ok());
    }
}
