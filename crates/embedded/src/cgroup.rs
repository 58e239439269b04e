//! cgroup limits and freezing for sandboxes, where the host lets us.
//!
//! cgroup v2 (unified, `/sys/fs/cgroup/cgroup.controllers` present) and v1
//! (one hierarchy per controller) are both handled. Where sandboxes' groups
//! go (docs/security.md, "cgroups"):
//!
//! - cgroup v2, a cgroup delegated to the service (systemd's `Delegate=yes`
//!   and `DelegateSubgroup=service`, which the embedded drop-in sets; systemd
//!   254 and later): systemd starts the service in the leaf
//!   `<unit group>/service` (no processes in inner groups); the service
//!   enables pids, memory and cpu below its unit's group, and each sandbox
//!   gets `<unit group>/sandboxes/<sandbox id>`. This is how an unprivileged
//!   service gets real limits on v2.
//! - otherwise `<controller root>/cube-adapter/<sandbox id>`, where that
//!   parent is ours to write: made by root (a service running as root), or
//!   made for the service user by `cube-adapter sandboxes prepare`, which the
//!   drop-in runs as root before the service (systemd delegates no v1
//!   controller to an unprivileged service).
//!
//! When nothing is writable, sandboxes run with rlimits only and pause falls
//! back to SIGSTOP.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::launch::Limits;

const ROOT: &str = "/sys/fs/cgroup";
const GROUP: &str = "cube-adapter";
/// The leaf of a delegated v2 cgroup systemd starts the service in.
const SERVICE_LEAF: &str = "service";
/// The group of a delegated v2 cgroup that holds the sandboxes' groups.
const SANDBOXES: &str = "sandboxes";
/// The v1 controllers sandboxes use, by directory under [`ROOT`].
const V1_CONTROLLERS: [&str; 4] = ["pids", "memory", "cpu", "freezer"];
/// The v2 controllers sandboxes need.
const V2_CONTROLLERS: &str = "+pids +memory +cpu";

/// What this host offers: where each kind of sandbox group is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// Sandbox groups under this v2 group; `delegated` when it is the
    /// service's own delegated cgroup.
    V2 {
        parent: PathBuf,
        delegated: bool,
    },
    /// Sandbox groups under these v1 parents, one per controller we can
    /// write.
    V1 {
        pids: Option<PathBuf>,
        memory: Option<PathBuf>,
        cpu: Option<PathBuf>,
        freezer: Option<PathBuf>,
    },
    None,
}

impl Host {
    /// Detect where sandbox groups can go, making what is needed; `None`
    /// when we cannot write anywhere.
    pub fn detect() -> Self {
        let root = Path::new(ROOT);
        if root.join("cgroup.controllers").exists() {
            let own = std::fs::read_to_string("/proc/self/cgroup")
                .ok()
                .and_then(|t| own_v2_group(&t));
            if let Some(own) = own {
                match take_delegated(root, &own) {
                    Ok(Some(parent)) => {
                        return Host::V2 {
                            parent,
                            delegated: true,
                        };
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(
                        cgroup = %own,
                        error = %e,
                        "cannot use the service's delegated cgroup"
                    ),
                }
            }
            let parent = root.join(GROUP);
            let ok = std::fs::create_dir_all(&parent).is_ok()
                && std::fs::write(root.join("cgroup.subtree_control"), V2_CONTROLLERS).is_ok()
                && std::fs::write(parent.join("cgroup.subtree_control"), V2_CONTROLLERS).is_ok();
            return if ok {
                Host::V2 {
                    parent,
                    delegated: false,
                }
            } else {
                Host::None
            };
        }
        let try_ctrl = |c: &str| {
            let d = root.join(c);
            let g = d.join(GROUP);
            (d.join("tasks").exists()
                && std::fs::create_dir_all(&g).is_ok()
                // A group root made before is not necessarily ours to write
                // (the service user after a run as root, or before
                // `sandboxes prepare`).
                && nix::unistd::access(&g, nix::unistd::AccessFlags::W_OK).is_ok())
            .then_some(g)
        };
        let [pids, memory, cpu, freezer] = V1_CONTROLLERS.map(try_ctrl);
        if pids.is_some() || memory.is_some() || cpu.is_some() || freezer.is_some() {
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
            Host::V2 { parent, delegated } => format!(
                "cgroup v2 (pids, memory, cpu, freeze) under {}{}",
                parent.display(),
                if *delegated {
                    ", delegated to the service"
                } else {
                    ""
                }
            ),
            Host::V1 {
                pids,
                memory,
                cpu,
                freezer,
            } => {
                let on: Vec<&str> = [pids, memory, cpu, freezer]
                    .into_iter()
                    .zip(V1_CONTROLLERS)
                    .filter(|(p, _)| p.is_some())
                    .map(|(_, n)| n)
                    .collect();
                format!("cgroup v1 ({})", on.join(", "))
            }
            Host::None => "no writable cgroups (rlimits only)".into(),
        }
    }

    /// The parents sandbox groups are made in, with the slot of [`Groups`]
    /// each fills.
    fn parents(&self) -> Vec<(Slot, PathBuf)> {
        match self {
            Host::V2 { parent, .. } => vec![(Slot::V2, parent.clone())],
            Host::V1 {
                pids,
                memory,
                cpu,
                freezer,
            } => [
                (Slot::Pids, pids),
                (Slot::Memory, memory),
                (Slot::Cpu, cpu),
                (Slot::Freezer, freezer),
            ]
            .into_iter()
            .filter_map(|(s, p)| p.clone().map(|p| (s, p)))
            .collect(),
            Host::None => vec![],
        }
    }
}

/// The v2 group this process is in (`0::/path`), when it is not the root.
fn own_v2_group(proc_self_cgroup: &str) -> Option<String> {
    proc_self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().to_string())
        .filter(|p| p != "/" && !p.is_empty())
}

/// Whether the host's root runs this process (not root in a user
/// namespace of its own).
fn host_root() -> bool {
    nix::unistd::geteuid().is_root() && !super::subids::in_user_namespace()
}

/// Whether systemd marked `dir` as delegated (`Delegate=yes`, systemd 251
/// and later).
fn marked_delegated(dir: &Path) -> bool {
    ["trusted.delegate", "user.delegate"]
        .iter()
        .any(|name| xattr_is_one(dir, name))
}

fn xattr_is_one(dir: &Path, name: &str) -> bool {
    let mut buf = [0u8; 8];
    super::sys::getxattr(dir, name, &mut buf).is_ok_and(|n| n == 1 && buf.first() == Some(&b'1'))
}

/// The delegated group to use, from the service's own v2 group: its
/// parent when the service was started in a leaf named `service`
/// (systemd's `DelegateSubgroup=service`, systemd 254 and later). A
/// service started in its unit's group itself (older systemd) does not use
/// it: it could move itself into a leaf, but a restart while sandboxes live
/// would then fail, because systemd cannot start the new process in a group
/// whose controllers are enabled for its children.
fn delegated_base(own: &str) -> Option<&str> {
    own.strip_suffix(&format!("/{SERVICE_LEAF}"))
        .filter(|base| !base.is_empty())
}

/// Take the service's delegated v2 group as the parent of the sandboxes'
/// groups: where [`delegated_base`] names one, writable by us and either
/// marked delegated or ours without being the host's root (nobody else
/// hands an unprivileged user a writable cgroup). Enables the controllers
/// below it and makes `sandboxes`. Ok(None): not delegated.
fn take_delegated(root: &Path, own: &str) -> std::io::Result<Option<PathBuf>> {
    let Some(base) = delegated_base(own) else {
        return Ok(None);
    };
    let base = root.join(base.trim_start_matches('/'));
    let writable = |p: &Path| nix::unistd::access(p, nix::unistd::AccessFlags::W_OK).is_ok();
    if !writable(&base) || !writable(&base.join("cgroup.subtree_control")) {
        return Ok(None);
    }
    if host_root() && !marked_delegated(&base) {
        return Ok(None);
    }
    std::fs::write(base.join("cgroup.subtree_control"), V2_CONTROLLERS)?;
    let sandboxes = base.join(SANDBOXES);
    std::fs::create_dir_all(&sandboxes)?;
    std::fs::write(sandboxes.join("cgroup.subtree_control"), V2_CONTROLLERS)?;
    Ok(Some(sandboxes))
}

/// `cube-adapter sandboxes prepare`: as root, before an unprivileged
/// service starts, give `owner` the v1 parents `<controller>/cube-adapter`
/// (systemd delegates no v1 controller to an unprivileged service). On v2
/// nothing is needed (the unit's `Delegate=yes` does it): says so.
pub fn prepare(owner: nix::unistd::Uid, group: nix::unistd::Gid) -> std::io::Result<String> {
    let root = Path::new(ROOT);
    if root.join("cgroup.controllers").exists() {
        return Ok(
            "cgroup v2: nothing to prepare (the unit's Delegate=yes gives the service its cgroup)"
                .into(),
        );
    }
    let mut made = vec![];
    for c in V1_CONTROLLERS {
        let d = root.join(c);
        if !d.join("tasks").exists() {
            continue;
        }
        let g = d.join(GROUP);
        std::fs::create_dir_all(&g)?;
        std::os::unix::fs::chown(&g, Some(owner.as_raw()), Some(group.as_raw()))?;
        made.push(c);
    }
    Ok(if made.is_empty() {
        "no cgroup v1 controller is mounted: sandboxes get rlimits only".into()
    } else {
        format!(
            "cgroup v1 parents for {} given to uid {owner}",
            made.join(", ")
        )
    })
}

/// Which field of [`Groups`] a parent's groups fill.
#[derive(Debug, Clone, Copy)]
enum Slot {
    V2,
    Pids,
    Memory,
    Cpu,
    Freezer,
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
        let mut g = Groups::default();
        let mem = limits.memory_mb.saturating_mul(1024 * 1024);
        let period: u64 = 100_000;
        let quota = (cpus * period as f64).round() as u64;
        match host {
            Host::V2 { parent, .. } => {
                let d = parent.join(id);
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
                let mk = |parent: &Path| -> std::io::Result<PathBuf> {
                    let d = parent.join(id);
                    std::fs::create_dir_all(&d)?;
                    Ok(d)
                };
                if let Some(p) = pids {
                    let d = mk(p)?;
                    std::fs::write(d.join("pids.max"), limits.max_processes.to_string())?;
                    g.pids = Some(d);
                }
                if let Some(p) = memory {
                    let d = mk(p)?;
                    std::fs::write(d.join("memory.limit_in_bytes"), mem.to_string())?;
                    g.memory = Some(d);
                }
                if let Some(p) = cpu {
                    let d = mk(p)?;
                    if quota > 0 {
                        std::fs::write(d.join("cpu.cfs_period_us"), period.to_string())?;
                        std::fs::write(d.join("cpu.cfs_quota_us"), quota.to_string())?;
                    }
                    g.cpu = Some(d);
                }
                if let Some(p) = freezer {
                    g.freezer = Some(mk(p)?);
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

/// Every sandbox's groups of ours on this host, by sandbox id: under
/// `host`'s parents and the fixed ones (whoever made them).
fn all_groups(host: &Host) -> std::collections::BTreeMap<String, Groups> {
    let root = Path::new(ROOT);
    let mut parents = host.parents();
    parents.push((Slot::V2, root.join(GROUP)));
    for (slot, c) in [
        (Slot::Pids, "pids"),
        (Slot::Memory, "memory"),
        (Slot::Cpu, "cpu"),
        (Slot::Freezer, "freezer"),
    ] {
        parents.push((slot, root.join(c).join(GROUP)));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut by_id: std::collections::BTreeMap<String, Groups> = Default::default();
    for (slot, parent) in parents {
        if !seen.insert(parent.clone()) {
            continue;
        }
        for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let g = by_id
                .entry(e.file_name().to_string_lossy().into_owned())
                .or_default();
            let place = match slot {
                Slot::V2 => &mut g.v2,
                Slot::Pids => &mut g.pids,
                Slot::Memory => &mut g.memory,
                Slot::Cpu => &mut g.cpu,
                Slot::Freezer => &mut g.freezer,
            };
            *place = Some(e.path());
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
pub fn end_ownerless(host: &Host) -> Swept {
    let mut swept = Swept::default();
    for g in all_groups(host).into_values() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_group_is_read_from_the_unified_line() {
        let hybrid = "12:pids:/system.slice/a.service\n0::/system.slice/a.service/service\n";
        assert_eq!(
            own_v2_group(hybrid).as_deref(),
            Some("/system.slice/a.service/service")
        );
        assert_eq!(own_v2_group("0::/\n"), None);
        assert_eq!(own_v2_group("4:memory:/x\n"), None);
    }

    #[test]
    fn only_a_service_leaf_names_a_delegated_group() {
        assert_eq!(
            delegated_base("/system.slice/cube-adapter.service/service"),
            Some("/system.slice/cube-adapter.service")
        );
        // Started in its unit's group (systemd before 254): not used.
        assert_eq!(delegated_base("/system.slice/cube-adapter.service"), None);
        assert_eq!(delegated_base("/service"), None);
        assert_eq!(delegated_base("/user.slice/x/myservice"), None);
    }
}
