//! Serving an axum router on a bound TCP listener, over TLS (handshake per
//! connection, under a timeout, never in the accept loop) or plain HTTP.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// How long a client may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accept connections until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
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
            () = &mut shutdown => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
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
                            builder
                                .serve_connection_with_upgrades(
                                    TokioIo::new(tls),
                                    TowerToHyperService::new(app),
                                )
                                .await
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
                    builder
                        .serve_connection_with_upgrades(
                            TokioIo::new(stream),
                            TowerToHyperService::new(app),
                        )
                        .await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
