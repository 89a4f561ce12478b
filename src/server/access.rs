//! The access log (one `tracing` info line per request: method, path, status, duration,
//! prompt and generated tokens; off with `--no-access-log`) and each request's arrival time,
//! which the model's queue-time, time-to-first-token and end-to-end histograms count from.
//!
//! The middleware gives each request a [`Tokens`] record, reachable from its handler through
//! a task-local ([`current`]); the model thread fills in the token counts when the reply
//! ends. A streamed response is logged when its body ends (or the client drops it), any
//! other once it is built.

use super::Shared;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

/// One request's arrival and the token counts of its reply.
pub struct Tokens {
    pub start: Instant,
    prompt: AtomicU64,
    generated: AtomicU64,
}

impl Tokens {
    pub fn set(&self, prompt: usize, generated: usize) {
        self.prompt.store(prompt as u64, Ordering::Relaxed);
        self.generated.store(generated as u64, Ordering::Relaxed);
    }
}

tokio::task_local! {
    static CURRENT: Arc<Tokens>;
}

/// The record of the request whose handler calls this (none outside the middleware).
pub fn current() -> Option<Arc<Tokens>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// Writes the line when dropped.
struct Line {
    method: String,
    path: String,
    status: u16,
    tokens: Arc<Tokens>,
}

impl Drop for Line {
    fn drop(&mut self) {
        tracing::info!(
            target: "kestrel::access",
            "{} {} {} {:.1} ms prompt_tokens={} completion_tokens={}",
            self.method,
            self.path,
            self.status,
            self.tokens.start.elapsed().as_secs_f64() * 1e3,
            self.tokens.prompt.load(Ordering::Relaxed),
            self.tokens.generated.load(Ordering::Relaxed),
        );
    }
}

/// A response body that logs its request's line when it ends or is dropped.
struct Logged {
    inner: Body,
    line: Option<Line>,
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            self.line.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

pub(super) async fn access(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let tokens = Arc::new(Tokens {
        start: Instant::now(),
        prompt: AtomicU64::new(0),
        generated: AtomicU64::new(0),
    });
    let (method, path) = (req.method().to_string(), req.uri().path().to_string());
    let resp = CURRENT.scope(tokens.clone(), next.run(req)).await;
    if !s.config.access_log {
        return resp;
    }
    let line = Line {
        method,
        path,
        status: resp.status().as_u16(),
        tokens,
    };
    let streamed = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    if !streamed {
        drop(line);
        return resp;
    }
    let (parts, body) = resp.into_parts();
    Response::from_parts(
        parts,
        Body::new(Logged {
            inner: body,
            line: Some(line),
        }),
    )
}
