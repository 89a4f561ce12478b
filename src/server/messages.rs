//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API on the
//! chat path ([`start_chat`]: the same template, engine, prefix cache and metrics as chat
//! completions), answered as one `message` object or as Anthropic's event stream, every error
//! in Anthropic's shape.

use super::Shared;
use super::api::anthropic::{self, Blocks};
use super::api::{ApiError, Assembler, ResponseMeta, Usage};
use super::chat::{ChatRun, prompt_only, start_chat};
use super::http::{json_response, read_request, sse_response};
use super::submit::{Submitted, event_error, meta, model_gone};
use super::worker::Event;
use crate::generate::StopReason;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

/// An error response in Anthropic's shape and status.
pub(super) fn anthropic_error(e: &ApiError) -> Response {
    let (status, v) = anthropic::error_json(e);
    json_response(
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &v,
    )
}

pub(super) async fn messages(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let _busy = s.busy();
    let resp = messages_inner(&s, &headers, body)
        .await
        .unwrap_or_else(|e| anthropic_error(&e));
    s.metrics.request("/v1/messages", resp.status().as_u16());
    resp
}

pub(super) async fn count_tokens(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let parse = |v: &Value, d: &_| anthropic::parse_anthropic(v, d, true);
    let resp = match prompt_only(&s, &headers, body, parse).await {
        Ok(prompt) => json_response(StatusCode::OK, &json!({"input_tokens": prompt.ids.len()})),
        Err(e) => anthropic_error(&e),
    };
    s.metrics
        .request("/v1/messages/count_tokens", resp.status().as_u16());
    resp
}

/// Any other path under `/v1/messages`, or another method: Anthropic's 404 / 405.
pub(super) async fn not_found() -> Response {
    anthropic_error(&ApiError::new(404, "not_found_error", "no such endpoint"))
}

pub(super) async fn method_not_allowed() -> Response {
    anthropic_error(&ApiError::new(
        405,
        "invalid_request_error",
        "method not allowed for this endpoint (POST only)",
    ))
}

async fn messages_inner(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let v = read_request(s, headers, body).await?;
    let input = anthropic::parse_anthropic(&v, &s.defaults, false)?;
    let ChatRun {
        sub,
        asm,
        usage,
        params,
    } = start_chat(s, input).await?;
    let mut meta = meta(s, "msg");
    meta.id = meta.id.replacen('-', "_", 1);
    let reply = Reply {
        sub,
        asm,
        blocks: Blocks::new(&meta),
        meta,
        usage,
        end: None,
    };
    if params.stream {
        Ok(sse_response(stream(reply)))
    } else {
        collect(reply).await
    }
}

/// One reply being built from the model's events.
struct Reply {
    sub: Submitted,
    asm: Assembler,
    blocks: Blocks,
    meta: ResponseMeta,
    usage: Usage,
    /// `stop_reason` and `stop_sequence`, once it has ended.
    end: Option<(&'static str, Option<String>)>,
}

impl Reply {
    /// The stream events one of the model's events makes.
    fn handle(&mut self, ev: Event) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::new();
        match ev {
            Event::Token { pieces, .. } => {
                for (ch, text) in pieces {
                    for d in self.asm.push(ch, &text) {
                        out.extend(self.blocks.push(&d));
                    }
                }
            }
            Event::Done {
                stop,
                completion_tokens,
                reasoning_tokens,
                stop_string,
            } => {
                for d in self.asm.finish() {
                    out.extend(self.blocks.push(&d));
                }
                out.extend(self.blocks.close());
                self.usage.completion_tokens = completion_tokens;
                self.usage.reasoning_tokens = reasoning_tokens;
                let reason = anthropic::stop_reason(stop, self.blocks.tool_uses > 0);
                let sequence = stop_string.filter(|_| stop == StopReason::StopString);
                out.push(json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": anthropic::usage_json(&self.usage),
                }));
                out.push(json!({"type": "message_stop"}));
                self.end = Some((reason, sequence));
            }
            Event::Error { status, message } => return Err(event_error(status, message)),
            Event::Started { .. } => {}
        }
        Ok(out)
    }
}

async fn collect(mut r: Reply) -> Result<Response, ApiError> {
    loop {
        let ev = r.sub.rx.recv().await.ok_or_else(model_gone)?;
        r.handle(ev)?;
        if let Some((reason, sequence)) = &r.end {
            return Ok(json_response(
                StatusCode::OK,
                &anthropic::message_json(
                    &r.meta,
                    &r.blocks.content,
                    Some(reason),
                    sequence.as_deref(),
                    &r.usage,
                ),
            ));
        }
    }
}

/// Anthropic's event stream: `message_start`, `ping`, the content blocks' start / delta /
/// stop events, `message_delta` (stop reason and usage), `message_stop`; a failure after the
/// start is an `error` event.
fn stream(
    r: Reply,
) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static {
    futures_util::stream::unfold((r, false, false), |(mut r, started, done)| async move {
        if done {
            return None;
        }
        if !started {
            let start = json!({"type": "message_start",
                "message": anthropic::message_json(&r.meta, &[], None, None, &r.usage)});
            let out =
                anthropic::sse_event(&start) + &anthropic::sse_event(&json!({"type": "ping"}));
            return Some((Ok(Bytes::from(out)), (r, true, false)));
        }
        loop {
            let events = match r.sub.rx.recv().await {
                Some(ev) => r.handle(ev),
                None => Err(model_gone()),
            };
            let (events, done) = match events {
                Ok(evs) => (evs, r.end.is_some()),
                Err(e) => (vec![anthropic::error_json(&e).1], true),
            };
            if events.is_empty() && !done {
                continue;
            }
            let out: String = events.iter().map(anthropic::sse_event).collect();
            return Some((Ok(Bytes::from(out)), (r, true, done)));
        }
    })
}
