//! Identity: who is calling, and what they may do.
//!
//! Bearer tokens issued by `cube-adapter token create` are high-entropy
//! secrets: their records keep an HMAC-SHA-256 of the token under the
//! store's token key (`Store::token_key`, sealed at rest), checked in
//! constant time in microseconds and without memory of its own. People's
//! passwords (HTTP Basic, `users`) stay argon2id, checked on one dedicated
//! thread with a reused memory block (`argon`), so memory does not grow
//! with the number of attempts. A verified credential is cached (by its
//! SHA-256) for a minute. The reference adapter's `CUBE_ADAPTER_TOKENS_FILE`
//! principals and shared `CUBE_ADAPTER_TOKEN` are accepted too (compared in
//! constant time).
//!
//! Token records from before schema 4 hold an argon2id hash. They are
//! rekeyed on their first successful use (checked on the argon2 thread,
//! then the record's hash is rewritten under the token key): the plaintext
//! token is never kept, so no one-off step at start could rewrite them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::Digest;
use subtle::ConstantTimeEq;

use crate::store::event::{Outcome, Phase};
use crate::store::typed::{self, ReadOps};
use crate::store::{Store, StoreError, tables};

mod argon;
pub(crate) mod client_ca;
pub(crate) mod oidc;
pub(crate) mod settings;
pub(crate) mod throttle;
pub(crate) mod users;

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Agent,
    Approver,
    Auditor,
    Admin,
}

impl Role {
    /// The role's name, as `--role` takes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Approver => "approver",
            Role::Auditor => "auditor",
            Role::Admin => "admin",
        }
    }
}

/// A role name that is none of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role '{0}' (agent, approver, auditor, admin)")]
pub struct UnknownRole(pub String);

impl std::str::FromStr for Role {
    type Err = UnknownRole;
    fn from_str(s: &str) -> Result<Self, UnknownRole> {
        match s {
            "agent" | "runtime" => Ok(Role::Agent),
            "approver" => Ok(Role::Approver),
            "auditor" => Ok(Role::Auditor),
            "admin" => Ok(Role::Admin),
            other => Err(UnknownRole(other.to_string())),
        }
    }
}

/// The runtimes an identity may be limited to (`[defaults]
/// allowed_runtimes`, a token's `--runtime`); the reference's four.
pub const RUNTIMES: &[&str] = &["openclaw", "dsh", "hermes", "mcp"];

/// What every role may read: listings, statuses, outputs, receipts.
pub const READ_ACTIONS: &[&str] = &[
    "lease:list",
    "lease:status",
    "job:status",
    "job:output",
    "pty:status",
    "pty:events",
    "checkpoint:list",
    "file:read",
    "file:list",
    "file:stat",
    "task:status",
    "task:receipt",
    "mcp:list",
];

/// What an agent does with its leases, besides reading.
pub const AGENT_ACTIONS: &[&str] = &[
    "lease:*",
    "exec:*",
    "file:*",
    "job:*",
    "pty:*",
    "checkpoint:*",
    "mcp:*",
    "task:plan",
    "task:submit",
    "task:result",
    "task:cancel",
];

impl Role {
    /// The action scopes this role gets when none are given: an auditor
    /// reads, an approver decides on task plans and reads, an agent works
    /// its leases and plans tasks, an admin may do everything.
    pub fn default_actions(self) -> Vec<&'static str> {
        match self {
            Role::Admin => vec!["*"],
            Role::Auditor => READ_ACTIONS.to_vec(),
            Role::Approver => {
                let mut v = vec!["task:approve"];
                v.extend_from_slice(READ_ACTIONS);
                v
            }
            Role::Agent => {
                let mut v = AGENT_ACTIONS.to_vec();
                v.extend_from_slice(READ_ACTIONS);
                v
            }
        }
    }
}

/// The default action scopes of a set of roles: the union of each role's
/// (`*` alone if any role grants everything), without repeats, and
/// without scopes a family wildcard in the set already covers.
pub fn default_actions(roles: &[Role]) -> Vec<String> {
    let all: Vec<&str> = roles.iter().flat_map(|r| r.default_actions()).collect();
    if all.contains(&"*") {
        return vec!["*".into()];
    }
    let families: Vec<&str> = all.iter().filter_map(|a| a.strip_suffix(":*")).collect();
    let mut out: Vec<String> = vec![];
    for a in all {
        let covered = !a.ends_with(":*")
            && a.split(':')
                .next()
                .is_some_and(|fam| families.contains(&fam));
        if !covered && !out.iter().any(|o| o == a) {
            out.push(a.to_string());
        }
    }
    out
}

/// An authenticated caller.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Principal {
    pub tenant: String,
    pub subject: String,
    pub roles: Vec<Role>,
    /// `None`: any runtime. `Some([])`: none.
    pub runtimes: Option<Vec<String>>,
    /// `None`: any profile. `Some([])`: none.
    pub profiles: Option<Vec<String>>,
    /// Action scopes (`exec:run`, `file:*`, `*`); an empty list denies all.
    pub actions: Vec<String>,
    /// Task templates this identity may plan (`*` or names); an empty list
    /// denies all.
    #[serde(default = "all")]
    pub task_templates: Vec<String>,
    /// Set only inside the appliance, for the calls a trusted task makes on
    /// its own lease: such a lease is visible to nothing else. Never stored,
    /// never read from a token.
    #[serde(skip)]
    pub task: Option<String>,
    /// The OIDC issuer that vouched for this identity (`[[auth.oidc]]`);
    /// None for the appliance's own identities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    /// What the credential is called, for people (issue #36): a token's
    /// description (or `token <id>`), a user's name, a certificate
    /// identity's description. Set when the caller is authenticated, never
    /// stored with the principal, never a secret.
    #[serde(skip)]
    pub label: Option<String>,
}

fn all() -> Vec<String> {
    vec!["*".into()]
}

impl Principal {
    /// `subject` of `tenant` with one role and nothing narrowed: every
    /// runtime, profile, action scope and task template (the first start's
    /// admin, the shared token).
    pub fn unrestricted(tenant: &str, subject: &str, role: Role) -> Principal {
        Principal {
            label: None,
            tenant: tenant.into(),
            subject: subject.into(),
            roles: vec![role],
            runtimes: None,
            profiles: None,
            actions: all(),
            task_templates: all(),
            task: None,
            issuer: None,
        }
    }

    /// What identifies this caller in digests (requester and approver
    /// binding, audit): tenant and subject, and the issuer of an OIDC
    /// identity (one provider's `sub` is not another's).
    pub fn identity_key(&self) -> String {
        match &self.issuer {
            Some(iss) => format!("{}\0{}\0{}", self.tenant, self.subject, iss),
            None => format!("{}\0{}", self.tenant, self.subject),
        }
    }

    pub fn is_admin(&self) -> bool {
        self.roles.contains(&Role::Admin)
    }

    /// `*`, an exact match, or `family:*`.
    pub fn allows_action(&self, action: &str) -> bool {
        self.is_admin()
            || self.actions.iter().any(|a| {
                a == "*"
                    || a == action
                    || a.strip_suffix(":*")
                        .is_some_and(|fam| action.split(':').next() == Some(fam))
            })
    }

    /// Admins, `*`, or the template's name.
    pub fn allows_task_template(&self, name: &str) -> bool {
        self.is_admin() || self.task_templates.iter().any(|t| t == "*" || t == name)
    }

    /// Approvers and admins may decide on plans (never their own, see
    /// `broker::tasks`).
    pub fn may_approve(&self) -> bool {
        self.roles.contains(&Role::Approver) || self.is_admin()
    }

    /// Auditors and admins look at the audit journal.
    pub fn may_audit(&self) -> bool {
        self.roles.contains(&Role::Auditor) || self.is_admin()
    }

    /// The effective action scopes as a list joined by `sep` (`*` for an
    /// admin, `(none)` for none).
    pub fn scopes_text(&self, sep: &str) -> String {
        if self.is_admin() {
            "*".into()
        } else if self.actions.is_empty() {
            "(none)".into()
        } else {
            self.actions.join(sep)
        }
    }

    /// The same identity, acting for a trusted task on the task's own lease:
    /// every action scope (the task was approved as a whole), but the
    /// identity's runtimes and profiles still apply, and no admin power.
    pub fn for_task(&self, task_ref: &str) -> Principal {
        Principal {
            roles: vec![Role::Agent],
            actions: all(),
            task: Some(task_ref.to_string()),
            ..self.clone()
        }
    }

    pub fn allows_runtime(&self, r: &str) -> bool {
        self.runtimes
            .as_ref()
            .is_none_or(|v| v.iter().any(|x| x == r || x == "*"))
    }

    pub fn allows_profile(&self, p: &str) -> bool {
        self.profiles
            .as_ref()
            .is_none_or(|v| v.iter().any(|x| x == p || x == "*"))
    }
}

/// A stored token (never the token itself).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenRecord {
    pub id: String,
    /// `hmac-sha256:<hex>` of the token under the store's token key; an
    /// argon2id PHC string in records from before schema 4 (until the
    /// token's next use rewrites it); empty for a certificate identity.
    pub hash: String,
    pub principal: Principal,
    pub created_at: String,
    #[serde(default)]
    pub revoked_at: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// A client-certificate identity: the SHA-256 of the certificate (hex)
    /// that stands for this principal (`hash` is then empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_sha256: Option<String>,
}

impl TokenRecord {
    /// The principal it stands for, with its label (issue #36): its
    /// description, or else `token <id>` (`certificate <id>`).
    pub fn labelled(self) -> Principal {
        let kind = if self.cert_sha256.is_some() {
            "certificate"
        } else {
            "token"
        };
        let mut p = self.principal;
        p.label = Some(
            self.description
                .filter(|d| !d.trim().is_empty())
                .unwrap_or_else(|| format!("{kind} {}", self.id)),
        );
        p
    }
}

/// The verified client certificate a connection presented (a request
/// extension, set by the TLS server): its SHA-256, and the identity it
/// stands for when the company's CA issued it (`[auth.client_ca]`). One of
/// the identity CA identifies a caller only when a certificate identity was
/// registered for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCert {
    pub sha256: [u8; 32],
    pub company: Option<Arc<Principal>>,
}

impl PeerCert {
    /// A certificate of the identity CA.
    pub fn own(sha256: [u8; 32]) -> Self {
        Self {
            sha256,
            company: None,
        }
    }
}

/// A client-certificate identity's record: its id is the first 12 hex
/// characters of the certificate's SHA-256.
pub fn cert_record(
    principal: Principal,
    description: Option<String>,
    cert: &PeerCert,
    clock: &crate::clock::Clock,
) -> TokenRecord {
    let fp = hex::encode(cert.sha256);
    TokenRecord {
        id: fp.chars().take(12).collect(),
        hash: String::new(),
        principal,
        created_at: clock.text(),
        revoked_at: None,
        description,
        cert_sha256: Some(fp),
    }
}

/// `cat_<id>_<secret>`.
pub const TOKEN_PREFIX: &str = "cat_";

/// A token's id, from its id or the token itself (`cat_<id>_<secret>`), as
/// `token revoke` takes it.
pub fn token_id(id: &str) -> &str {
    id.trim_start_matches(TOKEN_PREFIX)
        .split('_')
        .next()
        .unwrap_or("")
}

fn parse_token(t: &str) -> Option<(&str, &str)> {
    let rest = t.strip_prefix(TOKEN_PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    (id.len() == 12 && id.bytes().all(|b| b.is_ascii_hexdigit()) && secret.len() >= 32)
        .then_some((id, secret))
}

/// How a keyed token hash starts (`hmac-sha256:<hex>`).
pub const KEYED_PREFIX: &str = "hmac-sha256:";

/// HMAC-SHA-256 of `token` under `key`.
fn keyed(key: &[u8; 32], token: &str) -> Option<[u8; 32]> {
    let mut m = <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new_from_slice(key).ok()?;
    hmac::Mac::update(&mut m, token.as_bytes());
    Some(hmac::Mac::finalize(m).into_bytes().into())
}

/// A record's `hash` for `token` under `key`.
fn keyed_hash(key: &[u8; 32], token: &str) -> Option<String> {
    keyed(key, token).map(|h| format!("{KEYED_PREFIX}{}", hex::encode(h)))
}

/// Whether `token` matches a keyed `hash` (constant time).
fn keyed_matches(key: &[u8; 32], token: &str, hash: &str) -> bool {
    let (Some(hex_part), Some(mine)) = (hash.strip_prefix(KEYED_PREFIX), keyed(key, token)) else {
        return false;
    };
    hex::decode(hex_part).is_ok_and(|stored| bool::from(stored.as_slice().ct_eq(&mine)))
}

/// A token made but not stored yet: `store_token` keys its hash under the
/// store's token key. (No `Debug`: it holds the token.)
pub struct NewToken {
    record: TokenRecord,
    token: String,
}

impl NewToken {
    pub fn id(&self) -> &str {
        &self.record.id
    }
}

/// Make a new token: the plaintext (shown once) and what `store_token`
/// keeps of it. Nothing here can fail.
pub fn new_token(
    principal: Principal,
    description: Option<String>,
    clock: &crate::clock::Clock,
) -> (String, NewToken) {
    let id = crate::ids::random_hex(6);
    let secret: [u8; 32] = rand::random();
    let token = format!(
        "{TOKEN_PREFIX}{id}_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret)
    );
    let created_at = clock.text();
    (
        token.clone(),
        NewToken {
            record: TokenRecord {
                id,
                hash: String::new(),
                principal,
                created_at,
                revoked_at: None,
                description,
                cert_sha256: None,
            },
            token,
        },
    )
}

/// An identity change's audit event, appended in the same transaction as
/// the change (`None`: not audited). Its outcome is set there: `ok`, or
/// `rejected` with the code of a refusal the transaction found (no such
/// token or user, a name taken).
pub type AuditEvent = Option<crate::store::event::Event>;

/// The `meta` key of the identity stamp: a random value rewritten, in the
/// same transaction, by every change that takes rights away (a revoked
/// token or certificate identity, a user's new password, a disabled or
/// removed user). Replicas sharing a store look at it every
/// [`STAMP_POLL`] and forget the identities they verified when it moved
/// (docs/security.md, "Revocation across replicas").
const IDENTITY_STAMP: &str = "identity_stamp";

/// How often [`Authenticator::watch_revocations`] looks at the stamp.
pub const STAMP_POLL: Duration = Duration::from_secs(2);

/// Move the identity stamp, in a change's transaction. Random, not a
/// counter: two replicas changing it at once never write the same value
/// over a value a third has seen.
pub(crate) fn bump_identity_stamp(txn: &crate::store::Wx) -> Result<(), StoreError> {
    use crate::store::typed::WriteOps;
    let v: [u8; 16] = rand::random();
    txn.put_meta(IDENTITY_STAMP, &v)
}

/// Append `ev` (if any) with its outcome, in the change's transaction.
pub(crate) fn append_audit(
    txn: &crate::store::Wx,
    chain: &mut crate::store::Chain,
    ev: AuditEvent,
    refused: Option<&str>,
) -> Result<(), StoreError> {
    if let Some(mut ev) = ev {
        ev.phase = Phase::Event;
        ev.outcome = if refused.is_some() {
            Outcome::Rejected
        } else {
            Outcome::Ok
        };
        ev.error_code = refused.map(str::to_string);
        chain.append(txn, ev)?;
    }
    Ok(())
}

/// Store a new token's record, its hash keyed under the store's token key.
pub async fn store_token(store: &Store, new: NewToken) -> Result<(), StoreError> {
    store_token_audited(store, new, None).await
}

/// [`store_token`], with its audit event in the same transaction.
pub async fn store_token_audited(
    store: &Store,
    new: NewToken,
    ev: AuditEvent,
) -> Result<(), StoreError> {
    let key = store.token_key()?;
    let mut rec = new.record;
    rec.hash = keyed_hash(&key, &new.token)
        .ok_or_else(|| StoreError::Corrupt("the token key is unusable".into()))?;
    store
        .write(move |txn, chain| {
            typed::put(txn, tables::TOKENS, &rec.id, &rec)?;
            append_audit(txn, chain, ev, None)
        })
        .await
}

pub fn list_tokens(store: &Store) -> Result<Vec<TokenRecord>, StoreError> {
    store.read_now(|txn| txn.records(tables::TOKENS))
}

/// Store a certificate identity; refused when its id is taken.
pub async fn store_cert_identity(store: &Store, rec: TokenRecord) -> Result<(), OpError> {
    store_cert_identity_audited(store, rec, None).await
}

/// [`store_cert_identity`], with its audit event in the same transaction
/// (`rejected` with `identity_exists` when the id is taken):
/// `invalid_identity` for a record without a certificate,
/// `identity_exists`, or a store failure (`OpError::failed`).
pub async fn store_cert_identity_audited(
    store: &Store,
    rec: TokenRecord,
    ev: AuditEvent,
) -> Result<(), OpError> {
    if rec.cert_sha256.is_none() {
        return Err(OpError::new(
            "invalid_identity",
            "not a certificate identity",
        ));
    }
    let r = store
        .write(move |txn, chain| {
            if txn.has(tables::TOKENS, &rec.id)? {
                append_audit(txn, chain, ev, Some("identity_exists"))?;
                return Ok(false);
            }
            typed::put(txn, tables::TOKENS, &rec.id, &rec)?;
            append_audit(txn, chain, ev, None)?;
            Ok(true)
        })
        .await
        .map_err(OpError::failed)?;
    if r {
        Ok(())
    } else {
        Err(OpError::new(
            "identity_exists",
            "an identity with this id exists already",
        ))
    }
}

/// Mark a token revoked. Returns false when no such token exists.
pub async fn revoke_token(
    store: &Store,
    id: &str,
    clock: &crate::clock::Clock,
) -> Result<bool, StoreError> {
    revoke_token_audited(store, id, clock, None).await
}

/// [`revoke_token`], with its audit event in the same transaction
/// (`rejected` with `token_not_found` when there is no such token).
pub async fn revoke_token_audited(
    store: &Store,
    id: &str,
    clock: &crate::clock::Clock,
    ev: AuditEvent,
) -> Result<bool, StoreError> {
    let now = clock.text();
    let id = token_id(id).to_string();
    store
        .write(move |txn, chain| {
            let Some(mut rec): Option<TokenRecord> = txn.record(tables::TOKENS, &id)? else {
                append_audit(txn, chain, ev, Some("token_not_found"))?;
                return Ok(false);
            };
            if rec.revoked_at.is_none() {
                rec.revoked_at = Some(now);
            }
            typed::put(txn, tables::TOKENS, &id, &rec)?;
            bump_identity_stamp(txn)?;
            append_audit(txn, chain, ev, None)?;
            Ok(true)
        })
        .await
}

/// Why an identity operation (a token, a certificate identity, a user) was
/// refused: a stable code (`invalid_tenant`, `user_exists`, …) and a plain
/// message. The CLI prints the message, the console shows both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpError {
    pub code: &'static str,
    pub message: String,
}

impl OpError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// A failure of the store or the CA (not the caller's fault).
    pub fn failed(message: impl std::fmt::Display) -> Self {
        Self::new("identity_store_failed", message.to_string())
    }
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for OpError {}

impl From<OpError> for String {
    fn from(e: OpError) -> Self {
        e.message
    }
}

/// What `token create` (and the console's token form) asks for: checked
/// and turned into a principal by [`TokenSpec::principal`], the one place
/// for the rules (tenant, roles, runtimes, default scopes).
#[derive(Debug, Clone, Default)]
pub struct TokenSpec {
    pub tenant: String,
    /// Who holds it; defaults to the tenant.
    pub subject: Option<String>,
    /// Role names (`agent`, `approver`, `auditor`, `admin`); none: agent.
    pub roles: Vec<String>,
    /// Allowed runtimes; none: any.
    pub runtimes: Vec<String>,
    /// Allowed profiles; none: any.
    pub profiles: Vec<String>,
    /// Action scopes; none: the roles' defaults (unless `no_actions`).
    pub actions: Vec<String>,
    /// An explicit empty scope list.
    pub no_actions: bool,
    /// Task templates; none: `*`.
    pub task_templates: Vec<String>,
}

/// Constant-time equality of two secrets (an empty expected one matches
/// nothing): CSRF tokens, OIDC state and nonce.
pub fn same_secret(expected: &str, given: &str) -> bool {
    !expected.is_empty()
        && expected.len() == given.len()
        && bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
}

/// A tenant name: 1-128 characters of `[A-Za-z0-9_.:-]`.
pub fn valid_tenant_name(t: &str) -> bool {
    valid_tenant(t)
}

/// A subject, profile, action or template name: 1-256 bytes, no control
/// characters.
fn valid_word(w: &str) -> bool {
    !w.is_empty() && w.len() <= 256 && !w.chars().any(char::is_control)
}

/// Parse role names (none: `default`), sorted, without repeats.
pub fn parse_roles(names: &[String], default: Role) -> Result<Vec<Role>, OpError> {
    let roles: Result<Vec<Role>, UnknownRole> = names.iter().map(|r| r.parse()).collect();
    let mut roles = match roles {
        Ok(r) if r.is_empty() => vec![default],
        Ok(r) => r,
        Err(e) => return Err(OpError::new("invalid_role", e.to_string())),
    };
    roles.sort();
    roles.dedup();
    Ok(roles)
}

impl TokenSpec {
    /// The principal this asks for, or why not.
    pub fn principal(self) -> Result<Principal, OpError> {
        self.principal_with(Role::Agent)
    }

    /// [`TokenSpec::principal`], with `default_role` when no role is named
    /// (a token's is agent, a user's approver: `users::user_principal`).
    pub(crate) fn principal_with(self, default_role: Role) -> Result<Principal, OpError> {
        if !valid_tenant(&self.tenant) {
            return Err(OpError::new(
                "invalid_tenant",
                "--tenant must be 1-128 characters of [A-Za-z0-9_.:-]",
            ));
        }
        let roles = parse_roles(&self.roles, default_role)?;
        for r in &self.runtimes {
            if !RUNTIMES.contains(&r.as_str()) {
                return Err(OpError::new(
                    "invalid_runtime",
                    format!("unknown runtime '{r}' ({})", RUNTIMES.join(", ")),
                ));
            }
        }
        if let Some(s) = &self.subject
            && !valid_word(s)
        {
            return Err(OpError::new(
                "invalid_subject",
                "a subject must be 1-256 bytes without control characters",
            ));
        }
        let words = self
            .profiles
            .iter()
            .chain(&self.actions)
            .chain(&self.task_templates);
        if let Some(w) = words.into_iter().find(|w| !valid_word(w)) {
            return Err(OpError::new(
                "invalid_scope",
                format!(
                    "{w:?} is not a profile, action or template name (1-256 bytes, no control characters)"
                ),
            ));
        }
        Ok(Principal {
            label: None,
            subject: self.subject.unwrap_or_else(|| self.tenant.clone()),
            tenant: self.tenant,
            roles: roles.clone(),
            runtimes: (!self.runtimes.is_empty()).then_some(self.runtimes),
            profiles: (!self.profiles.is_empty()).then_some(self.profiles),
            actions: if self.no_actions {
                vec![]
            } else if self.actions.is_empty() {
                default_actions(&roles)
            } else {
                self.actions
            },
            task_templates: if self.task_templates.is_empty() {
                all()
            } else {
                self.task_templates
            },
            task: None,
            issuer: None,
        })
    }
}

/// A reference-adapter principal (`CUBE_ADAPTER_TOKENS_FILE` entry).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    #[serde(default)]
    token: Option<String>,
    tenant_id: String,
    #[serde(default)]
    subject: Option<String>,
    #[serde(default)]
    roles: Option<ListOrString>,
    #[serde(default)]
    allowed_profiles: Option<ListOrString>,
    #[serde(default)]
    allowed_runtimes: Option<ListOrString>,
    #[serde(default)]
    allowed_actions: Option<ListOrString>,
    #[serde(default)]
    allowed_task_templates: Option<ListOrString>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum ListOrString {
    List(Vec<String>),
    Str(String),
}

impl ListOrString {
    fn items(&self) -> Vec<String> {
        match self {
            ListOrString::List(v) => v
                .iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            ListOrString::Str(s) => s
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
        }
    }
}

fn valid_tenant(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

/// Why a reference principals file (`CUBE_ADAPTER_TOKENS_FILE`) was
/// refused.
#[derive(Debug, thiserror::Error)]
pub enum TokensFileError {
    #[error("tokens file is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("tokens file must be a list or an object")]
    NotListOrObject,
    /// An entry is not the reference's shape.
    #[error("tokens file entry: {0}")]
    Entry(#[source] serde_json::Error),
    /// An entry of the list form names no token.
    #[error("tokens file entry without a token")]
    NoToken,
    #[error("a token for tenant {tenant} is shorter than 24 characters")]
    ShortToken { tenant: String },
    #[error("invalid tenant_id '{tenant}'")]
    InvalidTenant { tenant: String },
    #[error(transparent)]
    Role(#[from] UnknownRole),
}

/// Parse a reference principals file: a list of entries, or a map
/// token → entry.
pub fn load_tokens_file(text: &str) -> Result<Vec<(String, Principal)>, TokensFileError> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(TokensFileError::NotJson)?;
    let entries: Vec<(String, FileEntry)> = match v {
        serde_json::Value::Array(items) => items
            .into_iter()
            .map(|i| {
                let e: FileEntry = serde_json::from_value(i).map_err(TokensFileError::Entry)?;
                let t = e.token.clone().ok_or(TokensFileError::NoToken)?;
                Ok((t, e))
            })
            .collect::<Result<_, TokensFileError>>()?,
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(t, i)| {
                let e: FileEntry = serde_json::from_value(i).map_err(TokensFileError::Entry)?;
                Ok((t, e))
            })
            .collect::<Result<_, TokensFileError>>()?,
        _ => return Err(TokensFileError::NotListOrObject),
    };
    let mut out = vec![];
    for (token, e) in entries {
        if token.len() < 24 {
            return Err(TokensFileError::ShortToken {
                tenant: e.tenant_id,
            });
        }
        if !valid_tenant(&e.tenant_id) {
            return Err(TokensFileError::InvalidTenant {
                tenant: e.tenant_id,
            });
        }
        let roles = e
            .roles
            .map(|r| {
                r.items()
                    .iter()
                    .map(|x| x.parse())
                    .collect::<Result<Vec<Role>, _>>()
            })
            .transpose()?
            .unwrap_or_else(|| vec![Role::Agent]);
        // The reference's empty profile/runtime lists mean "all".
        let nonempty = |l: Option<ListOrString>| l.map(|l| l.items()).filter(|v| !v.is_empty());
        out.push((
            token,
            Principal {
                label: None,
                subject: e.subject.unwrap_or_else(|| e.tenant_id.clone()),
                tenant: e.tenant_id,
                roles,
                runtimes: nonempty(e.allowed_runtimes),
                profiles: nonempty(e.allowed_profiles),
                actions: e
                    .allowed_actions
                    .map(|l| l.items())
                    .unwrap_or_else(|| vec!["*".into()]),
                task_templates: e
                    .allowed_task_templates
                    .map(|l| l.items())
                    .unwrap_or_else(all),
                task: None,
                issuer: None,
            },
        ));
    }
    Ok(out)
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("identity store unavailable")]
    Unavailable,
    /// Too many sign-in attempts (this credential's or this address's
    /// failures, or the sign-in queue is full): retry after the seconds
    /// given.
    #[error("too many sign-in attempts")]
    Throttled(u64),
    /// An OIDC token that does not hold (401 `invalid_token`), and why.
    #[error("invalid token: {0}")]
    InvalidToken(String),
}

struct Cached {
    principal: Principal,
    until: Instant,
}

/// Verifies bearer tokens. Cheap to clone.
#[derive(Clone)]
pub struct Authenticator {
    store: Store,
    /// The shared token's principal (from the environment: never reloaded).
    shared: Arc<Fixed>,
    /// The principals file's (replaced by a reload).
    file: Arc<std::sync::RwLock<Arc<Fixed>>>,
    cache: Arc<Mutex<HashMap<[u8; 32], Cached>>>,
    /// Bumped by every `clear_cache` (under the cache's lock): a check that
    /// began before a revocation never caches what it found.
    generation: Arc<std::sync::atomic::AtomicU64>,
    /// The store's identity stamp as last seen (`sync_revocations`).
    stamp: Arc<Mutex<Option<Vec<u8>>>>,
    inflight: Arc<Mutex<HashMap<[u8; 32], Flight>>>,
    /// Tokens from before schema 4 waiting for their (argon2) check.
    hashing: Arc<tokio::sync::Semaphore>,
    /// Password checks (HTTP Basic): one at a time, so that guessing
    /// cannot fill the argon2 queue before old tokens' checks.
    basic: Arc<tokio::sync::Semaphore>,
    /// The argon2 thread (passwords, and tokens from before schema 4).
    argon: Arc<argon::Pool>,
    /// Failed sign-ins per credential and source address (`throttle`).
    throttle: Arc<throttle::Throttle>,
    /// Where the blocks the throttle starts are reported (to be audited).
    blocks: Option<tokio::sync::mpsc::Sender<throttle::Blocked>>,
    /// Wall-clock time for what the authenticator records (the system
    /// clock unless `with_clock`); cache and throttle windows are `Instant`s.
    clock: crate::clock::Clock,
    /// Keys the Basic cache entries (a password's plain hash is never
    /// kept), made at start.
    basic_key: Arc<[u8; 32]>,
    /// Trusted OIDC issuers (`[[auth.oidc]]`), if any.
    oidc: Option<Arc<oidc::Verifier>>,
    /// Whether local users sign in with their password (HTTP Basic).
    local_users: bool,
}

pub use throttle::{MAX_FAILURES, Source};

/// The source of a sign-in that did not come over the network (counted
/// together).
const UNKNOWN_SOURCE: Source = Source::UNSPECIFIED;
/// How long a password check waits for its turn before answering 429.
const BASIC_WAIT: Duration = Duration::from_secs(2);

/// Tokens compared as they are (shared token, principals file).
type Fixed = Vec<(Vec<u8>, Principal)>;

/// One token's verification in progress.
type Flight = Arc<tokio::sync::Mutex<()>>;

/// A turn at one credential's check; its map entry goes with the last
/// ticket (dropped on every path, a cancelled request's included).
struct FlightTicket {
    map: Arc<Mutex<HashMap<[u8; 32], Flight>>>,
    key: [u8; 32],
    flight: Flight,
}

impl Drop for FlightTicket {
    fn drop(&mut self) {
        let mut f = self.map.lock().unwrap_or_else(|p| p.into_inner());
        // The map's reference and ours: nobody else waits.
        if Arc::strong_count(&self.flight) <= 2 {
            f.remove(&self.key);
        }
    }
}

const CACHE_TTL: Duration = Duration::from_secs(60);
const CACHE_MAX: usize = 10_000;

impl Authenticator {
    /// `shared`: the shared token's principal; `file`: the principals
    /// file's; `hashing_slots`: how many checks of tokens from before
    /// schema 4 may wait for the argon2 thread at once.
    pub fn new(
        store: Store,
        shared: Vec<(String, Principal)>,
        file: Vec<(String, Principal)>,
        hashing_slots: usize,
    ) -> Self {
        let bytes = |v: Vec<(String, Principal)>| -> Vec<(Vec<u8>, Principal)> {
            v.into_iter().map(|(t, p)| (t.into_bytes(), p)).collect()
        };
        Self {
            store,
            shared: Arc::new(bytes(shared)),
            file: Arc::new(std::sync::RwLock::new(Arc::new(bytes(file)))),
            cache: Arc::default(),
            generation: Arc::default(),
            stamp: Arc::default(),
            inflight: Arc::default(),
            hashing: Arc::new(tokio::sync::Semaphore::new(hashing_slots.max(1))),
            basic: Arc::new(tokio::sync::Semaphore::new(1)),
            // Room for every permit of both semaphores: a check never
            // finds the queue full.
            argon: Arc::new(argon::Pool::start(hashing_slots.max(1) + 1)),
            throttle: Arc::default(),
            blocks: None,
            basic_key: Arc::new(rand::random()),
            clock: crate::clock::Clock::System,
            oidc: None,
            local_users: true,
        }
    }

    /// The same authenticator, refusing local users' passwords (`[console]
    /// local_users = false`: people sign in with the identity provider).
    pub fn without_local_users(mut self) -> Self {
        self.local_users = false;
        self
    }

    /// The same authenticator, also accepting the JWTs of these issuers.
    pub fn with_oidc(mut self, verifier: Arc<oidc::Verifier>) -> Self {
        self.oidc = Some(verifier);
        self
    }

    /// The same authenticator, reporting each sign-in block it starts to
    /// `tx` (the service audits them; a full channel drops the report).
    pub fn with_block_reports(mut self, tx: tokio::sync::mpsc::Sender<throttle::Blocked>) -> Self {
        self.blocks = Some(tx);
        self
    }

    /// Count a failed sign-in; report the blocks it starts.
    fn failed(&self, source: Source, cred: &throttle::Credential) {
        for b in self.throttle.failed(source, cred) {
            tracing::warn!(
                source = %b.source.ip(),
                seconds = b.for_.as_secs(),
                credential = b.credential.is_some(),
                "sign-ins blocked after repeated failures"
            );
            if let Some(tx) = &self.blocks {
                let _ = tx.try_send(b);
            }
        }
    }

    /// A credential refused before any check: 429 while the source is
    /// blocked, else the failure is counted for the source alone.
    fn refuse_malformed(&self, source: Source) -> AuthError {
        let cred = throttle::Credential::Unknown;
        if let Err(wait) = self.throttle.admit(source, &cred) {
            return AuthError::Throttled(wait);
        }
        self.failed(source, &cred);
        AuthError::Unauthorized
    }

    /// The same authenticator with `clock` for wall-clock time.
    pub fn with_clock(mut self, clock: crate::clock::Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Its clock (token records' `created_at`, `revoked_at`).
    pub fn clock(&self) -> &crate::clock::Clock {
        &self.clock
    }

    /// Replace the principals file's identities (a reload): the old ones
    /// stop working at once.
    pub fn replace_file_principals(&self, file: Vec<(String, Principal)>) {
        let v: Vec<(Vec<u8>, Principal)> =
            file.into_iter().map(|(t, p)| (t.into_bytes(), p)).collect();
        *self.file.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(v);
        self.clear_cache();
    }

    /// Forget verified tokens (after a revocation).
    pub fn clear_cache(&self) {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        c.clear();
    }

    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Forget verified identities if the store's identity stamp moved since
    /// the last look (another replica, or this one, took rights away).
    /// Returns whether it had moved. The first look only notes it.
    pub async fn sync_revocations(&self) -> Result<bool, StoreError> {
        let now = self
            .store
            .read(|txn| txn.meta(IDENTITY_STAMP))
            .await?
            .unwrap_or_default();
        let mut seen = self.stamp.lock().unwrap_or_else(|p| p.into_inner());
        let moved = seen.as_ref().is_some_and(|s| *s != now);
        *seen = Some(now);
        drop(seen);
        if moved {
            self.clear_cache();
        }
        Ok(moved)
    }

    /// Look at the identity stamp every [`STAMP_POLL`] until `stop`: a
    /// revocation made on another replica takes effect here within that
    /// (plus a request in flight), not the cache's minute.
    pub async fn watch_revocations(self, stop: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(STAMP_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.sync_revocations().await {
                Ok(true) => tracing::debug!("identities changed in the store: cache dropped"),
                Ok(false) => {}
                // Unknown: forget, so nothing revoked outlives an outage.
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the identity stamp");
                    self.clear_cache();
                }
            }
        }
    }

    /// Cache a verified principal, unless the cache was cleared since the
    /// check began (`generation`).
    fn remember(&self, key: [u8; 32], principal: &Principal, generation: u64) {
        self.remember_for(key, principal, generation, CACHE_TTL);
    }

    /// [`Authenticator::remember`] for at most `ttl`.
    fn remember_for(&self, key: [u8; 32], principal: &Principal, generation: u64, ttl: Duration) {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if self.generation() != generation {
            return;
        }
        if c.len() >= CACHE_MAX {
            let now = Instant::now();
            c.retain(|_, v| v.until > now);
            if c.len() >= CACHE_MAX {
                c.clear();
            }
        }
        c.insert(
            key,
            Cached {
                principal: principal.clone(),
                until: Instant::now() + ttl.min(CACHE_TTL),
            },
        );
    }

    /// Take this credential's turn: one check at a time per credential
    /// (the others then find the cache). The entry goes when the last
    /// waiter does, even if a request is abandoned mid-way.
    fn flight(&self, key: [u8; 32]) -> FlightTicket {
        let flight = {
            let mut f = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            f.entry(key).or_default().clone()
        };
        FlightTicket {
            map: self.inflight.clone(),
            key,
            flight,
        }
    }

    /// A bearer token's principal. `source` (the client's address) is
    /// throttled: failures for one token id from one address, and any
    /// failures from one address, are refused for a while (`throttle`); a
    /// token already verified is not.
    pub async fn authenticate(
        &self,
        token: &str,
        source: Option<Source>,
    ) -> Result<Principal, AuthError> {
        let source = source.unwrap_or(UNKNOWN_SOURCE);
        if let Some(v) = &self.oidc
            && oidc::looks_like_jwt(token)
        {
            return self.authenticate_jwt(v, token, source).await;
        }
        let cred = match parse_token(token) {
            Some((id, _)) => throttle::Credential::Token(id.to_string()),
            None => throttle::Credential::Unknown,
        };
        if token.is_empty() || token.len() > 512 {
            return Err(self.refuse_malformed(source));
        }
        let key: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        self.throttle
            .admit(source, &cred)
            .map_err(AuthError::Throttled)?;
        // One verification per token at a time: concurrent requests with the
        // same token wait for it and then hit the cache, instead of each
        // running argon2 (19 MiB and tens of milliseconds apiece).
        let generation = self.generation();
        let ticket = self.flight(key);
        let _turn = ticket.flight.lock().await;
        let r = self.verify_uncached(token, key, generation).await;
        match &r {
            Ok(_) => self.throttle.succeeded(source, &cred),
            Err(AuthError::Unauthorized) => self.failed(source, &cred),
            Err(_) => {}
        }
        r
    }

    /// An OIDC token's principal: cached (by its SHA-256) until it expires,
    /// a minute at most; failures count against the source address.
    async fn authenticate_jwt(
        &self,
        v: &oidc::Verifier,
        token: &str,
        source: Source,
    ) -> Result<Principal, AuthError> {
        let key: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        let cred = throttle::Credential::Unknown;
        self.throttle
            .admit(source, &cred)
            .map_err(AuthError::Throttled)?;
        let generation = self.generation();
        let now = self.clock.unix().max(0).unsigned_abs();
        match v.verify(token, now).await {
            Ok(ok) => {
                let left = Duration::from_secs(ok.expires.saturating_sub(now));
                self.remember_for(key, &ok.principal, generation, left);
                Ok(ok.principal)
            }
            Err(why) => {
                tracing::info!(reason = %why, "OIDC token refused");
                self.failed(source, &cred);
                Err(AuthError::InvalidToken(why.0))
            }
        }
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Principal> {
        let c = self.cache.lock().ok()?;
        c.get(key)
            .filter(|h| h.until > Instant::now())
            .map(|h| h.principal.clone())
    }

    async fn verify_uncached(
        &self,
        token: &str,
        key: [u8; 32],
        generation: u64,
    ) -> Result<Principal, AuthError> {
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        let mut found = None;
        let file = self.file.read().unwrap_or_else(|e| e.into_inner()).clone();
        for (t, p) in self.shared.iter().chain(file.iter()) {
            if t.len() == token.len() && bool::from(t.as_slice().ct_eq(token.as_bytes())) {
                found = Some(p.clone());
            }
        }
        let principal = match found {
            Some(p) => p,
            None => self.verify_stored(token).await?,
        };
        self.remember(key, &principal, generation);
        Ok(principal)
    }

    /// Hash a new password (`user add`/`passwd` from the console) on the
    /// argon2 thread, with its one reused block, taking a password
    /// check's turn: `invalid_password` if too short,
    /// `password_hashing_busy` when no turn comes within `BASIC_WAIT`.
    pub async fn hash_new_password(&self, password: &str) -> Result<String, OpError> {
        users::check_new_password(password)?;
        let busy = || {
            OpError::new(
                "password_hashing_busy",
                "the appliance is busy checking passwords; try again in a moment",
            )
        };
        // A password check's turn (`basic`): the argon2 queue has room for
        // every permit, so a check never finds it full because of a hash.
        let _permit = tokio::time::timeout(BASIC_WAIT, self.basic.acquire())
            .await
            .map_err(|_| busy())?
            .map_err(OpError::failed)?;
        match self.argon.hash(password.as_bytes()).await {
            Ok(h) => Ok(h),
            Err(AuthError::Throttled(_)) => Err(busy()),
            Err(e) => Err(OpError::failed(e)),
        }
    }

    /// A user's principal, for HTTP Basic credentials: a known, enabled
    /// user and their password. Password checks (argon2, on the argon2
    /// thread) run one at a time, waiting at most `BASIC_WAIT` (else 429); a
    /// name that failed `MAX_FAILURES` times from this `source` is refused
    /// from there without a check for a while (`throttle`), not from
    /// elsewhere; an unknown or disabled name costs the same check as a
    /// known one.
    pub async fn authenticate_basic(
        &self,
        name: &str,
        password: &str,
        source: Option<Source>,
    ) -> Result<Principal, AuthError> {
        let source = source.unwrap_or(UNKNOWN_SOURCE);
        if !self.local_users {
            return Err(AuthError::Unauthorized);
        }
        if !users::valid_name(name) || password.is_empty() || password.len() > 1024 {
            // Nothing to check: counted against the source only, so that
            // made-up names add no keys (`throttle`).
            return Err(self.refuse_malformed(source));
        }
        let cred = throttle::Credential::User(name.to_string());
        let key: [u8; 32] = {
            let Ok(mut m) =
                <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new_from_slice(&*self.basic_key)
            else {
                return Err(AuthError::Unavailable);
            };
            hmac::Mac::update(&mut m, name.as_bytes());
            hmac::Mac::update(&mut m, b"\0");
            hmac::Mac::update(&mut m, password.as_bytes());
            hmac::Mac::finalize(m).into_bytes().into()
        };
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        self.throttle
            .admit(source, &cred)
            .map_err(AuthError::Throttled)?;
        let generation = self.generation();
        let ticket = self.flight(key);
        let _turn = ticket.flight.lock().await;
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        let rec = users::get_user(&self.store, name)
            .map_err(|_| AuthError::Unavailable)?
            .filter(|u| u.disabled_at.is_none());
        let _permit = tokio::time::timeout(BASIC_WAIT, self.basic.acquire())
            .await
            .map_err(|_| AuthError::Throttled(BASIC_WAIT.as_secs().max(1)))?
            .map_err(|_| AuthError::Unavailable)?;
        // An unknown or disabled name: the dummy check, same cost.
        let hash = rec.as_ref().map(|u| u.hash.clone());
        let ok = self.argon.verify(hash, password.as_bytes()).await?;
        match rec {
            Some(u) if ok => {
                self.throttle.succeeded(source, &cred);
                let mut p = u.principal;
                p.label = Some(u.name);
                self.remember(key, &p, generation);
                Ok(p)
            }
            _ => {
                self.failed(source, &cred);
                Err(AuthError::Unauthorized)
            }
        }
    }

    /// The principal a verified client certificate stands for (a
    /// registered, unrevoked certificate identity), cached as tokens are.
    pub async fn authenticate_cert(&self, cert: &PeerCert) -> Result<Principal, AuthError> {
        if let Some(p) = &cert.company {
            return Ok((**p).clone());
        }
        let mut h = sha2::Sha256::new();
        h.update(b"client-certificate\0");
        h.update(cert.sha256);
        let key: [u8; 32] = h.finalize().into();
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        let generation = self.generation();
        let fp = hex::encode(cert.sha256);
        let id: String = fp.chars().take(12).collect();
        let rec: Option<TokenRecord> = self
            .store
            .read(move |txn| txn.record(tables::TOKENS, &id))
            .await
            .map_err(|_| AuthError::Unavailable)?;
        let principal = rec
            .filter(|r| r.revoked_at.is_none() && r.cert_sha256.as_deref() == Some(fp.as_str()))
            .map(TokenRecord::labelled)
            .ok_or(AuthError::Unauthorized)?;
        self.remember(key, &principal, generation);
        Ok(principal)
    }

    async fn verify_stored(&self, token: &str) -> Result<Principal, AuthError> {
        let Some((id, _)) = parse_token(token) else {
            return Err(AuthError::Unauthorized);
        };
        let id = id.to_string();
        let rec: Option<TokenRecord> = self
            .store
            .read(move |txn| txn.record(tables::TOKENS, &id))
            .await
            .map_err(|_| AuthError::Unavailable)?;
        let rec = rec
            .filter(|r| r.revoked_at.is_none() && r.cert_sha256.is_none())
            .ok_or(AuthError::Unauthorized)?;
        let key = self.token_key()?;
        if rec.hash.starts_with(KEYED_PREFIX) {
            return if keyed_matches(&key, token, &rec.hash) {
                Ok(rec.labelled())
            } else {
                Err(AuthError::Unauthorized)
            };
        }
        // A record from before schema 4: argon2 once, then rekeyed.
        let ok = {
            let _permit = self
                .hashing
                .acquire()
                .await
                .map_err(|_| AuthError::Unavailable)?;
            self.argon
                .verify(Some(rec.hash.clone()), token.as_bytes())
                .await?
        };
        if !ok {
            return Err(AuthError::Unauthorized);
        }
        self.rekey(&rec, &key, token).await;
        Ok(rec.labelled())
    }

    /// The store's token key (unsealed when the store was opened).
    fn token_key(&self) -> Result<[u8; 32], AuthError> {
        self.store.token_key().map_err(|e| {
            tracing::error!(error = %e, "cannot read the token key");
            AuthError::Unavailable
        })
    }

    /// Rewrite an old token record's argon2 hash under the token key, if
    /// the record still holds that hash (a revocation in between is kept).
    /// A failure is logged: the token stays valid, and the next use tries
    /// again.
    async fn rekey(&self, rec: &TokenRecord, key: &[u8; 32], token: &str) {
        let Some(new) = keyed_hash(key, token) else {
            return;
        };
        let (id, old) = (rec.id.clone(), rec.hash.clone());
        let r = self
            .store
            .write(move |txn, _| {
                let Some(mut cur): Option<TokenRecord> = txn.record(tables::TOKENS, &id)? else {
                    return Ok(false);
                };
                if cur.hash != old {
                    return Ok(false);
                }
                cur.hash = new;
                typed::put(txn, tables::TOKENS, &id, &cur)?;
                Ok(true)
            })
            .await;
        match r {
            Ok(true) => tracing::info!(token.id = %rec.id, "token record rekeyed (schema 4)"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(token.id = %rec.id, error = %e, "token record not rekeyed; the next use tries again");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sign-ins refused before any check (a malformed name, an empty or
    /// oversized password or token) count against the source only: made-up
    /// names add no throttle keys, and a blocked source gets 429.
    #[tokio::test]
    async fn malformed_sign_ins_count_for_the_source_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let a = Authenticator::new(store, vec![], vec![], 1);
        let from = Some(Source::new("203.0.113.5".parse().unwrap()));
        for i in 0..throttle::MAX_SOURCE_FAILURES {
            let r = a
                .authenticate_basic(&format!("Bad Name {i}"), "pw", from)
                .await;
            assert_eq!(r.unwrap_err(), AuthError::Unauthorized);
        }
        assert_eq!(a.throttle.len(), 1, "the source's key alone");
        let r = a.authenticate_basic("Another Bad", "pw", from).await;
        assert!(matches!(r, Err(AuthError::Throttled(_))), "{r:?}");
        let r = a.authenticate("", from).await;
        assert!(matches!(r, Err(AuthError::Throttled(_))), "{r:?}");
        assert_eq!(a.throttle.len(), 1);
    }

    /// #34 L6: password guesses from loopback (an SSH port-forward) are
    /// throttled as any address's: after `MAX_SOURCE_FAILURES` failed
    /// checks, loopback's next guesses are 429 without an argon2 check, so
    /// they no longer hold the one password turn; people elsewhere still
    /// get theirs, and loopback's bearer tokens are not blocked.
    #[tokio::test]
    async fn password_guesses_from_loopback_stop_holding_the_argon2_turn() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let a = Authenticator::new(store, vec![], vec![], 1);
        let lo = Some(Source::new("127.0.0.1".parse().unwrap()));
        for i in 0..throttle::MAX_SOURCE_FAILURES {
            let r = a.authenticate_basic(&format!("guess{i}"), "pw", lo).await;
            assert_eq!(r.unwrap_err(), AuthError::Unauthorized);
        }
        // Held the turn for the whole of the next minute before: now refused
        // at once, even while the turn is taken (no wait for it).
        let held = a.basic.clone().acquire_owned().await.unwrap();
        let t = std::time::Instant::now();
        let r = a.authenticate_basic("guess-next", "pw", lo).await;
        assert!(
            matches!(r, Err(AuthError::Throttled(s)) if s >= 59),
            "{r:?}"
        );
        assert!(t.elapsed() < BASIC_WAIT / 4, "{:?}", t.elapsed());
        drop(held);
        // Someone elsewhere gets a check (a wrong password: 401, not 429).
        let elsewhere = Some(Source::new("192.0.2.10".parse().unwrap()));
        let r = a.authenticate_basic("alice", "pw", elsewhere).await;
        assert_eq!(r.unwrap_err(), AuthError::Unauthorized);
        // A (malformed) bearer token from loopback is not blocked.
        let r = a.authenticate("cat_x", lo).await;
        assert_eq!(r.unwrap_err(), AuthError::Unauthorized);
    }

    /// A new password's hash takes a password check's turn: while the
    /// turn is held, it answers `password_hashing_busy` (it never queues
    /// past the checks the argon2 queue is sized for).
    #[tokio::test]
    async fn hashing_a_new_password_takes_a_check_turn() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let a = Authenticator::new(store, vec![], vec![], 1);
        let held = a.basic.clone().acquire_owned().await.unwrap();
        let e = a
            .hash_new_password("a long enough password")
            .await
            .unwrap_err();
        assert_eq!(e.code, "password_hashing_busy");
        drop(held);
        let h = a.hash_new_password("a long enough password").await.unwrap();
        assert!(h.starts_with("$argon2id$"), "{h}");
    }

    /// A certificate identity's refusals carry their own codes (a store
    /// failure is `identity_store_failed`, not the caller's fault).
    #[tokio::test]
    async fn cert_identity_refusals_have_codes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let clock = crate::clock::Clock::System;
        let rec = cert_record(p(&["*"]), None, &PeerCert::own([7; 32]), &clock);
        let mut plain = rec.clone();
        plain.cert_sha256 = None;
        let e = store_cert_identity(&store, plain).await.unwrap_err();
        assert_eq!(e.code, "invalid_identity");
        store_cert_identity(&store, rec.clone()).await.unwrap();
        let e = store_cert_identity(&store, rec).await.unwrap_err();
        assert_eq!(e.code, "identity_exists");
        assert_eq!(OpError::failed("disk").code, "identity_store_failed");
    }

    /// An identity change and its audit event commit together: refusals
    /// the transaction finds are `rejected` with their code, a change `ok`;
    /// without an event nothing is appended.
    #[tokio::test]
    async fn identity_changes_carry_their_event_in_their_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let clock = crate::clock::Clock::System;
        use crate::store::event::Action;
        let ev = |action: Action| {
            Some(crate::store::event::Event {
                action,
                ..Default::default()
            })
        };
        let found = revoke_token_audited(&store, "0123456789ab", &clock, ev(Action::TokenRevoke));
        assert!(!found.await.unwrap());
        let (_t, rec) = new_token(p(&["*"]), None, &clock);
        let id = rec.id().to_string();
        store_token_audited(&store, rec, ev(Action::TokenCreate))
            .await
            .unwrap();
        assert!(revoke_token(&store, &id, &clock).await.unwrap());
        let op = users::UserOp::SetDisabled {
            name: "nobody".into(),
            disabled: true,
        };
        let e = users::user_op_audited(&store, op, &clock, ev(Action::UserDisable)).await;
        assert_eq!(e.unwrap_err().code, "user_not_found");
        let mut got = vec![];
        store
            .read_now(|txn| {
                crate::store::journal::for_each_event(txn, 1, |_, e| {
                    got.push((
                        e.action.to_string(),
                        e.outcome.to_string(),
                        e.error_code,
                        e.phase.to_string(),
                    ));
                    Ok(())
                })
            })
            .unwrap();
        let s = |x: &str| x.to_string();
        assert_eq!(
            got,
            vec![
                (
                    s("token_revoke"),
                    s("rejected"),
                    Some(s("token_not_found")),
                    s("event")
                ),
                (s("token_create"), s("ok"), None, s("event")),
                (
                    s("user_disable"),
                    s("rejected"),
                    Some(s("user_not_found")),
                    s("event")
                ),
            ]
        );
    }

    fn p(actions: &[&str]) -> Principal {
        Principal {
            label: None,
            tenant: "t".into(),
            subject: "s".into(),
            roles: vec![Role::Agent],
            runtimes: None,
            profiles: Some(vec![]),
            actions: actions.iter().map(|s| s.to_string()).collect(),
            task_templates: vec!["train".into()],
            task: None,
            issuer: None,
        }
    }

    #[test]
    fn scopes() {
        assert!(p(&["*"]).allows_action("exec:run"));
        assert!(p(&["task:*"]).allows_action("task:status"));
        assert!(!p(&["task:*"]).allows_action("exec:run"));
        assert!(!p(&["tas:*"]).allows_action("task:status"));
        assert!(p(&["exec:run"]).allows_action("exec:run"));
        assert!(
            !p(&[]).allows_action("exec:run"),
            "explicit empty list denies all"
        );
        assert!(
            !p(&["*"]).allows_profile("offline-code"),
            "explicit empty profiles denies all"
        );
        assert!(p(&["*"]).allows_runtime("mcp"));
        assert!(p(&[]).allows_task_template("train"));
        assert!(!p(&[]).allows_task_template("other"));
        assert!(!p(&[]).may_approve());
        let t = p(&[]).for_task("task_0123456789abcdef0123");
        assert!(t.allows_action("exec:run") && !t.is_admin());
        assert!(
            !t.allows_profile("offline-code"),
            "the identity's profiles still apply"
        );
    }

    #[test]
    fn tokens_file_formats() {
        let list = r#"[{"token":"aaaaaaaaaaaaaaaaaaaaaaaaaaaa","tenant_id":"acme","allowed_actions":"exec:run,file:*","allowed_profiles":[]}]"#;
        let v = load_tokens_file(list).unwrap();
        assert_eq!(v[0].1.actions, ["exec:run", "file:*"]);
        assert_eq!(v[0].1.profiles, None);
        let map =
            r#"{"bbbbbbbbbbbbbbbbbbbbbbbbbbbb":{"tenant_id":"x","roles":["runtime","approver"]}}"#;
        let v = load_tokens_file(map).unwrap();
        assert_eq!(v[0].1.roles, [Role::Agent, Role::Approver]);
        let e = |text: &str| load_tokens_file(text).err().map(|e| e.to_string());
        assert_eq!(
            e(r#"[{"token":"short","tenant_id":"x"}]"#).as_deref(),
            Some("a token for tenant x is shorter than 24 characters")
        );
        assert_eq!(
            e(r#"{"bbbbbbbbbbbbbbbbbbbbbbbbbbbb":{"tenant_id":"x","roles":"root"}}"#).as_deref(),
            Some("unknown role 'root' (agent, approver, auditor, admin)")
        );
        assert_eq!(
            e("1").as_deref(),
            Some("tokens file must be a list or an object")
        );
        assert!(
            load_tokens_file(
                r#"[{"token":"cccccccccccccccccccccccccccc","tenant_id":"x","bogus":1}]"#
            )
            .is_err()
        );
    }

    #[test]
    fn token_shape() {
        let (t, new) = new_token(p(&["*"]), None, &crate::clock::Clock::System);
        let (id, _) = parse_token(&t).unwrap();
        assert_eq!(id, new.id());
        let key = [7u8; 32];
        let h = keyed_hash(&key, &t).unwrap();
        assert!(h.starts_with(KEYED_PREFIX) && !h.contains(&t));
        assert!(keyed_matches(&key, &t, &h));
        assert!(!keyed_matches(&[8u8; 32], &t, &h), "another key");
        assert!(!keyed_matches(&key, &format!("{t}x"), &h));
        assert!(!keyed_matches(
            &key,
            &t,
            "$argon2id$v=19$m=19456,t=2,p=1$x$y"
        ));
        assert!(!keyed_matches(&key, &t, &h[..h.len() - 2]), "truncated");
    }

    /// Two replicas on one store (issue #34, L7): a token revoked through
    /// one stays cached by the other only until the other looks at the
    /// identity stamp; a user's change moves the stamp too.
    #[tokio::test]
    async fn revocations_reach_other_replicas_through_the_stamp() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let clock = crate::clock::Clock::System;
        let a = Authenticator::new(store.clone(), vec![], vec![], 2);
        let b = Authenticator::new(store.clone(), vec![], vec![], 2);
        assert!(!b.sync_revocations().await.unwrap(), "the first look notes");
        let (t, new) = new_token(p(&["*"]), None, &clock);
        let id = new.id().to_string();
        store_token(&store, new).await.unwrap();
        assert!(a.authenticate(&t, None).await.is_ok());
        assert!(b.authenticate(&t, None).await.is_ok());
        assert!(
            !b.sync_revocations().await.unwrap(),
            "a new token takes no rights away"
        );
        assert!(revoke_token(&store, &id, &clock).await.unwrap());
        a.clear_cache();
        assert_eq!(a.authenticate(&t, None).await, Err(AuthError::Unauthorized));
        assert!(b.authenticate(&t, None).await.is_ok(), "b's cache");
        assert!(b.sync_revocations().await.unwrap());
        assert_eq!(b.authenticate(&t, None).await, Err(AuthError::Unauthorized));
        assert!(!b.sync_revocations().await.unwrap());
        let op = users::UserOp::SetDisabled {
            name: "nobody".into(),
            disabled: true,
        };
        assert!(
            users::user_op_audited(&store, op, &clock, None)
                .await
                .is_err()
        );
        assert!(
            !b.sync_revocations().await.unwrap(),
            "nothing changed, nothing moved"
        );
    }

    #[tokio::test]
    async fn tokens_keyed_and_old_records_rekeyed() {
        use argon2::password_hash::{PasswordHasher, SaltString};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let authn = Authenticator::new(store.clone(), vec![], vec![], 2);
        let (t, new) = new_token(p(&["*"]), None, &crate::clock::Clock::System);
        store_token(&store, new).await.unwrap();
        let rec = &list_tokens(&store).unwrap()[0];
        assert!(rec.hash.starts_with(KEYED_PREFIX), "{}", rec.hash);
        assert_eq!(authn.authenticate(&t, None).await.unwrap().subject, "s");
        let wrong = format!(
            "{}{}",
            &t[..t.len() - 1],
            if t.ends_with('A') { 'B' } else { 'A' }
        );
        assert_eq!(
            authn.authenticate(&wrong, None).await,
            Err(AuthError::Unauthorized)
        );
        // An old record: argon2id of the token, as before schema 4.
        let old = format!("{TOKEN_PREFIX}0123456789ab_{}", "x".repeat(43));
        let salt = SaltString::encode_b64(b"0123456789abcdef").unwrap();
        let phc = argon2::Argon2::default()
            .hash_password(old.as_bytes(), &salt)
            .unwrap()
            .to_string();
        let rec = TokenRecord {
            id: "0123456789ab".into(),
            hash: phc.clone(),
            principal: p(&["task:*"]),
            created_at: "then".into(),
            revoked_at: None,
            description: None,
            cert_sha256: None,
        };
        store
            .write(move |txn, _| typed::put(txn, tables::TOKENS, &rec.id, &rec))
            .await
            .unwrap();
        let bad = format!("{TOKEN_PREFIX}0123456789ab_{}", "y".repeat(43));
        assert_eq!(
            authn.authenticate(&bad, None).await,
            Err(AuthError::Unauthorized)
        );
        let stored: TokenRecord = store
            .read_now(|txn| txn.record(tables::TOKENS, "0123456789ab"))
            .unwrap()
            .unwrap();
        assert_eq!(stored.hash, phc, "a failed check rewrites nothing");
        assert_eq!(
            authn.authenticate(&old, None).await.unwrap().actions,
            ["task:*"]
        );
        let stored: TokenRecord = store
            .read_now(|txn| txn.record(tables::TOKENS, "0123456789ab"))
            .unwrap()
            .unwrap();
        assert!(
            stored.hash.starts_with(KEYED_PREFIX),
            "rekeyed: {}",
            stored.hash
        );
        // Checked by its keyed hash from now on (a fresh authenticator has
        // no cache).
        let again = Authenticator::new(store.clone(), vec![], vec![], 2);
        assert!(again.authenticate(&old, None).await.is_ok());
        assert_eq!(
            again.authenticate(&bad, None).await,
            Err(AuthError::Unauthorized)
        );
        store.close().await;
    }

    #[test]
    fn role_defaults() {
        let d = |r: &[Role]| default_actions(r);
        let q = |r: &[Role], a: &str| {
            Principal {
                label: None,
                roles: r.to_vec(),
                actions: d(r),
                ..p(&[])
            }
            .allows_action(a)
        };
        for a in ["lease:status", "job:output", "task:status", "task:receipt"] {
            assert!(q(&[Role::Auditor], a), "{a}");
        }
        for a in [
            "lease:acquire",
            "exec:run",
            "file:write",
            "task:approve",
            "task:plan",
            "checkpoint:rollback",
        ] {
            assert!(!q(&[Role::Auditor], a), "auditor: {a}");
        }
        assert!(q(&[Role::Approver], "task:approve") && q(&[Role::Approver], "lease:list"));
        for a in ["lease:acquire", "exec:run", "task:submit", "job:start"] {
            assert!(!q(&[Role::Approver], a), "approver: {a}");
        }
        for a in [
            "lease:acquire",
            "exec:run",
            "file:write",
            "job:start",
            "pty:create",
            "task:plan",
            "task:submit",
            "task:status",
        ] {
            assert!(q(&[Role::Agent], a), "agent: {a}");
        }
        assert!(!q(&[Role::Agent], "task:approve") && !q(&[Role::Agent], "admin:gc"));
        assert_eq!(d(&[Role::Admin, Role::Auditor]), ["*"]);
        let both = d(&[Role::Agent, Role::Approver]);
        assert!(
            both.contains(&"task:approve".to_string()) && both.contains(&"lease:*".to_string())
        );
        assert!(
            !both.contains(&"lease:status".to_string()),
            "covered by lease:*: {both:?}"
        );
    }
}
