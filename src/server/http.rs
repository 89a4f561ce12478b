//! The HTTP side every endpoint shares (auth, the POST body checks, JSON / SSE / error
//! responses) and the small endpoints: `/health` / `/ready`, `/live`, `/get_load`, `/metrics`,
//! `/v1/models`, the fallbacks.

use super::Shared;
use super::api::ApiError;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(super) fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &e.body())
}

pub(super) fn json_response(status: StatusCode, v: &Value) -> Response {
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

pub(super) async fn not_found() -> Response {
    error_response(
        &ApiError::new(404, "invalid_request_error", "no such endpoint").with_code("not_found"),
    )
}

pub(super) async fn method_not_allowed() -> Response {
    error_response(&ApiError::new(
        405,
        "invalid_request_error",
        "method not allowed for this endpoint",
    ))
}

/// What the server is doing, as `/health`, `/ready` and `/live` report it.
fn status(s: &Shared) -> &'static str {
    if s.draining.load(Ordering::SeqCst) || s.stopping.load(Ordering::SeqCst) {
        "draining"
    } else if s.ready.load(Ordering::SeqCst) {
        "ok"
    } else {
        "loading"
    }
}

/// `GET /health` and `GET /ready`: readiness, what routers probe (vllm-router and
/// sglang-router both `GET /health` and take only a 2xx as healthy): 200 while requests are
/// taken, 503 while loading and while draining.
pub(super) async fn health(State(s): State<Arc<Shared>>) -> Response {
    let st = status(&s);
    let code = if st == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(code, &json!({"status": st}))
}

/// `GET /live`: liveness, 200 whenever the HTTP side answers (loading and draining
/// included), for a supervisor that restarts a hung process and must not kill one that is
/// loading or finishing its requests.
pub(super) async fn live(State(s): State<Arc<Shared>>) -> Response {
    json_response(StatusCode::OK, &json!({"status": status(&s)}))
}

/// `GET /get_load`: the load the routers' load-aware policies read (`load`: requests
/// running and waiting), with the two parts.
pub(super) async fn load(State(s): State<Arc<Shared>>) -> Response {
    let running = s.metrics.running.load(Ordering::Relaxed);
    let waiting = s.metrics.queue_depth.load(Ordering::Relaxed);
    json_response(
        StatusCode::OK,
        &json!({
            "load": running + waiting,
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "draining": s.draining.load(Ordering::SeqCst),
        }),
    )
}

pub(super) async fn metrics_text(State(s): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        s.metrics.render(&s.config.model_id),
    )
        .into_response()
}

fn check_auth(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.config.api_key else {
        return Ok(());
    };
    // `Authorization: Bearer KEY` (the scheme in any case, RFC 9110) or Anthropic's
    // `x-api-key: KEY`.
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest)
        });
    let given = bearer
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    match given {
        Some(g) if same_secret(g.as_bytes(), key.as_bytes()) => Ok(()),
        Some(_) => Err(
            ApiError::new(401, "invalid_request_error", "Incorrect API key provided.")
                .with_code("invalid_api_key"),
        ),
        None => Err(ApiError::new(
            401,
            "invalid_request_error",
            "Missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`.",
        )
        .with_code("invalid_api_key")),
    }
}

/// Compares a given key with the server's in time that does not depend on where they differ.
fn same_secret(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len() && given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The one model this server runs, as `/v1/models` lists it: OpenAI's fields, vLLM's
/// `max_model_len` (the context limit: prompt + reply tokens) and `root`, the vocabulary size,
/// and Anthropic's `type` / `display_name` / `created_at`, so both SDKs' model listings read it.
/// Its creation time is the server's start.
fn model_object(s: &Shared) -> Value {
    json!({
        "id": s.config.model_id,
        "object": "model",
        "created": s.started,
        "owned_by": "kestrel",
        "root": s.config.model_id,
        "max_model_len": s.config.max_seq,
        "vocab_size": s.tokenizer.vocab_size(),
        "type": "model",
        "display_name": s.config.model_id,
        "created_at": rfc3339(s.started),
    })
}

/// `secs` since the Unix epoch as an RFC 3339 UTC time, `1970-01-01T00:00:00Z`.
pub(super) fn rfc3339(secs: u64) -> String {
    // Civil date from days since the epoch (proleptic Gregorian, eras of 400 years).
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

pub(super) async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let resp = match check_auth(&s, &headers) {
        Err(e) => error_response(&e),
        Ok(()) => json_response(
            StatusCode::OK,
            // Anthropic's list fields beside OpenAI's.
            &json!({"object": "list", "data": [model_object(&s)], "has_more": false,
                    "first_id": s.config.model_id, "last_id": s.config.model_id}),
        ),
    };
    s.metrics.request("/v1/models", resp.status().as_u16());
    resp
}

/// `GET /v1/models/{id}` (the `openai` SDK's `models.retrieve`): the model, or a 404 in
/// OpenAI's error shape for any other id.
pub(super) async fn model(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let resp = match check_auth(&s, &headers) {
        Err(e) => error_response(&e),
        Ok(()) if id == s.config.model_id => json_response(StatusCode::OK, &model_object(&s)),
        Ok(()) => error_response(
            &ApiError::new(
                404,
                "invalid_request_error",
                format!(
                    "The model `{id}` does not exist; this server runs `{}`.",
                    s.config.model_id
                ),
            )
            .with_code("model_not_found"),
        ),
    };
    s.metrics.request("/v1/models/{id}", resp.status().as_u16());
    resp
}

pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Auth, readiness, body and JSON checks common to the POST endpoints that generate.
pub(super) async fn read_request(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    read_json(s, headers, body, true).await
}

/// 503 unless the server takes new generation requests (loaded, not draining, not
/// stopping).
fn check_admitting(s: &Shared) -> Result<(), ApiError> {
    if s.draining.load(Ordering::SeqCst) && !s.stopping.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "service_unavailable",
            "the server is draining: it finishes the requests it has and takes no new ones; retry on another replica",
        )
        .with_code("draining"));
    }
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
    Ok(())
}

/// [`read_request`]; without `need_model` (endpoints that only tokenize or render a prompt)
/// it answers while the weights load, while the server drains and while it shuts down.
pub(super) async fn read_json(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
    need_model: bool,
) -> Result<Value, ApiError> {
    check_auth(s, headers)?;
    if need_model {
        check_admitting(s)?;
    }
    // Only JSON bodies: a `text/plain` POST needs no CORS preflight, so accepting one would
    // let any web page the user opens make this server generate.
    let json_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
    if !json_type {
        return Err(ApiError::new(
            415,
            "invalid_request_error",
            "the request body must be JSON, sent with `Content-Type: application/json`",
        )
        .with_code("unsupported_media_type"));
    }
    // A body declared too large is refused before any of it is read.
    let limit = s.config.max_body;
    let too_large = || {
        ApiError::new(
            413,
            "invalid_request_error",
            format!("the request body exceeds {limit} bytes"),
        )
        .with_code("request_too_large")
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let read = tokio::time::timeout(s.config.body_timeout, axum::body::to_bytes(body, limit));
    let bytes = match read.await {
        Err(_) => {
            return Err(ApiError::new(
                408,
                "invalid_request_error",
                format!(
                    "the request body was not received within {} s",
                    s.config.body_timeout.as_secs_f64()
                ),
            )
            .with_code("request_timeout"));
        }
        Ok(Err(e)) if format!("{e}").contains("length limit") => return Err(too_large()),
        Ok(Err(e)) => {
            return Err(ApiError::invalid(
                "",
                format!("cannot read the request body: {e:#}"),
            ));
        }
        Ok(Ok(b)) => b,
    };
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

pub(super) fn sse_response<S>(stream: S) -> Response
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

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::rfc3339(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(super::rfc3339(4_102_444_800), "2100-01-01T00:00:00Z");
    }
}
