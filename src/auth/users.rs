//! People: named users with a password (argon2id), for approvers and
//! auditors. They sign in to `/v1` (and `/mcp`) with HTTP Basic
//! (`curl -u alice …`), and to the console once it exists, with the same
//! records. Managed by `cube-adapter user …`; the password is hashed by the
//! CLI, so it never crosses the admin socket.

use argon2::password_hash::{PasswordHasher, SaltString};
use serde::{Deserialize, Serialize};

use super::{OpError, Principal, Role};
use crate::store::typed::{self, ReadOps};
use crate::store::{Store, StoreError, tables};

/// Shortest password accepted.
pub const MIN_PASSWORD: usize = 12;

/// A user as stored (never the password).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UserRecord {
    pub name: String,
    /// argon2id PHC string.
    pub hash: String,
    /// Its subject is the user's name.
    pub principal: Principal,
    pub created_at: String,
    pub password_changed_at: String,
    #[serde(default)]
    pub disabled_at: Option<String>,
}

/// A user as listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UserInfo {
    pub name: String,
    pub principal: Principal,
    pub created_at: String,
    pub password_changed_at: String,
    pub disabled_at: Option<String>,
}

impl From<UserRecord> for UserInfo {
    fn from(u: UserRecord) -> Self {
        Self {
            name: u.name,
            principal: u.principal,
            created_at: u.created_at,
            password_changed_at: u.password_changed_at,
            disabled_at: u.disabled_at,
        }
    }
}

/// What `cube-adapter user …` asks of the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum UserOp {
    Add {
        principal: Box<Principal>,
        hash: String,
    },
    Passwd {
        name: String,
        hash: String,
    },
    SetDisabled {
        name: String,
        disabled: bool,
    },
    Remove {
        name: String,
    },
    List,
}

/// What a [`UserOp`] did: `{"users": […]}`, `{"added": name}`, …
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UserAnswer {
    /// `List`.
    Users(Vec<UserInfo>),
    Added(String),
    /// `Passwd` and `SetDisabled`.
    Changed(String),
    Removed(String),
}

/// `^[a-z][a-z0-9._-]{0,63}$`: a name that fits a URL, a log line and a
/// subject.
pub fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    n.len() <= 64
        && c.next().is_some_and(|f| f.is_ascii_lowercase())
        && c.all(|x| x.is_ascii_lowercase() || x.is_ascii_digit() || "._-".contains(x))
}

/// Why a password could not be hashed, or a hash is not one we take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PasswordError {
    #[error("a password needs at least {MIN_PASSWORD} characters")]
    TooShort,
    /// Salting or hashing failed (argon2's own words).
    #[error(transparent)]
    Hash(#[from] argon2::password_hash::Error),
    #[error("not a PHC password hash")]
    NotPhc,
    #[error("password hashes must be argon2id")]
    NotArgon2id,
    /// The parameters in the hash do not parse.
    #[error("argon2 parameters: {0}")]
    Params(#[source] argon2::password_hash::Error),
    /// Weaker than the defaults, or heavier than a sign-in can afford.
    #[error(
        "argon2 parameters out of bounds (at least the defaults, at most 256 MiB, 16 passes, 8 lanes)"
    )]
    OutOfBounds,
}

/// Hash a password for a user record (the CLI does this).
pub fn hash_password(password: &str) -> Result<String, PasswordError> {
    if password.chars().count() < MIN_PASSWORD {
        return Err(PasswordError::TooShort);
    }
    let salt_bytes: [u8; 16] = rand::random();
    let salt = SaltString::encode_b64(&salt_bytes)?;
    Ok(argon2::Argon2::default()
        .hash_password(password.as_bytes(), &salt)?
        .to_string())
}

/// A hash the CLI made: argon2id with parameters no weaker than the
/// defaults and no heavier than a sign-in can afford (a hash arrives over
/// the admin socket; a huge memory cost would be paid at every sign-in).
pub fn check_hash(hash: &str) -> Result<(), PasswordError> {
    let h = argon2::PasswordHash::new(hash).map_err(|_| PasswordError::NotPhc)?;
    if h.algorithm.as_str() != "argon2id" {
        return Err(PasswordError::NotArgon2id);
    }
    let p = argon2::Params::try_from(&h).map_err(PasswordError::Params)?;
    let d = argon2::Params::default();
    let ok = (d.m_cost()..=262_144).contains(&p.m_cost())
        && (d.t_cost()..=16).contains(&p.t_cost())
        && (1..=8).contains(&p.p_cost());
    if ok {
        Ok(())
    } else {
        Err(PasswordError::OutOfBounds)
    }
}

/// What `user add` (and the console's person form) asks for, checked:
/// the user's principal (subject: the name; default role approver), or
/// why not.
pub fn user_principal(
    name: &str,
    tenant: &str,
    roles: &[String],
    actions: Vec<String>,
    profiles: Vec<String>,
    task_templates: Vec<String>,
) -> Result<Principal, OpError> {
    if !valid_name(name) {
        return Err(OpError::new(
            "invalid_name",
            "a user name must match ^[a-z][a-z0-9._-]{0,63}$",
        ));
    }
    // The rules tokens follow (tenant, roles, scope words, defaults), with
    // approver as the default role.
    super::TokenSpec {
        tenant: tenant.to_string(),
        subject: Some(name.to_string()),
        roles: roles.to_vec(),
        runtimes: vec![],
        profiles,
        actions,
        no_actions: false,
        task_templates,
    }
    .principal_with(Role::Approver)
}

/// [`hash_password`], refusing a short password with `invalid_password`.
pub fn hash_new_password(password: &str) -> Result<String, OpError> {
    check_new_password(password)?;
    hash_password(password).map_err(OpError::failed)
}

/// A new password is long enough (`invalid_password` if not).
pub fn check_new_password(password: &str) -> Result<(), OpError> {
    if password.chars().count() < MIN_PASSWORD {
        return Err(OpError::new(
            "invalid_password",
            format!("a password needs at least {MIN_PASSWORD} characters"),
        ));
    }
    Ok(())
}

pub fn get_user(store: &Store, name: &str) -> Result<Option<UserRecord>, StoreError> {
    store.read_now(|txn| txn.record(tables::USERS, name))
}

/// Carry out one operation; the CLI prints the listing.
pub async fn user_op(
    store: &Store,
    op: UserOp,
    clock: &crate::clock::Clock,
) -> Result<UserAnswer, OpError> {
    user_op_audited(store, op, clock, None).await
}

/// [`user_op`], with the audit event of a change in the same transaction
/// (`rejected` with `user_exists` or `user_not_found` when the transaction
/// finds so; a refusal before it, a bad hash or name, is not appended).
pub async fn user_op_audited(
    store: &Store,
    op: UserOp,
    clock: &crate::clock::Clock,
    ev: super::AuditEvent,
) -> Result<UserAnswer, OpError> {
    let now = clock.text();
    match op {
        UserOp::List => {
            let v: Vec<UserInfo> = store
                .read_now(|txn| {
                    let all: Vec<UserRecord> = txn.records(tables::USERS)?;
                    Ok(all.into_iter().map(UserInfo::from).collect())
                })
                .map_err(OpError::failed)?;
            Ok(UserAnswer::Users(v))
        }
        UserOp::Add { principal, hash } => {
            check_hash(&hash).map_err(|e| OpError::new("invalid_password_hash", e.to_string()))?;
            let name = principal.subject.clone();
            if !valid_name(&name) {
                return Err(OpError::new(
                    "invalid_name",
                    "a user name must match ^[a-z][a-z0-9._-]{0,63}$",
                ));
            }
            let rec = UserRecord {
                name: name.clone(),
                hash,
                principal: *principal,
                created_at: now.clone(),
                password_changed_at: now,
                disabled_at: None,
            };
            let added = store
                .write(move |txn, chain| {
                    if txn.has(tables::USERS, &rec.name)? {
                        super::append_audit(txn, chain, ev, Some("user_exists"))?;
                        return Ok(false);
                    }
                    typed::put(txn, tables::USERS, &rec.name, &rec)?;
                    super::append_audit(txn, chain, ev, None)?;
                    Ok(true)
                })
                .await
                .map_err(OpError::failed)?;
            if added {
                Ok(UserAnswer::Added(name))
            } else {
                Err(OpError::new(
                    "user_exists",
                    format!("a user named {name} exists already"),
                ))
            }
        }
        UserOp::Passwd { name, hash } => {
            check_hash(&hash).map_err(|e| OpError::new("invalid_password_hash", e.to_string()))?;
            change(store, &name, ev, move |u| {
                u.hash = hash;
                u.password_changed_at = now;
            })
            .await
        }
        UserOp::SetDisabled { name, disabled } => {
            change(store, &name, ev, move |u| {
                u.disabled_at = disabled.then_some(now);
            })
            .await
        }
        UserOp::Remove { name } => {
            let n2 = name.clone();
            let removed = store
                .write(move |txn, chain| {
                    let removed = typed::remove(txn, tables::USERS, &n2)?;
                    if removed {
                        super::bump_identity_stamp(txn)?;
                    }
                    let refused = (!removed).then_some("user_not_found");
                    super::append_audit(txn, chain, ev, refused)?;
                    Ok(removed)
                })
                .await
                .map_err(OpError::failed)?;
            if removed {
                Ok(UserAnswer::Removed(name))
            } else {
                Err(OpError::new(
                    "user_not_found",
                    format!("no user named {name}"),
                ))
            }
        }
    }
}

async fn change(
    store: &Store,
    name: &str,
    ev: super::AuditEvent,
    f: impl FnOnce(&mut UserRecord) + Send + 'static,
) -> Result<UserAnswer, OpError> {
    let n2 = name.to_string();
    let found = store
        .write(move |txn, chain| {
            let Some(mut u): Option<UserRecord> = txn.record(tables::USERS, &n2)? else {
                super::append_audit(txn, chain, ev, Some("user_not_found"))?;
                return Ok(false);
            };
            f(&mut u);
            typed::put(txn, tables::USERS, &n2, &u)?;
            super::bump_identity_stamp(txn)?;
            super::append_audit(txn, chain, ev, None)?;
            Ok(true)
        })
        .await
        .map_err(OpError::failed)?;
    if found {
        Ok(UserAnswer::Changed(name.to_string()))
    } else {
        Err(OpError::new(
            "user_not_found",
            format!("no user named {name}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_passwords() {
        assert!(valid_name("alice") && valid_name("a.b-c_1"));
        assert!(!valid_name("Alice") && !valid_name("1a") && !valid_name("a b") && !valid_name(""));
        assert_eq!(
            hash_password("short").unwrap_err().to_string(),
            "a password needs at least 12 characters"
        );
        let h = hash_password("correct horse battery").unwrap();
        assert!(h.starts_with("$argon2id$") && !h.contains("horse"));
        assert_eq!(check_hash(&h), Ok(()));
        assert_eq!(
            check_hash("$argon2id$v=19$m=8,t=1,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA"),
            Err(PasswordError::OutOfBounds)
        );
        assert_eq!(
            check_hash("plain").unwrap_err().to_string(),
            "not a PHC password hash"
        );
    }

    #[test]
    fn user_principals_follow_the_token_rules() {
        let p = user_principal("alice", "acme", &[], vec![], vec![], vec![]).unwrap();
        assert_eq!(
            (p.subject.as_str(), p.roles.clone()),
            ("alice", vec![Role::Approver])
        );
        assert_eq!(p.actions, super::super::default_actions(&[Role::Approver]));
        assert_eq!(p.task_templates, vec!["*".to_string()]);
        let code = |r: Result<Principal, OpError>| r.unwrap_err().code;
        assert_eq!(
            code(user_principal("Alice", "acme", &[], vec![], vec![], vec![])),
            "invalid_name"
        );
        assert_eq!(
            code(user_principal("alice", "a b", &[], vec![], vec![], vec![])),
            "invalid_tenant"
        );
        let root = vec!["root".to_string()];
        assert_eq!(
            code(user_principal(
                "alice",
                "acme",
                &root,
                vec![],
                vec![],
                vec![]
            )),
            "invalid_role"
        );
        // Scope words are checked as a token's are.
        let bad = vec!["lease:\u{7}".to_string()];
        assert_eq!(
            code(user_principal("alice", "acme", &[], bad, vec![], vec![])),
            "invalid_scope"
        );
    }
}
