//! Every table of `state.redb`, in one place. Names carry their version;
//! values are versioned JSON decoded with typed errors (see `codec`).

use redb::TableDefinition;

/// Schema version this binary writes (see `migrations/`).
pub const SCHEMA_VERSION: u64 = 8;

/// `schema_version`, `instance_id`, audit chain head, the sealed token key
/// (schema 4).
pub const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
/// Token id → token record (keyed hash, or an argon2 hash until first use
/// after schema 4; scopes).
pub const TOKENS: TableDefinition<&str, &[u8]> = TableDefinition::new("tokens_v1");
/// lease_ref → lease record.
pub const LEASES: TableDefinition<&str, &[u8]> = TableDefinition::new("leases_v1");
/// `tenant \0 runtime \0 session_hash` → lease_ref.
pub const SESSIONS: TableDefinition<&str, &str> = TableDefinition::new("sessions_v1");
/// seq → audit event (hash-chained).
pub const AUDIT: TableDefinition<u64, &[u8]> = TableDefinition::new("audit_v1");
/// operation_id → seq of its intent, while the outcome is not recorded.
pub const PENDING: TableDefinition<&str, u64> = TableDefinition::new("pending_v1");
/// job_ref → job record (schema 2).
pub const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs_v1");
/// `lease_ref \0 job_ref` → () : a lease's jobs, by prefix (schema 2).
pub const LEASE_JOBS: TableDefinition<&str, ()> = TableDefinition::new("lease_jobs_v1");
/// checkpoint_ref → checkpoint record (schema 2).
pub const CHECKPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("checkpoints_v1");
/// `lease_ref \0 checkpoint_ref` → () : a lease's checkpoints (schema 2).
pub const LEASE_CHECKPOINTS: TableDefinition<&str, ()> =
    TableDefinition::new("lease_checkpoints_v1");
/// pty_ref → PTY record (schema 2).
pub const PTYS: TableDefinition<&str, &[u8]> = TableDefinition::new("ptys_v1");
/// `lease_ref \0 pty_ref` → () : a lease's PTYs (schema 2).
pub const LEASE_PTYS: TableDefinition<&str, ()> = TableDefinition::new("lease_ptys_v1");
/// plan_ref → task plan (schema 3).
pub const PLANS: TableDefinition<&str, &[u8]> = TableDefinition::new("plans_v1");
/// task_ref → trusted task, with its result and receipt (schema 3).
pub const TASKS: TableDefinition<&str, &[u8]> = TableDefinition::new("tasks_v1");
/// user name → console/API user (argon2 password hash, principal) (schema 3).
pub const USERS: TableDefinition<&str, &[u8]> = TableDefinition::new("users_v1");
/// digest of a console session id → console session (user, times,
/// password fingerprint) (schema 5).
pub const CONSOLE_SESSIONS: TableDefinition<&str, &[u8]> =
    TableDefinition::new("console_sessions_v1");
/// `(field \0 value, seq)` → () : the audit events with a value of an
/// indexed field, in `seq` order (schema 6; `audit_index`).
pub const AUDIT_BY: TableDefinition<(&str, u64), ()> = TableDefinition::new("audit_by_v1");
/// Unix minute → (lowest, highest) `seq` of the audit events stamped in it
/// (schema 6; `audit_index`).
pub const AUDIT_MINUTES: TableDefinition<u64, (u64, u64)> =
    TableDefinition::new("audit_minutes_v1");
/// audit sink name → the `seq` of the last event it acknowledged (schema 7;
/// `audit::sinks`).
pub const SINK_CURSORS: TableDefinition<&str, u64> = TableDefinition::new("sink_cursors_v1");
/// recording_ref → session recording (its file, its sealed chunks)
/// (schema 8; `recordings`).
pub const RECORDINGS: TableDefinition<&str, &[u8]> = TableDefinition::new("recordings_v1");
/// `lease_ref \0 recording_ref` → () : a lease's recordings (schema 8).
pub const LEASE_RECORDINGS: TableDefinition<&str, ()> = TableDefinition::new("lease_recordings_v1");
