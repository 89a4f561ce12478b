//! `POST /tokenize` and `POST /detokenize` in llama.cpp's shapes: `{content, add_special?,
//! parse_special?, with_pieces?}` → `{tokens: [id, ...]}` (or `[{id, piece}, ...]`, a piece
//! that is not whole UTF-8 as its bytes), and `{tokens}` → `{content}`. They need only the
//! tokenizer, so they answer while the weights load.

use super::Shared;
use super::api::ApiError;
use super::http::{error_response, json_response, read_json};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Map, Value, json};
use std::sync::Arc;

fn flag(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
    }
}

/// The body as a JSON object (auth and body checks first; no need for the model).
async fn read_object(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<Map<String, Value>, ApiError> {
    match read_json(s, headers, body, false).await? {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::invalid(
            "",
            "the request body must be a JSON object",
        )),
    }
}

/// Tokenizing a long text takes a while: off the async workers.
async fn blocking<T: Send + 'static>(
    s: &Arc<Shared>,
    f: impl FnOnce(&Shared) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let s = s.clone();
    tokio::task::spawn_blocking(move || f(&s))
        .await
        .map_err(|e| ApiError::new(500, "server_error", format!("tokenizer task failed: {e}")))?
}

async fn tokenize_inner(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    let obj = read_object(s, headers, body).await?;
    let content = match obj.get("content") {
        Some(Value::String(t)) => t.clone(),
        _ => {
            return Err(ApiError::invalid(
                "content",
                "`content` is required and must be a string",
            ));
        }
    };
    // This tokenizer adds no BOS or other special tokens of its own, so `add_special` changes
    // nothing; it is checked and accepted.
    flag(&obj, "add_special", false)?;
    let parse_special = flag(&obj, "parse_special", true)?;
    let with_pieces = flag(&obj, "with_pieces", false)?;
    // a text the context cannot hold is refused as a prompt would be, and tokenized within
    // the server's budget
    super::submit::context_floor(s, content.len(), "content")?;
    blocking(s, move |s| {
        let ids = super::submit::encode_bounded(s, &content, parse_special, "content")?;
        let tokens: Vec<Value> = if with_pieces {
            ids.iter()
                .map(|&id| {
                    let bytes = s.tokenizer.token_bytes(id).unwrap_or_default();
                    let piece = match String::from_utf8(bytes) {
                        Ok(t) => json!(t),
                        Err(e) => json!(e.into_bytes()),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect()
        } else {
            ids.iter().map(|&id| json!(id)).collect()
        };
        Ok(json!({"tokens": tokens}))
    })
    .await
}

async fn detokenize_inner(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    let obj = read_object(s, headers, body).await?;
    let vocab = s.tokenizer.vocab_size();
    let ids = obj
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` must be a list of token ids"))?
        .iter()
        .map(|t| match t.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            _ => Err(ApiError::invalid(
                "tokens",
                format!("{t} is not a token id (0 to {})", vocab - 1),
            )),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    blocking(s, move |s| {
        let content = s
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::new(500, "server_error", format!("{e:#}")))?;
        Ok(json!({"content": content}))
    })
    .await
}

fn respond(s: &Shared, endpoint: &str, r: Result<Value, ApiError>) -> Response {
    let resp = match r {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => error_response(&e),
    };
    s.metrics.request(endpoint, resp.status().as_u16());
    resp
}

pub(super) async fn tokenize(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r = tokenize_inner(&s, &headers, body).await;
    respond(&s, "/tokenize", r)
}

pub(super) async fn detokenize(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r = detokenize_inner(&s, &headers, body).await;
    respond(&s, "/detokenize", r)
}
