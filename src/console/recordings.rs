//! Session recordings in the console: the list (an auditor's tenant, every
//! tenant for an admin), a player for one, and its file.
//!
//! The player is `web/static/player.js` (ours, no framework): it fetches
//! the recording's file and replays it in a `<pre>` with seek, speed and a
//! search in the output. Without JavaScript the page still shows the
//! output as text (escape sequences removed, the first
//! [`PLAIN_MAX`] bytes). Every view and download is recorded
//! (`recording_view`, `recording_download`) through the broker, which
//! refuses anyone but auditors and admins (`auditor_required`).

use askama::Template;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;

use super::ConsoleState;
use super::pages::{Page, broker_refused as refused, ctx, html, signed_in};
use crate::audit::event::Action;
use crate::broker::recordings::{Recording, RecordingState};

/// Recordings a list shows at most (newest first).
pub const MAX_LISTED: usize = 200;
/// How much of a recording's output the page shows as text.
pub const PLAIN_MAX: usize = 256 * 1024;

pub fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/console/recordings", get(list))
        .route("/console/recordings/{recording_ref}", get(show))
        .route("/console/recordings/{recording_ref}/cast", get(download))
}

/// One recording as the pages show it.
pub struct Row {
    pub recording_ref: String,
    pub kind: &'static str,
    pub subject: String,
    pub tenant: String,
    pub lease_ref: String,
    pub sandbox_ref: String,
    pub profile: String,
    pub created_at: String,
    pub sealed: bool,
    pub bytes: u64,
    pub chunks: usize,
    pub digest: String,
    pub damaged: bool,
}

impl From<&Recording> for Row {
    fn from(r: &Recording) -> Self {
        Self {
            recording_ref: r.recording_ref.clone(),
            kind: r.kind.as_str(),
            subject: r.subject.clone(),
            tenant: r.tenant.clone(),
            lease_ref: r.lease_ref.clone(),
            sandbox_ref: r.sandbox_ref.clone(),
            profile: r.profile.clone(),
            created_at: r.created_at.clone(),
            sealed: r.state == RecordingState::Sealed,
            bytes: if r.state == RecordingState::Sealed {
                r.bytes
            } else {
                r.sealed_bytes()
            },
            chunks: r.chunks.len(),
            digest: r.digest.clone().unwrap_or_default(),
            damaged: !r.damaged.is_empty(),
        }
    }
}

#[derive(Template)]
#[template(path = "recordings.html", config = "web/askama.toml")]
struct ListPage {
    page: Page,
    scope: String,
    filter: Option<String>,
    rows: Vec<Row>,
    more: bool,
    max: usize,
    may_audit: bool,
}

#[derive(Template)]
#[template(path = "recording.html", config = "web/askama.toml")]
struct ShowPage {
    page: Page,
    r: Row,
    plain: String,
    plain_cut: bool,
    markers: Vec<(String, String)>,
    js_version: String,
}

#[derive(Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    lease: Option<String>,
    #[serde(default)]
    subject: Option<String>,
}

pub async fn list(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let p = &who.principal;
    let lease = q
        .lease
        .filter(|l| crate::broker::leases::valid_ref(l, "lease"));
    let subject = q.subject.filter(|s| {
        ["job", "pty", "exec"]
            .iter()
            .any(|k| crate::broker::leases::valid_ref(s, k))
    });
    let mut rows = match st.broker.recordings_for(p, lease.as_deref(), usize::MAX) {
        Ok(r) => r,
        Err(e) => return refused(&who, &e),
    };
    if let Some(s) = &subject {
        rows.retain(|r| &r.subject == s);
    }
    let more = rows.len() > MAX_LISTED;
    rows.truncate(MAX_LISTED);
    let page = ListPage {
        page: Page::new(Some(&who), "recordings"),
        scope: if p.is_admin() {
            "every tenant".into()
        } else {
            format!("tenant {}", p.tenant)
        },
        filter: subject.or(lease),
        rows: rows.iter().map(Row::from).collect(),
        more,
        max: MAX_LISTED,
        may_audit: p.may_audit(),
    };
    html(StatusCode::OK, &page)
}

/// The output of a recording as plain text: escape sequences and control
/// characters other than newlines and tabs removed, at most `max` bytes.
pub fn plain_text(file: &[u8], max: usize) -> (String, bool, Vec<(String, String)>) {
    use base64::Engine;
    let mut raw = String::new();
    let mut markers = vec![];
    for l in file.split(|c| *c == b'\n').skip(1) {
        let Ok((t, code, data)) = serde_json::from_slice::<(f64, String, String)>(l) else {
            continue;
        };
        match code.as_str() {
            "o" | "e" => raw.push_str(&data),
            "ob" | "eb" => {
                if let Ok(b) = base64::engine::general_purpose::STANDARD.decode(data) {
                    raw.push_str(&String::from_utf8_lossy(&b));
                }
            }
            "m" => markers.push((format!("{t:.1}"), data)),
            _ => {}
        }
        if raw.len() > max * 2 {
            break;
        }
    }
    let mut out = String::with_capacity(raw.len().min(max));
    let mut it = raw.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '\u{1b}' => match it.next() {
                // CSI: parameters, then one final byte.
                Some('[') => {
                    for d in it.by_ref() {
                        if ('\u{40}'..='\u{7e}').contains(&d) {
                            break;
                        }
                    }
                }
                // OSC: to BEL or ESC \.
                Some(']') => {
                    while let Some(d) = it.next() {
                        if d == '\u{7}' {
                            break;
                        }
                        if d == '\u{1b}' {
                            it.next();
                            break;
                        }
                    }
                }
                _ => {}
            },
            '\r' if it.peek() == Some(&'\n') => {}
            '\n' | '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
        if out.len() >= max {
            return (out, true, markers);
        }
    }
    (out, false, markers)
}

/// The signed-in person and a recording they may read (`action` is
/// recorded), or the page that says why not.
async fn open(
    st: &ConsoleState,
    headers: &HeaderMap,
    action: Action,
    rec: &str,
) -> Result<(super::session::SignedIn, Recording, std::path::PathBuf), Response> {
    let who = signed_in(st, headers).await?;
    match st
        .broker
        .recording_for(&who.principal, &ctx(), action, rec)
        .await
    {
        Ok((r, path)) => Ok((who, r, path)),
        Err(e) => Err(refused(&who, &e)),
    }
}

/// How much of a file the text view reads: enough for [`PLAIN_MAX`] bytes
/// of text after escapes and JSON are taken away, never the whole of a
/// large recording.
const PLAIN_READ: u64 = 4 * PLAIN_MAX as u64;

pub async fn show(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(rec): Path<String>,
) -> Response {
    let (who, r, path) = match open(&st, &headers, Action::RecordingView, &rec).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    // Off the runtime's threads, and only the start of the file.
    let file = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut b = vec![];
        std::fs::File::open(&path)
            .and_then(|f| f.take(PLAIN_READ).read_to_end(&mut b))
            .map(|_| b)
            .unwrap_or_default()
    })
    .await
    .unwrap_or_default();
    let (plain, plain_cut, markers) = plain_text(&file, PLAIN_MAX);
    let page = ShowPage {
        page: Page::new(Some(&who), "recordings"),
        r: Row::from(&r),
        plain,
        plain_cut: plain_cut || file.len() as u64 >= PLAIN_READ,
        markers,
        js_version: super::assets::version("player.js"),
    };
    html(StatusCode::OK, &page)
}

pub async fn download(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(rec): Path<String>,
) -> Response {
    let (_, r, path) = match open(&st, &headers, Action::RecordingDownload, &rec).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(recording = %r.recording_ref, error = %e, "cannot read a recording");
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
    };
    let body = axum::body::Body::from_stream(tokio_util::io::ReaderStream::new(file));
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-asciicast"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{}\"", r.file_name())) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_drops_escapes_and_keeps_lines() {
        let f = "{}\n[0.1, \"o\", \"\\u001b[?2004hroot# \"]\n[0.2, \"o\", \"echo hi\\r\\n\\u001b]0;title\\u0007hi\\r\\n\"]\n[0.3, \"m\", \"restart\"]\n[0.4, \"e\", \"\\u001b[31merr\\u001b[0m\\n\"]\n";
        let (t, cut, m) = plain_text(f.as_bytes(), 1000);
        assert_eq!(t, "root# echo hi\nhi\nerr\n");
        assert!(!cut);
        assert_eq!(m, vec![("0.3".to_string(), "restart".to_string())]);
        let (t, cut, _) = plain_text(f.as_bytes(), 5);
        assert_eq!(t, "root#");
        assert!(cut);
    }
}
