//! Leases (`leases_v1`) and the session index (`sessions_v1`).

use serde::{Deserialize, Serialize};

use super::StoreError;
use super::tables;
use super::typed::{self, ReadOps, WriteOps};

/// A lease's state. Stored and answered as its string; the backend's own
/// sandbox states (a refreshed status) pass through as `Other`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum LeaseState {
    /// `running`
    Running,
    /// `paused`
    Paused,
    /// `released`: a kill whose checkpoints could not all be deleted.
    Released,
    /// `gone`: the backend no longer knows the sandbox.
    Gone,
    /// Any other state the backend reports.
    Other(String),
}

impl LeaseState {
    pub fn as_str(&self) -> &str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Released => "released",
            Self::Gone => "gone",
            Self::Other(s) => s,
        }
    }
}

impl From<String> for LeaseState {
    fn from(s: String) -> Self {
        match s.as_str() {
            "running" => Self::Running,
            "paused" => Self::Paused,
            "released" => Self::Released,
            "gone" => Self::Gone,
            _ => Self::Other(s),
        }
    }
}

impl From<LeaseState> for String {
    fn from(s: LeaseState) -> Self {
        match s {
            LeaseState::Other(s) => s,
            other => other.as_str().to_string(),
        }
    }
}

impl std::fmt::Display for LeaseState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A lease as stored. The sandbox id and traffic token never leave.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lease {
    pub lease_ref: String,
    pub tenant: String,
    pub runtime: String,
    pub session_hash: String,
    pub profile: String,
    pub sandbox_id: String,
    pub sandbox_ref: String,
    pub domain: String,
    /// Sealed with the store's key.
    pub traffic_token: Option<String>,
    pub state: LeaseState,
    pub created_at: String,
    pub last_used_at: String,
    pub last_used_unix: i64,
    /// The trusted task this lease runs (schema 3): visible to that task's
    /// calls only, never to agents directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_ref: Option<String>,
    /// The checkpoint a fork started from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<String>,
    /// envd's version as CubeAPI reported it at create: older envds need
    /// the fallbacks the SDK has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envd_version: Option<String>,
    /// The idle timeout (s) last set on the sandbox, when a capped renewal
    /// set one other than the profile's; the next use sets the profile's
    /// back (a real CubeSandbox keeps a timeout until it is set again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// The session's previous lease, whose sandbox was found gone when
    /// this one was acquired in its place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_lease_ref: Option<String>,
    /// The backend its sandbox runs on (`[backends.NAME]`); records from
    /// before there were several read as `default`, which is not written.
    #[serde(
        default = "default_backend",
        skip_serializing_if = "is_default_backend"
    )]
    pub backend: String,
    /// The volume mounted as its workspace, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<LeaseVolume>,
    /// Its governed MCP server (`[mcp_policies.NAME]`), started with the
    /// sandbox: the policy named when it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_policy: Option<String>,
    /// The MCP gateway's access token, sealed with the store's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_token: Option<String>,
    /// The operation whose result nobody knows (an MCP call past its
    /// timeout): its intent stays pending, and the lease takes no effect,
    /// not even a release, until an operator reconciles it (`cube-adapter
    /// audit reconcile --operation OP`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
    /// The template preset applied to its sandbox, `NAME@VERSION`, and the
    /// SHA-256 of the preset as it was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset_digest: Option<String>,
    /// The egress destinations an operator narrowed this lease to (each
    /// one of its profile's, as written there); none: all of the profile's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_only: Option<Vec<String>>,
    /// The token its sandbox names in `Proxy-Authorization` to the egress
    /// proxy's network listener (`[egress] listen`), sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_token: Option<String>,
}

/// A lease's workspace volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseVolume {
    /// The backend's volume ID.
    pub volume_id: String,
    pub mount_path: String,
    pub read_only: bool,
    /// Made by the appliance for this workspace (an operator's volume,
    /// `existing-volume`, never is).
    pub owned: bool,
    /// Kept when the lease ends.
    pub retain: bool,
}

/// The name of the backend a configuration without `[backends]` has.
pub const DEFAULT_BACKEND: &str = "default";

pub(crate) fn default_backend() -> String {
    DEFAULT_BACKEND.to_string()
}

pub(crate) fn is_default_backend(b: &str) -> bool {
    b == DEFAULT_BACKEND
}

/// For `skip_serializing_if` on a `String` field.
#[allow(clippy::ptr_arg)]
pub(crate) fn is_default_backend_ref(b: &String) -> bool {
    is_default_backend(b)
}

/// The session index key: `tenant \0 runtime \0 session_hash`, and
/// `\0 backend` for a backend other than `default` (the same session on
/// two backends is two leases).
pub fn session_key(tenant: &str, runtime: &str, hash: &str, backend: &str) -> String {
    if is_default_backend(backend) {
        format!("{tenant}\0{runtime}\0{hash}")
    } else {
        format!("{tenant}\0{runtime}\0{hash}\0{backend}")
    }
}

pub fn get(txn: &impl ReadOps, lease_ref: &str) -> Result<Option<Lease>, StoreError> {
    txn.record(tables::LEASES, lease_ref)
}

pub fn exists(txn: &impl ReadOps, lease_ref: &str) -> Result<bool, StoreError> {
    txn.has(tables::LEASES, lease_ref)
}

/// Every lease, by lease_ref.
pub fn all(txn: &impl ReadOps) -> Result<Vec<Lease>, StoreError> {
    txn.records(tables::LEASES)
}

/// The lease a session key points at.
pub fn by_session(txn: &impl ReadOps, key: &str) -> Result<Option<Lease>, StoreError> {
    match txn.link(tables::SESSIONS, key)? {
        Some(r) => get(txn, &r),
        None => Ok(None),
    }
}

pub fn put(txn: &impl WriteOps, l: &Lease) -> Result<(), StoreError> {
    typed::put(txn, tables::LEASES, &l.lease_ref, l)
}

/// Hold a lease for an operation whose result is unknown (if the lease
/// still exists).
pub fn hold(txn: &impl WriteOps, lease_ref: &str, op: &str) -> Result<(), StoreError> {
    if let Some(mut l) = get(txn, lease_ref)? {
        l.held_by = Some(op.to_string());
        put(txn, &l)?;
    }
    Ok(())
}

/// Lift the hold of `op` from its lease, if one has it: whether one did.
pub fn unhold(txn: &impl WriteOps, lease_ref: &str, op: &str) -> Result<bool, StoreError> {
    match get(txn, lease_ref)? {
        Some(mut l) if l.held_by.as_deref() == Some(op) => {
            l.held_by = None;
            put(txn, &l)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// The operations leases are held by (`Lease::held_by`).
pub fn held(txn: &impl ReadOps) -> Result<Vec<String>, StoreError> {
    Ok(all(txn)?.into_iter().filter_map(|l| l.held_by).collect())
}

/// Point a session key at a lease.
pub fn put_session(txn: &impl WriteOps, key: &str, lease_ref: &str) -> Result<(), StoreError> {
    typed::put_link(txn, tables::SESSIONS, key, lease_ref)
}

/// Remove the lease record and its session index entry (not what it owns).
pub fn remove(txn: &impl WriteOps, l: &Lease) -> Result<(), StoreError> {
    typed::remove(txn, tables::LEASES, &l.lease_ref)?;
    let sk = session_key(&l.tenant, &l.runtime, &l.session_hash, &l.backend);
    typed::remove_link(txn, tables::SESSIONS, &sk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_strings() {
        for (s, w) in [
            (LeaseState::Running, "\"running\""),
            (LeaseState::Paused, "\"paused\""),
            (LeaseState::Released, "\"released\""),
            (LeaseState::Gone, "\"gone\""),
            (LeaseState::Other("pausing".into()), "\"pausing\""),
        ] {
            assert_eq!(serde_json::to_string(&s).unwrap(), w);
            assert_eq!(serde_json::from_str::<LeaseState>(w).unwrap(), s);
        }
    }

    /// A record written before the states were typed reads back and
    /// encodes to the same bytes.
    #[test]
    fn old_records_keep_their_bytes() {
        let old = r#"{"lease_ref":"lease_00","tenant":"t","runtime":"r","session_hash":"h","profile":"p","sandbox_id":"s","sandbox_ref":"sr","domain":"d","traffic_token":null,"state":"running","created_at":"c","last_used_at":"u","last_used_unix":5,"task_ref":"task_00"}"#;
        let l: Lease = crate::store::codec::decode(old.as_bytes()).unwrap();
        assert_eq!(l.state, LeaseState::Running);
        assert_eq!(crate::store::codec::encode(&l).unwrap(), old.as_bytes());
    }
}
