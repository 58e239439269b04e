//! Identities (admins): bearer tokens, certificate identities and people.
//!
//! Every change goes through `admin::identity`, the admin socket's own
//! handler, as the signed-in admin (`admin::Actor::Console`): the same
//! records, validation (`auth::TokenSpec`, `auth::users::user_principal`),
//! codes and audit events (`token_create`, `token_revoke`,
//! `cert_identity_create`, `user_add`, `user_passwd`, `user_disable`,
//! `user_enable`) as `cube-adapter token …` and `cube-adapter user …`.
//! A person who is not an admin gets 403 on every page and form, and a
//! forged form is recorded as `rejected` with `admin_required`.
//!
//! Secrets are never rendered, except a token just created: the answer to
//! its form shows it once (a certificate identity's bundle is the answer
//! to its form, a download). The other changes are POST-redirect-GET: the
//! page shows a fixed message for the outcome or a known code.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;

use super::ConsoleState;
use super::pages::{
    Confirm, ConfirmForm, CsrfForm, Notice, Outcome, Page, confirmed, error_page, form_expired,
    html, roles_text, signed_in,
};
use super::session::{self, SignedIn};
use crate::admin::{self, Actor, Request, Response as Answer};
use crate::audit::event::{self, Action};
use crate::auth::users::{UserAnswer, UserInfo, UserOp};
use crate::auth::{OpError, Principal, TokenSpec};

/// This page's routes, merged into the console's router.
pub fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/console/identities", get(page))
        .route("/console/identities/tokens", post(create_token))
        .route("/console/identities/tokens/{id}/revoke", post(revoke))
        .route("/console/identities/certificates", post(issue_certificate))
        .route("/console/identities/people", post(add_person))
        .route("/console/identities/people/{name}/disable", post(disable))
        .route("/console/identities/people/{name}/enable", post(enable))
        .route("/console/identities/people/{name}/password", post(password))
}

/// One token or certificate identity as listed (never its hash).
pub struct IdentityRow {
    pub id: String,
    pub subject: String,
    pub tenant: String,
    pub roles: String,
    pub scopes: String,
    pub profiles: String,
    pub runtimes: String,
    pub created_at: String,
    pub revoked: bool,
    pub description: String,
    /// A certificate identity's certificate digest.
    pub cert_sha256: String,
}

/// One person as listed (never the password or its hash).
pub struct PersonRow {
    pub name: String,
    pub tenant: String,
    pub roles: String,
    pub enabled: bool,
    pub password_changed_at: String,
    pub me: bool,
}

#[derive(Template)]
#[template(path = "identities.html", config = "web/askama.toml")]
struct IdentitiesPage {
    page: Page,
    notice: Option<Notice>,
    tokens: Vec<IdentityRow>,
    certificates: Vec<IdentityRow>,
    people: Vec<PersonRow>,
    runtimes: String,
    /// The tenants there are (of tokens, certificates and people): the
    /// forms choose among them; a new one only by choosing "a new tenant".
    tenants: Vec<String>,
    csrf: String,
}

/// The form's value that asks for a new tenant (`new_tenant` names it).
pub const NEW_TENANT: &str = "(new)";

/// The tenant a form chose: one of the list, or, by explicit choice, a
/// new one.
fn chosen_tenant(tenant: &str, new_tenant: &str) -> String {
    if tenant.trim() == NEW_TENANT {
        new_tenant.trim().to_string()
    } else {
        tenant.trim().to_string()
    }
}

#[derive(Template)]
#[template(path = "identities_token.html", config = "web/askama.toml")]
struct TokenCreatedPage {
    page: Page,
    id: String,
    subject: String,
    tenant: String,
    roles: String,
    scopes: String,
    token: String,
    /// `console.js` (the copy button), linked by digest.
    js_version: String,
}

fn any_or(v: &Option<Vec<String>>) -> String {
    match v {
        None => "any".into(),
        Some(v) if v.is_empty() => "(none)".into(),
        Some(v) => v.join(", "),
    }
}

/// A form's list field: items separated by commas or white space.
pub(super) fn items(s: &str) -> Vec<String> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect()
}

/// Every identity page and form is for admins: the answer to anyone else.
pub(super) fn admin_only(who: &SignedIn) -> Option<Response> {
    (!who.principal.is_admin()).then(|| {
        error_page(
            StatusCode::FORBIDDEN,
            Some(who),
            "Admins only",
            "Identities and agent connections are managed by admins (admin_required).",
        )
    })
}

/// The signed-in admin, checked with the form's CSRF token; or the answer
/// (sign in, 403 for another role, recorded as a refused `action`; 403 for
/// a foreign form).
pub(super) async fn admin_form(
    st: &ConsoleState,
    headers: &HeaderMap,
    csrf: &str,
    action: Action,
) -> Result<SignedIn, Response> {
    let who = signed_in(st, headers).await?;
    if !session::same(&who.csrf, csrf) {
        return Err(form_expired(&who));
    }
    if let Some(r) = admin_only(&who) {
        record_refusal(st, &who, action, "admin_required").await;
        return Err(r);
    }
    Ok(who)
}

/// An identity request as the signed-in admin, through the admin socket's
/// handler (same records, codes and audit events as the CLI).
pub(super) async fn as_admin(
    st: &ConsoleState,
    who: &SignedIn,
    req: Request,
) -> Result<Answer, OpError> {
    admin::identity(
        req,
        st.broker.journal().store(),
        &st.auth,
        Some(st.broker.journal()),
        Actor::Console {
            principal: &who.principal,
            session_key: &who.key,
        },
    )
    .await
}

/// A refusal as a page (the code and its message); a store failure is 503.
pub(super) fn refused(who: &SignedIn, e: &OpError) -> Response {
    let status = if e.code == "identity_store_failed" {
        tracing::error!(error = %e, "console: an identity operation failed");
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::BAD_REQUEST
    };
    error_page(
        status,
        Some(who),
        "Refused",
        &format!("{} ({})", e.message, e.code),
    )
}

/// Codes a change may come back with (anything else in the query is not
/// shown).
const CODES: &[(&str, &str)] = &[
    (
        "token_not_found",
        "There is no token or certificate identity with this id.",
    ),
    ("user_not_found", "There is no person with this name."),
    ("user_exists", "A person with this name exists already."),
    (
        "invalid_name",
        "A name must match ^[a-z][a-z0-9._-]{0,63}$.",
    ),
    (
        "invalid_tenant",
        "A tenant is 1-128 characters of [A-Za-z0-9_.:-].",
    ),
    (
        "invalid_role",
        "The role must be agent, approver, auditor or admin.",
    ),
    (
        "invalid_password",
        "A password needs at least 12 characters.",
    ),
    (
        "password_mismatch",
        "The two passwords differ: nothing was changed.",
    ),
    ("self_disable_denied", "You cannot disable yourself."),
    (
        "identity_store_failed",
        "The appliance could not make the change. Try again.",
    ),
];

fn notice(q: &Outcome) -> Option<Notice> {
    let done = match q.done.as_deref() {
        Some("token_revoked") => Some("Revoked. The token or certificate is refused from now on."),
        Some("person_added") => Some("Added. The person can sign in now."),
        Some("person_disabled") => {
            Some("Disabled. Their sessions ended; they cannot sign in until enabled.")
        }
        Some("person_enabled") => Some("Enabled. The person can sign in again."),
        Some("password_reset") => {
            Some("Password reset. Their sessions ended; the old password is refused.")
        }
        _ => None,
    };
    if let Some(t) = done {
        return Notice::done(t);
    }
    let (code, text) = CODES.iter().find(|(c, _)| Some(*c) == q.error.as_deref())?;
    Notice::refused(code, text)
}

fn row(t: admin::TokenInfo) -> IdentityRow {
    IdentityRow {
        subject: t.principal.subject.clone(),
        tenant: t.principal.tenant.clone(),
        roles: roles_text(&t.principal),
        scopes: t.principal.scopes_text(", "),
        profiles: any_or(&t.principal.profiles),
        runtimes: any_or(&t.principal.runtimes),
        created_at: t.created_at,
        revoked: t.revoked_at.is_some(),
        description: t.description.unwrap_or_default(),
        cert_sha256: t.cert_sha256.unwrap_or_default(),
        id: t.id,
    }
}

pub async fn page(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Query(q): Query<Outcome>,
) -> Response {
    let who = match signed_in(&st, &headers).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Some(r) = admin_only(&who) {
        return r;
    }
    let tokens = match as_admin(&st, &who, Request::TokenList).await {
        Ok(Answer::Tokens { tokens }) => tokens,
        Ok(_) => return refused(&who, &OpError::failed("unexpected answer")),
        Err(e) => return refused(&who, &e),
    };
    let people: Vec<UserInfo> = match as_admin(&st, &who, Request::User { op: UserOp::List }).await
    {
        Ok(Answer::User {
            user: UserAnswer::Users(v),
        }) => v,
        Ok(_) => return refused(&who, &OpError::failed("unexpected answer")),
        Err(e) => return refused(&who, &e),
    };
    let mut tenants: Vec<String> = tokens
        .iter()
        .map(|t| t.principal.tenant.clone())
        .chain(people.iter().map(|u| u.principal.tenant.clone()))
        .collect();
    tenants.sort();
    tenants.dedup();
    let (certificates, tokens): (Vec<_>, Vec<_>) = tokens
        .into_iter()
        .map(row)
        .partition(|r| !r.cert_sha256.is_empty());
    let people = people
        .into_iter()
        .map(|u| PersonRow {
            me: u.name == who.name,
            tenant: u.principal.tenant.clone(),
            roles: roles_text(&u.principal),
            enabled: u.disabled_at.is_none(),
            password_changed_at: u.password_changed_at,
            name: u.name,
        })
        .collect();
    let page = IdentitiesPage {
        page: Page::new(Some(&who), "identities"),
        notice: notice(&q),
        tokens,
        certificates,
        people,
        runtimes: crate::config::RUNTIMES.join(", "),
        tenants,
        csrf: who.csrf.clone(),
    };
    html(StatusCode::OK, &page)
}

/// The token form (and the certificate form: the same identity fields).
#[derive(Deserialize)]
pub struct TokenForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    subject: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    new_tenant: String,
    #[serde(default)]
    role: String,
    #[serde(default)]
    actions: String,
    #[serde(default)]
    no_actions: Option<String>,
    #[serde(default)]
    profiles: String,
    #[serde(default)]
    runtimes: String,
    #[serde(default)]
    task_templates: String,
    #[serde(default)]
    description: String,
}

impl TokenForm {
    fn spec(&self) -> TokenSpec {
        let subject = self.subject.trim();
        TokenSpec {
            tenant: chosen_tenant(&self.tenant, &self.new_tenant),
            subject: (!subject.is_empty()).then(|| subject.to_string()),
            roles: items(&self.role),
            runtimes: items(&self.runtimes),
            profiles: items(&self.profiles),
            actions: items(&self.actions),
            no_actions: self.no_actions.is_some(),
            task_templates: items(&self.task_templates),
        }
    }

    fn description(&self) -> Option<String> {
        let d = self.description.trim();
        (!d.is_empty()).then(|| d.chars().take(256).collect())
    }
}

/// The page that shows a token just created, once.
pub(super) fn token_created(who: &SignedIn, p: &Principal, token: String) -> Response {
    let page = TokenCreatedPage {
        page: Page::new(Some(who), "identities"),
        id: admin_token_id(&token),
        subject: p.subject.clone(),
        tenant: p.tenant.clone(),
        roles: roles_text(p),
        scopes: p.scopes_text(", "),
        token,
        js_version: super::assets::version("console.js"),
    };
    html(StatusCode::OK, &page)
}

/// `cat_<id>_…` → `<id>`.
pub(super) fn admin_token_id(token: &str) -> String {
    token
        .strip_prefix(crate::auth::TOKEN_PREFIX)
        .and_then(|r| r.split('_').next())
        .unwrap_or_default()
        .to_string()
}

/// Create a token for `spec` as the signed-in admin: its principal and the
/// token, or the refusal (an invalid spec is recorded as a refused
/// `token_create`, as the admin socket records its refusals).
pub(super) async fn make_token(
    st: &ConsoleState,
    who: &SignedIn,
    spec: TokenSpec,
    description: Option<String>,
) -> Result<(Principal, String), OpError> {
    let principal = match spec.principal() {
        Ok(p) => p,
        Err(e) => {
            record_refusal(st, who, Action::TokenCreate, e.code).await;
            return Err(e);
        }
    };
    match as_admin(
        st,
        who,
        Request::TokenCreate {
            principal: principal.clone(),
            description,
        },
    )
    .await?
    {
        Answer::Token { token } if !token.is_empty() => Ok((principal, token)),
        _ => Err(OpError::failed("no token was issued")),
    }
}

/// Record a change refused before it reached the handler (bad input).
pub(super) async fn record_refusal(st: &ConsoleState, who: &SignedIn, action: Action, code: &str) {
    let j = st.broker.journal();
    let actor = Actor::Console {
        principal: &who.principal,
        session_key: &who.key,
    };
    let mut ev = admin::identity_event(j, actor, action, None, None);
    ev.outcome = event::Outcome::Rejected;
    ev.error_code = Some(code.to_string());
    if let Err(e) = j.record(ev).await {
        tracing::warn!(error = %e, "a refused identity change was not audited");
    }
}

pub async fn create_token(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Form(f): Form<TokenForm>,
) -> Response {
    let who = match admin_form(&st, &headers, &f.csrf, Action::TokenCreate).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    match make_token(&st, &who, f.spec(), f.description()).await {
        Ok((p, token)) => token_created(&who, &p, token),
        Err(e) => refused(&who, &e),
    }
}

fn back(done: Result<&str, &str>) -> Response {
    let q = match done {
        Ok(d) => format!("done={d}"),
        Err(c) => format!("error={c}"),
    };
    Redirect::to(&format!("/console/identities?{q}")).into_response()
}

pub async fn revoke(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(f): Form<ConfirmForm>,
) -> Response {
    let who = match admin_form(&st, &headers, &f.csrf, Action::TokenRevoke).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    let plain = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit());
    if !plain {
        return back(Err("token_not_found"));
    }
    if !confirmed(&f.confirm) {
        return Confirm {
            heading: "Revoke this identity?",
            question: format!(
                "Whoever holds identity {id} (a token or a client certificate) is refused from the next request on. It cannot be given back: make a new one instead."
            ),
            action: format!("/console/identities/tokens/{id}/revoke"),
            fields: vec![],
            button: "Revoke it",
            back: "/console/identities",
        }
        .page(&who);
    }
    match as_admin(&st, &who, Request::TokenRevoke { id }).await {
        Ok(Answer::Revoked { found: true }) => back(Ok("token_revoked")),
        Ok(_) => back(Err("token_not_found")),
        Err(e) => back(Err(e.code)),
    }
}

/// A certificate identity's bundle: `cube-identity-ID/` with `client.pem`,
/// `client.key` (0600) and `ca.pem`, as `token create --client-cert DIR`
/// writes them, in one ustar archive.
fn bundle_tar(id: &str, b: &crate::tls::ClientBundle, mtime: u64) -> std::io::Result<Vec<u8>> {
    let dir = format!("cube-identity-{id}");
    let mut w = crate::ops::tar::TarWriter::new(Vec::new());
    w.dir(&dir, 0o700, mtime)?;
    for (name, mode, data) in [
        ("client.pem", 0o644, &b.cert_pem),
        ("client.key", 0o600, &b.key_pem),
        ("ca.pem", 0o644, &b.ca_pem),
    ] {
        let bytes = data.as_bytes();
        w.file(
            &format!("{dir}/{name}"),
            mode,
            mtime,
            bytes.len() as u64,
            &mut &bytes[..],
        )?;
    }
    w.finish()
}

pub async fn issue_certificate(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Form(f): Form<TokenForm>,
) -> Response {
    let who = match admin_form(&st, &headers, &f.csrf, Action::CertIdentityCreate).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    let principal = match f.spec().principal() {
        Ok(p) => p,
        Err(e) => {
            record_refusal(&st, &who, Action::CertIdentityCreate, e.code).await;
            return refused(&who, &e);
        }
    };
    // The state directory: the served certificate is `STATE/tls/server.pem`.
    let Some(state) = st.cert_file.parent().and_then(|t| t.parent()) else {
        return refused(&who, &OpError::failed("no state directory"));
    };
    let state = state.to_path_buf();
    let sealer = st.broker.journal().store().sealer.clone();
    let clock = st.broker.clock().clone();
    let subject = principal.subject.clone();
    let issued = tokio::task::spawn_blocking(move || {
        crate::tls::issue_identity_cert(&state, sealer, clock, &subject)
    })
    .await;
    let bundle = match issued {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return refused(&who, &OpError::failed(e)),
        Err(e) => return refused(&who, &OpError::failed(e)),
    };
    let rec = crate::auth::cert_record(
        principal,
        f.description(),
        &crate::auth::PeerCert::own(bundle.sha256),
        st.broker.clock(),
    );
    let id = rec.id.clone();
    if let Err(e) = as_admin(&st, &who, Request::CertIdentityCreate { record: rec }).await {
        return refused(&who, &e);
    }
    let mtime = u64::try_from(st.broker.clock().unix()).unwrap_or(0);
    let tar = match bundle_tar(&id, &bundle, mtime) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, id, "console: a certificate bundle could not be packed");
            return error_page(
                StatusCode::INTERNAL_SERVER_ERROR,
                Some(&who),
                "Not delivered",
                &format!(
                    "The identity {id} is registered but its bundle could not be made; revoke it and issue another."
                ),
            );
        }
    };
    let mut r = (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-tar")],
        tar,
    )
        .into_response();
    if let Ok(v) =
        HeaderValue::from_str(&format!("attachment; filename=\"cube-identity-{id}.tar\""))
    {
        r.headers_mut().insert(header::CONTENT_DISPOSITION, v);
    }
    r
}

#[derive(Deserialize)]
pub struct PersonForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    new_tenant: String,
    #[serde(default)]
    role: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    password_again: String,
}

/// Hash a new password typed twice, on the argon2 thread.
async fn new_password(st: &ConsoleState, password: &str, again: &str) -> Result<String, OpError> {
    if !session::same(password, again) {
        return Err(OpError::new(
            "password_mismatch",
            "the two passwords differ",
        ));
    }
    st.auth.hash_new_password(password).await
}

pub async fn add_person(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Form(f): Form<PersonForm>,
) -> Response {
    let who = match admin_form(&st, &headers, &f.csrf, Action::UserAdd).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    let principal = match crate::auth::users::user_principal(
        f.name.trim(),
        &chosen_tenant(&f.tenant, &f.new_tenant),
        &items(&f.role),
        vec![],
        vec![],
        vec![],
    ) {
        Ok(p) => p,
        Err(e) => {
            record_refusal(&st, &who, Action::UserAdd, e.code).await;
            return back(Err(e.code));
        }
    };
    let hash = match new_password(&st, &f.password, &f.password_again).await {
        Ok(h) => h,
        Err(e) => {
            record_refusal(&st, &who, Action::UserAdd, e.code).await;
            return back(Err(e.code));
        }
    };
    match as_admin(
        &st,
        &who,
        Request::User {
            op: UserOp::Add {
                principal: Box::new(principal),
                hash,
            },
        },
    )
    .await
    {
        Ok(_) => back(Ok("person_added")),
        Err(e) => back(Err(e.code)),
    }
}

async fn set_disabled(
    st: ConsoleState,
    headers: HeaderMap,
    name: String,
    csrf: String,
    disabled: bool,
) -> Response {
    let action = if disabled {
        Action::UserDisable
    } else {
        Action::UserEnable
    };
    let who = match admin_form(&st, &headers, &csrf, action.clone()).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    if !crate::auth::users::valid_name(&name) {
        return back(Err("user_not_found"));
    }
    if disabled && name == who.name {
        record_refusal(&st, &who, action, "self_disable_denied").await;
        return back(Err("self_disable_denied"));
    }
    match as_admin(
        &st,
        &who,
        Request::User {
            op: UserOp::SetDisabled { name, disabled },
        },
    )
    .await
    {
        Ok(_) if disabled => back(Ok("person_disabled")),
        Ok(_) => back(Ok("person_enabled")),
        Err(e) => back(Err(e.code)),
    }
}

pub async fn disable(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Form(f): Form<ConfirmForm>,
) -> Response {
    if !confirmed(&f.confirm) {
        let who = match admin_form(&st, &headers, &f.csrf, Action::UserDisable).await {
            Ok(w) => w,
            Err(r) => return r,
        };
        if !crate::auth::users::valid_name(&name) {
            return back(Err("user_not_found"));
        }
        return Confirm {
            heading: "Disable this person?",
            question: format!(
                "{name} is signed out of the console at their next request and cannot sign in or use their password on /v1 until enabled again."
            ),
            action: format!("/console/identities/people/{name}/disable"),
            fields: vec![],
            button: "Disable",
            back: "/console/identities",
        }
        .page(&who);
    }
    set_disabled(st, headers, name, f.csrf, true).await
}

pub async fn enable(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Form(f): Form<CsrfForm>,
) -> Response {
    set_disabled(st, headers, name, f.csrf, false).await
}

#[derive(Deserialize)]
pub struct PasswordForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    password: String,
    #[serde(default)]
    password_again: String,
}

pub async fn password(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Form(f): Form<PasswordForm>,
) -> Response {
    let who = match admin_form(&st, &headers, &f.csrf, Action::UserPasswd).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    if !crate::auth::users::valid_name(&name) {
        return back(Err("user_not_found"));
    }
    let hash = match new_password(&st, &f.password, &f.password_again).await {
        Ok(h) => h,
        Err(e) => {
            record_refusal(&st, &who, Action::UserPasswd, e.code).await;
            return back(Err(e.code));
        }
    };
    match as_admin(
        &st,
        &who,
        Request::User {
            op: UserOp::Passwd { name, hash },
        },
    )
    .await
    {
        Ok(_) => back(Ok("password_reset")),
        Err(e) => back(Err(e.code)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_fields_and_notices() {
        assert_eq!(items(" a, b  c,,"), vec!["a", "b", "c"]);
        assert!(items("  ").is_empty());
        assert_eq!(
            admin_token_id("cat_0123456789ab_secretsecret"),
            "0123456789ab"
        );
        assert_eq!(admin_token_id("nope"), "");
        let q = |done: Option<&str>, error: Option<&str>| Outcome {
            done: done.map(String::from),
            error: error.map(String::from),
        };
        assert!(notice(&q(Some("token_revoked"), None)).is_some_and(|n| n.ok));
        let n = notice(&q(None, Some("user_exists"))).unwrap();
        assert!(!n.ok && n.code == Some("user_exists"));
        // Nothing else from the query is shown.
        assert!(notice(&q(Some("<b>"), Some("<script>"))).is_none());
    }
}
