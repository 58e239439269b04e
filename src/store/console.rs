//! Console sign-in sessions (`console_sessions_v1`, schema 5).
//!
//! Keyed by a digest of the session id: the id itself (the cookie's value)
//! is never stored, so a copy of the store signs no one in.

use serde::{Deserialize, Serialize};

use super::typed::{self, ReadOps, WriteOps};
use super::{StoreError, tables};

/// A signed-in person's session as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConsoleSession {
    /// The user's name (`users_v1`).
    pub user: String,
    /// When it began (Unix seconds): the absolute lifetime counts from here.
    pub created_unix: i64,
    /// When it was last used (Unix seconds, kept to the minute): the idle
    /// lifetime counts from here.
    pub seen_unix: i64,
    /// A digest of the user's password hash at sign-in: a new password
    /// ends the session.
    pub password_fingerprint: String,
    /// A person the identity provider vouched for (`[console.oidc]`): their
    /// principal as signed in (kept as the console wrote it: the store
    /// does not read it). `user` is then their name, not a local user's,
    /// and the session lasts as its lifetimes allow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<serde_json::Value>,
}

impl ConsoleSession {
    /// Whether it has outlived either lifetime at `now`.
    pub fn expired(&self, now: i64, idle_seconds: u64, absolute_seconds: u64) -> bool {
        let idle = i64::try_from(idle_seconds).unwrap_or(i64::MAX);
        let absolute = i64::try_from(absolute_seconds).unwrap_or(i64::MAX);
        now.saturating_sub(self.seen_unix) > idle
            || now.saturating_sub(self.created_unix) > absolute
    }
}

pub fn get(txn: &impl ReadOps, key: &str) -> Result<Option<ConsoleSession>, StoreError> {
    txn.record(tables::CONSOLE_SESSIONS, key)
}

pub fn put(txn: &impl WriteOps, key: &str, s: &ConsoleSession) -> Result<(), StoreError> {
    typed::put(txn, tables::CONSOLE_SESSIONS, key, s)
}

/// Remove a session (absent is fine): whether it was there.
pub fn remove(txn: &impl WriteOps, key: &str) -> Result<bool, StoreError> {
    typed::remove(txn, tables::CONSOLE_SESSIONS, key)
}

/// Remove every session expired at `now`: how many.
pub fn remove_expired(
    txn: &impl WriteOps,
    now: i64,
    idle_seconds: u64,
    absolute_seconds: u64,
) -> Result<usize, StoreError> {
    let mut gone = vec![];
    for (k, v) in txn.raw_records(tables::CONSOLE_SESSIONS)? {
        // An undecodable session signs no one in: it goes too.
        match super::codec::decode::<ConsoleSession>(&v) {
            Ok(s) if !s.expired(now, idle_seconds, absolute_seconds) => {}
            _ => gone.push(k),
        }
    }
    for k in &gone {
        remove(txn, k)?;
    }
    Ok(gone.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetimes() {
        let s = ConsoleSession {
            user: "bob".into(),
            created_unix: 1000,
            seen_unix: 2000,
            password_fingerprint: "f".into(),
            principal: None,
        };
        assert!(!s.expired(2000 + 60, 60, 10_000));
        assert!(s.expired(2000 + 61, 60, 10_000), "idle");
        assert!(!s.expired(2500, 1000, 1500));
        assert!(s.expired(2501, 1000, 1500), "absolute");
    }
}
