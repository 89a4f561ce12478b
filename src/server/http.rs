//! The HTTP side every endpoint shares (auth, the POST body checks, JSON / SSE / error
//! responses) and the small endpoints: `/health`, `/metrics`, `/v1/models`, the fallbacks.

use super::Shared;
use super::api::ApiError;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Largest request body accepted.
const BODY_LIMIT: usize = 32 << 20;

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
            "Missing API key: send `Authorization: Bearer KEY`.",
        )
        .with_code("invalid_api_key")),
    }
}

/// Compares a given key with the server's in time that does not depend on where they differ.
fn same_secret(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len() && given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The one model this server runs, as `/v1/models` lists it.
fn model_object(s: &Shared) -> Value {
    json!({
        "id": s.config.model_id,
        "object": "model",
        "created": unix_now(),
        "owned_by": "kestrel",
        "max_model_len": s.config.max_seq,
    })
}

pub(super) async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let resp = match check_auth(&s, &headers) {
        Err(e) => error_response(&e),
        Ok(()) => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [model_object(&s)]}),
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

/// Auth, readiness, body and JSON checks common to the POST endpoints.
pub(super) async fn read_request(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    check_auth(s, headers)?;
    check_admitting(s)?;
    read_json(s, headers, body).await
}

/// 503 unless the server takes new generation requests (loaded, not draining).
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

/// Auth, body and JSON checks of a POST endpoint that does not generate (rendering a
/// prompt): answered while loading and draining too.
pub(super) async fn read_request_any_time(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    check_auth(s, headers)?;
    read_json(s, headers, body).await
}

/// The body as JSON, with the model id checked.
async fn read_json(s: &Shared, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
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
