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

pub use super::vocab::{Action, Outcome, Phase, UnknownWord};

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
    /// `intent`, `outcome` or `event` (a single-step record); blank for
    /// some task events ([`Phase::Blank`]).
    pub phase: Phase,
    pub action: Action,
    /// `pending` (intent), `ok`, `rejected`, `error`, `uncertain`, `reconciled`.
    pub outcome: Outcome,
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
    /// A person's (or an agent's) reason for a plan or a decision, in
    /// clear (issue #36: it is their words, not a secret): at most
    /// [`REASON_MAX`] bytes, control characters escaped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approver_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_state: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleanup: Option<String>,
    /// The tool of a governed MCP call (`mcp_call`), as its policy names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// A keyed digest of what a call returned (`mcp_call`'s outcome).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_digest: Option<String>,
    /// Where the egress proxy went for a sandbox (`egress_request`):
    /// `HOST:PORT`, a destination the profile allows. One it refused is
    /// kept as `destination_digest` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination: Option<String>,
    /// The HTTP method of a brokered request (`CONNECT` for a tunnel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The HTTP status a brokered request's destination answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_status: Option<u16>,
    /// A session recording (`recording_*` events; `docs/recordings.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recording_ref: Option<String>,
    /// The PTY an event is about (a PTY's recording).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty_ref: Option<String>,
    /// A recording's chunk: its index (from 0); in `recording_sealed`, how
    /// many chunks it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<u64>,
    /// Where a recording's chunk starts in its file (bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// A killed lease's recordings, sealed (`release`, `task_finalize`):
    /// SHA-256 over the lines `RECORDING_REF SHA256\n`, in ref order, of
    /// its recordings' `recording_sealed` digests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recordings_digest: Option<String>,
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

/// The most bytes any text field of an event holds (`docs/security.md`,
/// "What one caller can do to the appliance"). Every field the appliance
/// writes itself (ids, refs, names, digests, codes, timestamps) fits well
/// within it; only a caller's value that was never validated could not.
pub const FIELD_MAX: usize = 128;

/// The most bytes an event's `reason` holds (a plan's or decision's
/// reason is at most 1024 bytes, kept whole).
pub const REASON_MAX: usize = 1024;

/// A reason as an event keeps it: whole, with every control character
/// (newlines and tabs included) as `\u{..}` so a line of the journal
/// stays one line wherever it goes; its [`unshaped`] form if it is longer
/// than a [`REASON_MAX`]-byte reason can be once escaped. Keeping a kept
/// reason changes nothing.
pub fn reason_kept(value: &str) -> String {
    if value.len() > 6 * REASON_MAX {
        return unshaped(value);
    }
    value
        .chars()
        .map(|c| {
            if c.is_control() {
                format!("\\u{{{:x}}}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// How a value that is too long or not printable ASCII is kept instead:
/// `~sha256:<first 32 hex of its SHA-256>:<its length in bytes>`.
pub const UNSHAPED_PREFIX: &str = "~sha256:";

/// A value that does not fit an event, as it is recorded: its digest and
/// length, never itself.
pub fn unshaped(value: &str) -> String {
    let d = hex::encode(sha2::Sha256::digest(value.as_bytes()));
    let head = d.get(..32).unwrap_or(&d);
    format!("{UNSHAPED_PREFIX}{head}:{}", value.len())
}

/// Whether a value may be recorded as it is: at most [`FIELD_MAX`] bytes of
/// printable ASCII without spaces (nothing to hide, reorder or wrap).
pub fn fits(value: &str) -> bool {
    value.len() <= FIELD_MAX && value.bytes().all(|b| b.is_ascii_graphic())
}

impl Event {
    /// Every text field within its bound: a value that does not [`fits`] is
    /// replaced by its [`unshaped`] form. `Chain::append` applies this to
    /// every event before it is hashed, stored or indexed, so no caller can
    /// make the journal, its indexes or its sinks' messages large.
    pub fn bound(&mut self) {
        let Event {
            seq: _,
            event_id,
            ts,
            operation_id,
            phase,
            action,
            outcome,
            runtime,
            tenant_digest,
            identity_digest,
            issuer_digest,
            session_digest,
            profile,
            backend,
            request_id,
            lease_ref,
            sandbox_ref,
            duration_ms: _,
            command_digest,
            path_digest,
            destination_digest,
            content_sha256,
            bytes: _,
            exit_code: _,
            reused: _,
            release_action,
            job_ref,
            checkpoint_ref,
            error_code,
            note_digest,
            fork_lease_ref,
            plan_ref,
            task_ref,
            task_template,
            parameters_digest,
            decision,
            reason_digest,
            reason,
            approver_digest,
            task_state,
            cleanup,
            tool,
            result_digest,
            destination,
            method,
            http_status: _,
            recording_ref,
            pty_ref,
            chunk: _,
            offset: _,
            recordings_digest,
            prev_hash,
            hash,
        } = self;
        if let Some(r) = reason {
            *r = reason_kept(r);
        }
        phase.bound();
        action.bound();
        outcome.bound();
        for v in [event_id, ts, prev_hash, hash] {
            if !fits(v) {
                *v = unshaped(v);
            }
        }
        for v in [
            operation_id,
            runtime,
            tenant_digest,
            identity_digest,
            issuer_digest,
            session_digest,
            profile,
            backend,
            request_id,
            lease_ref,
            sandbox_ref,
            command_digest,
            path_digest,
            destination_digest,
            content_sha256,
            release_action,
            job_ref,
            checkpoint_ref,
            error_code,
            note_digest,
            fork_lease_ref,
            plan_ref,
            task_ref,
            task_template,
            parameters_digest,
            decision,
            reason_digest,
            approver_digest,
            task_state,
            cleanup,
            tool,
            result_digest,
            destination,
            method,
            recording_ref,
            pty_ref,
            recordings_digest,
        ]
        .into_iter()
        .flatten()
        {
            if !fits(v) {
                *v = unshaped(v);
            }
        }
    }

    /// The largest an event can be once [`Event::bound`]: every text field
    /// at [`FIELD_MAX`], as JSON (with its names and the numbers at their
    /// widest). A unit test checks a full event against it.
    pub const MAX_JSON: usize = 50 * (FIELD_MAX + 32) + 12 * REASON_MAX + 32;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_that_does_not_fit_is_kept_as_its_digest_and_length() {
        let huge = "x".repeat(4 << 20);
        let mut ev = Event {
            runtime: Some(huge.clone()),
            profile: Some("net\u{202e}code".into()),
            backend: Some("with space".into()),
            lease_ref: Some("lease_0123456789abcdef".into()),
            error_code: Some("reconciled:exec".into()),
            ..Default::default()
        };
        ev.bound();
        let runtime = ev.runtime.clone().unwrap_or_default();
        assert!(runtime.starts_with(UNSHAPED_PREFIX), "{runtime}");
        assert!(runtime.ends_with(&format!(":{}", huge.len())), "{runtime}");
        assert!(fits(&runtime));
        assert_eq!(runtime, unshaped(&huge));
        assert!(
            ev.profile
                .as_deref()
                .is_some_and(|p| p.starts_with(UNSHAPED_PREFIX))
        );
        assert!(
            ev.backend
                .as_deref()
                .is_some_and(|p| p.starts_with(UNSHAPED_PREFIX))
        );
        // What the appliance writes itself is kept as it is.
        assert_eq!(ev.lease_ref.as_deref(), Some("lease_0123456789abcdef"));
        assert_eq!(ev.error_code.as_deref(), Some("reconciled:exec"));
        // Bounding twice changes nothing.
        let once = ev.clone();
        ev.bound();
        assert_eq!(ev, once);
    }

    #[test]
    fn a_bound_event_at_its_widest_stays_under_max_json() {
        let wide = "y".repeat(FIELD_MAX + 1);
        let mut ev = Event {
            seq: u64::MAX,
            duration_ms: Some(u64::MAX),
            bytes: Some(u64::MAX),
            exit_code: Some(i32::MIN),
            reused: Some(false),
            ..Default::default()
        };
        let mut v = serde_json::to_value(&ev).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            for (_, f) in o.iter_mut() {
                if !f.is_number() && !f.is_boolean() {
                    *f = serde_json::Value::String(wide.clone());
                }
            }
            for k in [
                "operation_id",
                "runtime",
                "tenant_digest",
                "identity_digest",
                "issuer_digest",
                "session_digest",
                "profile",
                "backend",
                "request_id",
                "lease_ref",
                "sandbox_ref",
                "command_digest",
                "path_digest",
                "destination_digest",
                "content_sha256",
                "release_action",
                "job_ref",
                "checkpoint_ref",
                "error_code",
                "note_digest",
                "fork_lease_ref",
                "plan_ref",
                "task_ref",
                "task_template",
                "parameters_digest",
                "decision",
                "reason_digest",
                "reason",
                "approver_digest",
                "task_state",
                "cleanup",
                "tool",
                "result_digest",
                "destination",
                "method",
            ] {
                o.insert(k.into(), serde_json::Value::String(wide.clone()));
            }
        }
        ev = serde_json::from_value(v).unwrap_or_default();
        assert!(
            ev.runtime.is_some() && ev.cleanup.is_some(),
            "every field set"
        );
        ev.bound();
        ev.prev_hash = "0".repeat(64);
        ev.hash = "0".repeat(64);
        let len = serde_json::to_vec(&ev)
            .map(|b| b.len())
            .unwrap_or(usize::MAX);
        assert!(len < Event::MAX_JSON, "{len} >= {}", Event::MAX_JSON);
    }

    #[test]
    fn reasons_are_kept_whole_on_one_line() {
        assert_eq!(reason_kept("ok, ship it"), "ok, ship it");
        assert_eq!(reason_kept("a\nb\tc"), "a\\u{a}b\\u{9}c");
        let once = reason_kept(&"\n".repeat(REASON_MAX));
        assert_eq!(reason_kept(&once), once, "keeping is idempotent");
        assert!(reason_kept(&"x".repeat(7 * REASON_MAX)).starts_with(UNSHAPED_PREFIX));
        assert_eq!(reason_kept("é ü ✓"), "é ü ✓");
    }
}
