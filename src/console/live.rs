//! Leases, jobs and PTYs: the live list, a job's output tail (read-only),
//! and release/cancel/kill for admins.
//!
//! Every read and action goes through the broker as the signed-in person:
//! the list is `Broker::live_leases` (the policy of `GET /v1/leases`:
//! `lease:list`, the person's tenant, every tenant for an admin), a job's
//! tail is `Broker::job_tail` (the policy and the `job_output` event of
//! `POST /v1/jobs/{ref}/output`), and the actions are `release`,
//! `cancel_job` and `pty_kill`, as on `/v1`. The forms are shown to admins
//! only; anyone else's forged POST gets the broker's code. Actions are
//! POST-redirect-GET: the outcome or the broker's code comes back as a
//! query, shown as a fixed message (nothing else from the query is echoed).

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;

use super::ConsoleState;
use super::pages::{
    CsrfForm, Notice, Outcome, Page, age, broker_refused as refused, checked_form, ctx, html,
    scope_text, signed_in, span,
};
use crate::broker::Code;
use crate::broker::leases::LeaseState;

/// Leases shown at most (newest first).
pub const MAX_LEASES: usize = 200;
/// How much of each stream a job's page shows (its end).
pub const TAIL_BYTES: usize = 16 * 1024;
/// How often the list reloads itself (seconds; a meta refresh).
pub const LIST_REFRESH_SECONDS: u32 = 10;
/// How much of a preset's digest (hex) a lease shows.
pub const DIGEST_SHOWN: usize = 12;

/// This page's routes, merged into the console's router.
pub fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/console/leases", get(list))
        .route("/console/leases/{lease_ref}/release", post(release))
        .route("/console/leases/{lease_ref}/egress", post(narrow_egress))
        .route("/console/jobs/{job_ref}", get(job))
        .route("/console/jobs/{job_ref}/cancel", post(cancel_job))
        .route("/console/ptys/{pty_ref}/kill", post(kill_pty))
}

/// One job or PTY under a lease.
pub struct ProcRow {
    pub r#ref: String,
    pub state: &'static str,
    pub running: bool,
    pub exit_code: Option<i32>,
    pub age: String,
}

/// One lease of the list.
pub struct LeaseRow {
    pub lease_ref: String,
    pub tenant: String,
    pub runtime: String,
    pub profile: String,
    pub sandbox_ref: String,
    pub state: String,
    pub age: String,
    pub idle: String,
    pub task_ref: Option<String>,
    /// The template preset applied: `NAME@VERSION` and the start of its
    /// digest.
    pub preset: Option<(String, String)>,
    /// Its egress destinations (none: its profile has no egress) and
    /// whether an operator narrowed them.
    pub egress: Option<(Vec<String>, bool)>,
    /// Admins may release it (not a trusted task's: that ends with its task).
    pub releasable: bool,
    pub jobs: Vec<ProcRow>,
    pub ptys: Vec<ProcRow>,
    /// More jobs or PTYs than shown.
    pub jobs_more: bool,
    pub ptys_more: bool,
}

#[derive(Template)]
#[template(path = "leases.html", config = "web/askama.toml")]
struct ListPage {
    page: Page,
    scope: String,
    backend: String,
    refresh: u32,
    notice: Option<Notice>,
    rows: Vec<LeaseRow>,
    more: bool,
    max: usize,
    max_procs: usize,
    admin: bool,
    auditor: bool,
    csrf: String,
}

#[derive(Template)]
#[template(path = "job.html", config = "web/askama.toml")]
struct JobPage {
    page: Page,
    notice: Option<Notice>,
    job_ref: String,
    lease_ref: String,
    sandbox_ref: String,
    tenant: String,
    state: &'static str,
    running: bool,
    exit_code: Option<i32>,
    timed_out: bool,
    cancelled: bool,
    created_at: String,
    updated_at: String,
    tail_kib: usize,
    stdout: String,
    stderr: String,
    stdout_size: u64,
    stderr_size: u64,
    stdout_cut: bool,
    stderr_cut: bool,
    admin: bool,
    auditor: bool,
    csrf: String,
}

/// The message for an action's outcome or the broker's code.
fn notice(q: &Outcome) -> Option<Notice> {
    let ok = Notice::done;
    match q.done.as_deref() {
        Some("paused") => {
            return ok("Paused. The lease's sandbox is paused; the agent can resume it.");
        }
        Some("killed") => return ok("Killed. The lease and its sandbox are gone."),
        Some("job_cancelled") => return ok("Cancelled. The job's processes were ended."),
        Some("pty_killed") => return ok("Killed. The PTY's process was ended."),
        Some("egress_narrowed") => {
            return ok(
                "Narrowed. The lease's sandbox reaches only the destinations kept, from its next request.",
            );
        }
        _ => {}
    }
    let code = q.code()?;
    let text = match code {
        Code::ActionDenied => {
            "Your identity is not allowed to do this: releasing leases and ending jobs and PTYs is for admins."
        }
        Code::LeaseNotFound => "There is no such lease (it may have been released meanwhile).",
        Code::JobNotFound => "There is no such job (its lease may have been released meanwhile).",
        Code::PtyNotFound => "There is no such PTY (its lease may have been released meanwhile).",
        Code::InvalidAction => "The release must be pause or kill.",
        Code::AdminRequired => "Narrowing a lease's egress is for admins.",
        Code::InvalidRequest => {
            "The destinations changed meanwhile (a lease's egress can only be narrowed); look again."
        }
        Code::ProfileDenied => {
            "The lease's profile is no longer configured: the lease can only be released."
        }
        Code::ExecutionFailed | Code::CheckpointCleanupFailed => {
            "The backend failed the operation; the lease stays as it was (try again)."
        }
        Code::Timeout => "The backend did not answer in time: it may have happened; look again.",
        Code::AuditUnavailable => "The audit journal is unavailable: nothing was done.",
        _ => "The appliance refused the action.",
    };
    Notice::refused(code.as_str(), text)
}

fn proc_row(
    r: String,
    state: &'static str,
    running: bool,
    exit: Option<i32>,
    created: &str,
    now: i64,
) -> ProcRow {
    ProcRow {
        r#ref: r,
        state,
        running,
        exit_code: exit,
        age: age(created, now),
    }
}

pub async fn list(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Query(q): Query<Outcome>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (leases, more) = match st
        .broker
        .live_leases(&who.principal, &ctx(), MAX_LEASES)
        .await
    {
        Ok(v) => v,
        Err(e) => return refused(&who, &e),
    };
    let admin = who.principal.is_admin();
    let now = st.broker.clock().unix();
    let rows = leases
        .into_iter()
        .map(|l| LeaseRow {
            age: age(&l.created_at, now),
            idle: span(now - l.last_used_unix),
            releasable: admin
                && l.task_ref.is_none()
                && matches!(
                    l.state,
                    LeaseState::Running | LeaseState::Paused | LeaseState::Released
                ),
            state: l.state.to_string(),
            jobs_more: l.jobs_total > l.jobs.len(),
            ptys_more: l.ptys_total > l.ptys.len(),
            jobs: l
                .jobs
                .iter()
                .map(|j| {
                    proc_row(
                        j.job_ref.clone(),
                        j.state.as_str(),
                        !j.is_terminal(),
                        j.exit_code,
                        &j.created_at,
                        now,
                    )
                })
                .collect(),
            ptys: l
                .ptys
                .iter()
                .map(|p| {
                    proc_row(
                        p.pty_ref.clone(),
                        p.state.as_str(),
                        p.is_running(),
                        p.exit_code,
                        &p.created_at,
                        now,
                    )
                })
                .collect(),
            preset: l
                .preset
                .map(|(name, digest)| (name, digest.chars().take(DIGEST_SHOWN).collect())),
            egress: l.egress.map(|e| (e.destinations, e.narrowed)),
            lease_ref: l.lease_ref,
            tenant: l.tenant,
            runtime: l.runtime,
            profile: l.profile,
            sandbox_ref: l.sandbox_ref,
            task_ref: l.task_ref,
        })
        .collect();
    let page = ListPage {
        page: Page::new(Some(&who), "leases"),
        scope: scope_text(&who.principal),
        backend: st.backend.clone(),
        refresh: LIST_REFRESH_SECONDS,
        notice: notice(&q),
        rows,
        more,
        max: MAX_LEASES,
        max_procs: crate::broker::LIVE_PROCS,
        admin,
        auditor: who.principal.may_audit(),
        csrf: who.csrf.clone(),
    };
    html(StatusCode::OK, &page)
}

pub async fn job(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(job_ref): Path<String>,
    Query(q): Query<Outcome>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let t = match st
        .broker
        .job_tail(&who.principal, &ctx(), &job_ref, TAIL_BYTES)
        .await
    {
        Ok(t) => t,
        Err(e) => return refused(&who, &e),
    };
    let j = t.job;
    let page = JobPage {
        page: Page::new(Some(&who), "leases"),
        notice: notice(&q),
        state: j.state.as_str(),
        running: j.state == crate::broker::jobs::JobState::Running,
        exit_code: j.exit_code,
        timed_out: j.timed_out,
        cancelled: j.cancelled,
        created_at: j.created_at,
        updated_at: j.updated_at,
        tail_kib: TAIL_BYTES / 1024,
        stdout: String::from_utf8_lossy(&t.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&t.stderr).into_owned(),
        stdout_size: t.stdout_size,
        stderr_size: t.stderr_size,
        stdout_cut: t.stdout_from > 0,
        stderr_cut: t.stderr_from > 0,
        admin: who.principal.is_admin(),
        auditor: who.principal.may_audit(),
        csrf: who.csrf.clone(),
        tenant: t.tenant,
        job_ref: j.job_ref,
        lease_ref: j.lease_ref,
        sandbox_ref: j.sandbox_ref,
    };
    html(StatusCode::OK, &page)
}

#[derive(Deserialize)]
pub struct ReleaseForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    confirm: String,
}

pub async fn release(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(lease_ref): Path<String>,
    Form(f): Form<ReleaseForm>,
) -> Response {
    let who = match checked_form(&st, &headers, &f.csrf, &lease_ref).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if f.action == "kill" && !super::pages::confirmed(&f.confirm) {
        return super::pages::Confirm {
            heading: "Kill this lease?",
            question: format!(
                "Killing lease {lease_ref} ends its sandbox and everything running in it; its files are gone unless a checkpoint kept them. This cannot be undone."
            ),
            action: format!("/console/leases/{lease_ref}/release"),
            fields: vec![("action", "kill")],
            button: "Kill the lease",
            back: "/console/leases",
        }
        .page(&who);
    }
    let to = match st
        .broker
        .release(&who.principal, &ctx(), &lease_ref, &f.action)
        .await
    {
        Ok(_) if f.action == "kill" => "/console/leases?done=killed".to_string(),
        Ok(_) => "/console/leases?done=paused".to_string(),
        Err(e) => format!("/console/leases?error={}", e.code.as_str()),
    };
    Redirect::to(&to).into_response()
}

/// Keep only the checked destinations of a lease's egress: each kept one
/// arrives as a field `keep:DEST`.
pub async fn narrow_egress(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(lease_ref): Path<String>,
    Form(f): Form<std::collections::HashMap<String, String>>,
) -> Response {
    let csrf = f.get("csrf").map(String::as_str).unwrap_or("");
    let who = match checked_form(&st, &headers, csrf, &lease_ref).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let mut keep: Vec<String> = f
        .keys()
        .filter_map(|k| k.strip_prefix("keep:"))
        .map(str::to_string)
        .collect();
    keep.sort();
    let to = match st
        .broker
        .egress_narrow(&who.principal, &lease_ref, keep)
        .await
    {
        Ok(_) => "/console/leases?done=egress_narrowed".to_string(),
        Err(e) => format!("/console/leases?error={}", e.code.as_str()),
    };
    Redirect::to(&to).into_response()
}

pub async fn cancel_job(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(job_ref): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let who = match checked_form(&st, &headers, &f.csrf, &job_ref).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let to = match st.broker.cancel_job(&who.principal, &ctx(), &job_ref).await {
        Ok(_) => format!("/console/jobs/{job_ref}?done=job_cancelled"),
        // A job this person cannot see: back to the list, not its page.
        Err(e) if e.code == Code::JobNotFound => {
            format!("/console/leases?error={}", e.code.as_str())
        }
        Err(e) => format!("/console/jobs/{job_ref}?error={}", e.code.as_str()),
    };
    Redirect::to(&to).into_response()
}

pub async fn kill_pty(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(pty_ref): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    let who = match checked_form(&st, &headers, &f.csrf, &pty_ref).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let to = match st.broker.pty_kill(&who.principal, &ctx(), &pty_ref).await {
        Ok(_) => "/console/leases?done=pty_killed".to_string(),
        Err(e) => format!("/console/leases?error={}", e.code.as_str()),
    };
    Redirect::to(&to).into_response()
}
