//! The accept loop: each connection is served by hyper's HTTP/1 with a header read timeout
//! (counted from the connection's start or the end of its previous response, so it is also
//! the idle keep-alive limit), and the number of connections is capped: beyond
//! [`ServerConfig::max_connections`] a connection still gets one request (so `/health` and
//! other prompt clients are answered) but must send it within [`OVER_CAP_HEADER_TIMEOUT`],
//! and is closed after it. Idle, half-sent or flooding connections so hold a bounded number of
//! tasks for a bounded time.

use super::{ServerConfig, Shared, router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How long a connection beyond the cap has to send its request's headers.
pub const OVER_CAP_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// Counts a connection as open while it lives.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Accept errors that concern one connection only (the loop goes on at once).
fn per_connection(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// Resolves once the server is closing.
async fn closing_signal(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|c| *c).await;
}

/// Serves `shared`'s routes on `listener` until `shutdown` resolves, then lets the open
/// connections finish their responses (keep-alive ones close after the current one).
///
/// For a graceful stop, `shutdown` is [`super::drain`] (as `kestrel serve` passes it): while it
/// runs, connections are still accepted so that `/health` answers 503 `draining` and new
/// generation requests are refused with 503 (529 on `/v1/messages`) while the taken ones
/// finish; once it resolves the listener closes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let ServerConfig {
        header_timeout,
        max_connections,
        ..
    } = shared.config.clone();
    let app = router(shared);
    let open = Arc::new(AtomicUsize::new(0));
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if per_connection(&e) => continue,
            Err(e) => {
                // Out of file descriptors and the like: wait for connections to close.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let over = open.fetch_add(1, Ordering::SeqCst) >= max_connections;
        let guard = Open(open.clone());
        let service = TowerToHyperService::new(app.clone());
        let mut closing = closing_rx.clone();
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(if over {
                    OVER_CAP_HEADER_TIMEOUT
                } else {
                    header_timeout
                })
                .keep_alive(!over);
            let conn = b.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = closing_signal(&mut closing) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(guard);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    while open.load(Ordering::SeqCst) > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}
