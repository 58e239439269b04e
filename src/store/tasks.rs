//! Trusted tasks (`tasks_v1`), with their results and receipts.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::jobs::JobState;
use super::typed::{self, ReadOps, WriteOps};
use super::{StoreError, tables};

/// A task's state, stored and answered as its snake_case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Starting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
    SetupFailed,
    /// Its job or lease is gone.
    Orphaned,
    /// Ended, but its sandbox is not yet known to be gone (no receipt yet).
    CleanupPending,
    OutputValidationFailed,
    /// A cancel found its job `lost` (kept as the job said it).
    Lost,
}

impl TaskState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::TimedOut => "timed_out",
            Self::SetupFailed => "setup_failed",
            Self::Orphaned => "orphaned",
            Self::CleanupPending => "cleanup_pending",
            Self::OutputValidationFailed => "output_validation_failed",
            Self::Lost => "lost",
        }
    }

    /// A state from its wire name.
    pub fn parse(s: &str) -> Option<Self> {
        serde_json::from_value(Value::String(s.to_string())).ok()
    }
}

/// The task state a job's state shows, as the job names it.
impl From<JobState> for TaskState {
    fn from(s: JobState) -> Self {
        match s {
            JobState::Running => Self::Running,
            JobState::Succeeded => Self::Succeeded,
            JobState::Failed => Self::Failed,
            JobState::TimedOut => Self::TimedOut,
            JobState::Cancelled => Self::Cancelled,
            JobState::Lost => Self::Lost,
        }
    }
}

impl std::fmt::Display for TaskState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A trusted task as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Task {
    pub task_ref: String,
    pub plan_ref: String,
    pub tenant: String,
    pub requester: String,
    #[serde(default)]
    pub approver: Option<String>,
    #[serde(default)]
    pub approved_at: Option<String>,
    /// Every approval the plan had (issue #36): the receipt names them all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<crate::store::plans::Decision>,
    pub template: String,
    pub template_digest: String,
    pub profile: String,
    /// The backend its profile ran on when it was made (`default` is
    /// not written: records from before several backends read as it).
    #[serde(
        default = "crate::store::leases::default_backend",
        skip_serializing_if = "crate::store::leases::is_default_backend_ref"
    )]
    pub backend: String,
    pub parameters_sha256: String,
    pub command_sha256: String,
    pub state: TaskState,
    #[serde(default)]
    pub lease_ref: Option<String>,
    #[serde(default)]
    pub sandbox_ref: Option<String>,
    #[serde(default)]
    pub job_ref: Option<String>,
    #[serde(default)]
    pub exit_code: Option<i32>,
    pub created_at: String,
    pub updated_at: String,
    /// The result (sealed: it may carry output content).
    #[serde(default)]
    pub result_sealed: Option<String>,
    #[serde(default)]
    pub receipt: Option<Value>,
    #[serde(default)]
    pub completed_at: Option<String>,
    /// `verified` or `pending`.
    #[serde(default)]
    pub cleanup: Option<String>,
    /// Why its setup failed (`code: message`), for a `setup_failed` task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup_error: Option<String>,
}

impl Task {
    /// Whether its execution has ended (whatever the result).
    pub fn execution_ended(&self) -> bool {
        !matches!(self.state, TaskState::Starting | TaskState::Running)
    }
}

pub fn get(txn: &impl ReadOps, task_ref: &str) -> Result<Option<Task>, StoreError> {
    txn.record(tables::TASKS, task_ref)
}

pub fn put(txn: &impl WriteOps, t: &Task) -> Result<(), StoreError> {
    typed::put(txn, tables::TASKS, &t.task_ref, t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_strings() {
        for s in [
            TaskState::Starting,
            TaskState::Running,
            TaskState::Succeeded,
            TaskState::Failed,
            TaskState::Cancelled,
            TaskState::TimedOut,
            TaskState::SetupFailed,
            TaskState::Orphaned,
            TaskState::CleanupPending,
            TaskState::OutputValidationFailed,
            TaskState::Lost,
        ] {
            let w = format!("\"{}\"", s.as_str());
            assert_eq!(serde_json::to_string(&s).unwrap(), w);
            assert_eq!(TaskState::parse(s.as_str()), Some(s));
        }
    }
}
