//! Start-up, phase 6: the routes (`/v1`, `/mcp`, the console, `/metrics`),
//! the admin socket and SIGHUP, and the listener's TLS.

use std::net::SocketAddr;
use std::sync::Arc;

use super::identities::Tls;
use super::state::Opened;
use super::{Reload, Tasks};
use crate::api::{self, AppState};
use crate::auth::Authenticator;
use crate::broker::Broker;
use crate::config::Config;

/// What the listener serves, and how.
pub(super) struct Http {
    pub app: axum::Router,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    pub judge: Option<crate::server::PeerJudge>,
    pub url: String,
}

/// What the routes are made of.
pub(super) struct Parts<'a> {
    pub cfg: &'a Arc<Config>,
    pub opened: &'a Opened,
    pub tls: Tls,
    pub authn: Authenticator,
    pub console_oidc: Option<Arc<crate::auth::oidc::CodeFlow>>,
    pub broker: &'a Broker,
    pub backend: &'a str,
    pub addr: SocketAddr,
    pub reload: &'a Reload,
}

/// The application (every route under one request-metrics layer, HSTS on
/// HTTPS), the admin socket (`STATE/admin.sock`) and, for a service, the
/// SIGHUP handler; both are aborted at shutdown (they hold nothing
/// half-done).
pub(super) async fn start(p: Parts<'_>, tasks: &mut Tasks) -> anyhow::Result<Http> {
    let Parts {
        cfg,
        opened,
        tls,
        authn,
        console_oidc,
        broker,
        backend,
        addr,
        reload,
    } = p;
    let st = AppState {
        broker: broker.clone(),
        auth: authn.clone(),
        metrics: Arc::new(api::Metrics::new(
            // As a message: it names its cause already (no chain to repeat it).
            cfg.metrics.token().map_err(anyhow::Error::msg)?,
            Some(tls.ca.dir.clone()),
        )),
    };
    // `/mcp` runs its tools through the same `/v1` router, in-process.
    let v1 = api::router(st.clone());
    let mut hosts = tls.names.clone();
    hosts.extend(["localhost", "127.0.0.1", "::1"].map(String::from));
    let console = crate::console::router(crate::console::ConsoleState {
        broker: broker.clone(),
        auth: authn.clone(),
        backend: backend.to_string(),
        cert_file: tls.ca.dir.join("server.pem"),
        oidc: console_oidc,
    });
    let http_metrics = st.metrics.clone();
    // The request histograms see every route: a layer on the whole app,
    // where each route's `MatchedPath` is known.
    let mut app = crate::mcp::http::router(st, v1.clone(), hosts)
        .merge(v1)
        .merge(console)
        .layer(axum::middleware::from_fn_with_state(
            http_metrics,
            api::track,
        ));
    let server_tls = if cfg.insecure_plain_http {
        anyhow::ensure!(
            addr.ip().is_loopback(),
            "plain HTTP is only allowed on a loopback address"
        );
        None
    } else {
        // HTTPS answers (API, MCP, console alike) carry HSTS; plain HTTP
        // on loopback does not (a browser ignores it there anyway).
        app = app.layer(axum::middleware::map_response(crate::server::hsts));
        Some(Arc::new(tls.server))
    };
    let scheme = if server_tls.is_some() {
        "https"
    } else {
        "http"
    };
    let url = format!("{scheme}://{addr}");
    // Operator commands reach the running service on the admin socket.
    let reloader = Arc::new(crate::ops::Reloader::new(
        match reload {
            Reload::Off => None,
            Reload::Signal(source) => Some(source.clone()),
        },
        (**cfg).clone(),
        tls.ca.clone(),
        addr,
        tls.served,
        Some(broker.clone()),
        Some(authn.clone()),
    ));
    let ops = Arc::new(crate::ops::Service {
        store: opened.store.clone(),
        broker: broker.clone(),
        reloader: reloader.clone(),
        state: opened.state.clone(),
        url: url.clone(),
        backend: backend.to_string(),
        started_at: cfg.clock.text(),
    });
    let admin = opened.state.join("admin.sock");
    tasks.aborted(
        "admin socket",
        crate::admin::serve(&admin, opened.store.clone(), authn, ops)
            .await
            .map_err(|e| anyhow::anyhow!("admin socket {}: {e}", admin.display()))?,
    );
    if let Reload::Signal(_) = reload {
        tasks.aborted(
            "SIGHUP handler",
            crate::ops::spawn_sighup(reloader)
                .map_err(|e| anyhow::anyhow!("SIGHUP handler: {e}"))?,
        );
    }
    let judge = server_tls.is_some().then_some(tls.judge);
    Ok(Http {
        app,
        tls: server_tls,
        judge,
        url,
    })
}
