//! Session recordings (`recordings_v1`) and a lease's recordings
//! (`lease_recordings_v1`, schema 8). The files are under
//! `STATE/recordings/`; a record says what a file is, how much of it is
//! sealed into the journal and with which digests. A recording outlives its
//! lease: only retention removes it.

use serde::{Deserialize, Serialize};

/// The recordings' directory under the state directory.
pub const DIR: &str = "recordings";

use super::typed::{self, ReadOps, WriteOps};
use super::{StoreError, index_key, owned_items, tables};

/// What was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordingKind {
    Pty,
    Job,
    Exec,
}

impl RecordingKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pty => "pty",
            Self::Job => "job",
            Self::Exec => "exec",
        }
    }
}

/// Where a recording is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordingState {
    /// Being written: what it holds so far is sealed chunk by chunk.
    Open,
    /// Closed: every byte is in a sealed chunk and the whole file's digest
    /// is in the journal (`recording_sealed`).
    Sealed,
}

/// One sealed chunk: bytes `offset .. offset + len` of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    pub offset: u64,
    pub len: u64,
    /// SHA-256 of the chunk's bytes (hex).
    pub sha256: String,
}

/// A recording as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Recording {
    pub recording_ref: String,
    pub tenant: String,
    pub lease_ref: String,
    pub sandbox_ref: String,
    pub profile: String,
    pub kind: RecordingKind,
    /// The PTY's or job's ref (an exec: its request id).
    pub subject: String,
    pub state: RecordingState,
    pub created_at: String,
    pub updated_at: String,
    /// The chunks sealed so far, in file order (they tile the file from 0).
    pub chunks: Vec<Chunk>,
    /// SHA-256 of the whole file, once sealed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The file's length once sealed.
    #[serde(default)]
    pub bytes: u64,
    /// Chunks found changed at a restart (by index): the file no longer
    /// matches the journal there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub damaged: Vec<u64>,
    /// The replica whose disk holds the file (a shared database).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// An operator's legal hold: retention never removes it while set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<Hold>,
}

/// A legal hold: when, and a keyed digest of the operator's note.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub at: String,
    pub note_digest: String,
}

impl Recording {
    /// Bytes of the file covered by sealed chunks.
    pub fn sealed_bytes(&self) -> u64 {
        self.chunks.last().map_or(0, |c| c.offset + c.len)
    }

    /// The file's name under `STATE/recordings/`.
    pub fn file_name(&self) -> String {
        format!("{}.cast", self.recording_ref)
    }
}

pub fn get(txn: &impl ReadOps, recording_ref: &str) -> Result<Option<Recording>, StoreError> {
    txn.record(tables::RECORDINGS, recording_ref)
}

/// Every recording, by ref.
pub fn all(txn: &impl ReadOps) -> Result<Vec<Recording>, StoreError> {
    txn.records(tables::RECORDINGS)
}

/// Insert or replace a recording, indexed under its lease.
pub fn put(txn: &impl WriteOps, r: &Recording) -> Result<(), StoreError> {
    typed::put(txn, tables::RECORDINGS, &r.recording_ref, r)?;
    typed::put_index(
        txn,
        tables::LEASE_RECORDINGS,
        &index_key(&r.lease_ref, &r.recording_ref),
    )
}

/// Remove a recording's record (its file is the caller's).
pub fn remove(txn: &impl WriteOps, r: &Recording) -> Result<(), StoreError> {
    typed::remove(txn, tables::RECORDINGS, &r.recording_ref)?;
    typed::remove_index(
        txn,
        tables::LEASE_RECORDINGS,
        &index_key(&r.lease_ref, &r.recording_ref),
    )
}

/// A lease's recordings, by ref.
pub fn of_lease(txn: &impl ReadOps, lease_ref: &str) -> Result<Vec<Recording>, StoreError> {
    owned_items(txn, tables::LEASE_RECORDINGS, tables::RECORDINGS, lease_ref)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_bytes_is_the_end_of_the_last_chunk() {
        let mut r = Recording {
            recording_ref: "rec_x".into(),
            tenant: "t".into(),
            lease_ref: "lease_x".into(),
            sandbox_ref: "abcd1234".into(),
            profile: "p".into(),
            kind: RecordingKind::Pty,
            subject: "pty_x".into(),
            state: RecordingState::Open,
            created_at: String::new(),
            updated_at: String::new(),
            chunks: vec![],
            digest: None,
            bytes: 0,
            damaged: vec![],
            replica: None,
            hold: None,
        };
        assert_eq!(r.sealed_bytes(), 0);
        r.chunks.push(Chunk {
            offset: 0,
            len: 10,
            sha256: String::new(),
        });
        r.chunks.push(Chunk {
            offset: 10,
            len: 5,
            sha256: String::new(),
        });
        assert_eq!(r.sealed_bytes(), 15);
        assert_eq!(serde_json::to_string(&r.kind).unwrap(), "\"pty\"");
    }
}
