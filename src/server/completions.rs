//! `POST /v1/completions`: a text or token-id prompt, answered as one JSON object or as an
//! SSE stream.

use super::Shared;
use super::api::{self, ApiError, Usage};
use super::http::{error_response, json_response, read_request, sse_response};
use super::submit::{
    context_error, context_floor, encode_bounded, event_error, finish_reason, fits_context,
    gone_event, max_tokens_cap, meta, model_gone, settings, submit, token_text,
};
use super::worker::Event;
use crate::generate::Channel;
use crate::sampling::TokenLogprobs;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

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

pub(super) async fn completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let _busy = s.busy();
    let resp = match completion_inner(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    s.metrics.request("/v1/completions", resp.status().as_u16());
    resp
}

async fn completion_inner(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let v = read_request(s, headers, body).await?;
    let (prompt, params) = api::parse_completion(&v, &s.defaults)?;
    max_tokens_cap(s, params.max_tokens)?;
    let ids = match prompt {
        api::PromptInput::Text(t) => {
            context_floor(s, t.len(), "prompt")?;
            let s2 = s.clone();
            tokio::task::spawn_blocking(move || encode_bounded(&s2, &t, true, "prompt"))
                .await
                .map_err(|e| {
                    ApiError::new(500, "server_error", format!("tokenization failed: {e}"))
                })??
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
    fits_context(s, ids.len(), params.max_tokens, "prompt")?;
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
                        // Closed before `Done` or `Error`: still an error event, not silence.
                        let ev = sub.rx.recv().await.unwrap_or_else(gone_event);
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
