//! Sign-in with the company's identity provider (`[console.oidc]`): the
//! authorization code flow with PKCE (`auth::oidc::CodeFlow`).
//!
//! - `GET /console/oidc/start` sends the browser to the provider and binds
//!   the sign-in's `state` to it with `__Host-cube_oidc` (SameSite=Lax: the
//!   provider's redirect back is a navigation from another site, on which a
//!   Strict cookie is not sent).
//! - `GET /console/oidc/callback` takes the code only with that cookie's
//!   `state`, once, and answers with a page that moves on to `/console` by
//!   itself: the session cookie is Strict, and a browser does not send a
//!   Strict cookie on a redirect that a cross-site navigation began.

use askama::Template;
use axum::Extension;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use super::ConsoleState;
use super::pages::{self, Page, error_page, html};
use super::session;
use crate::auth::Source;

/// The cookie that binds a sign-in's `state` to the browser that began it.
pub const STATE_COOKIE: &str = "__Host-cube_oidc";

fn lax_cookie(value: &str, max_age: u64) -> String {
    format!("{STATE_COOKIE}={value}; Path=/; Secure; HttpOnly; SameSite=Lax; Max-Age={max_age}")
}

#[derive(Template)]
#[template(path = "oidc_done.html", config = "web/askama.toml")]
struct DonePage {
    page: Page,
}

fn not_configured() -> Response {
    error_page(
        StatusCode::NOT_FOUND,
        None,
        "Not found",
        "Sign-in with an identity provider is not configured here.",
    )
}

pub async fn start(State(st): State<ConsoleState>) -> Response {
    let Some(flow) = st.oidc.clone() else {
        return not_configured();
    };
    let now = st.broker.clock().unix().max(0).unsigned_abs();
    match flow.start(now).await {
        Ok((url, state)) => {
            let mut r = Redirect::to(&url).into_response();
            if let Ok(v) = HeaderValue::from_str(&lax_cookie(&state, session::SIGN_IN_FORM_SECONDS))
            {
                r.headers_mut().append(header::SET_COOKIE, v);
            }
            r
        }
        Err(e) => {
            tracing::warn!(error = %e, "console sign-in with the identity provider could not start");
            error_page(
                StatusCode::BAD_GATEWAY,
                None,
                "Identity provider unavailable",
                "The identity provider cannot be reached now. Try again shortly.",
            )
        }
    }
}

#[derive(Deserialize)]
pub struct Callback {
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

/// An answer that also removes the state cookie.
fn clearing(mut r: Response) -> Response {
    if let Ok(v) = HeaderValue::from_str(&lax_cookie("", 0)) {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}

pub async fn callback(
    State(st): State<ConsoleState>,
    source: Option<Extension<Source>>,
    headers: HeaderMap,
    Query(q): Query<Callback>,
) -> Response {
    let Some(flow) = st.oidc.clone() else {
        return not_configured();
    };
    let source = source.map(|Extension(s)| s);
    let bound = session::cookie(&headers, STATE_COOKIE).unwrap_or("");
    let state = q.state.as_deref().unwrap_or("");
    if !session::same(bound, state) {
        pages::refused(&st, source, "oidc", "invalid_state").await;
        return clearing(error_page(
            StatusCode::FORBIDDEN,
            None,
            "Sign-in expired",
            "This sign-in was not started in this browser, or has expired. Sign in again.",
        ));
    }
    if let Some(e) = &q.error {
        tracing::info!(error = %e, "the identity provider ended a console sign-in");
        pages::refused(&st, source, "oidc", "provider_refused").await;
        return clearing(pages::sign_in_page(
            &st,
            StatusCode::UNAUTHORIZED,
            "",
            Some("The identity provider did not sign you in."),
        ));
    }
    let Some(code) = q
        .code
        .as_deref()
        .filter(|c| !c.is_empty() && c.len() <= 4096)
    else {
        return clearing(error_page(
            StatusCode::BAD_REQUEST,
            None,
            "Sign-in incomplete",
            "The identity provider sent no code. Sign in again.",
        ));
    };
    let now = st.broker.clock().unix().max(0).unsigned_abs();
    let person = match flow.finish(state, code, now).await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(reason = %e, "console sign-in with the identity provider refused");
            pages::refused(&st, source, "oidc", "invalid_token").await;
            return clearing(pages::sign_in_page(
                &st,
                StatusCode::UNAUTHORIZED,
                "",
                Some("The identity provider's answer did not hold. Sign in again."),
            ));
        }
    };
    if !pages::may_use_console(&person.principal) {
        pages::refused(&st, source, &person.name, "forbidden").await;
        return clearing(error_page(
            StatusCode::FORBIDDEN,
            None,
            "Not for your role",
            "The console is for approvers, auditors and admins.",
        ));
    }
    let store = st.broker.journal().store().clone();
    let now = st.broker.clock().unix();
    let life = pages::lifetimes(&st);
    let id = match session::open_person(&store, &person.name, &person.principal, now, life).await {
        Ok(id) => id,
        Err(e) => {
            tracing::error!(error = %e, "console sign-in: session not stored");
            return clearing(pages::unavailable());
        }
    };
    let key = session::key_of(&id);
    // No audit, no sign-in.
    if let Err(e) = pages::audit_sign_in(
        &st,
        source,
        &person.name,
        Some((&person.principal, &key)),
        None,
    )
    .await
    {
        tracing::error!(error = %e, "console sign-in not audited: refused");
        let _ = session::end(&store, key).await;
        return clearing(pages::unavailable());
    }
    let mut r = clearing(html(
        StatusCode::OK,
        &DonePage {
            page: Page::new(None, "sign-in"),
        },
    ));
    if let Ok(v) = HeaderValue::from_str(&session::set_cookie(session::COOKIE, &id, life.absolute))
    {
        r.headers_mut().append(header::SET_COOKIE, v);
    }
    r
}
