//! `kestrel serve`: an OpenAI- and Anthropic-compatible HTTP server (axum on tokio).
//!
//! The HTTP side validates and tokenizes requests, then hands each one as a [`worker::Job`]
//! to the model thread ([`run_model`]), which owns the engine and streams [`worker::Event`]s
//! back. Handlers never touch the engine, so a slow generation never blocks `/health`,
//! `/metrics` or the validation of other requests.
//!
//! Endpoints: `GET /health` and `GET /ready` (readiness: 503 while loading or draining),
//! `GET /live` (liveness), `GET /get_load`, `GET /v1/models`, `GET /v1/models/{id}`,
//! `GET /metrics`, `POST /v1/chat/completions`, `POST /v1/chat/completions/render` (the
//! prompt's token ids, for cache-aware routers), `POST /v1/completions`, `POST /v1/messages`
//! and `/v1/messages/count_tokens` (Anthropic), `POST /tokenize` and `/detokenize`
//! (llama.cpp's shapes). Wire formats are in [`api`]. [`drain`] is the graceful stop routers
//! need; [`serve`] runs the accept loop it stops.
//!
//! Files: `conn` (the accept loop: timeouts and the connection cap), `cors` (the CORS
//! policy), `access` (the access log and each request's arrival time), `http` (auth, body checks, JSON / SSE / error responses, the small endpoints),
//! `chat` and `completions` (the OpenAI POST endpoints), `messages` (Anthropic's, on the chat
//! path), `tokens` (tokenize / detokenize), `submit` (queueing a job for the model thread and
//! reading its events), [`worker`] (the model thread), [`cache`] (the prefix cache),
//! [`metrics`].

mod access;
pub mod api;
pub mod cache;
mod chat;
mod completions;
mod conn;
mod cors;
mod http;
mod messages;
pub mod metrics;
mod submit;
mod tokens;
pub mod worker;

use crate::config::GenerationConfig;
use crate::model::Engine;
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use axum::Router;
use axum::routing::{any, get, post};
use chat::{chat_completions, chat_render};
use completions::completions;
use http::{health, live, load, method_not_allowed, metrics_text, model, models, not_found};
use metrics::Metrics;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use worker::Job;

pub use conn::serve;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id clients send as `model` (and `/v1/models` lists).
    pub model_id: String,
    /// Context limit: prompt + reply tokens.
    pub max_seq: usize,
    pub api_key: Option<String>,
    /// Bytes of sequence states the prefix cache may hold.
    pub cache_mem: usize,
    /// A request still unfinished this long after it arrived is stopped.
    pub request_timeout: Duration,
    /// `max_tokens` of a chat request that gives none.
    pub default_max_tokens: usize,
    pub prefill_chunk: usize,
    /// Requests waiting for the model beyond this are refused with 429.
    pub max_queue: usize,
    /// Sequences decoded at once (one batched step a token; admitted in arrival order).
    /// `None`: [`worker::MAX_RUNNING_DEFAULT`] where states live in device memory (fewer
    /// while their reservations do not fit, [`worker::StateBudget`]); 4 in host memory.
    pub max_running: Option<usize>,
    /// Largest request body (bytes); a larger one is refused with 413, one declared larger
    /// before any of it is read.
    pub max_body: usize,
    /// Time a client has to send a request's headers, counted from connecting or from the
    /// end of its previous response (so also how long an idle keep-alive connection stays).
    pub header_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in (408 after).
    pub body_timeout: Duration,
    /// Connections served as usual at once; beyond it each gets one request, sent within
    /// [`conn::OVER_CAP_HEADER_TIMEOUT`], and is closed ([`conn`]).
    pub max_connections: usize,
    /// Origins (`scheme://host[:port]`, or `*` for any) whose cross-origin requests to the
    /// API are answered with CORS headers ([`cors`]); empty: none are.
    pub allow_origins: Vec<String>,
    /// One `tracing` info line per request (method, path, status, duration, tokens).
    pub access_log: bool,
    /// MTP speculative decoding for every request (`--speculative mtp`); `None`: off.
    pub speculative: Option<crate::generate::Speculative>,
}

impl ServerConfig {
    /// The defaults of the limits on clients: 32 MiB bodies, 30 s for headers (and idle
    /// keep-alive), 60 s for a body, 512 connections.
    pub const MAX_BODY: usize = 32 << 20;
    pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
    pub const BODY_TIMEOUT: Duration = Duration::from_secs(60);
    pub const MAX_CONNECTIONS: usize = 512;
}

/// What the HTTP handlers and the model thread share.
pub struct Shared {
    pub config: ServerConfig,
    pub tokenizer: Tokenizer,
    pub metrics: Metrics,
    /// Set by the model thread once the weights are loaded.
    pub ready: AtomicBool,
    /// Set on shutdown: running and queued requests end with a 503 error.
    pub stopping: AtomicBool,
    /// Set while draining ([`drain`]): new requests get 503 and readiness fails, while the
    /// requests already taken (queued or running) finish.
    pub draining: AtomicBool,
    /// POST handlers between their start and their response (a stream's response leaves
    /// once the model started it; the model's `running` and queue gauges count it from
    /// then on).
    busy: AtomicUsize,
    defaults: SamplingParams,
    stop_ids: Vec<u32>,
    think_ids: Option<(u32, u32)>,
    close_think_ids: Vec<u32>,
    im_start: Option<u32>,
    jobs: Mutex<Sender<Job>>,
    next_id: AtomicU64,
    /// When the server started (Unix seconds): the model's `created` time.
    started: u64,
    /// [`Tokenizer::max_token_bytes`]: a prompt's token count is known to be at least its
    /// bytes over this before it is tokenized.
    max_token_bytes: usize,
    /// Bytes of text being tokenized at once ([`submit::encode_bounded`]).
    tokenizing: submit::TextBudget,
    /// The structured-output vocabulary and compiler, built on first use.
    grammar: std::sync::OnceLock<Result<Arc<crate::grammar::GrammarEngine>, String>>,
}

impl Shared {
    /// The shared state and the receiving end of the job queue (for [`run_model`]).
    pub fn new(
        config: ServerConfig,
        tokenizer: Tokenizer,
        generation: &GenerationConfig,
    ) -> anyhow::Result<(Arc<Shared>, Receiver<Job>)> {
        let vocab_limit = tokenizer
            .vocab_size()
            .min(crate::tokenizer::special::FIRST_PADDING_ID as usize);
        let defaults = SamplingParams::from_generation_config(generation, vocab_limit);
        defaults
            .validate()
            .map_err(|e| anyhow::anyhow!("generation_config.json: {e}"))?;
        let think_ids = tokenizer
            .token_to_id("<think>")
            .zip(tokenizer.token_to_id("</think>"));
        let close_think_ids = tokenizer.encode("</think>\n\n", true)?;
        let im_start = tokenizer.token_to_id("<|im_start|>");
        let max_token_bytes = tokenizer.max_token_bytes();
        // The longest text the context floor lets through, or the body limit if smaller: one
        // such text at a time, or many short ones.
        let tokenizing = submit::TextBudget::new(
            max_token_bytes
                .saturating_mul(config.max_seq)
                .min(config.max_body)
                .max(1),
        );
        let (tx, rx) = channel();
        let shared = Shared {
            config,
            tokenizer,
            metrics: Metrics::default(),
            ready: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            defaults,
            stop_ids: generation.eos_token_ids.clone(),
            think_ids,
            close_think_ids,
            im_start,
            jobs: Mutex::new(tx),
            next_id: AtomicU64::new(1),
            started: http::unix_now(),
            max_token_bytes,
            tokenizing,
            grammar: Default::default(),
        };
        Ok((Arc::new(shared), rx))
    }

    /// Counts a POST handler as busy until the guard drops.
    pub(crate) fn busy(&self) -> Busy<'_> {
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(&self.busy)
    }

    /// Requests taken and not yet answered: handlers at work, queued jobs, running sequences.
    pub fn in_flight(&self) -> usize {
        self.busy.load(Ordering::SeqCst)
            + self.metrics.queue_depth.load(Ordering::SeqCst) as usize
            + self.metrics.running.load(Ordering::SeqCst) as usize
    }
}

/// [`Shared::busy`]'s guard.
pub(crate) struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How a [`drain`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drained {
    /// Every request taken before the drain finished.
    Clean,
    /// The timeout passed first: the rest were ended with a 503 error (an `error` event
    /// where streaming); this many were still open.
    TimedOut { ended: usize },
}

/// Graceful drain: from now on new generation requests are refused in their API's error
/// shape (OpenAI's 503 on `/v1/chat/completions` and `/v1/completions`, Anthropic's 529
/// `overloaded_error` on `/v1/messages`) and `/health` and `/ready` answer 503 `draining`, so
/// routers stop sending here; queued and running requests finish. Returns once none are
/// left, or once `timeout` has passed, when the rest are ended with a 503 error (streams with
/// an `error` event, then OpenAI's `[DONE]`), giving the model thread up to 5 s to report
/// that. [`serve`]'s shutdown future awaits this before the accept loop stops.
pub async fn drain(shared: &Shared, timeout: Duration) -> Drained {
    shared.draining.store(true, Ordering::SeqCst);
    shared.metrics.draining.store(true, Ordering::SeqCst);
    let t0 = std::time::Instant::now();
    let tick = Duration::from_millis(20);
    while shared.in_flight() > 0 {
        if t0.elapsed() >= timeout {
            let ended = shared.in_flight();
            shared.stopping.store(true, Ordering::SeqCst);
            let t1 = std::time::Instant::now();
            while shared.in_flight() > 0 && t1.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(tick).await;
            }
            return Drained::TimedOut { ended };
        }
        tokio::time::sleep(tick).await;
    }
    Drained::Clean
}

impl Shared {
    /// The grammar engine of the tokenizer (built on the first call: a few hundred ms over
    /// the 248k vocabulary).
    pub fn grammar(&self) -> Result<Arc<crate::grammar::GrammarEngine>, String> {
        self.grammar
            .get_or_init(|| {
                let t = std::time::Instant::now();
                let vocab = self.tokenizer.vocab_size();
                let e = crate::grammar::GrammarEngine::shared(&self.tokenizer, vocab)
                    .map_err(|e| format!("{e:#}"));
                tracing::info!(
                    "structured outputs: grammar engine over {vocab} ids built in {:.0} ms",
                    t.elapsed().as_secs_f64() * 1e3
                );
                e
            })
            .clone()
    }
}

/// Runs the model loop on the calling thread until the server's job queue closes.
///
/// Where the engine's states live in device memory, the memory the weights left free is the
/// [`worker::StateBudget`] running sequences reserve from and the prefix cache uses the rest
/// of (said at start; an error before anything is served if not even one `--max-seq`
/// sequence fits); without `--max-running` up to [`worker::MAX_RUNNING_DEFAULT`] sequences run
/// at once, as many as their reservations fit.
pub fn run_model<E: Engine>(
    engine: &E,
    shared: Arc<Shared>,
    rx: Receiver<Job>,
) -> anyhow::Result<()> {
    if shared.config.speculative.is_some() {
        // before the server reports ready: every request would fail its first step
        engine.mtp_check()?;
    }
    let cache_cap = shared.config.cache_mem;
    let max_seq = shared
        .config
        .max_seq
        .min(engine.config().max_position_embeddings);
    let mut max_running = shared.config.max_running.unwrap_or(4).max(1);
    let mut budget = None;
    if let Some(mem) = engine.state_memory() {
        let b = worker::StateBudget::new(mem, max_seq)?;
        max_running = shared
            .config
            .max_running
            .unwrap_or(worker::MAX_RUNNING_DEFAULT)
            .max(1);
        eprintln!(
            "kestrel serve: up to {max_running} sequences at once (--max-running), as many as their memory fits; {}",
            b.describe(max_seq)
        );
        // Warm-up states grow to 16 positions + a step per batch width: as many as fit.
        let warm = max_running.min(b.sequences_of(32).max(1));
        warm_up(engine, warm)?;
        budget = Some(b);
    }
    let mut scheduler = worker::Scheduler::new(engine, shared, cache_cap);
    scheduler.max_running = max_running;
    scheduler.budget = budget;
    scheduler.run(rx);
    Ok(())
}

/// The GPU engine before the first request: a short prompt, a greedy step, and batched steps
/// of 2, 4, 8, .. sequences up to `max_running`, so that it loads its kernels and picks its
/// GEMM algorithms (per power of two of rows up to 32) here and not in the first clients'
/// time to first token.
fn warm_up<E: Engine>(engine: &E, max_running: usize) -> anyhow::Result<()> {
    let mut states = vec![engine.new_state()?];
    engine.forward(&mut states[0], &[0; 16], crate::model::Logits::Last)?;
    let v = engine.config().vocab_size;
    engine.forward_greedy_id(&mut states[0], 0, v)?;
    let mut rows = 2;
    while rows <= max_running.min(64) {
        while states.len() < rows {
            let mut s = engine.new_state()?;
            engine.forward(&mut s, &[0; 16], crate::model::Logits::Last)?;
            states.push(s);
        }
        let mut refs: Vec<&mut E::State> = states.iter_mut().collect();
        engine.forward_batch_greedy(&mut refs, &vec![0; rows], v)?;
        rows *= 2;
    }
    Ok(())
}

/// The HTTP routes.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(health))
        .route("/live", get(live))
        .route("/get_load", get(load))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/chat/completions/render", post(chat_render))
        .route("/v1/completions", post(completions))
        .route(
            "/v1/messages",
            post(messages::messages).fallback(messages::method_not_allowed),
        )
        .route(
            "/v1/messages/count_tokens",
            post(messages::count_tokens).fallback(messages::method_not_allowed),
        )
        .route("/v1/messages/{*rest}", any(messages::not_found))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            cors::cors,
        ))
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            access::access,
        ))
        .with_state(shared)
}
