//! Connect an agent (admins): the ready configuration of an agent host
//! (Codex, Claude Code, OpenCode, OpenClaw, Hermes Agent) for this
//! appliance, over stdio (`cube-adapter mcp`) or HTTP (`/mcp`), with a
//! freshly created token scoped to a tenant and a profile, shown once.
//!
//! The snippets have one source, `docs/clients/snippets/`: compiled into
//! their generator, `crate::clients` (shared with `cube-adapter connect`,
//! which writes the same entries into a host's file), and the very blocks
//! of `docs/clients/*.md` (a test below fails when a page's block differs
//! from its file). They are written for the
//! documentation's example appliance (`https://cube.example.internal:18080`),
//! profile (`offline-code`) and home (`/home/alice`); the page puts this
//! appliance's URL, the chosen profile and home in their place. The token
//! is made as the signed-in admin through the same path as the Identities
//! page and `cube-adapter token create` (`identities::make_token`).

use askama::Template;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Form, Router};
use serde::Deserialize;

use super::ConsoleState;
use super::identities::{admin_form, admin_only, make_token, record_refusal, refused};
use super::pages::{Page, error_page, html, signed_in};
use super::session::SignedIn;
use crate::audit::event::Action;
use crate::auth::{OpError, TokenSpec};

/// This page's routes, merged into the console's router.
pub fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/console/connect", get(page).post(create))
        .route("/console/connect/ca.pem", get(ca_pem))
}

/// The snippets and the examples they name, and the entries `cube-adapter
/// connect` writes from them: one generator, kept with the command
/// (`crate::clients`), which the page and its tests use as they are.
pub use crate::clients::{EXAMPLE_HOME, HOSTS, SNIPPETS, public_url, render};

/// A profile name that may go into a URL, JSON, TOML, YAML and a shell
/// line as it is.
fn plain(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 64
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// An absolute home directory of plain characters.
fn plain_home(h: &str) -> bool {
    h.starts_with('/')
        && h.len() <= 200
        && !h.split('/').any(|c| c == "..")
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b))
}

/// `host[:port]` the request names (its Host header; over HTTP/2 its
/// authority), checked: plain characters only.
fn host_header(headers: &HeaderMap, uri: &Uri) -> Option<(String, Option<u16>)> {
    let h = match headers.get(header::HOST) {
        Some(v) => v.to_str().ok()?,
        None => uri.authority()?.as_str(),
    };
    if h.is_empty()
        || h.len() > 255
        || !h
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
    {
        return None;
    }
    // `[v6]:port`, `name:port`, `name`.
    let (name, port) = match h.rsplit_once(':') {
        Some((n, p)) if !n.ends_with(':') && (h.starts_with('[') == n.ends_with(']')) => {
            (n, Some(p.parse::<u16>().ok()?))
        }
        _ => (h, None),
    };
    Some((
        name.trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        port,
    ))
}

/// This appliance's URL for agents: the name the browser used when the
/// server certificate covers it (localhost, its addresses, its host name,
/// `server_names`), else the first configured `server_names` entry (else
/// the listen address), with the port of the request or the listener.
pub fn base_url(st: &ConsoleState, headers: &HeaderMap, uri: &Uri) -> String {
    let cfg = st.broker.config();
    public_url(&cfg, cfg.listen, host_header(headers, uri))
}

/// The appliance's CA (`STATE/tls/ca.pem`, next to the served
/// certificate).
fn ca_file(st: &ConsoleState) -> std::path::PathBuf {
    st.cert_file.with_file_name("ca.pem")
}

/// A host as the form offers it.
pub struct HostChoice {
    pub id: &'static str,
    pub name: &'static str,
}

#[derive(Template)]
#[template(path = "connect.html", config = "web/askama.toml")]
struct ConnectPage {
    page: Page,
    hosts: Vec<HostChoice>,
    profiles: Vec<String>,
    url: String,
    ca_fingerprint: String,
    csrf: String,
}

#[derive(Template)]
#[template(path = "connect_result.html", config = "web/askama.toml")]
struct ResultPage {
    page: Page,
    host_name: &'static str,
    doc: &'static str,
    transport: &'static str,
    dest: &'static str,
    lang: &'static str,
    snippet: String,
    token: String,
    token_id: String,
    tenant: String,
    profile: String,
    home: String,
    url: String,
    ca_fingerprint: String,
    ca_hint: &'static str,
    js_version: String,
}

async fn fingerprint(st: &ConsoleState) -> String {
    tokio::fs::read(ca_file(st))
        .await
        .ok()
        .and_then(|pem| crate::tls::cert_info(&pem).ok().map(|c| c.sha256))
        .unwrap_or_else(|| "(unreadable)".into())
}

fn profiles(st: &ConsoleState) -> Vec<String> {
    st.broker
        .config()
        .profiles
        .keys()
        .filter(|p| plain(p))
        .cloned()
        .collect()
}

pub async fn page(State(st): State<ConsoleState>, headers: HeaderMap, uri: Uri) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Some(r) = admin_only(&who) {
        return r;
    }
    let page = ConnectPage {
        page: Page::new(Some(&who), "connect"),
        hosts: HOSTS
            .iter()
            .map(|(id, name, _, _)| HostChoice { id, name })
            .collect(),
        profiles: profiles(&st),
        url: base_url(&st, &headers, &uri),
        ca_fingerprint: fingerprint(&st).await,
        csrf: who.csrf.clone(),
    };
    html(StatusCode::OK, &page)
}

#[derive(Deserialize)]
pub struct ConnectForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    host: String,
    #[serde(default)]
    transport: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    profile: String,
    #[serde(default)]
    home: String,
}

/// A form refused for its input: recorded as a refused `token_create`
/// (as the Identities page records its refusals), then the refusal page.
async fn bad_input(st: &ConsoleState, who: &SignedIn, e: OpError) -> Response {
    record_refusal(st, who, Action::TokenCreate, e.code).await;
    refused(who, &e)
}

pub async fn create(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    uri: Uri,
    Form(f): Form<ConnectForm>,
) -> Response {
    let who = match admin_form(&st, &headers, &f.csrf, Action::TokenCreate).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    let Some(&(host, host_name, doc, ca_hint)) = HOSTS.iter().find(|h| h.0 == f.host) else {
        return bad_input(
            &st,
            &who,
            OpError::new("invalid_host", "choose one of the agent hosts"),
        )
        .await;
    };
    let Some(snippet) = SNIPPETS
        .iter()
        .find(|s| s.host == host && s.transport == f.transport)
    else {
        return bad_input(
            &st,
            &who,
            OpError::new("invalid_transport", "the transport is stdio or http"),
        )
        .await;
    };
    let profile = f.profile.trim();
    if !profiles(&st).iter().any(|p| p == profile) {
        return bad_input(
            &st,
            &who,
            OpError::new("invalid_profile", "choose one of the appliance's profiles"),
        )
        .await;
    }
    let home = match f.home.trim() {
        "" => EXAMPLE_HOME,
        h if plain_home(h) => h.trim_end_matches('/'),
        _ => {
            let e = OpError::new(
                "invalid_home",
                "the home directory is an absolute path of letters, digits, '.', '_', '-' and '/'",
            );
            return bad_input(&st, &who, e).await;
        }
    };
    let name = f.name.trim();
    let spec = TokenSpec {
        tenant: f.tenant.trim().to_string(),
        subject: (!name.is_empty()).then(|| name.to_string()),
        profiles: vec![profile.to_string()],
        ..TokenSpec::default()
    };
    let description = Some(format!("{host_name} over {} (console)", snippet.transport));
    let (principal, token) = match make_token(&st, &who, spec, description).await {
        Ok(t) => t,
        Err(e) => return refused(&who, &e),
    };
    let url = base_url(&st, &headers, &uri);
    let page = ResultPage {
        page: Page::new(Some(&who), "connect"),
        host_name,
        doc,
        transport: snippet.transport,
        dest: snippet.dest,
        lang: snippet.lang,
        snippet: render(snippet, &url, profile, home),
        token_id: super::identities::admin_token_id(&token),
        token,
        tenant: principal.tenant,
        profile: profile.to_string(),
        home: home.to_string(),
        url,
        ca_fingerprint: fingerprint(&st).await,
        ca_hint,
        js_version: super::assets::version("console.js"),
    };
    html(StatusCode::OK, &page)
}

/// The appliance's CA certificate (public), to place on the agent's
/// machine.
pub async fn ca_pem(State(st): State<ConsoleState>, headers: HeaderMap) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Some(r) = admin_only(&who) {
        return r;
    }
    match tokio::fs::read(ca_file(&st)).await {
        Ok(pem) => (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "application/x-pem-file"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"ca.pem\"",
                ),
            ],
            pem,
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "console: the CA certificate is unreadable");
            error_page(
                StatusCode::SERVICE_UNAVAILABLE,
                Some(&who),
                "Unavailable",
                "The appliance's CA certificate cannot be read now.",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clients::{EXAMPLE_PROFILE, EXAMPLE_URL};

    /// The documentation pages, by file name.
    const DOCS: &[(&str, &str)] = &[
        ("codex.md", include_str!("../../docs/clients/codex.md")),
        (
            "claude-code.md",
            include_str!("../../docs/clients/claude-code.md"),
        ),
        (
            "opencode.md",
            include_str!("../../docs/clients/opencode.md"),
        ),
        (
            "openclaw.md",
            include_str!("../../docs/clients/openclaw.md"),
        ),
        ("hermes.md", include_str!("../../docs/clients/hermes.md")),
    ];

    /// Single source: each snippet file is, byte for byte, the block after
    /// its `<!-- check: HOST TRANSPORT DEST -->` marker in its host's page
    /// (the block `tests/hosts/run.sh` checks against the real host).
    #[test]
    fn the_documentation_shows_the_snippets_the_console_renders() {
        for (host, _, doc, _) in HOSTS {
            let page = DOCS.iter().find(|(d, _)| d == doc).expect("a page").1;
            for transport in ["stdio", "http"] {
                let s = SNIPPETS
                    .iter()
                    .find(|s| s.host == *host && s.transport == transport)
                    .expect("a snippet per host and transport");
                let block = format!(
                    "<!-- check: {host} {transport} {} -->\n```{}\n{}```\n",
                    s.dest, s.lang, s.text
                );
                assert!(
                    page.contains(&block),
                    "docs/clients/{doc} does not show docs/clients/snippets for {host} {transport} as it is"
                );
                assert!(s.text.contains(EXAMPLE_URL), "{host} {transport}");
                assert!(s.text.contains(EXAMPLE_PROFILE), "{host} {transport}");
            }
        }
        assert_eq!(SNIPPETS.len(), 2 * HOSTS.len());
    }

    #[test]
    fn rendering_fills_url_profile_and_home() {
        let s = SNIPPETS
            .iter()
            .find(|s| s.host == "codex" && s.transport == "stdio")
            .unwrap();
        let r = render(s, "https://10.0.0.5:18080", "dev", "/home/bob");
        assert!(r.contains("\"--url\", \"https://10.0.0.5:18080\""));
        assert!(r.contains("\"--profile\", \"dev\""));
        assert!(r.contains("\"/home/bob/.config/cube-adapter/token\""));
        assert!(!r.contains("example.internal") && !r.contains("alice"));
        assert!(plain("offline-code") && !plain("a b") && !plain("x\"y") && !plain(""));
        assert!(plain_home("/home/bob") && !plain_home("home") && !plain_home("/a/../b"));
        assert!(!plain_home("/a b") && !plain_home("/a\"b"));
        let mut h = HeaderMap::new();
        let path: Uri = "/console/connect".parse().unwrap();
        assert_eq!(host_header(&h, &path), None);
        let full: Uri = "https://cube.example:9443/console/connect".parse().unwrap();
        assert_eq!(
            host_header(&h, &full),
            Some(("cube.example".into(), Some(9443)))
        );
        h.insert(header::HOST, "127.0.0.1:8443".parse().unwrap());
        assert_eq!(
            host_header(&h, &full),
            Some(("127.0.0.1".into(), Some(8443)))
        );
        h.insert(header::HOST, "[::1]:18080".parse().unwrap());
        assert_eq!(host_header(&h, &path), Some(("::1".into(), Some(18080))));
        h.insert(header::HOST, "cube.example".parse().unwrap());
        assert_eq!(host_header(&h, &path), Some(("cube.example".into(), None)));
        h.insert(header::HOST, "evil\"host".parse().unwrap());
        assert_eq!(host_header(&h, &path), None);
    }
}
