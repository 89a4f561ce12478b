//! `POST /v1/chat/completions`: render the conversation with the chat template, then answer
//! as one JSON object ([`chat_collect`]) or as an SSE stream ([`chat_stream`]).

use super::Shared;
use super::api::{self, ApiError, Assembler, Delta, ResponseMeta, ToolChoice, Usage};
use super::http::{error_response, json_response, read_json, read_request, sse_response};
use super::submit::{
    Submitted, context_error, context_floor, encode_bounded, event_error, finish_reason,
    fits_context, gone_event, max_tokens_cap, meta, model_gone, settings, submit, token_text,
};
use super::worker::Event;
use crate::chat::ChatRequest;
use crate::grammar::ToolCalls;
use crate::sampling::{SamplingParams, TokenLogprobs};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

fn chat_logprob(s: &Shared, lp: &TokenLogprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let t = token_text(s, id);
        json!({"token": t, "logprob": logprob, "bytes": t.as_bytes()})
    };
    let mut v = entry(lp.id, lp.logprob);
    v["top_logprobs"] = lp.top.iter().map(|&(i, l)| entry(i, l)).collect();
    v
}

pub(super) async fn chat_completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let _busy = s.busy();
    let resp = match chat_inner(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    s.metrics
        .request("/v1/chat/completions", resp.status().as_u16());
    resp
}

/// A chat template's refusal as the client sees it: the reason only (the template's own
/// message, as `raise_exception` gave it), without the template's name, line or source.
fn template_error(e: &anyhow::Error) -> ApiError {
    let text = format!("{e}");
    let reason = text
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("chat template: ")
        .trim_start_matches("invalid operation: ");
    let reason = reason.split(" (in ").next().unwrap_or(reason).trim();
    ApiError::invalid(
        "messages",
        format!("the messages cannot be rendered as a prompt: {reason}"),
    )
}

/// The rendered prompt of a chat request: ids, snapshot points and a forced answer prefix.
pub(super) struct ChatPrompt {
    pub(super) ids: Vec<u32>,
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
    let mut text = template.render(&req).map_err(|e| template_error(&e))?;
    // tool_choice required / named: the answer starts with the call (no thinking first).
    let forced = match &input.tool_choice {
        ToolChoice::Required => "<tool_call>\n<function=".to_string(),
        ToolChoice::Named(n) => format!("<tool_call>\n<function={n}>\n"),
        _ => String::new(),
    };
    if !forced.is_empty() || input.prefill.is_some() {
        if text.ends_with("<think>\n") {
            text.push_str("\n</think>\n\n");
        }
        text.push_str(input.prefill.as_deref().unwrap_or_default());
        text.push_str(&forced);
    }
    // the whole rendered prompt against the context floor: also what the check of the
    // messages' contents did not count (assistant turns, tool calls)
    let ids = encode_bounded(s, &text, true, "messages")?;
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

/// `POST /v1/chat/completions/render` (vLLM's endpoint of that name): the prompt token ids a
/// chat request would run, without running it. Cache-aware routers (vllm-router) render each
/// chat request through a backend and route on the ids, so that requests sharing a rendered
/// prefix (a system prompt, an earlier turn) go to the replica that has it cached. It needs
/// only the tokenizer, so it answers while the weights load and while the server drains.
pub(super) async fn chat_render(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let resp = match prompt_only(&s, &headers, body, api::parse_chat).await {
        Ok(prompt) => json_response(
            StatusCode::OK,
            &json!({"model": s.config.model_id, "token_ids": prompt.ids}),
        ),
        Err(e) => error_response(&e),
    };
    s.metrics
        .request("/v1/chat/completions/render", resp.status().as_u16());
    resp
}

/// The prompt a chat request (read with `parse`) would run, without running it: auth, body
/// and JSON checks, then rendering and tokenizing. Only the tokenizer is needed, so it
/// answers while the weights load and while the server drains (`/v1/chat/completions/render`,
/// Anthropic's `count_tokens`).
pub(super) async fn prompt_only(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
    parse: impl FnOnce(&Value, &SamplingParams) -> Result<api::ChatInput, ApiError>,
) -> Result<ChatPrompt, ApiError> {
    let v = read_json(s, headers, body, false).await?;
    let input = parse(&v, &s.defaults)?;
    chat_prompt(s, input).await
}

/// Renders and tokenizes a chat request's prompt off the async workers (a long prompt takes
/// a while).
pub(super) async fn chat_prompt(
    s: &Arc<Shared>,
    input: api::ChatInput,
) -> Result<ChatPrompt, ApiError> {
    let s2 = s.clone();
    tokio::task::spawn_blocking(move || render_chat(&s2, &input))
        .await
        .map_err(|e| ApiError::new(500, "server_error", format!("prompt rendering failed: {e}")))?
}

/// A chat request the model has started: its events, the [`Assembler`] for them, the usage
/// so far and the request's options. Both chat endpoints (OpenAI's and Anthropic's) build
/// their responses from it.
pub(super) struct ChatRun {
    pub(super) sub: Submitted,
    pub(super) asm: Assembler,
    pub(super) usage: Usage,
    pub(super) params: api::GenParams,
}

/// Renders `input`, checks it against the context limit and queues it for the model.
pub(super) async fn start_chat(
    s: &Arc<Shared>,
    input: api::ChatInput,
) -> Result<ChatRun, ApiError> {
    let params = input.params.clone();
    // The template writes system, user and tool contents whole (trimmed): text the prompt
    // surely holds.
    let surely: usize = input
        .messages
        .iter()
        .filter(|m| matches!(m["role"].as_str(), Some("system" | "user" | "tool")))
        .filter_map(|m| m["content"].as_str())
        .map(|c| c.trim().len())
        .sum();
    max_tokens_cap(s, params.max_tokens)?;
    context_floor(s, surely, "messages")?;
    let prompt = chat_prompt(s, input).await?;
    if prompt.ids.len() >= s.config.max_seq {
        return Err(context_error(s, prompt.ids.len(), "messages"));
    }
    fits_context(s, prompt.ids.len(), params.max_tokens, "messages")?;
    let mut params = params;
    // Strict tools: their calls' arguments follow their schemas (a forced call prefix is
    // where the reply starts inside a call).
    if params.constraint.is_none()
        && let Some(mut t) = prompt.tools.as_deref().and_then(ToolCalls::of)
    {
        t.started = prompt
            .forced
            .strip_prefix("<tool_call>")
            .map(str::to_string);
        params.tool_calls = Some(t);
    }
    let settings = settings(s, &params, s.config.default_max_tokens, true)?;
    let prompt_tokens = prompt.ids.len();
    let sub = submit(s, prompt.ids, prompt.points, settings, &params).await?;
    let asm = Assembler::new(prompt.tools.as_deref(), &prompt.forced);
    let usage = Usage {
        prompt_tokens,
        cached_tokens: sub.cached_tokens,
        ..Default::default()
    };
    Ok(ChatRun {
        sub,
        asm,
        usage,
        params,
    })
}

async fn chat_inner(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let v = read_request(s, headers, body).await?;
    let input = api::parse_chat(&v, &s.defaults)?;
    let ChatRun {
        sub,
        asm,
        usage,
        params,
    } = start_chat(s, input).await?;
    let meta = meta(s, "chatcmpl");
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
                ..
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
                ..
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
            // A channel closed before `Done` or `Error` (the model thread is gone) still ends
            // the stream with an error event, never a silent end.
            let ev = st.sub.rx.recv().await.unwrap_or_else(gone_event);
            let out = st.handle(ev);
            if !out.is_empty() {
                return Some((Ok(Bytes::from(out)), st));
            }
        }
    })
}
