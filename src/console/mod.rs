//! The web console (`/console`): server-rendered pages for approvers,
//! auditors and admins (docs/architecture.md, "Where things live"; `docs/console.md`).
//!
//! Templates live in `web/templates/` (askama, compiled in), static assets
//! in `web/static/` (rust-embed, served under `/console/static/`). Every
//! answer carries the browser security headers (`security_headers`); pages
//! need a signed-in person (`session`), forms a CSRF token.
//!
//! Pages: sign-in and sign-out, the Overview, Approvals (the queue, a
//! plan's review, approve/deny), Tasks (list, detail, receipt download and
//! verification, cancel), Audit (search, export, the chain's state),
//! Leases (leases, jobs, PTYs, a job's output tail), Identities and Connect
//! an agent (admins). Approval notifications are sent by `notify`.

mod approvals;
mod assets;
mod audit;
mod connect;
mod identities;
mod live;
pub mod notify;
mod oidc;
mod pages;
mod recordings;
pub mod session;
mod tasks;

use std::path::PathBuf;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};

use crate::auth::Authenticator;
use crate::broker::Broker;

/// What the console's handlers need. Cheap to clone.
#[derive(Clone)]
pub struct ConsoleState {
    pub broker: Broker,
    pub auth: Authenticator,
    /// How the backend is described (`app::Started::backend`).
    pub backend: String,
    /// The served certificate's file (`TLS/server.pem`): its days left.
    pub cert_file: PathBuf,
    /// Sign-in with the company's identity provider (`[console.oidc]`).
    pub oidc: Option<std::sync::Arc<crate::auth::oidc::CodeFlow>>,
}

/// Largest form body accepted (sign-in is the largest form).
const MAX_FORM: usize = 16 * 1024;

/// `/console…`. Merged into the appliance's router by `app`.
pub fn router(st: ConsoleState) -> Router {
    Router::new()
        .route("/console", get(pages::overview))
        .route("/console/", get(pages::to_overview))
        .route(
            "/console/sign-in",
            get(pages::sign_in_form).post(pages::sign_in),
        )
        .route("/console/sign-out", post(pages::sign_out))
        .route("/console/oidc/start", get(oidc::start))
        .route("/console/oidc/callback", get(oidc::callback))
        .route("/console/approvals", get(approvals::queue))
        .route("/console/approvals/pending", get(approvals::pending))
        .route("/console/plans/{plan_ref}", get(approvals::review))
        .route("/console/plans/{plan_ref}/decide", post(approvals::decide))
        .merge(tasks::routes())
        .merge(audit::routes())
        .merge(live::routes())
        .merge(recordings::routes())
        .merge(identities::routes())
        .merge(connect::routes())
        .route("/console/static/{*path}", get(assets::serve))
        // Unknown console pages answer as the console does (headers, HTML).
        .route("/console/{*rest}", get(pages::not_found))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_FORM))
        .layer(middleware::from_fn(security_headers))
        .with_state(st)
}

/// The headers every console answer carries. `Cache-Control` is
/// `no-store` unless the handler chose (static assets: long-lived).
pub const SECURITY_HEADERS: &[(&str, &str)] = &[
    (
        "content-security-policy",
        "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    ("referrer-policy", "no-referrer"),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
];

async fn security_headers(req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    for (k, v) in SECURITY_HEADERS {
        h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
    }
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    r
}
