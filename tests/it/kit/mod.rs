//! The test kit every area module uses:
//! - `backend`: `TestBackend` (the embedded backend in-process over mTLS)
//!   and host-process helpers (`is_zombie`, `pids_in_ns`);
//! - `server`: `Server` (the appliance in-process), `raw_request`, `code`;
//! - `rig`: `Proc` and `ProcRig` (real `serve` processes), `revoke`;
//! - `python`: `sdk_python`, `spec_tools` (the SDK and schemathesis
//!   virtualenvs, each made once under a lock);
//! - `spec`: `docs/openapi.yaml` as an oracle for answers;
//! - `sandboxes`: `end_sandboxes` (what every `Drop` here uses to end the
//!   sandboxes a test left) and `SandboxReaper`;
//! - `tmpfs`: `Tmpfs` (a size-limited tmpfs, root only);
//! - `pg`: `Postgres` (a PostgreSQL cluster of its own on 127.0.0.1) and
//!   `Haproxy` (TCP, in front of replicas).
//!
//! What a test needs from the host (root, python3, systemd-analyze, tar…)
//! fails loudly when missing: nothing here skips.

pub mod backend;
pub mod pg;
pub mod python;
pub mod rig;
pub mod sandboxes;
pub mod server;
pub mod spec;
pub mod tmpfs;
pub mod world;

pub use backend::{TestBackend, pids_in_ns, settings};
pub use pg::{Haproxy, Postgres};
pub use python::{sdk_python, spec_tools};
pub use rig::{Proc, ProcRig, revoke};
pub use sandboxes::{SandboxReaper, end_sandboxes};
pub use server::{Server, code, raw_request};
pub use tmpfs::Tmpfs;

/// The `cube-adapter` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_cube-adapter");

/// A mebibyte: the output cap most sandbox commands in tests run with.
pub const MB: usize = 1024 * 1024;

/// `cube-adapter ARGS… --state-dir STATE --config CONFIG`: a command on a
/// state directory, as an operator runs it.
pub fn cli_at(
    state: &std::path::Path,
    config: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap()
}

/// A shell command as the SDK runs it (`/bin/bash -l -c`).
pub fn sh(cmd: &str) -> cube_adapter::cube::StartOptions {
    cube_adapter::cube::StartOptions::shell(cmd)
}
