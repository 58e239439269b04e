//! The pages: sign-in, sign-out and the Overview. One askama struct per
//! template (`web/templates/`), each with the shared [`Page`] frame.

use askama::Template;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form};
use serde::Deserialize;

use super::ConsoleState;
use super::session::{self, Lifetimes, NoSession, SignedIn};
use crate::audit::AuditError;
use crate::audit::event::{self, Action};
use crate::auth::{AuthError, Principal, Role, Source};
use crate::store::typed::ReadOps;
use crate::store::{leases, plans, tables, tasks};

/// The signed-in person as the page frame shows them.
pub struct Who {
    pub name: String,
    pub roles: String,
    pub csrf: String,
    /// Admins see the admin-only navigation entries.
    pub admin: bool,
    /// Auditors and admins see the Audit entry (approvers are refused it).
    pub auditor: bool,
}

/// What every page's frame (`base.html`) needs.
pub struct Page {
    pub signed_in: Option<Who>,
    /// The navigation entry of this page.
    pub here: &'static str,
    pub css_version: String,
}

impl Page {
    pub(super) fn new(signed_in: Option<&SignedIn>, here: &'static str) -> Self {
        Self {
            signed_in: signed_in.map(|s| Who {
                name: s.name.clone(),
                roles: roles_text(&s.principal),
                csrf: s.csrf.clone(),
                admin: s.principal.is_admin(),
                auditor: s.principal.may_audit(),
            }),
            here,
            css_version: super::assets::version("console.css"),
        }
    }
}

#[derive(Template)]
#[template(path = "sign_in.html", config = "web/askama.toml")]
struct SignInPage {
    page: Page,
    csrf: String,
    name: String,
    message: Option<String>,
    /// "Sign in with …", when `[console.oidc]` is configured.
    sso: Option<String>,
    /// Whether local users may sign in here (`[console] local_users`).
    local: bool,
    /// Where to go once signed in (a console page: [`safe_next`]).
    next: String,
}

/// A page to return to after signing in, if it is one: a console path of
/// letters, digits, `/`, `_` and `-` (a plan's review from a notification
/// link), never another site or a path with a query.
pub(super) fn safe_next(next: &str) -> Option<&str> {
    let ok = next.starts_with("/console/")
        && next.len() <= 200
        && !next.contains("//")
        && !next.starts_with("/console/sign-")
        && next
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/_-".contains(&b));
    ok.then_some(next)
}

#[derive(Template)]
#[template(path = "overview.html", config = "web/askama.toml")]
struct OverviewPage {
    page: Page,
    scope: String,
    ready: bool,
    audit_ok: bool,
    audit_state: &'static str,
    audit_mode: &'static str,
    backend: String,
    cert_days: Option<i64>,
    pending_plans: usize,
    running_tasks: usize,
    live_leases: usize,
    /// For auditors and admins: outcomes the crash policy could not know
    /// (`audit_recover`, outcome `uncertain`), to review.
    uncertain: Option<u64>,
    /// For auditors and admins: the audit sinks and how far behind each is.
    sinks: Vec<crate::audit::sinks::SinkStatus>,
}

#[derive(Template)]
#[template(path = "error.html", config = "web/askama.toml")]
struct ErrorPage {
    page: Page,
    heading: String,
    message: String,
}

/// A rendered page with `status`; a template that fails to render is a
/// logged 500.
pub(super) fn html(status: StatusCode, t: &impl Template) -> Response {
    match t.render() {
        Ok(body) => (
            status,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            body,
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "a console template failed to render");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "internal error",
            )
                .into_response()
        }
    }
}

/// An error page.
pub(super) fn error_page(
    status: StatusCode,
    signed_in: Option<&SignedIn>,
    heading: &str,
    message: &str,
) -> Response {
    html(
        status,
        &ErrorPage {
            page: Page::new(signed_in, ""),
            heading: heading.into(),
            message: message.into(),
        },
    )
}

#[derive(Template)]
#[template(path = "confirm.html", config = "web/askama.toml")]
struct ConfirmPage {
    page: Page,
    heading: String,
    question: String,
    action: String,
    csrf: String,
    fields: Vec<(String, String)>,
    button: String,
    back: String,
}

/// What an action that cannot be undone asks before it acts (issue #36):
/// a page with the same form again, `confirm=yes` added, and a way back.
/// Works without JavaScript; nothing has happened yet.
pub(super) struct Confirm<'a> {
    pub heading: &'a str,
    pub question: String,
    pub action: String,
    pub fields: Vec<(&'a str, &'a str)>,
    pub button: &'a str,
    pub back: &'a str,
}

impl Confirm<'_> {
    pub(super) fn page(self, who: &SignedIn) -> Response {
        html(
            StatusCode::OK,
            &ConfirmPage {
                page: Page::new(Some(who), ""),
                heading: self.heading.into(),
                question: self.question,
                action: self.action,
                csrf: who.csrf.clone(),
                fields: self
                    .fields
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                button: self.button.into(),
                back: self.back.into(),
            },
        )
    }
}

/// Whether a form was confirmed (`confirm=yes`).
pub(super) fn confirmed(v: &str) -> bool {
    v == "yes"
}

pub(super) fn unavailable() -> Response {
    error_page(
        StatusCode::SERVICE_UNAVAILABLE,
        None,
        "Unavailable",
        "The appliance cannot serve this page now. Try again shortly.",
    )
}

/// `agent, approver` for a principal's roles.
pub(super) fn roles_text(p: &Principal) -> String {
    p.roles
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Approvers, auditors and admins use the console; agents do not.
pub(super) fn may_use_console(p: &Principal) -> bool {
    p.roles
        .iter()
        .any(|r| matches!(r, Role::Approver | Role::Auditor | Role::Admin))
}

pub(super) fn lifetimes(st: &ConsoleState) -> Lifetimes {
    let c = st.broker.config();
    Lifetimes {
        idle: c.console.idle_timeout_seconds,
        absolute: c.console.absolute_timeout_seconds,
        local_users: c.console.local_users,
    }
}

fn to_sign_in(clear: bool, next: Option<&str>) -> Response {
    let to = match next.and_then(safe_next) {
        Some(n) => format!("/console/sign-in?next={n}"),
        None => "/console/sign-in".into(),
    };
    let mut r = Redirect::to(&to).into_response();
    if clear && let Ok(v) = HeaderValue::from_str(&session::clear_cookie(session::COOKIE)) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

/// The signed-in person allowed to use the console, or the answer to give
/// instead (303 to sign-in, 403, 503).
pub(super) async fn signed_in(
    st: &ConsoleState,
    headers: &HeaderMap,
) -> Result<SignedIn, Response> {
    signed_in_returning(st, headers, None).await
}

/// [`signed_in`], and someone signed out is sent back to `next` once they
/// have signed in (a page a link leads to: a plan's review).
pub(super) async fn signed_in_returning(
    st: &ConsoleState,
    headers: &HeaderMap,
    next: Option<&str>,
) -> Result<SignedIn, Response> {
    let store = st.broker.journal().store();
    let now = st.broker.clock().unix();
    match session::current(store, headers, now, lifetimes(st)).await {
        Ok(s) if may_use_console(&s.principal) => Ok(s),
        Ok(s) => Err(error_page(
            StatusCode::FORBIDDEN,
            Some(&s),
            "Not for your role",
            "The console is for approvers, auditors and admins.",
        )),
        Err(NoSession::SignIn) => Err(to_sign_in(
            session::cookie(headers, session::COOKIE).is_some(),
            next,
        )),
        Err(NoSession::Store(e)) => {
            tracing::error!(error = %e, "console session lookup failed");
            Err(unavailable())
        }
    }
}

pub async fn not_found() -> Response {
    error_page(
        StatusCode::NOT_FOUND,
        None,
        "Not found",
        "The console has no such page.",
    )
}

pub async fn to_overview() -> Redirect {
    Redirect::to("/console")
}

pub async fn overview(State(st): State<ConsoleState>, headers: HeaderMap) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let j = st.broker.journal();
    let (audit_ok, audit_state) = match j.check() {
        Ok(()) => (true, "ok"),
        Err(AuditError::Blocked) => (false, "reconciliation required"),
        Err(_) => (false, "unavailable"),
    };
    let store = j.store().clone();
    let auditor = who.principal.may_audit();
    // Admins see every tenant's work; everyone else their tenant's.
    let tenant = (!who.principal.is_admin()).then(|| who.principal.tenant.clone());
    let t2 = tenant.clone();
    let counts = store
        .read(move |txn| {
            let mine = |t: &str| t2.as_deref().is_none_or(|x| x == t);
            let pending = plans::all(txn)?
                .iter()
                .filter(|p| p.state == plans::PlanState::PendingApproval && mine(&p.tenant))
                .count();
            let all_tasks: Vec<tasks::Task> = txn.records(tables::TASKS)?;
            let running = all_tasks
                .iter()
                .filter(|t| {
                    matches!(
                        t.state,
                        tasks::TaskState::Starting | tasks::TaskState::Running
                    ) && mine(&t.tenant)
                })
                .count();
            let live = leases::all(txn)?
                .iter()
                .filter(|l| {
                    matches!(
                        l.state,
                        leases::LeaseState::Running | leases::LeaseState::Paused
                    ) && mine(&l.tenant)
                })
                .count();
            // The journal's outcomes are every tenant's: auditors' only.
            let uncertain = if auditor {
                Some(crate::store::audit_index::Reader::open(txn)?.count(
                    crate::store::audit_index::Field::Outcome,
                    event::Outcome::Uncertain.as_str(),
                )?)
            } else {
                None
            };
            Ok((pending, running, live, uncertain))
        })
        .await;
    let (pending_plans, running_tasks, live_leases, uncertain) = match counts {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "console overview: store read failed");
            return unavailable();
        }
    };
    let now = st.broker.clock().unix();
    let cert_days = tokio::fs::read(&st.cert_file)
        .await
        .ok()
        .and_then(|pem| crate::tls::cert_info(&pem).ok())
        .map(|c| c.days_left(now));
    let page = OverviewPage {
        page: Page::new(Some(&who), "overview"),
        scope: match tenant {
            Some(t) => format!("tenant {t}"),
            None => "all tenants".into(),
        },
        // `check` passing is `is_ready`; a failed store is not ready even
        // when the journal is best effort.
        ready: audit_ok && !store.failed(),
        audit_ok,
        audit_state,
        audit_mode: audit_mode_text(j.mode()),
        backend: st.backend.clone(),
        cert_days,
        pending_plans,
        running_tasks,
        live_leases,
        uncertain,
        sinks: if auditor { j.sinks().status() } else { vec![] },
    };
    html(StatusCode::OK, &page)
}

/// The sign-in form, with a fresh double-submit token.
pub(super) fn sign_in_page(
    st: &ConsoleState,
    status: StatusCode,
    name: &str,
    message: Option<&str>,
) -> Response {
    sign_in_page_to(st, status, name, message, "")
}

/// The sign-in form, returning to `next` once signed in.
fn sign_in_page_to(
    st: &ConsoleState,
    status: StatusCode,
    name: &str,
    message: Option<&str>,
    next: &str,
) -> Response {
    let token = session::new_token();
    let mut r = html(
        status,
        &SignInPage {
            page: Page::new(None, "sign-in"),
            csrf: token.clone(),
            name: name.into(),
            message: message.map(str::to_string),
            sso: st.oidc.as_ref().map(|o| o.label().to_string()),
            local: st.broker.config().console.local_users,
            next: safe_next(next).unwrap_or_default().to_string(),
        },
    );
    if let Ok(v) = HeaderValue::from_str(&session::set_cookie(
        session::SIGN_IN_COOKIE,
        &token,
        session::SIGN_IN_FORM_SECONDS,
    )) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

#[derive(Deserialize)]
pub struct SignInQuery {
    #[serde(default)]
    next: String,
}

pub async fn sign_in_form(
    State(st): State<ConsoleState>,
    axum::extract::Query(q): axum::extract::Query<SignInQuery>,
) -> Response {
    sign_in_page_to(&st, StatusCode::OK, "", None, &q.next)
}

#[derive(Deserialize)]
pub struct SignInForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    next: String,
}

/// Record a sign-in attempt (never the password; the name as a digest).
pub(super) async fn audit_sign_in(
    st: &ConsoleState,
    source: Option<Source>,
    name: &str,
    ok: Option<(&Principal, &str)>,
    error_code: Option<&str>,
) -> Result<(), AuditError> {
    let j = st.broker.journal();
    let mut ev = match ok {
        Some((p, key)) => {
            let mut ev = st.broker.event(p, Action::ConsoleSignIn, &ctx());
            ev.outcome = event::Outcome::Ok;
            ev.session_digest = Some(j.digest("console_session", key.as_bytes()));
            ev
        }
        None => {
            let mut ev = j.event(Action::ConsoleSignIn);
            ev.outcome = event::Outcome::Rejected;
            ev.identity_digest = Some(j.digest("user", name.as_bytes()));
            ev
        }
    };
    ev.error_code = error_code.map(str::to_string);
    if let Some(s) = source {
        ev.note_digest = Some(j.digest("source", s.ip().to_string().as_bytes()));
    }
    j.record(ev).await
}

/// Record a refused sign-in (a failure to record is logged: the answer is
/// a refusal either way).
pub(super) async fn refused(st: &ConsoleState, source: Option<Source>, name: &str, code: &str) {
    if let Err(e) = audit_sign_in(st, source, name, None, Some(code)).await {
        tracing::warn!(error = %e, "a console sign-in failure was not audited");
    }
}

pub async fn sign_in(
    State(st): State<ConsoleState>,
    source: Option<Extension<Source>>,
    headers: HeaderMap,
    Form(f): Form<SignInForm>,
) -> Response {
    let source = source.map(|Extension(s)| s);
    if !st.broker.config().console.local_users {
        return error_page(
            StatusCode::FORBIDDEN,
            None,
            "Password sign-in is off",
            "Sign in with the company's identity provider.",
        );
    }
    let expected = session::cookie(&headers, session::SIGN_IN_COOKIE).unwrap_or("");
    if !session::same(expected, &f.csrf) {
        return error_page(
            StatusCode::FORBIDDEN,
            None,
            "Form expired",
            "This sign-in form has expired or was not sent from the console. Open the sign-in page again.",
        );
    }
    let principal = match st
        .auth
        .authenticate_basic(&f.name, &f.password, source)
        .await
    {
        Ok(p) => p,
        Err(AuthError::Throttled(secs)) => {
            refused(&st, source, &f.name, "sign_in_throttled").await;
            let mut r = sign_in_page_to(
                &st,
                StatusCode::TOO_MANY_REQUESTS,
                &f.name,
                Some("Too many attempts. Wait a little, then try again."),
                &f.next,
            );
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            return r;
        }
        // (A password check never yields an OIDC refusal.)
        Err(AuthError::Unauthorized | AuthError::InvalidToken(_)) => {
            refused(&st, source, &f.name, "unauthorized").await;
            return sign_in_page_to(
                &st,
                StatusCode::UNAUTHORIZED,
                &f.name,
                Some("Wrong user name or password."),
                &f.next,
            );
        }
        Err(AuthError::Unavailable) => return unavailable(),
    };
    let store = st.broker.journal().store().clone();
    // The record the session is opened under (checked again: the
    // password check may have come from the authenticator's cache).
    let user = match crate::auth::users::get_user(&store, &f.name) {
        Ok(Some(u)) if u.disabled_at.is_none() => u,
        Ok(_) => {
            refused(&st, source, &f.name, "unauthorized").await;
            return sign_in_page_to(
                &st,
                StatusCode::UNAUTHORIZED,
                &f.name,
                Some("Wrong user name or password."),
                &f.next,
            );
        }
        Err(e) => {
            tracing::error!(error = %e, "console sign-in: user lookup failed");
            return unavailable();
        }
    };
    if !may_use_console(&principal) {
        refused(&st, source, &f.name, "forbidden").await;
        return error_page(
            StatusCode::FORBIDDEN,
            None,
            "Not for your role",
            "The console is for approvers, auditors and admins.",
        );
    }
    let now = st.broker.clock().unix();
    let id = match session::open(&store, &user, now, lifetimes(&st)).await {
        Ok(id) => id,
        Err(e) => {
            tracing::error!(error = %e, "console sign-in: session not stored");
            return unavailable();
        }
    };
    let key = session::key_of(&id);
    // A sign-in the journal cannot record (audit required) does not
    // happen: the session just made is removed.
    if let Err(e) = audit_sign_in(&st, source, &f.name, Some((&principal, &key)), None).await {
        tracing::error!(error = %e, "console sign-in not audited: refused");
        let _ = session::end(&store, key).await;
        return unavailable();
    }
    let mut r = Redirect::to(safe_next(&f.next).unwrap_or("/console")).into_response();
    let life = lifetimes(&st);
    for c in [
        session::set_cookie(session::COOKIE, &id, life.absolute),
        session::clear_cookie(session::SIGN_IN_COOKIE),
    ] {
        if let Ok(v) = HeaderValue::from_str(&c) {
            r.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    r
}

#[derive(Deserialize)]
pub struct CsrfForm {
    #[serde(default)]
    pub(super) csrf: String,
}

/// A form for an action asked about first ([`Confirm`]).
#[derive(Deserialize)]
pub struct ConfirmForm {
    #[serde(default)]
    pub(super) csrf: String,
    #[serde(default)]
    pub(super) confirm: String,
}

pub async fn sign_out(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Form(f): Form<CsrfForm>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if !session::same(&who.csrf, &f.csrf) {
        return form_expired(&who);
    }
    let store = st.broker.journal().store().clone();
    if let Err(e) = session::end(&store, who.key.clone()).await {
        tracing::error!(error = %e, "console sign-out: session not removed");
        return unavailable();
    }
    let j = st.broker.journal();
    let mut ev = st
        .broker
        .event(&who.principal, Action::ConsoleSignOut, &ctx());
    ev.outcome = event::Outcome::Ok;
    ev.session_digest = Some(j.digest("console_session", who.key.as_bytes()));
    if let Err(e) = j.record(ev).await {
        tracing::warn!(error = %e, "a console sign-out was not audited");
    }
    to_sign_in(true, None)
}

/// The message a page shows after an action (from its [`Outcome`] query).
pub struct Notice {
    pub ok: bool,
    pub code: Option<&'static str>,
    pub text: &'static str,
}

impl Notice {
    /// The action was done.
    pub(super) fn done(text: &'static str) -> Option<Self> {
        Some(Self {
            ok: true,
            code: None,
            text,
        })
    }

    /// The action was refused with `code`.
    pub(super) fn refused(code: &'static str, text: &'static str) -> Option<Self> {
        Some(Self {
            ok: false,
            code: Some(code),
            text,
        })
    }
}

/// The query a form's redirect carries: `?done=…` or `?error=<code>`.
#[derive(Deserialize)]
pub struct Outcome {
    #[serde(default)]
    pub(super) done: Option<String>,
    #[serde(default)]
    pub(super) error: Option<String>,
}

impl Outcome {
    /// The broker's code in `error`, if it is one.
    pub(super) fn code(&self) -> Option<crate::broker::Code> {
        crate::broker::Code::from_wire(self.error.as_deref()?)
    }
}

/// How long ago `ts` (RFC 3339) was at `now`, or `ts` itself if it does
/// not parse.
pub(super) fn age(ts: &str, now: i64) -> String {
    crate::clock::parse_unix(ts)
        .map(|c| span(now - c))
        .unwrap_or_else(|| ts.to_string())
}

/// The tenants a person's lists cover: an admin sees every tenant's,
/// everyone else their own.
pub(super) fn scope_text(p: &Principal) -> String {
    if p.is_admin() {
        "all tenants".into()
    } else {
        format!("tenant {}", p.tenant)
    }
}

/// The journal's mode as the console shows it (`best effort`).
pub(super) fn audit_mode_text(m: crate::audit::AuditMode) -> &'static str {
    match m {
        crate::audit::AuditMode::BestEffort => "best effort",
        m => m.as_str(),
    }
}

/// A short span: `45 s`, `12 min`, `3 h 5 min`, `2 d 4 h`.
pub fn span(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..86400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86400, s % 86400 / 3600),
    }
}

/// A request context for a broker call from the console.
pub(super) fn ctx() -> crate::broker::Ctx {
    crate::broker::Ctx {
        request_id: crate::ids::random_hex(8),
        ..Default::default()
    }
}

/// A request context for a broker call a signed-in person makes: it
/// names the console session (recorded as runtime `console`).
pub(super) fn session_ctx(who: &SignedIn) -> crate::broker::Ctx {
    crate::broker::Ctx {
        console_session: Some(who.key.clone()),
        ..ctx()
    }
}

/// The broker's refusal as a page: its status, its code and message.
pub(super) fn broker_refused(who: &SignedIn, e: &crate::broker::Error) -> Response {
    if e.code.status().is_server_error() {
        tracing::error!(code = e.code.as_str(), "console: the broker failed");
    }
    error_page(
        e.code.status(),
        Some(who),
        "Refused",
        &format!("{} ({})", e.message, e.code.as_str()),
    )
}

/// A form that is not the session's: 403, nothing done.
pub(super) fn form_expired(who: &SignedIn) -> Response {
    error_page(
        StatusCode::FORBIDDEN,
        Some(who),
        "Form expired",
        "This form was not sent from this session of the console. Reload the page and try again.",
    )
}

/// References (`plan_…`, `task_…`, `lease_…`, `job_…`, `pty_…`) are
/// letters, digits, `_` and `-`: anything else is no such thing, and never
/// goes into a redirect.
pub(super) fn plain_ref(r: &str) -> bool {
    !r.is_empty()
        && r.len() <= 80
        && r.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The person behind a form about `reference` (a plan, task, lease, job
/// or PTY): signed in, the form's CSRF token this session's, the reference
/// plain; or the answer to give instead (sign-in, 403, 404).
pub(super) async fn checked_form(
    st: &ConsoleState,
    headers: &HeaderMap,
    csrf: &str,
    reference: &str,
) -> Result<SignedIn, Response> {
    checked_form_returning(st, headers, csrf, reference, None).await
}

/// [`checked_form`], and someone signed out is sent back to `next` once
/// they have signed in.
pub(super) async fn checked_form_returning(
    st: &ConsoleState,
    headers: &HeaderMap,
    csrf: &str,
    reference: &str,
    next: Option<&str>,
) -> Result<SignedIn, Response> {
    let who = signed_in_returning(st, headers, next).await?;
    if !session::same(&who.csrf, csrf) {
        return Err(form_expired(&who));
    }
    if !plain_ref(reference) {
        return Err(not_found().await);
    }
    Ok(who)
}
