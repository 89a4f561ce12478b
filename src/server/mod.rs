//! `kestrel serve`: an OpenAI-compatible HTTP server (axum on tokio).
//!
//! The HTTP side validates and tokenizes requests, then hands each one as a [`worker::Job`]
//! to the model thread ([`run_model`]), which owns the engine and streams [`worker::Event`]s
//! back. Handlers never touch the engine, so a slow generation never blocks `/health`,
//! `/metrics` or the validation of other requests.
//!
//! Endpoints: `GET /health`, `GET /v1/models`, `GET /metrics`, `POST /v1/chat/completions`,
//! `POST /v1/completions`. Wire formats are in [`api`].

pub mod api;
pub mod cache;
pub mod metrics;
pub mod worker;

use crate::chat::ChatRequest;
use crate::config::GenerationConfig;
use crate::generate::{Channel, GenerateOptions, ReplySettings, StopReason, ThinkingControl};
use crate::model::Engine;
use crate::sampling::{SamplingParams, TokenLogprobs};
use crate::tokenizer::Tokenizer;
use api::{ApiError, Assembler, Delta, GenParams, ResponseMeta, ToolChoice, Usage};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrics::Metrics;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use worker::{Event, Job};

/// Largest request body accepted.
const BODY_LIMIT: usize = 32 << 20;

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
    /// Sequences decoded at once (interleaved token by token; admitted in arrival order).
    pub max_running: usize,
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
/// the weights left free (else an error, before anything is served), and the prefix cache is
/// limited to the rest (with a warning when that is less than `cache_mem`).
pub fn run_model<E: Engine>(
    engine: &E,
    shared: Arc<Shared>,
    rx: Receiver<Job>,
) -> anyhow::Result<()> {
    if engine.state_memory().is_some() {
        // The GPU engine: a short prompt and a greedy step on a scratch state before the first
        // request, so that it loads its kernels and picks its GEMM algorithms (one for all
        // products of up to 32 rows, a first chat turn's pieces included) here and not in the
        // first client's time to first token.
        let mut scratch = engine.new_state();
        engine.forward(&mut scratch, &[0; 16], crate::model::Logits::Last)?;
        engine.forward_greedy_id(&mut scratch, 0, engine.config().vocab_size)?;
    }
    let mut cache_cap = shared.config.cache_mem;
    if let Some(mem) = engine.state_memory() {
        let cap = worker::device_cache_budget(mem, shared.config.max_running.max(1), cache_cap)?;
        if cap < cache_cap {
            tracing::warn!(
                "the prefix cache gets {:.2} GiB of GPU memory, not the {:.2} GiB of --cache-mem: that is what {} running sequence states leave free",
                cap as f64 / (1u64 << 30) as f64,
                cache_cap as f64 / (1u64 << 30) as f64,
                shared.config.max_running.max(1)
            );
        }
        cache_cap = cap;
    }
    worker::Scheduler::new(engine, shared, cache_cap).run(rx);
    Ok(())
}

/// The error for a request whose model-thread channel closed without an answer.
fn model_gone() -> ApiError {
    ApiError::new(500, "server_error", "the model thread dropped the request")
}

/// The HTTP routes.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
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

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &e.body())
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        v.to_string(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error_response(
        &ApiError::new(404, "invalid_request_error", "no such endpoint").with_code("not_found"),
    )
}

async fn method_not_allowed() -> Response {
    error_response(&ApiError::new(
        405,
        "invalid_request_error",
        "method not allowed for this endpoint",
    ))
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    if s.ready.load(Ordering::SeqCst) {
        json_response(StatusCode::OK, &json!({"status": "ok"}))
    } else {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "loading"}),
        )
    }
}

async fn metrics_text(State(s): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        s.metrics.render(),
    )
        .into_response()
}

fn check_auth(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.config.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(g) if g == key => Ok(()),
        Some(_) => Err(
            ApiError::new(401, "invalid_request_error", "Incorrect API key provided.")
                .with_code("invalid_api_key"),
        ),
        None => Err(ApiError::new(
            401,
            "invalid_request_error",
            "Missing API key: send `Authorization: Bearer KEY`.",
        )
        .with_code("invalid_api_key")),
    }
}

async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let resp = match check_auth(&s, &headers) {
        Err(e) => error_response(&e),
        Ok(()) => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{
                "id": s.config.model_id,
                "object": "model",
                "created": unix_now(),
                "owned_by": "kestrel",
                "max_model_len": s.config.max_seq,
            }]}),
        ),
    };
    s.metrics.request("/v1/models", resp.status().as_u16());
    resp
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Auth, readiness, body and JSON checks common to the POST endpoints.
async fn read_request(s: &Shared, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    check_auth(s, headers)?;
    if s.stopping.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "service_unavailable",
            "the server is shutting down",
        ));
    }
    if !s.ready.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "service_unavailable",
            "the model is still loading",
        ));
    }
    let bytes = axum::body::to_bytes(body, BODY_LIMIT).await.map_err(|e| {
        let msg = format!("{e}");
        if msg.contains("length limit") {
            ApiError::new(
                413,
                "invalid_request_error",
                format!("the request body exceeds {BODY_LIMIT} bytes"),
            )
        } else {
            ApiError::invalid("", format!("cannot read the request body: {msg}"))
        }
    })?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid("", format!("the request body is not valid JSON: {e}")))?;
    if let Some(obj) = v.as_object()
        && let Some(m) = obj.get("model").filter(|m| !m.is_null())
    {
        let m = m
            .as_str()
            .ok_or_else(|| ApiError::invalid("model", "`model` must be a string"))?;
        if m != s.config.model_id {
            return Err(ApiError::new(
                404,
                "invalid_request_error",
                format!(
                    "The model `{m}` does not exist; this server serves `{}`.",
                    s.config.model_id
                ),
            )
            .with_code("model_not_found"));
        }
    }
    Ok(v)
}

fn context_error(s: &Shared, n: usize, param: &str) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "This model's maximum context length is {} tokens, but the prompt is {n} tokens. Shorten the prompt.",
            s.config.max_seq
        ),
    )
    .with_code("context_length_exceeded")
}

fn settings(
    s: &Shared,
    params: &GenParams,
    default_max: usize,
    chat: bool,
) -> Result<ReplySettings, ApiError> {
    let think_ids = if chat { s.think_ids } else { None };
    let thinking = match (think_ids, params.thinking_budget) {
        (Some((open_id, close_id)), budget) => Some(ThinkingControl {
            open_id,
            close_id,
            budget,
            close_ids: s.close_think_ids.clone(),
        }),
        (None, Some(_)) => {
            return Err(ApiError::invalid(
                "thinking_budget",
                "`thinking_budget` only applies to chat completions",
            ));
        }
        (None, None) => None,
    };
    Ok(ReplySettings {
        opts: GenerateOptions {
            max_tokens: params.max_tokens.unwrap_or(default_max),
            stop_ids: s.stop_ids.clone(),
            prefill_chunk: s.config.prefill_chunk,
            max_seq: s.config.max_seq,
            thinking,
            device_greedy: crate::generate::device_greedy_allowed(),
        },
        stop_strings: params.stop.clone(),
        think_ids,
    })
}

/// Sets the cancel flag when dropped: the handler or its response stream went away.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn fresh_seed(s: &Shared) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    t ^ s
        .next_id
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A queued job's receiving side.
struct Submitted {
    rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    cached_tokens: usize,
}

/// Queues a job and waits until the model starts it (or refuses it).
async fn submit(
    s: &Arc<Shared>,
    prompt: Vec<u32>,
    snapshot_points: Vec<usize>,
    settings: ReplySettings,
    params: &GenParams,
) -> Result<Submitted, ApiError> {
    let (tx, mut rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt,
        snapshot_points,
        settings,
        params: params.sampling.clone(),
        seed: params.seed.unwrap_or_else(|| fresh_seed(s)),
        logprobs: params.logprobs,
        cache_key: params.cache_key.clone(),
        events: tx,
        cancel: cancel.clone(),
        deadline: Instant::now() + s.config.request_timeout,
    };
    let guard = CancelOnDrop(cancel);
    let waiting = s.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    if waiting as usize >= s.config.max_queue {
        s.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::new(
            429,
            "rate_limit_error",
            format!("{waiting} requests are already waiting for the model; retry later"),
        )
        .with_code("queue_full"));
    }
    let sent = s.jobs.lock().unwrap_or_else(|e| e.into_inner()).send(job);
    if sent.is_err() {
        s.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::new(
            503,
            "service_unavailable",
            "the model thread has stopped",
        ));
    }
    match rx.recv().await {
        Some(Event::Started { cached_tokens }) => Ok(Submitted {
            rx,
            guard,
            cached_tokens,
        }),
        Some(Event::Error { status, message }) => Err(event_error(status, message)),
        _ => Err(model_gone()),
    }
}

fn event_error(status: u16, message: String) -> ApiError {
    match status {
        503 => ApiError::new(503, "service_unavailable", message),
        400 => ApiError::invalid("", message).with_code("context_length_exceeded"),
        504 => ApiError::new(504, "timeout", message),
        _ => ApiError::new(status, "server_error", message),
    }
}

fn finish_reason(stop: StopReason, calls: bool) -> &'static str {
    match stop {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        _ if calls => "tool_calls",
        _ => "stop",
    }
}

fn token_text(s: &Shared, id: u32) -> String {
    s.tokenizer.decode(&[id], false).unwrap_or_default()
}

fn chat_logprob(s: &Shared, lp: &TokenLogprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let t = token_text(s, id);
        json!({"token": t, "logprob": logprob, "bytes": t.as_bytes()})
    };
    let mut v = entry(lp.id, lp.logprob);
    v["top_logprobs"] = lp.top.iter().map(|&(i, l)| entry(i, l)).collect();
    v
}

/// Completions' logprobs object for `lps`, whose text starts at byte `offset`.
fn completion_logprobs(s: &Shared, lps: &[TokenLogprobs], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut values = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for lp in lps {
        let t = token_text(s, lp.id);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        values.push(lp.logprob);
        let top: serde_json::Map<String, Value> = lp
            .top
            .iter()
            .map(|&(i, l)| (token_text(s, i), json!(l)))
            .collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
}

fn meta(s: &Shared, prefix: &str) -> ResponseMeta {
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    ResponseMeta {
        id: format!("{prefix}-{:x}{n:06}", unix_now()),
        created: unix_now(),
        model: s.config.model_id.clone(),
    }
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let resp = match chat_inner(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    s.metrics
        .request("/v1/chat/completions", resp.status().as_u16());
    resp
}

async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let resp = match completion_inner(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    s.metrics.request("/v1/completions", resp.status().as_u16());
    resp
}

/// The rendered prompt of a chat request: ids, snapshot points and a forced answer prefix.
struct ChatPrompt {
    ids: Vec<u32>,
    points: Vec<usize>,
    forced: String,
    tools: Option<Vec<Value>>,
}

fn render_chat(s: &Shared, input: &api::ChatInput) -> Result<ChatPrompt, ApiError> {
    let template =
        s.tokenizer.template.as_ref().ok_or_else(|| {
            ApiError::new(500, "server_error", "the checkpoint has no chat template")
        })?;
    let tools_on = input.tool_choice != ToolChoice::None;
    let req = ChatRequest {
        messages: input.messages.clone(),
        tools: input.tools.clone().filter(|_| tools_on),
        add_generation_prompt: true,
        enable_thinking: input.enable_thinking,
        extra: input.extra.clone(),
    };
    let mut text = template
        .render(&req)
        .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
    // tool_choice required / named: the answer starts with the call (no thinking first).
    let forced = match &input.tool_choice {
        ToolChoice::Required => "<tool_call>\n<function=".to_string(),
        ToolChoice::Named(n) => format!("<tool_call>\n<function={n}>\n"),
        _ => String::new(),
    };
    if !forced.is_empty() {
        if text.ends_with("<think>\n") {
            text.push_str("\n</think>\n\n");
        }
        text.push_str(&forced);
    }
    let ids = s
        .tokenizer
        .encode(&text, true)
        .map_err(|e| ApiError::new(500, "server_error", format!("{e:#}")))?;
    // Snapshot at the end of the first message (a shared system prompt) and before the
    // generation prompt, the last `<|im_start|>` (the conversation so far, which the next
    // turn extends).
    let mut points = Vec::new();
    if let Some(im) = s.im_start {
        let starts: Vec<usize> = ids
            .iter()
            .enumerate()
            .filter(|&(_, &t)| t == im)
            .map(|(i, _)| i)
            .collect();
        points.extend(starts.get(1));
        points.extend(starts.last().filter(|&&p| p > 0));
    }
    Ok(ChatPrompt {
        ids,
        points,
        forced,
        tools: input.tools.clone().filter(|_| tools_on),
    })
}

async fn chat_inner(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let v = read_request(s, headers, body).await?;
    let input = api::parse_chat(&v, &s.defaults)?;
    let params = input.params.clone();
    // Rendering and tokenizing a long prompt takes a while: off the async workers.
    let s2 = s.clone();
    let prompt = tokio::task::spawn_blocking(move || render_chat(&s2, &input))
        .await
        .map_err(|e| {
            ApiError::new(500, "server_error", format!("prompt rendering failed: {e}"))
        })??;
    if prompt.ids.len() >= s.config.max_seq {
        return Err(context_error(s, prompt.ids.len(), "messages"));
    }
    let settings = settings(s, &params, s.config.default_max_tokens, true)?;
    let prompt_tokens = prompt.ids.len();
    let sub = submit(s, prompt.ids, prompt.points, settings, &params).await?;
    let asm = Assembler::new(prompt.tools.as_deref(), &prompt.forced);
    let meta = meta(s, "chatcmpl");
    let usage = Usage {
        prompt_tokens,
        cached_tokens: sub.cached_tokens,
        ..Default::default()
    };
    if params.stream {
        Ok(sse_response(chat_stream(
            s.clone(),
            sub,
            asm,
            meta,
            usage,
            params.include_usage,
        )))
    } else {
        chat_collect(s, sub, asm, meta, usage).await
    }
}

async fn chat_collect(
    s: &Shared,
    mut sub: Submitted,
    mut asm: Assembler,
    meta: ResponseMeta,
    mut usage: Usage,
) -> Result<Response, ApiError> {
    let mut lps = Vec::new();
    let mut any_lp = false;
    loop {
        match sub.rx.recv().await {
            Some(Event::Token { pieces, logprobs }) => {
                if let Some(lp) = logprobs {
                    any_lp = true;
                    lps.push(chat_logprob(s, &lp));
                }
                for (ch, text) in pieces {
                    asm.push(ch, &text);
                }
            }
            Some(Event::Done {
                stop,
                completion_tokens,
                reasoning_tokens,
            }) => {
                asm.finish();
                usage.completion_tokens = completion_tokens;
                usage.reasoning_tokens = reasoning_tokens;
                let finish = finish_reason(stop, !asm.calls.is_empty());
                let lp = any_lp.then_some(Value::Array(lps));
                drop(sub.guard);
                return Ok(json_response(
                    StatusCode::OK,
                    &api::chat_json(&meta, &asm, finish, lp, &usage),
                ));
            }
            Some(Event::Error { status, message }) => return Err(event_error(status, message)),
            Some(Event::Started { .. }) => {}
            None => {
                return Err(model_gone());
            }
        }
    }
}

fn sse_response<S>(stream: S) -> Response
where
    S: futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Streaming state of one chat response.
struct ChatStream {
    s: Arc<Shared>,
    sub: Submitted,
    asm: Assembler,
    meta: ResponseMeta,
    usage: Usage,
    include_usage: bool,
    calls: usize,
    pending_lp: Vec<Value>,
    started: bool,
    done: bool,
}

impl ChatStream {
    fn chunk(&mut self, delta: Value, finish: Option<&str>) -> String {
        let lp = (!self.pending_lp.is_empty())
            .then(|| Value::Array(std::mem::take(&mut self.pending_lp)));
        api::sse_data(&api::chat_chunk(
            &self.meta,
            delta,
            finish,
            lp,
            self.include_usage,
        ))
    }

    fn deltas(&mut self, ds: Vec<Delta>) -> String {
        let mut out = String::new();
        for d in ds {
            if matches!(&d, Delta::Content(t) | Delta::Reasoning(t) if t.is_empty()) {
                continue;
            }
            let v = api::delta_json(&self.meta, &d, self.calls);
            if matches!(d, Delta::Call(_)) {
                self.calls += 1;
            }
            out.push_str(&self.chunk(v, None));
        }
        out
    }

    fn handle(&mut self, ev: Event) -> String {
        match ev {
            Event::Token { pieces, logprobs } => {
                if let Some(lp) = logprobs {
                    self.pending_lp.push(chat_logprob(&self.s, &lp));
                }
                let mut out = String::new();
                for (ch, text) in pieces {
                    let ds = self.asm.push(ch, &text);
                    out.push_str(&self.deltas(ds));
                }
                out
            }
            Event::Done {
                stop,
                completion_tokens,
                reasoning_tokens,
            } => {
                let ds = self.asm.finish();
                let mut out = self.deltas(ds);
                self.usage.completion_tokens = completion_tokens;
                self.usage.reasoning_tokens = reasoning_tokens;
                let finish = finish_reason(stop, self.calls > 0);
                out.push_str(&self.chunk(json!({}), Some(finish)));
                if self.include_usage {
                    out.push_str(&api::sse_data(&api::usage_chunk(
                        &self.meta,
                        "chat.completion.chunk",
                        &self.usage,
                    )));
                }
                out.push_str(api::SSE_DONE);
                self.done = true;
                out
            }
            Event::Error { status, message } => {
                self.done = true;
                format!(
                    "{}{}",
                    api::sse_data(&event_error(status, message).body()),
                    api::SSE_DONE
                )
            }
            Event::Started { .. } => String::new(),
        }
    }
}

fn chat_stream(
    s: Arc<Shared>,
    sub: Submitted,
    asm: Assembler,
    meta: ResponseMeta,
    usage: Usage,
    include_usage: bool,
) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static {
    let st = ChatStream {
        s,
        sub,
        asm,
        meta,
        usage,
        include_usage,
        calls: 0,
        pending_lp: Vec::new(),
        started: false,
        done: false,
    };
    futures_util::stream::unfold(st, |mut st| async move {
        if !st.started {
            st.started = true;
            let first = st.chunk(json!({"role": "assistant", "content": ""}), None);
            return Some((Ok(Bytes::from(first)), st));
        }
        loop {
            if st.done {
                return None;
            }
            let ev = st.sub.rx.recv().await?;
            let out = st.handle(ev);
            if !out.is_empty() {
                return Some((Ok(Bytes::from(out)), st));
            }
        }
    })
}

async fn completion_inner(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let v = read_request(s, headers, body).await?;
    let (prompt, params) = api::parse_completion(&v, &s.defaults)?;
    let ids = match prompt {
        api::PromptInput::Text(t) => {
            let s2 = s.clone();
            tokio::task::spawn_blocking(move || s2.tokenizer.encode(&t, true))
                .await
                .map_err(|e| {
                    ApiError::new(500, "server_error", format!("tokenization failed: {e}"))
                })?
                .map_err(|e| ApiError::new(500, "server_error", format!("{e:#}")))?
        }
        api::PromptInput::Ids(ids) => {
            let vocab = s.defaults.vocab_limit;
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary ({vocab})"),
                ));
            }
            ids
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` encodes to no tokens"));
    }
    if ids.len() >= s.config.max_seq {
        return Err(context_error(s, ids.len(), "prompt"));
    }
    let settings = settings(s, &params, 16, false)?;
    let prompt_tokens = ids.len();
    let mut sub = submit(s, ids, vec![], settings, &params).await?;
    let meta = meta(s, "cmpl");
    let mut usage = Usage {
        prompt_tokens,
        cached_tokens: sub.cached_tokens,
        ..Default::default()
    };
    let want_lp = params.logprobs.is_some();
    if params.stream {
        let include_usage = params.include_usage;
        let s2 = s.clone();
        let stream = futures_util::stream::unfold(
            (sub, usage, false, 0usize),
            move |(mut sub, mut usage, mut done, mut offset)| {
                let s = s2.clone();
                let meta = meta.clone();
                async move {
                    loop {
                        if done {
                            return None;
                        }
                        let ev = match sub.rx.recv().await {
                            Some(ev) => ev,
                            None => return None,
                        };
                        let out = match ev {
                            Event::Token { pieces, logprobs } => {
                                let text: String = pieces.into_iter().map(|(_, t)| t).collect();
                                let lp = logprobs.map(|lp| completion_logprobs(&s, &[lp], offset));
                                offset += text.len();
                                if text.is_empty() && lp.is_none() {
                                    continue;
                                }
                                api::sse_data(&api::completion_chunk(
                                    &meta,
                                    &text,
                                    None,
                                    lp,
                                    include_usage,
                                ))
                            }
                            Event::Done {
                                stop,
                                completion_tokens,
                                ..
                            } => {
                                done = true;
                                usage.completion_tokens = completion_tokens;
                                let mut out = api::sse_data(&api::completion_chunk(
                                    &meta,
                                    "",
                                    Some(finish_reason(stop, false)),
                                    None,
                                    include_usage,
                                ));
                                if include_usage {
                                    out.push_str(&api::sse_data(&api::usage_chunk(
                                        &meta,
                                        "text_completion",
                                        &usage,
                                    )));
                                }
                                out.push_str(api::SSE_DONE);
                                out
                            }
                            Event::Error { status, message } => {
                                done = true;
                                format!(
                                    "{}{}",
                                    api::sse_data(&event_error(status, message).body()),
                                    api::SSE_DONE
                                )
                            }
                            Event::Started { .. } => continue,
                        };
                        return Some((Ok(Bytes::from(out)), (sub, usage, done, offset)));
                    }
                }
            },
        );
        return Ok(sse_response(stream));
    }
    let mut text = String::new();
    let mut lps = Vec::new();
    loop {
        match sub.rx.recv().await {
            Some(Event::Token { pieces, logprobs }) => {
                lps.extend(logprobs);
                for (ch, t) in pieces {
                    debug_assert_eq!(ch, Channel::Answer);
                    text.push_str(&t);
                }
            }
            Some(Event::Done {
                stop,
                completion_tokens,
                ..
            }) => {
                usage.completion_tokens = completion_tokens;
                let lp = want_lp.then(|| completion_logprobs(s, &lps, 0));
                return Ok(json_response(
                    StatusCode::OK,
                    &api::completion_json(&meta, &text, finish_reason(stop, false), lp, &usage),
                ));
            }
            Some(Event::Error { status, message }) => return Err(event_error(status, message)),
            Some(Event::Started { .. }) => {}
            None => {
                return Err(model_gone());
            }
        }
    }
}
