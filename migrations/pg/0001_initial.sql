-- cube-adapter's PostgreSQL store, schema step 1 (`[store] kind = "postgres"`).
-- Applied by the service at start, under an advisory lock, in one
-- transaction with its row in cube_schema. The records are the redb
-- store's (schema 7): the same JSON values, the same keys.

-- meta: schema_version, instance_id, the sealed token key.
CREATE TABLE cube_meta (
    k text PRIMARY KEY,
    v bytea NOT NULL
);

-- Every keyed table of the redb store (tokens_v1, leases_v1, sessions_v1,
-- jobs_v1, lease_jobs_v1, …) by its name: keys are bytes (they hold NUL
-- separators), values the record's JSON (empty for an index entry).
CREATE TABLE cube_records (
    tbl text NOT NULL,
    k bytea NOT NULL,
    v bytea NOT NULL,
    PRIMARY KEY (tbl, k)
);

-- The audit journal: one row per event, hash-chained (seq from 1).
CREATE TABLE cube_audit (
    seq bigint PRIMARY KEY CHECK (seq > 0),
    event bytea NOT NULL
);

-- The head of the chain. Every write transaction locks this row first
-- (FOR UPDATE): writes of all replicas are serialised, and each event's
-- link is computed from the head read in the transaction that appends it.
CREATE TABLE cube_chain (
    id integer PRIMARY KEY CHECK (id = 1),
    next_seq bigint NOT NULL,
    last_hash text NOT NULL
);
INSERT INTO cube_chain (id, next_seq, last_hash)
VALUES (1, 1, '0000000000000000000000000000000000000000000000000000000000000000');

-- Intents whose outcome is not recorded yet: operation id -> seq, and
-- the replica that wrote it (it resolves its own after a crash; those of
-- a replica that is not running are resolved by the next one to start).
CREATE TABLE cube_pending (
    op text PRIMARY KEY,
    seq bigint NOT NULL,
    replica text
);

-- The replicas that have run on this database. A running replica holds a
-- session advisory lock whose key is (lock_hi << 32) | lock_lo: pg_locks
-- tells whether it is running, and the database lets go of the lock the
-- moment the replica's connection ends.
CREATE TABLE cube_replicas (
    id text PRIMARY KEY,
    lock_hi bigint NOT NULL,
    lock_lo bigint NOT NULL,
    host text NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at timestamptz NOT NULL
);

-- The audit search indexes (redb schema 6).
CREATE TABLE cube_audit_by (
    k bytea NOT NULL,
    seq bigint NOT NULL,
    PRIMARY KEY (k, seq)
);
CREATE TABLE cube_audit_minutes (
    minute bigint PRIMARY KEY,
    lo bigint NOT NULL,
    hi bigint NOT NULL
);

-- The audit sinks' cursors (redb schema 7).
CREATE TABLE cube_sink_cursors (
    name text PRIMARY KEY,
    seq bigint NOT NULL
);
