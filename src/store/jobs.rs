//! Jobs (`jobs_v1`) and a lease's jobs (`lease_jobs_v1`).

use serde::{Deserialize, Serialize};

use super::typed::{self, ReadOps, WriteOps};
use super::{StoreError, delete_owned, index_key, owned_items, tables};

/// A job's state, stored and answered as its snake_case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Succeeded,
    Failed,
    TimedOut,
    Cancelled,
    /// The runner or the sandbox is gone, with no exit code recorded.
    Lost,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::TimedOut => "timed_out",
            Self::Cancelled => "cancelled",
            Self::Lost => "lost",
        }
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Compare with a wire name (`state == "timed_out"`).
impl PartialEq<&str> for JobState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A job as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub job_ref: String,
    pub lease_ref: String,
    pub tenant: String,
    /// Keyed digest of the command (never the command).
    pub command_digest: String,
    /// The runner's pid inside the sandbox.
    pub runner_pid: u32,
    pub state: JobState,
    pub exit_code: Option<i32>,
    pub cancelled: bool,
    pub created_at: String,
    pub updated_at: String,
    pub max_seconds: u64,
}

impl Job {
    pub fn is_terminal(&self) -> bool {
        self.state != JobState::Running
    }
}

pub fn get(txn: &impl ReadOps, job_ref: &str) -> Result<Option<Job>, StoreError> {
    txn.record(tables::JOBS, job_ref)
}

/// Insert or replace a job, indexed under its lease.
pub fn put(txn: &impl WriteOps, j: &Job) -> Result<(), StoreError> {
    typed::put(txn, tables::JOBS, &j.job_ref, j)?;
    typed::put_index(
        txn,
        tables::LEASE_JOBS,
        &index_key(&j.lease_ref, &j.job_ref),
    )
}

pub fn remove(txn: &impl WriteOps, j: &Job) -> Result<(), StoreError> {
    typed::remove(txn, tables::JOBS, &j.job_ref)?;
    typed::remove_index(
        txn,
        tables::LEASE_JOBS,
        &index_key(&j.lease_ref, &j.job_ref),
    )
}

/// Remove a lease's jobs.
pub fn remove_lease(txn: &impl WriteOps, lease_ref: &str) -> Result<(), StoreError> {
    delete_owned(txn, tables::LEASE_JOBS, tables::JOBS, lease_ref)
}

/// Every job, by job_ref.
pub fn all(txn: &impl ReadOps) -> Result<Vec<Job>, StoreError> {
    txn.records(tables::JOBS)
}

/// A lease's jobs, in job_ref order.
pub fn of_lease(txn: &impl ReadOps, lease_ref: &str) -> Result<Vec<Job>, StoreError> {
    owned_items(txn, tables::LEASE_JOBS, tables::JOBS, lease_ref)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_strings() {
        for s in [
            JobState::Running,
            JobState::Succeeded,
            JobState::Failed,
            JobState::TimedOut,
            JobState::Cancelled,
            JobState::Lost,
        ] {
            let w = format!("\"{}\"", s.as_str());
            assert_eq!(serde_json::to_string(&s).unwrap(), w);
            assert_eq!(serde_json::from_str::<JobState>(&w).unwrap(), s);
        }
        assert_eq!(JobState::TimedOut.as_str(), "timed_out");
    }

    /// A record written before the states were typed reads back and
    /// encodes to the same bytes.
    #[test]
    fn old_records_keep_their_bytes() {
        let old = r#"{"job_ref":"job_00","lease_ref":"lease_00","tenant":"t","command_digest":"d","runner_pid":7,"state":"timed_out","exit_code":124,"cancelled":false,"created_at":"c","updated_at":"u","max_seconds":60}"#;
        let j: Job = crate::store::codec::decode(old.as_bytes()).unwrap();
        assert_eq!(j.state, JobState::TimedOut);
        assert!(j.state == "timed_out");
        assert_eq!(crate::store::codec::encode(&j).unwrap(), old.as_bytes());
    }
}
