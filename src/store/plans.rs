//! Task plans (`plans_v1`).

use serde::{Deserialize, Serialize};

use super::typed::{self, ReadOps, WriteOps};
use super::{StoreError, tables};

/// A plan's state, stored and answered as its snake_case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanState {
    PendingApproval,
    /// Needs no approval: may be submitted.
    Ready,
    Approved,
    Denied,
    Expired,
    Submitted,
}

impl PlanState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PendingApproval => "pending_approval",
            Self::Ready => "ready",
            Self::Approved => "approved",
            Self::Denied => "denied",
            Self::Expired => "expired",
            Self::Submitted => "submitted",
        }
    }

    /// Plans that can still expire (open plans).
    pub fn is_live(self) -> bool {
        matches!(self, Self::PendingApproval | Self::Ready | Self::Approved)
    }
}

impl std::fmt::Display for PlanState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who asked for a plan, readable by people (issue #36): the identity's
/// subject, the credential's label, and what the agent said of itself.
/// Never a secret; the identity digest (`Plan::requester`) stays the key.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Requester {
    pub subject: String,
    /// The OIDC issuer that vouched for the subject.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    /// The token's description (or `token <id>`), a user's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// The lease the agent was working in, when it named one, and that
    /// lease's runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// What the client said it is: the MCP host's client info, or the
    /// HTTP client's `User-Agent` (printable ASCII, at most 128 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
}

/// One person's decision on a plan (issue #36): who, when, why, and
/// through what.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Decision {
    /// The decider's identity digest.
    pub identity: String,
    /// Digest of the decider's subject alone: one person in two tenants
    /// counts once.
    pub subject_digest: String,
    pub subject: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    pub tenant: String,
    pub at: String,
    /// The decider's words, as they gave them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `console` or `api`.
    pub via: String,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// A plan as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    pub plan_ref: String,
    pub tenant: String,
    /// Identity digest of who asked for it.
    pub requester: String,
    /// Digest of the requester's subject alone (an admin of another tenant
    /// with the same subject is the same person).
    #[serde(default)]
    pub requester_subject: String,
    pub template: String,
    pub template_digest: String,
    pub profile: String,
    /// Digest of the profile's settings when the plan was made: a changed
    /// profile changes what runs, as a changed template does.
    #[serde(default)]
    pub profile_digest: String,
    /// The backend its profile ran on when it was made (`default` is
    /// not written: records from before several backends read as it).
    #[serde(
        default = "crate::store::leases::default_backend",
        skip_serializing_if = "crate::store::leases::is_default_backend_ref"
    )]
    pub backend: String,
    /// The parameters, sealed under the store key.
    pub parameters_sealed: String,
    pub parameters_sha256: String,
    pub command_sha256: String,
    pub state: PlanState,
    pub approval_required: bool,
    pub created_at: String,
    pub expires_at: String,
    pub expires_unix: i64,
    #[serde(default)]
    pub approved_at: Option<String>,
    /// Identity digest of who approved or denied it.
    #[serde(default)]
    pub approver: Option<String>,
    #[serde(default)]
    pub decided_at: Option<String>,
    #[serde(default)]
    pub denial_reason_sha256: Option<String>,
    #[serde(default)]
    pub task_ref: Option<String>,
    /// Who asked, readable (absent in plans made before issue #36).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<Requester>,
    /// Why the agent asked, in its own words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Approvals from distinct people the plan needs.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub approvals_required: u32,
    /// The approvals given so far, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<Decision>,
    /// The denial that ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denial: Option<Decision>,
}

pub fn get(txn: &impl ReadOps, plan_ref: &str) -> Result<Option<Plan>, StoreError> {
    txn.record(tables::PLANS, plan_ref)
}

/// Every plan, by plan_ref.
pub fn all(txn: &impl ReadOps) -> Result<Vec<Plan>, StoreError> {
    txn.records(tables::PLANS)
}

pub fn put(txn: &impl WriteOps, p: &Plan) -> Result<(), StoreError> {
    typed::put(txn, tables::PLANS, &p.plan_ref, p)
}

pub fn remove(txn: &impl WriteOps, plan_ref: &str) -> Result<(), StoreError> {
    typed::remove(txn, tables::PLANS, plan_ref).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_strings() {
        for s in [
            PlanState::PendingApproval,
            PlanState::Ready,
            PlanState::Approved,
            PlanState::Denied,
            PlanState::Expired,
            PlanState::Submitted,
        ] {
            let w = format!("\"{}\"", s.as_str());
            assert_eq!(serde_json::to_string(&s).unwrap(), w);
            assert_eq!(serde_json::from_str::<PlanState>(&w).unwrap(), s);
        }
    }
}
