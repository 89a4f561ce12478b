//! The CORS policy: a cross-origin request (an `Origin` header other than the server's own,
//! `http://` + its `Host`) gets `Access-Control-Allow-*` headers only where its origin is
//! one of [`ServerConfig::allow_origins`](super::ServerConfig::allow_origins) (`*`: any).
//! Otherwise it gets none, so a web page the user opens cannot read any answer, and its
//! preflight `OPTIONS` is refused with 403 in the API's error shape (Anthropic's under
//! `/v1/messages`), so the browser never sends the request itself. Requests without an
//! `Origin` (SDKs, curl) are untouched.

use super::Shared;
use super::api::ApiError;
use super::http::error_response;
use super::messages::anthropic_error;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Methods and headers a preflight may ask for.
const ALLOW_METHODS: &str = "GET, POST, OPTIONS";
const ALLOW_HEADERS: &str = "authorization, content-type, x-api-key, anthropic-version, anthropic-beta, openai-organization, openai-project, x-stainless-*";

/// The request's `Origin` where it is not the server's own.
fn cross_origin(headers: &HeaderMap) -> Option<&str> {
    let origin = headers.get(header::ORIGIN)?.to_str().ok()?.trim();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let own = ["http://", "https://"]
        .iter()
        .any(|scheme| origin.eq_ignore_ascii_case(&format!("{scheme}{host}")));
    (!own).then_some(origin)
}

/// Whether `origin` may read the API's answers.
fn allowed(s: &Shared, origin: &str) -> bool {
    s.config
        .allow_origins
        .iter()
        .any(|o| o == "*" || o.trim_end_matches('/').eq_ignore_ascii_case(origin))
}

pub(super) async fn cors(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let Some(origin) = cross_origin(req.headers()).map(str::to_string) else {
        return next.run(req).await;
    };
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if !allowed(&s, &origin) {
        if !preflight {
            // No CORS headers: the browser keeps the answer from the page.
            return next.run(req).await;
        }
        let e = ApiError::new(
            403,
            "permission_error",
            format!(
                "cross-origin requests from {origin} are not allowed; start the server with `--allow-origin {origin}` to allow them"
            ),
        )
        .with_code("origin_not_allowed");
        let resp = if req.uri().path().starts_with("/v1/messages") {
            anthropic_error(&e)
        } else {
            error_response(&e)
        };
        s.metrics.request("OPTIONS", resp.status().as_u16());
        return resp;
    }
    let allow_origin = if s.config.allow_origins.iter().any(|o| o == "*") {
        HeaderValue::from_static("*")
    } else {
        HeaderValue::from_str(&origin).unwrap_or(HeaderValue::from_static("null"))
    };
    let mut resp = if preflight {
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned();
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(ALLOW_METHODS),
        );
        // The headers it asked for (a browser sends only those), else the usual ones.
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            asked.unwrap_or(HeaderValue::from_static(ALLOW_HEADERS)),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        s.metrics.request("OPTIONS", 204);
        r
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow_origin);
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    resp
}
