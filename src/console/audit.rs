//! Audit: search the journal by time, tenant, identity, runtime, action,
//! outcome, sandbox, request id and plan/task ref; cursor paging; export of
//! the current filter as JSONL and CSV; the chain's verification state.
//!
//! For auditors and admins: an auditor searches their own tenant's events
//! only, an admin every tenant's; approvers (who decide, not inspect) are
//! refused with `action_denied`, recorded as on `/v1`. Every search, page
//! and export is itself an event (`audit_search`, `audit_export`) of the
//! signed-in person, with a digest of the filter.
//!
//! The search runs on the journal's indexes (schema 6,
//! `store::audit_index`, `audit::search`): pages are newest first, the
//! cursor (`after`) is the `seq` below which the next page starts.

use askama::Template;
use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;

use super::ConsoleState;
use super::pages::{Page, ctx, error_page, html, signed_in};
use super::session::SignedIn;
use crate::audit::event::{Action, Event, Outcome, Phase};
use crate::audit::search::{self, Query as Search};
use crate::audit::{AuditError, Journal};
use crate::broker::{Code, Error};
use crate::store::audit_index::Field;

/// Events on one page.
pub const PAGE_SIZE: usize = 50;
/// Events an export reads in one read transaction (one chunk of answer).
const EXPORT_BATCH: usize = 512;
/// Chunks read ahead of a slow reader.
const EXPORT_AHEAD: usize = 2;
/// Longest filter value accepted.
const MAX_VALUE: usize = 200;

/// This page's routes, merged into the console's router.
pub fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/console/audit", get(search_page))
        .route("/console/audit/export.jsonl", get(export_jsonl))
        .route("/console/audit/export.csv", get(export_csv))
}

/// The query of the page and the exports (every field optional).
#[derive(Debug, Default, Deserialize)]
pub struct Params {
    #[serde(default)]
    from: String,
    #[serde(default)]
    to: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    identity: String,
    #[serde(default)]
    runtime: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    outcome: String,
    #[serde(default)]
    sandbox_ref: String,
    #[serde(default)]
    request_id: String,
    #[serde(default)]
    plan_ref: String,
    #[serde(default)]
    task_ref: String,
    #[serde(default)]
    after: String,
}

impl Params {
    /// The filter as a query string (without the cursor), fields in a fixed
    /// order: the exports' and the next page's links, and what the search
    /// event digests.
    fn filter_query(&self) -> String {
        let mut s = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in self.fields() {
            if !v.trim().is_empty() {
                s.append_pair(k, v.trim());
            }
        }
        s.finish()
    }

    fn fields(&self) -> [(&'static str, &str); 11] {
        [
            ("from", &self.from),
            ("to", &self.to),
            ("tenant", &self.tenant),
            ("identity", &self.identity),
            ("runtime", &self.runtime),
            ("action", &self.action),
            ("outcome", &self.outcome),
            ("sandbox_ref", &self.sandbox_ref),
            ("request_id", &self.request_id),
            ("plan_ref", &self.plan_ref),
            ("task_ref", &self.task_ref),
        ]
    }
}

/// Outcomes an event can have (the form's choices): the vocabulary's
/// words, in its order.
pub const OUTCOMES: &[&str] = Outcome::WORDS;

/// Why a filter was refused.
#[derive(Debug)]
enum Bad {
    /// 400 `invalid_request`: the message says which field.
    Input(String),
    /// 403 `action_denied`: another tenant's events, for a non-admin.
    Tenant,
    /// 403 `action_denied`: neither an auditor nor an admin.
    Role,
}

fn plain(name: &str, v: &str) -> Result<(), Bad> {
    if v.len() > MAX_VALUE {
        return Err(Bad::Input(format!(
            "{name} is too long (at most {MAX_VALUE} bytes)"
        )));
    }
    if v.chars().any(|c| c.is_control()) {
        return Err(Bad::Input(format!("{name} has a control character")));
    }
    Ok(())
}

fn is_digest(v: &str) -> bool {
    v.len() == 32 && v.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The search a query asks for, scoped to what `who` may see.
fn build(j: &Journal, who: &SignedIn, p: &Params) -> Result<(Search, Option<u64>), Bad> {
    for (k, v) in p.fields() {
        plain(k, v.trim())?;
    }
    let t = |s: &str, name: &str| -> Result<Option<i64>, Bad> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(None);
        }
        search::parse_time(s).map(Some).ok_or_else(|| {
            Bad::Input(format!(
                "{name} is not a time: use 2026-05-01, 2026-05-01T10:00 (UTC) or RFC 3339"
            ))
        })
    };
    let (from, to) = (t(&p.from, "from")?, t(&p.to, "to")?);
    if let (Some(f), Some(t)) = (from, to)
        && f >= t
    {
        return Err(Bad::Input("from must be before to".into()));
    }
    let mut q = Search::default().between(from, to);
    let me = &who.principal;
    let tenant = p.tenant.trim();
    // A non-admin sees their own tenant's events, whatever is asked.
    let tenant = if me.is_admin() {
        (!tenant.is_empty()).then_some(tenant)
    } else if tenant.is_empty() || tenant == me.tenant {
        Some(me.tenant.as_str())
    } else {
        return Err(Bad::Tenant);
    };
    if let Some(t) = tenant {
        q = q.with(Field::Tenant, &j.digest("tenant", t.as_bytes()));
    }
    let identity = p.identity.trim();
    if !identity.is_empty() {
        let d = if is_digest(identity) {
            identity.to_string()
        } else {
            let Some(t) = tenant else {
                return Err(Bad::Input(
                    "identity needs a tenant (or give the identity's 32-character digest)".into(),
                ));
            };
            j.digest("identity", format!("{t}\0{identity}").as_bytes())
        };
        q = q.with(Field::Identity, &d);
    }
    let outcome = p.outcome.trim();
    if !outcome.is_empty() && outcome.parse::<Outcome>().is_err() {
        return Err(Bad::Input(format!(
            "outcome must be one of {}",
            OUTCOMES.join(", ")
        )));
    }
    for (f, v) in [
        (Field::Runtime, &p.runtime),
        (Field::Action, &p.action),
        (Field::Outcome, &p.outcome),
        (Field::SandboxRef, &p.sandbox_ref),
        (Field::RequestId, &p.request_id),
        (Field::PlanRef, &p.plan_ref),
        (Field::TaskRef, &p.task_ref),
    ] {
        let v = v.trim();
        if !v.is_empty() {
            q = q.with(f, v);
        }
    }
    let after = match p.after.trim() {
        "" => None,
        a => Some(a.parse::<u64>().map_err(|_| {
            Bad::Input("after is not a cursor (a sequence number from a next-page link)".into())
        })?),
    };
    Ok((q, after))
}

/// The person's event for this look at the journal (the filter as a
/// digest of its query string).
fn event(st: &ConsoleState, who: &SignedIn, action: Action, p: &Params) -> Event {
    let j = st.broker.journal();
    let mut ev = st.broker.event(&who.principal, action, &ctx());
    ev.runtime = Some("console".into());
    ev.parameters_digest = Some(j.digest("audit_filter", p.filter_query().as_bytes()));
    ev
}

/// The refusal of a look at the journal: recorded (as `/v1` records a
/// denied request), then a page with the code.
async fn refuse(st: &ConsoleState, who: &SignedIn, ev: Event, bad: Bad) -> Response {
    let e = match bad {
        Bad::Input(m) => Error::new(Code::InvalidRequest, m),
        Bad::Tenant => Error::new(
            Code::ActionDenied,
            "you may search your own tenant's events only",
        ),
        Bad::Role => Error::new(
            Code::ActionDenied,
            "the audit journal is for auditors and admins",
        ),
    };
    let e = st.broker.reject(ev, e).await;
    error_page(
        e.code.status(),
        Some(who),
        if e.code == Code::InvalidRequest {
            "Bad search"
        } else {
            "Refused"
        },
        &format!("{} ({})", e.message, e.code.as_str()),
    )
}

/// Who may look, the query checked, the look recorded: the search to run,
/// or the answer to give instead.
async fn admit(
    st: &ConsoleState,
    headers: &HeaderMap,
    action: Action,
    p: &Params,
) -> Result<(SignedIn, Search, Option<u64>), Response> {
    let who = signed_in(st, headers).await?;
    let mut ev = event(st, &who, action, p);
    if !who.principal.may_audit() {
        return Err(refuse(st, &who, ev, Bad::Role).await);
    }
    let (q, after) = match build(st.broker.journal(), &who, p) {
        Ok(v) => v,
        Err(b) => return Err(refuse(st, &who, ev, b).await),
    };
    ev.outcome = Outcome::Ok;
    ev.phase = Phase::Event;
    if let Err(e) = st.broker.journal().record(ev).await {
        // Looking at the journal is audited: a look it cannot record
        // (audit required) does not happen.
        tracing::error!(error = %e, "an audit search was not recorded: refused");
        return Err(error_page(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(&who),
            "Unavailable",
            "The audit journal cannot record this search now (audit_unavailable).",
        ));
    }
    Ok((who, q, after))
}

/// One row of the results.
pub struct Row {
    pub seq: u64,
    pub ts: String,
    pub action: String,
    pub phase: String,
    pub outcome: String,
    pub ok: bool,
    pub runtime: String,
    pub sandbox_ref: String,
    pub request_id: String,
    pub plan_ref: String,
    pub task_ref: String,
    pub error_code: String,
    pub identity: String,
    pub tenant: String,
    /// The recording the event is about, or of the job or PTY it is about
    /// (a link to the player, or to that subject's recordings).
    pub recording_ref: String,
    pub subject: String,
}

fn short(d: &Option<String>) -> String {
    d.as_deref().unwrap_or("").chars().take(12).collect()
}

impl From<Event> for Row {
    fn from(e: Event) -> Self {
        Self {
            seq: e.seq,
            ok: e.outcome == Outcome::Ok,
            identity: short(&e.identity_digest),
            tenant: short(&e.tenant_digest),
            ts: e.ts,
            action: e.action.to_string(),
            phase: e.phase.to_string(),
            outcome: e.outcome.to_string(),
            runtime: e.runtime.unwrap_or_default(),
            sandbox_ref: e.sandbox_ref.unwrap_or_default(),
            request_id: e.request_id.unwrap_or_default(),
            plan_ref: e.plan_ref.unwrap_or_default(),
            task_ref: e.task_ref.unwrap_or_default(),
            error_code: e.error_code.unwrap_or_default(),
            recording_ref: e.recording_ref.unwrap_or_default(),
            subject: e.job_ref.or(e.pty_ref).unwrap_or_default(),
        }
    }
}

/// The journal's own state and its chain head.
pub struct ChainState {
    pub ok: bool,
    pub state: &'static str,
    pub mode: &'static str,
    pub events: u64,
    pub head: String,
    pub pending: usize,
}

#[derive(Template)]
#[template(path = "audit.html", config = "web/askama.toml")]
struct AuditPage {
    page: Page,
    scope: String,
    admin: bool,
    f: Params,
    outcomes: &'static [&'static str],
    rows: Vec<Row>,
    page_size: usize,
    first_page: bool,
    next: Option<String>,
    filter: String,
    chain: ChainState,
}

/// The chain's head as read in `txn`: its last sequence number, the last
/// event's hash and how many outcomes are pending.
fn chain_head(txn: &crate::store::Rx) -> Result<(u64, String, usize), crate::store::StoreError> {
    let last = crate::audit::last_seq(txn)?;
    let head = crate::store::journal::event(txn, last)?
        .map(|e| e.hash)
        .unwrap_or_else(|| crate::audit::event::GENESIS.to_string());
    let pending = crate::store::journal::pending(txn)?.len();
    Ok((last, head, pending))
}

fn chain_state(j: &Journal, (events, head, pending): (u64, String, usize)) -> ChainState {
    let (state, ok) = match j.check() {
        Ok(()) => ("ok", true),
        Err(AuditError::Blocked) => ("reconciliation required", false),
        Err(AuditError::Unavailable(_)) => ("blocked: the store cannot commit", false),
    };
    ChainState {
        ok,
        state,
        mode: super::pages::audit_mode_text(j.mode()),
        events,
        head,
        pending,
    }
}

pub async fn search_page(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Query(p): Query<Params>,
) -> Response {
    let (who, q, after) = match admit(&st, &headers, Action::AuditSearch, &p).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let j = st.broker.journal();
    let q2 = q.clone();
    let found = j
        .store()
        .read(move |txn| Ok((search::page(txn, &q2, after, PAGE_SIZE)?, chain_head(txn)?)))
        .await;
    let found = match found {
        Ok((f, head)) => (f, chain_state(j, head)),
        Err(e) => {
            tracing::error!(error = %e, "console audit search: store read failed");
            return super::pages::unavailable();
        }
    };
    let (found, chain) = found;
    let filter = p.filter_query();
    let next = found.next.map(|n| {
        if filter.is_empty() {
            format!("after={n}")
        } else {
            format!("{filter}&after={n}")
        }
    });
    let me = &who.principal;
    let page = AuditPage {
        page: Page::new(Some(&who), "audit"),
        scope: super::pages::scope_text(me),
        admin: me.is_admin(),
        outcomes: OUTCOMES,
        rows: found.events.into_iter().map(Row::from).collect(),
        page_size: PAGE_SIZE,
        first_page: after.is_none(),
        next,
        filter,
        chain,
        f: p,
    };
    html(StatusCode::OK, &page)
}

/// The columns of the CSV export: every field of an event, in order.
pub const CSV_COLUMNS: &[&str] = &[
    "seq",
    "event_id",
    "ts",
    "operation_id",
    "phase",
    "action",
    "outcome",
    "runtime",
    "tenant_digest",
    "identity_digest",
    "session_digest",
    "profile",
    "request_id",
    "lease_ref",
    "sandbox_ref",
    "duration_ms",
    "command_digest",
    "path_digest",
    "destination_digest",
    "content_sha256",
    "bytes",
    "exit_code",
    "reused",
    "release_action",
    "job_ref",
    "checkpoint_ref",
    "error_code",
    "note_digest",
    "fork_lease_ref",
    "plan_ref",
    "task_ref",
    "task_template",
    "parameters_digest",
    "decision",
    "reason_digest",
    "reason",
    "approver_digest",
    "task_state",
    "cleanup",
    "tool",
    "result_digest",
    "destination",
    "method",
    "http_status",
    "recording_ref",
    "pty_ref",
    "chunk",
    "offset",
    "recordings_digest",
    "prev_hash",
    "hash",
];

/// One CSV cell (RFC 4180): a cell a spreadsheet would take for a formula
/// (starting `=`, `+`, `-`, `@`, tab or carriage return) gets a leading
/// `'`; a cell with a comma, quote or line break is quoted, quotes
/// doubled.
pub fn csv_cell(v: &str, out: &mut String) {
    let guarded = matches!(v.chars().next(), Some('=' | '+' | '-' | '@' | '\t' | '\r'));
    let v = if guarded {
        std::borrow::Cow::Owned(format!("'{v}"))
    } else {
        std::borrow::Cow::Borrowed(v)
    };
    if v.contains([',', '"', '\n', '\r']) {
        out.push('"');
        out.push_str(&v.replace('"', "\"\""));
        out.push('"');
    } else {
        out.push_str(&v);
    }
}

/// One event as a CSV record (with its CRLF).
pub fn csv_line(ev: &Event, out: &mut String) {
    let v = serde_json::to_value(ev).unwrap_or_default();
    for (i, c) in CSV_COLUMNS.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match v.get(*c) {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(s)) => csv_cell(s, out),
            Some(other) => csv_cell(&other.to_string(), out),
        }
    }
    out.push_str("\r\n");
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Jsonl,
    Csv,
}

pub async fn export_jsonl(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Query(p): Query<Params>,
) -> Response {
    export(st, headers, p, Format::Jsonl).await
}

pub async fn export_csv(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Query(p): Query<Params>,
) -> Response {
    export(st, headers, p, Format::Csv).await
}

/// The current filter's events, oldest first, streamed: one task of the
/// blocking pool reads them in batches (each its own read transaction, up
/// to the last `seq` fixed first) into a bounded channel, so memory stays
/// flat however many match and a slow reader holds the export back. A
/// store error part way aborts the answer (no clean end: a truncated
/// export cannot pass for a whole one).
async fn export(st: ConsoleState, headers: HeaderMap, p: Params, fmt: Format) -> Response {
    let (_who, q, _after) = match admit(&st, &headers, Action::AuditExport, &p).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let store = st.broker.journal().store().clone();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(EXPORT_AHEAD);
    tokio::task::spawn_blocking(move || {
        let to = match store.read_now(crate::audit::last_seq) {
            Ok(t) => t,
            Err(e) => {
                let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
                return;
            }
        };
        if fmt == Format::Csv {
            let mut head = CSV_COLUMNS.join(",");
            head.push_str("\r\n");
            if tx.blocking_send(Ok(head.into_bytes())).is_err() {
                return;
            }
        }
        let mut from = 1;
        loop {
            let mut chunk = String::new();
            let r = store.read_now(|txn| {
                search::forward(txn, &q, from, to, EXPORT_BATCH, |ev| {
                    match fmt {
                        Format::Jsonl => {
                            chunk.push_str(&crate::audit::export_line(&ev));
                            chunk.push('\n');
                        }
                        Format::Csv => csv_line(&ev, &mut chunk),
                    }
                    Ok(())
                })
            });
            match r {
                Ok(next) => {
                    if !chunk.is_empty() && tx.blocking_send(Ok(chunk.into_bytes())).is_err() {
                        return;
                    }
                    match next {
                        Some(n) => from = n,
                        None => return,
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "console audit export: store read failed");
                    let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
                    return;
                }
            }
        }
    });
    let body = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let (ctype, name) = match fmt {
        Format::Jsonl => ("application/x-ndjson", "audit.jsonl"),
        Format::Csv => ("text/csv; charset=utf-8; header=present", "audit.csv"),
    };
    let mut r = Response::new(Body::from_stream(body));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    r.into_response()
}
