//! Ending the sandboxes a test leaves behind. Sandboxes outlive the process
//! that made them by design, so every kit value that owns a state directory
//! ends them in its `Drop` through [`end_sandboxes`]; [`SandboxReaper`] does
//! it for a directory a test manages itself.

use std::path::{Path, PathBuf};

/// End every sandbox under `dir` (a backend's `sandboxes` directory, one
/// subdirectory per sandbox): thaw its cgroups (the `groups` paths of its
/// `meta.json`; a paused sandbox's tasks die only once thawed), then SIGKILL
/// its init (the `pid` of its `init.json`), which ends its whole pid
/// namespace. Best effort: a missing or malformed file is passed over.
/// The inits it signalled.
pub fn end_sandboxes(dir: &Path) -> Vec<i32> {
    let mut inits = Vec::new();
    for d in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let groups: Vec<PathBuf> = std::fs::read(d.path().join("meta.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|m| m.get("groups").and_then(|g| g.as_object()).cloned())
            .map(|g| {
                g.values()
                    .filter_map(|v| v.as_str().map(PathBuf::from))
                    .collect()
            })
            .unwrap_or_default();
        for g in &groups {
            let _ = std::fs::write(g.join("cgroup.freeze"), "0");
            let _ = std::fs::write(g.join("freezer.state"), "THAWED");
        }
        if let Ok(b) = std::fs::read(d.path().join("init.json"))
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b)
            && let Some(pid) = v.get("pid").and_then(|p| p.as_i64())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            inits.push(pid as i32);
        }
        // Its own disk (`embedded::disk`): unmounted, so that the test's
        // directory can go (the loop device detaches once the sandbox's
        // own mounts end with it).
        cube_adapter::embedded::disk::release(&d.path());
    }
    inits
}

/// Ends the sandboxes under a directory (as [`end_sandboxes`]) when a test
/// ends, also when it panics.
pub struct SandboxReaper(pub PathBuf);

impl Drop for SandboxReaper {
    fn drop(&mut self) {
        let _ = end_sandboxes(&self.0);
    }
}
