//! Serving an axum router on a bound TCP listener, over TLS (handshake per
//! connection, under a timeout, never in the accept loop) or plain HTTP.
//!
//! At shutdown the listener closes, every open connection is asked to end
//! gracefully (requests in progress finish; idle keep-alive connections
//! close) and `serve` waits for them for at most [`DRAIN_TIMEOUT`]; what is
//! still open then (an event stream, a stuck client) is dropped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// How long a client may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long shutdown waits for open connections to finish.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Accept connections until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // Connection tasks still in their handshake are not watched yet: they
    // are tracked here and end with the drain too.
    let tasks = tokio_util::task::TaskTracker::new();
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let acceptor = acceptor.clone();
        let watcher = graceful.watcher();
        let cancel = cancel.clone();
        tasks.spawn(cancel.run_until_cancelled_owned(async move {
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let result = match acceptor {
                Some(acc) => {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acc.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            // A verified client certificate, for the
                            // handlers to look up (by its SHA-256).
                            let peer_cert = tls
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|c| c.first())
                                .map(|c| {
                                    use sha2::Digest;
                                    crate::auth::PeerCert(sha2::Sha256::digest(c.as_ref()).into())
                                });
                            let app = tower::ServiceExt::map_request(
                                app,
                                move |mut req: axum::http::Request<hyper::body::Incoming>| {
                                    if let Some(pc) = peer_cert {
                                        req.extensions_mut().insert(pc);
                                    }
                                    req
                                },
                            );
                            let conn = builder.serve_connection_with_upgrades(
                                TokioIo::new(tls),
                                TowerToHyperService::new(app),
                            );
                            watcher.watch(conn.into_owned()).await
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    }
                }
                None => {
                    let conn = builder.serve_connection_with_upgrades(
                        TokioIo::new(stream),
                        TowerToHyperService::new(app),
                    );
                    watcher.watch(conn.into_owned()).await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }));
    }
    drop(listener);
    tasks.close();
    let open = graceful.count();
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        graceful.shutdown().await;
        tasks.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open,
            "connections still open {}s after shutdown began; closing them",
            DRAIN_TIMEOUT.as_secs()
        );
        cancel.cancel();
        tasks.wait().await;
    } else if open > 0 {
        tracing::info!(open, "open connections drained");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At shutdown a request in progress still gets its answer, new
    /// connections are refused, and `serve` returns once it is drained.
    #[tokio::test]
    async fn shutdown_drains_requests_in_progress() {
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = finished.clone();
        let app = Router::new().route(
            "/slow",
            axum::routing::get(move || async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                f.store(true, std::sync::atomic::Ordering::SeqCst);
                "done"
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, app, None, async move {
            let _ = rx.await;
        }));
        crate::tls::install_default_provider();
        let http = reqwest::Client::new();
        let inflight = tokio::spawn({
            let http = http.clone();
            async move { http.get(format!("http://{addr}/slow")).send().await }
        });
        // Shut down once the request is in the handler.
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
        assert!(
            finished.load(std::sync::atomic::Ordering::SeqCst),
            "serve returned before the request in progress was answered"
        );
        let r = inflight.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "done");
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the listener outlived serve"
        );
    }
}
