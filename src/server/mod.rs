//! `kestrel serve`: an OpenAI-compatible HTTP server (axum on tokio).
//!
//! The HTTP side validates and tokenizes requests, then hands each one as a [`worker::Job`]
//! to the model thread ([`run_model`]), which owns the engine and streams [`worker::Event`]s
//! back. Handlers never touch the engine, so a slow generation never blocks `/health`,
//! `/metrics` or the validation of other requests.
//!
//! Endpoints: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /metrics`, `POST /v1/chat/completions`,
//! `POST /v1/completions`. Wire formats are in [`api`].
//!
//! Files: `http` (auth, body checks, JSON / SSE / error responses, the small endpoints),
//! `chat` and `completions` (the two POST endpoints), `submit` (queueing a job for the model
//! thread and reading its events), [`worker`] (the model thread), [`cache`] (the prefix
//! cache), [`metrics`].

pub mod api;
pub mod cache;
mod chat;
mod completions;
mod http;
pub mod metrics;
mod submit;
pub mod worker;

use crate::config::GenerationConfig;
use crate::model::Engine;
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use axum::Router;
use axum::routing::{get, post};
use chat::chat_completions;
use completions::completions;
use http::{health, method_not_allowed, metrics_text, model, models, not_found};
use metrics::Metrics;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use worker::Job;

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
    /// `None`: as many as device memory holds ([`worker::default_max_running`]; 4 where
    /// states live in host memory).
    pub max_running: Option<usize>,
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
    defaults: SamplingParams,
    stop_ids: Vec<u32>,
    think_ids: Option<(u32, u32)>,
    close_think_ids: Vec<u32>,
    im_start: Option<u32>,
    jobs: Mutex<Sender<Job>>,
    next_id: AtomicU64,
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
        let (tx, rx) = channel();
        let shared = Shared {
            config,
            tokenizer,
            metrics: Metrics::default(),
            ready: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            defaults,
            stop_ids: generation.eos_token_ids.clone(),
            think_ids,
            close_think_ids,
            im_start,
            jobs: Mutex::new(tx),
            next_id: AtomicU64::new(1),
        };
        Ok((Arc::new(shared), rx))
    }
}

/// Runs the model loop on the calling thread until the server's job queue closes.
///
/// Where the engine's states live in device memory, `max_running` of them must fit in what
/// the weights left free (else an error, before anything is served; without `--max-running`
/// as many as fit beside the cache's share, [`worker::default_max_running`], said at start),
/// and the prefix cache is limited to the rest (with a warning when that is less than
/// `cache_mem`).
pub fn run_model<E: Engine>(
    engine: &E,
    shared: Arc<Shared>,
    rx: Receiver<Job>,
) -> anyhow::Result<()> {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let mut cache_cap = shared.config.cache_mem;
    let mut max_running = shared.config.max_running.unwrap_or(4).max(1);
    if let Some(mem) = engine.state_memory() {
        if shared.config.max_running.is_none() {
            max_running = worker::default_max_running(mem, cache_cap);
            eprintln!(
                "kestrel serve: up to {max_running} sequences at once (--max-running): {:.2} GiB of GPU memory free, {:.2} GiB a sequence state at --max-seq, {:.2} GiB kept for the prefix cache",
                gib(mem.free),
                gib(mem.per_state),
                gib(cache_cap.min(mem.free / 4))
            );
        }
        let cap = worker::device_cache_budget(mem, max_running, cache_cap)?;
        if cap < cache_cap {
            tracing::warn!(
                "the prefix cache gets {:.2} GiB of GPU memory, not the {:.2} GiB of --cache-mem: that is what {max_running} running sequence states leave free",
                gib(cap),
                gib(cache_cap),
            );
        }
        cache_cap = cap;
        warm_up(engine, max_running)?;
    }
    let mut scheduler = worker::Scheduler::new(engine, shared, cache_cap);
    scheduler.max_running = max_running;
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
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

/// Serves `router(shared)` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(shared))
        .with_graceful_shutdown(shutdown)
        .await
}
