//! cgroup limits and freezing for sandboxes, where the host lets us.
//!
//! cgroup v2 (unified, `/sys/fs/cgroup/cgroup.controllers` present) and v1
//! (one hierarchy per controller) are both handled. Each sandbox gets
//! `<controller root>/cube-adapter/<sandbox id>`. When nothing is writable,
//! sandboxes run with rlimits only and pause falls back to SIGSTOP.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::launch::Limits;

const ROOT: &str = "/sys/fs/cgroup";
const GROUP: &str = "cube-adapter";

/// What this host offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    V2,
    V1 {
        pids: bool,
        memory: bool,
        cpu: bool,
        freezer: bool,
    },
    None,
}

impl Host {
    /// Detect and create our parent group; `None` when we cannot write.
    pub fn detect() -> Self {
        let root = Path::new(ROOT);
        if root.join("cgroup.controllers").exists() {
            let parent = root.join(GROUP);
            let ok = std::fs::create_dir_all(&parent).is_ok()
                && std::fs::write(root.join("cgroup.subtree_control"), "+pids +memory +cpu")
                    .is_ok()
                && std::fs::write(parent.join("cgroup.subtree_control"), "+pids +memory +cpu")
                    .is_ok();
            return if ok { Host::V2 } else { Host::None };
        }
        let try_ctrl = |c: &str| {
            let d = root.join(c);
            let g = d.join(GROUP);
            d.join("tasks").exists()
                && std::fs::create_dir_all(&g).is_ok()
                // A group root made before is not necessarily ours to write
                // (the service user after a run as root).
                && nix::unistd::access(&g, nix::unistd::AccessFlags::W_OK).is_ok()
        };
        let (pids, memory, cpu, freezer) = (
            try_ctrl("pids"),
            try_ctrl("memory"),
            try_ctrl("cpu"),
            try_ctrl("freezer"),
        );
        if pids || memory || cpu || freezer {
            Host::V1 {
                pids,
                memory,
                cpu,
                freezer,
            }
        } else {
            Host::None
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Host::V2 => "cgroup v2 (pids, memory, cpu, freeze)".into(),
            Host::V1 {
                pids,
                memory,
                cpu,
                freezer,
            } => {
                let mut v = vec![];
                for (on, n) in [
                    (pids, "pids"),
                    (memory, "memory"),
                    (cpu, "cpu"),
                    (freezer, "freezer"),
                ] {
                    if *on {
                        v.push(n);
                    }
                }
                format!("cgroup v1 ({})", v.join(", "))
            }
            Host::None => "no writable cgroups (rlimits only)".into(),
        }
    }
}

/// One sandbox's groups.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Groups {
    pub v2: Option<PathBuf>,
    pub pids: Option<PathBuf>,
    pub memory: Option<PathBuf>,
    pub cpu: Option<PathBuf>,
    pub freezer: Option<PathBuf>,
}

impl Groups {
    /// Create the sandbox's groups and write its limits.
    pub fn create(host: &Host, id: &str, limits: &Limits, cpus: f64) -> std::io::Result<Self> {
        let root = Path::new(ROOT);
        let mut g = Groups::default();
        let mem = limits.memory_mb.saturating_mul(1024 * 1024);
        let period: u64 = 100_000;
        let quota = (cpus * period as f64).round() as u64;
        match host {
            Host::V2 => {
                let d = root.join(GROUP).join(id);
                std::fs::create_dir_all(&d)?;
                std::fs::write(d.join("pids.max"), limits.max_processes.to_string())?;
                std::fs::write(d.join("memory.max"), mem.to_string())?;
                let _ = std::fs::write(d.join("memory.swap.max"), "0");
                if quota > 0 {
                    std::fs::write(d.join("cpu.max"), format!("{quota} {period}"))?;
                }
                g.v2 = Some(d);
            }
            Host::V1 {
                pids,
                memory,
                cpu,
                freezer,
            } => {
                let mk = |c: &str| -> std::io::Result<PathBuf> {
                    let d = root.join(c).join(GROUP).join(id);
                    std::fs::create_dir_all(&d)?;
                    Ok(d)
                };
                if *pids {
                    let d = mk("pids")?;
                    std::fs::write(d.join("pids.max"), limits.max_processes.to_string())?;
                    g.pids = Some(d);
                }
                if *memory {
                    let d = mk("memory")?;
                    std::fs::write(d.join("memory.limit_in_bytes"), mem.to_string())?;
                    g.memory = Some(d);
                }
                if *cpu {
                    let d = mk("cpu")?;
                    if quota > 0 {
                        std::fs::write(d.join("cpu.cfs_period_us"), period.to_string())?;
                        std::fs::write(d.join("cpu.cfs_quota_us"), quota.to_string())?;
                    }
                    g.cpu = Some(d);
                }
                if *freezer {
                    g.freezer = Some(mk("freezer")?);
                }
            }
            Host::None => {}
        }
        Ok(g)
    }

    fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        [&self.v2, &self.pids, &self.memory, &self.cpu, &self.freezer]
            .into_iter()
            .flatten()
    }

    /// The files a process writes its pid to, to join every group.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs().map(|d| d.join("cgroup.procs")).collect()
    }

    pub fn has_memory(&self) -> bool {
        self.v2.is_some() || self.memory.is_some()
    }

    pub fn can_freeze(&self) -> bool {
        self.v2.is_some() || self.freezer.is_some()
    }

    /// Freeze (true) or thaw (false) every process; waits until done.
    pub async fn set_frozen(&self, frozen: bool) -> std::io::Result<()> {
        if let Some(d) = &self.v2 {
            std::fs::write(d.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
            let want = if frozen { "frozen 1" } else { "frozen 0" };
            for _ in 0..200 {
                let ev = std::fs::read_to_string(d.join("cgroup.events")).unwrap_or_default();
                if ev.lines().any(|l| l.trim() == want) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            return Err(std::io::Error::other(
                "cgroup did not reach the freezer state in time",
            ));
        }
        if let Some(d) = &self.freezer {
            let want = if frozen { "FROZEN" } else { "THAWED" };
            std::fs::write(d.join("freezer.state"), want)?;
            for _ in 0..200 {
                if std::fs::read_to_string(d.join("freezer.state"))
                    .unwrap_or_default()
                    .trim()
                    == want
                {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            return Err(std::io::Error::other(
                "freezer did not reach the requested state in time",
            ));
        }
        Err(std::io::Error::other("no freezer available"))
    }

    /// Thaw without waiting (the caller kills next).
    fn thaw_now(&self) {
        if let Some(d) = &self.v2 {
            let _ = std::fs::write(d.join("cgroup.freeze"), "0");
        }
        if let Some(d) = &self.freezer {
            let _ = std::fs::write(d.join("freezer.state"), "THAWED");
        }
    }

    /// Every pid in the sandbox's groups.
    pub fn pids(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self
            .dirs()
            .flat_map(|d| {
                std::fs::read_to_string(d.join("cgroup.procs"))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<_>>()
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// `cgroup.kill` where the kernel has it (v2, Linux ≥ 5.14).
    pub fn kill_all(&self) -> bool {
        self.v2
            .as_ref()
            .is_some_and(|d| std::fs::write(d.join("cgroup.kill"), "1").is_ok())
    }

    /// Remove the groups (they must be empty).
    pub fn remove(&self) {
        for d in self.dirs() {
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Every sandbox's groups of ours on this host (whoever made them), by
/// sandbox id.
fn all_groups() -> std::collections::BTreeMap<String, Groups> {
    let root = Path::new(ROOT);
    let mut by_id: std::collections::BTreeMap<String, Groups> = Default::default();
    for (ctrl, parent) in [
        ("", root.join(GROUP)),
        ("pids", root.join("pids").join(GROUP)),
        ("memory", root.join("memory").join(GROUP)),
        ("cpu", root.join("cpu").join(GROUP)),
        ("freezer", root.join("freezer").join(GROUP)),
    ] {
        for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let g = by_id
                .entry(e.file_name().to_string_lossy().into_owned())
                .or_default();
            let slot = match ctrl {
                "" => &mut g.v2,
                "pids" => &mut g.pids,
                "memory" => &mut g.memory,
                "cpu" => &mut g.cpu,
                _ => &mut g.freezer,
            };
            *slot = Some(e.path());
        }
    }
    by_id
}

/// Whether `pid` is a sandbox launcher or init (`__sandbox-launch DIR`)
/// whose DIR was removed: it holds that directory open (the init's
/// watchdog does) and the kernel says the directory is deleted. Read
/// through the process's own descriptors, so it holds whatever mount
/// namespace the directory was made in.
fn owner_gone(pid: i32) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let (Some(verb), Some(dir)) = (args.get(1), args.get(2)) else {
        return false;
    };
    if *verb != b"__sandbox-launch" {
        return false;
    }
    let gone = format!("{} (deleted)", String::from_utf8_lossy(dir));
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .any(|target| target.as_os_str().to_string_lossy() == gone)
}

/// What [`end_ownerless`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Sandboxes whose directory was gone, thawed and killed.
    pub killed: usize,
    /// Empty groups older than ten minutes, removed.
    pub removed: usize,
}

/// End the sandboxes on this host whose owner is gone, whoever made them:
/// one whose state directory was removed ends itself, unless it is paused
/// (frozen, its watchdog too); this thaws and kills it. Also removes our
/// empty groups older than ten minutes (a sandbox's group is never empty
/// for long: it is made just before its launcher joins it, and removed
/// when it ends). Safe beside other backends: a sandbox whose directory
/// still exists is never touched.
pub fn end_ownerless() -> Swept {
    let mut swept = Swept::default();
    for g in all_groups().into_values() {
        let pids = g.pids();
        if pids.is_empty() {
            let old = g.dirs().all(|d| {
                std::fs::metadata(d)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| crate::clock::system_time().duration_since(t).ok())
                    .is_some_and(|age| age > Duration::from_secs(600))
            });
            if old {
                swept.removed += g.dirs().count();
                g.remove();
            }
            continue;
        }
        if !pids.iter().any(|p| owner_gone(*p)) {
            continue;
        }
        // Thawed first: a frozen process does not die of SIGKILL.
        g.thaw_now();
        if !g.kill_all() {
            for p in &pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        g.remove();
        swept.killed += 1;
    }
    swept
}
