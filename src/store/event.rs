//! The audit event record and its hash chain. It lives with the store,
//! which appends it and links the chain in the same transaction as the
//! state change it records; `audit` builds events and redacts them.
//!
//! Never in an event: command text, file content, output, tokens, session
//! keys, subjects or full sandbox ids. Those appear only as keyed digests
//! (HMAC-SHA256 under the appliance's key) or as the 8-character
//! `sandbox_ref`.

use serde::{Deserialize, Serialize};
use sha2::Digest;

/// `prev_hash` of the first event.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub event_id: String,
    pub ts: String,
    /// Links an intent, its outcome and reconciliation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<String>,
    /// `intent`, `outcome` or `event` (a single-step record).
    pub phase: String,
    pub action: String,
    /// `pending` (intent), `ok`, `rejected`, `error`, `uncertain`, `reconciled`.
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_digest: Option<String>,
    /// The OIDC issuer of the identity (absent for the appliance's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// The backend the action ran on (`[backends.NAME]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reused: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_action: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_lease_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approver_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_state: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleanup: Option<String>,
    pub prev_hash: String,
    pub hash: String,
}

impl Event {
    /// SHA-256 over the previous hash and this event without its own hash.
    pub fn compute_hash(&self) -> String {
        let mut copy = self.clone();
        copy.hash = String::new();
        let body = serde_json::to_vec(&copy).unwrap_or_default();
        let mut h = sha2::Sha256::new();
        h.update(self.prev_hash.as_bytes());
        h.update(b"\n");
        h.update(&body);
        hex::encode(h.finalize())
    }
}
