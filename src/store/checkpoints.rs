//! Checkpoints (`checkpoints_v1`) and a lease's checkpoints
//! (`lease_checkpoints_v1`).

use serde::{Deserialize, Serialize};

use super::typed::{self, ReadOps, WriteOps};
use super::{StoreError, delete_owned, index_key, owned_items, tables};

/// A checkpoint as stored. The backend's snapshot id never leaves.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Checkpoint {
    pub checkpoint_ref: String,
    pub lease_ref: String,
    pub tenant: String,
    pub snapshot_id: String,
    pub name: String,
    pub created_at: String,
}

pub fn get(txn: &impl ReadOps, checkpoint_ref: &str) -> Result<Option<Checkpoint>, StoreError> {
    txn.record(tables::CHECKPOINTS, checkpoint_ref)
}

/// Insert or replace a checkpoint, indexed under its lease.
pub fn put(txn: &impl WriteOps, c: &Checkpoint) -> Result<(), StoreError> {
    typed::put(txn, tables::CHECKPOINTS, &c.checkpoint_ref, c)?;
    typed::put_index(
        txn,
        tables::LEASE_CHECKPOINTS,
        &index_key(&c.lease_ref, &c.checkpoint_ref),
    )
}

pub fn remove(txn: &impl WriteOps, c: &Checkpoint) -> Result<(), StoreError> {
    typed::remove(txn, tables::CHECKPOINTS, &c.checkpoint_ref)?;
    typed::remove_index(
        txn,
        tables::LEASE_CHECKPOINTS,
        &index_key(&c.lease_ref, &c.checkpoint_ref),
    )
}

/// Remove a lease's checkpoints.
pub fn remove_lease(txn: &impl WriteOps, lease_ref: &str) -> Result<(), StoreError> {
    delete_owned(
        txn,
        tables::LEASE_CHECKPOINTS,
        tables::CHECKPOINTS,
        lease_ref,
    )
}

/// A lease's checkpoints, in checkpoint_ref order.
pub fn of_lease(txn: &impl ReadOps, lease_ref: &str) -> Result<Vec<Checkpoint>, StoreError> {
    owned_items(
        txn,
        tables::LEASE_CHECKPOINTS,
        tables::CHECKPOINTS,
        lease_ref,
    )
}
