//! Console sessions: server-side, in the store (`store::console`).
//!
//! - The cookie `__Host-cube_session` (Secure, HttpOnly, SameSite=Strict,
//!   Path=/) holds a random 256-bit id; the store keeps only its SHA-256.
//! - A session ends after `[console] idle_timeout_seconds` unused (its
//!   last use is written at most once a minute) or
//!   `absolute_timeout_seconds` after sign-in, at sign-out, and at the next
//!   request once its user is removed, disabled or has a new password (the
//!   user record is read on every request: a point lookup; the session
//!   keeps a digest of the password hash it was opened under).
//! - The CSRF token of a session is an HMAC of the fixed label `csrf`
//!   under the session id: per session, never stored, compared in
//!   constant time. The sign-in form (no session yet) uses a short-lived
//!   double-submit cookie, `__Host-cube_signin`.

use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::Mac;
use sha2::Digest;

use crate::auth::Principal;
use crate::auth::users::{self, UserRecord};
use crate::store::console::{self as records, ConsoleSession};
use crate::store::{Store, StoreError};

/// The session cookie.
pub const COOKIE: &str = "__Host-cube_session";
/// The sign-in form's double-submit cookie.
pub const SIGN_IN_COOKIE: &str = "__Host-cube_signin";
/// How long a sign-in form may be used.
pub const SIGN_IN_FORM_SECONDS: u64 = 600;
/// How often a session's last use is written (the idle clock's precision).
pub const SEEN_PRECISION: i64 = 60;

/// A signed-in person, checked on this request.
#[derive(Debug, Clone)]
pub struct SignedIn {
    pub name: String,
    pub principal: Principal,
    /// This session's CSRF token.
    pub csrf: String,
    /// The store key of the session (a digest of its id).
    pub key: String,
}

/// Why a request has no usable session.
#[derive(Debug)]
pub enum NoSession {
    /// No cookie, an unknown one, or one that ended: sign in again.
    SignIn,
    Store(StoreError),
}

/// A fresh random token (session ids, sign-in form tokens).
pub fn new_token() -> String {
    crate::ids::random_token()
}

/// Whether `t` looks like one of ours (43 base64url characters).
fn well_formed(t: &str) -> bool {
    t.len() == 43
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The store key of a session id.
pub fn key_of(id: &str) -> String {
    let mut h = sha2::Sha256::new();
    h.update(b"cube-console-session\0");
    h.update(id.as_bytes());
    hex::encode(h.finalize())
}

/// A session's CSRF token.
pub fn csrf_of(id: &str) -> String {
    match <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(id.as_bytes()) {
        Ok(mut m) => {
            m.update(b"csrf");
            URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
        }
        // HMAC takes any key length: not reached.
        Err(_) => String::new(),
    }
}

/// Constant-time equality of two tokens (an empty expected token matches
/// nothing).
pub fn same(expected: &str, given: &str) -> bool {
    crate::auth::same_secret(expected, given)
}

/// A digest of a user's password hash: a new password ends the sessions
/// opened under the old one.
pub fn fingerprint(u: &UserRecord) -> String {
    let mut h = sha2::Sha256::new();
    h.update(b"cube-console-password\0");
    h.update(u.hash.as_bytes());
    hex::encode(h.finalize())
}

/// The value of cookie `name` in the request, if any.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim())
}

/// A `Set-Cookie` value for one of the console's `__Host-` cookies.
pub fn set_cookie(name: &str, value: &str, max_age: u64) -> String {
    format!("{name}={value}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age={max_age}")
}

/// A `Set-Cookie` value that removes a cookie.
pub fn clear_cookie(name: &str) -> String {
    set_cookie(name, "", 0)
}

/// Lifetimes, from `[console]`.
#[derive(Debug, Clone, Copy)]
pub struct Lifetimes {
    pub idle: u64,
    pub absolute: u64,
    /// Whether local users' sessions are honoured (`[console]
    /// local_users`).
    pub local_users: bool,
}

/// The person signed in with this request's cookie, checked now: the
/// session exists and has not outlived its lifetimes, and its user exists,
/// is enabled and has the password it signed in with. A session that fails
/// any check is removed.
pub async fn current(
    store: &Store,
    headers: &HeaderMap,
    now: i64,
    life: Lifetimes,
) -> Result<SignedIn, NoSession> {
    let Some(id) = cookie(headers, COOKIE).filter(|t| well_formed(t)) else {
        return Err(NoSession::SignIn);
    };
    let key = key_of(id);
    let k2 = key.clone();
    let found = store
        .read_now(|txn| records::get(txn, &k2))
        .map_err(NoSession::Store)?;
    let Some(s) = found else {
        return Err(NoSession::SignIn);
    };
    if let Some(v) = &s.principal {
        // The provider's person: nothing local to check again. (A principal
        // that no longer reads signs no one in.)
        let p = serde_json::from_value::<Principal>(v.clone()).ok();
        let Some(p) = p.filter(|_| !s.expired(now, life.idle, life.absolute)) else {
            end(store, key).await.map_err(NoSession::Store)?;
            return Err(NoSession::SignIn);
        };
        let mut p = p;
        p.label = Some(s.user.clone());
        let signed = SignedIn {
            name: s.user.clone(),
            principal: p,
            csrf: csrf_of(id),
            key: key.clone(),
        };
        touch(store, &key, &s, now).await?;
        return Ok(signed);
    }
    if !life.local_users {
        end(store, key).await.map_err(NoSession::Store)?;
        return Err(NoSession::SignIn);
    }
    let user = users::get_user(store, &s.user).map_err(NoSession::Store)?;
    let valid = !s.expired(now, life.idle, life.absolute)
        && user.as_ref().is_some_and(|u| {
            u.disabled_at.is_none() && same(&s.password_fingerprint, &fingerprint(u))
        });
    let Some(user) = user.filter(|_| valid) else {
        end(store, key).await.map_err(NoSession::Store)?;
        return Err(NoSession::SignIn);
    };
    touch(store, &key, &s, now).await?;
    let mut principal = user.principal;
    principal.label = Some(user.name.clone());
    Ok(SignedIn {
        name: user.name,
        principal,
        csrf: csrf_of(id),
        key,
    })
}

/// Record a session's use, at most once a minute.
async fn touch(store: &Store, key: &str, s: &ConsoleSession, now: i64) -> Result<(), NoSession> {
    if now.saturating_sub(s.seen_unix) < SEEN_PRECISION {
        return Ok(());
    }
    let k2 = key.to_string();
    let seen = ConsoleSession {
        seen_unix: now,
        ..s.clone()
    };
    store
        .write(move |txn, _| {
            // Only if it is still there (a sign-out may have won).
            if records::get(txn, &k2)?.is_some() {
                records::put(txn, &k2, &seen)?;
            }
            Ok(())
        })
        .await
        .map_err(NoSession::Store)
}

/// Open a session for `user` (whose record was just checked): the new
/// session id, for the cookie. Expired sessions are removed on the way.
pub async fn open(
    store: &Store,
    user: &UserRecord,
    now: i64,
    life: Lifetimes,
) -> Result<String, StoreError> {
    store_new(
        store,
        ConsoleSession {
            user: user.name.clone(),
            created_unix: now,
            seen_unix: now,
            password_fingerprint: fingerprint(user),
            principal: None,
        },
        now,
        life,
    )
    .await
}

/// Open a session for a person the identity provider vouched for.
pub async fn open_person(
    store: &Store,
    name: &str,
    principal: &Principal,
    now: i64,
    life: Lifetimes,
) -> Result<String, StoreError> {
    store_new(
        store,
        ConsoleSession {
            user: name.to_string(),
            created_unix: now,
            seen_unix: now,
            password_fingerprint: String::new(),
            principal: Some(
                serde_json::to_value(principal)
                    .map_err(|e| StoreError::Corrupt(format!("encode a console principal: {e}")))?,
            ),
        },
        now,
        life,
    )
    .await
}

async fn store_new(
    store: &Store,
    s: ConsoleSession,
    now: i64,
    life: Lifetimes,
) -> Result<String, StoreError> {
    let id = new_token();
    let key = key_of(&id);
    store
        .write(move |txn, _| {
            records::remove_expired(txn, now, life.idle, life.absolute)?;
            records::put(txn, &key, &s)
        })
        .await?;
    Ok(id)
}

/// End a session (absent is fine).
pub async fn end(store: &Store, key: String) -> Result<(), StoreError> {
    store
        .write(move |txn, _| records::remove(txn, &key).map(|_| ()))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_cookies_and_csrf() {
        let a = new_token();
        assert!(well_formed(&a) && a != new_token());
        assert!(!well_formed("short") && !well_formed(&format!("{}=", &a[..42])));
        assert_eq!(key_of(&a).len(), 64);
        assert_ne!(key_of(&a), a);
        let c = csrf_of(&a);
        assert!(same(&c, &c) && !same(&c, &csrf_of(&new_token())) && !same("", ""));
        assert!(!c.contains(&a));
        let mut h = HeaderMap::new();
        h.insert(
            axum::http::header::COOKIE,
            format!("x=1; {COOKIE}={a}; y=2").parse().unwrap(),
        );
        assert_eq!(cookie(&h, COOKIE), Some(a.as_str()));
        assert_eq!(cookie(&h, SIGN_IN_COOKIE), None);
        let s = set_cookie(COOKIE, &a, 60);
        for part in [
            "Path=/",
            "Secure",
            "HttpOnly",
            "SameSite=Strict",
            "Max-Age=60",
        ] {
            assert!(s.contains(part), "{s}");
        }
    }
}
