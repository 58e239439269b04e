//! PTYs (`ptys_v1`) and a lease's PTYs (`lease_ptys_v1`).

use serde::{Deserialize, Serialize};

use super::typed::{self, ReadOps, WriteOps};
use super::{StoreError, delete_owned, index_key, owned_items, tables};

/// A PTY's state, stored and answered as its snake_case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PtyState {
    Running,
    Exited,
    /// Killed by a call.
    Cancelled,
    /// Its terminal belonged to an earlier process, or its stream broke.
    Lost,
}

impl PtyState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Exited => "exited",
            Self::Cancelled => "cancelled",
            Self::Lost => "lost",
        }
    }
}

impl std::fmt::Display for PtyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A PTY as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pty {
    pub pty_ref: String,
    pub lease_ref: String,
    pub tenant: String,
    pub pid: u32,
    pub state: PtyState,
    pub exit_code: Option<i32>,
    pub rows: u32,
    pub cols: u32,
    pub created_at: String,
    pub updated_at: String,
    /// The replica whose process holds the terminal (a shared database;
    /// absent with redb, where there is one process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
}

impl Pty {
    pub fn is_running(&self) -> bool {
        self.state == PtyState::Running
    }
}

pub fn get(txn: &impl ReadOps, pty_ref: &str) -> Result<Option<Pty>, StoreError> {
    txn.record(tables::PTYS, pty_ref)
}

/// Every PTY, by pty_ref.
pub fn all(txn: &impl ReadOps) -> Result<Vec<Pty>, StoreError> {
    txn.records(tables::PTYS)
}

/// Insert or replace a PTY, indexed under its lease.
pub fn put(txn: &impl WriteOps, p: &Pty) -> Result<(), StoreError> {
    typed::put(txn, tables::PTYS, &p.pty_ref, p)?;
    typed::put_index(
        txn,
        tables::LEASE_PTYS,
        &index_key(&p.lease_ref, &p.pty_ref),
    )
}

/// Remove a lease's PTYs.
pub fn remove_lease(txn: &impl WriteOps, lease_ref: &str) -> Result<(), StoreError> {
    delete_owned(txn, tables::LEASE_PTYS, tables::PTYS, lease_ref)
}

/// A lease's PTYs, in pty_ref order.
pub fn of_lease(txn: &impl ReadOps, lease_ref: &str) -> Result<Vec<Pty>, StoreError> {
    owned_items(txn, tables::LEASE_PTYS, tables::PTYS, lease_ref)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_strings() {
        for s in [
            PtyState::Running,
            PtyState::Exited,
            PtyState::Cancelled,
            PtyState::Lost,
        ] {
            let w = format!("\"{}\"", s.as_str());
            assert_eq!(serde_json::to_string(&s).unwrap(), w);
            assert_eq!(serde_json::from_str::<PtyState>(&w).unwrap(), s);
        }
    }
}
