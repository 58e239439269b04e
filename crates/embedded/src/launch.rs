//! Starting a sandbox: a namespaced init that runs our own envd.
//!
//! The backend runs `cube-adapter __sandbox-launch DIR` (the *launcher*),
//! which, single-threaded:
//! 1. joins the sandbox's cgroups, binds the envd unix socket (and, for a
//!    sandbox with a network namespace of its own, the egress tap's:
//!    `egress_tap.rs`) and opens the
//!    directories the sandbox will mount, and its own binary (as `O_PATH`
//!    descriptors, so the unprivileged sandbox can mount them without being
//!    able to walk the backend's private state directory);
//! 2. forks a child that unshares user, mount, pid, ipc, uts and (without
//!    internet access) network namespaces; the launcher writes the child's
//!    uid/gid maps (sandbox root = an unprivileged host uid range);
//! 3. the child forks the sandbox's init (pid 1 of the new pid namespace),
//!    which builds the sandbox's root (read-only template, private `/tmp`,
//!    `/workspace`, home, fresh `/proc`, `/dev` with its own devpts, this
//!    binary read-only at `/run/cube/mcp-gateway`: `gateway.rs`),
//!    pivots into it, sets limits, forks the envd agent (which locks the
//!    mounts in a nested user namespace, binds the egress tap's port on the
//!    sandbox's loopback and installs the system-call filter, `seccomp`,
//!    with `no_new_privs`) and then only reaps orphans;
//! 4. the launcher writes `init.json` (the init's host pid and start time)
//!    and exits. The init is re-parented to the host's init: the sandbox
//!    outlives the backend, which re-adopts it from its state directory.
//!
//! Killing the init (SIGKILL) ends every process of the sandbox.

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, open};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::resource::{Resource, setrlimit};
use nix::sys::stat::Mode;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid};
use serde::{Deserialize, Serialize};

use super::egress_tap;
use super::envd::process::{AgentEnv, Processes};
use super::gateway::{GATEWAY_DIR, GATEWAY_PATH};
use super::sys::{self, Forked};

/// How sandboxes are isolated.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// User, mount, pid, ipc, uts and network namespaces.
    Namespaces,
    /// Plain processes on the host (no isolation at all).
    None,
}

/// Limits applied to every process of a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Limits {
    pub memory_mb: u64,
    pub max_processes: u64,
    pub cpu_seconds: u64,
    pub open_files: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mb: 2048,
            max_processes: 512,
            cpu_seconds: 3600 * 24,
            open_files: 4096,
        }
    }
}

/// Everything the launcher needs, written by the backend as `spec.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LaunchSpec {
    pub id: String,
    pub hostname: String,
    pub isolation: Isolation,
    /// Template root directory (`/` for the built-in `host` template).
    pub rootfs: PathBuf,
    /// Whether `rootfs` is the host's own root (then `/home`, `/mnt`, … are
    /// hidden rather than shared).
    pub host_root: bool,
    /// Of the host's root, only the programs and libraries and a filtered
    /// `/etc` (the `minimal` template; see `MINIMAL_TOP`, `MINIMAL_ETC`).
    #[serde(default)]
    pub minimal: bool,
    pub internet: bool,
    /// Network access through pasta, filtered (`egress.rs`). None with
    /// `internet`: the host's network namespace (specs of older builds).
    #[serde(default)]
    pub egress: Option<super::egress::Egress>,
    /// The size of the sandbox's own disk (`disk.rs`), made by the backend
    /// before the launch; None: its directories are on the state directory's.
    #[serde(default)]
    pub disk_mb: Option<u64>,
    /// Host uid/gid that sandbox root maps to, and how many ids are mapped.
    pub host_uid: u32,
    pub host_gid: u32,
    pub id_count: u32,
    pub limits: Limits,
    /// Whether cgroups enforce memory (then no per-process address-space cap).
    pub cgroup_memory: bool,
    /// cgroup directories (`cgroup.procs` or `tasks` files) to join.
    pub cgroup_procs: Vec<PathBuf>,
    pub env_vars: Vec<(String, String)>,
    /// Host paths hidden from the sandbox (the appliance's state directories).
    pub mask: Vec<PathBuf>,
    /// Volumes bound into the sandbox (`volumes.rs`), after the masks.
    #[serde(default)]
    pub volumes: Vec<VolumeBind>,
    /// The backend's heartbeat file (`HEARTBEAT_FILE`), which the init
    /// watches (see `Watch`). None: no watchdog (older specs).
    #[serde(default)]
    pub heartbeat: Option<PathBuf>,
    /// envd behaves as the real one does at deadlines (see `sandbox::Faithful`).
    #[serde(default)]
    pub faithful: bool,
    /// envd stands in for this (older) version (see `sandbox::Faithful`).
    #[serde(default)]
    pub envd_version: Option<String>,
}

/// What the launcher binds: a volume's `data/` at `target`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeBind {
    pub id: String,
    pub source: PathBuf,
    pub target: PathBuf,
    pub read_only: bool,
}

impl LaunchSpec {
    /// Whether the sandbox has a network namespace of its own.
    pub fn own_netns(&self) -> bool {
        !self.internet || self.egress.is_some()
    }
}

/// Written by the launcher: who the sandbox's init is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct InitInfo {
    pub pid: i32,
    pub start_time: u64,
}

pub const SPEC_FILE: &str = "spec.json";
/// In the backend's state directory: touched while a backend runs.
pub const HEARTBEAT_FILE: &str = "heartbeat";
/// In a sandbox's directory: its idle timeout and what it does then
/// (`Lifecycle`), for its init to act on when no backend runs.
pub const LIFECYCLE_FILE: &str = "lifecycle";
/// How often a running backend touches the heartbeat.
pub const HEARTBEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// How often a sandbox's init looks at its directory and the heartbeat.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// How long past its idle timeout, counted from the last heartbeat, a
/// sandbox's init waits before it ends the sandbox itself (default of
/// `[embedded] orphan_grace_seconds`).
pub const ORPHAN_GRACE_SECS: i64 = 60;

/// Touch the heartbeat in a backend's state directory (made if missing).
pub fn beat(state_dir: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(state_dir.join(HEARTBEAT_FILE))?;
    f.set_modified(crate::clock::system_time())
}

/// A sandbox's idle timeout as its init needs it: one fixed-width line,
/// `SECONDS|- GRACE pause|kill`, written in place (the init holds the file open
/// and reads it again each time it looks; an atomic rename would leave it
/// reading the old file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    /// None: never times out.
    pub timeout_secs: Option<i64>,
    /// Pause rather than kill at the timeout.
    pub pause: bool,
    /// How long past the timeout, with no backend, the init waits.
    pub grace_secs: i64,
}

const LIFECYCLE_LEN: usize = 32;

impl Lifecycle {
    pub fn write(&self, sandbox_dir: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let t = self
            .timeout_secs
            .map_or_else(|| "-".to_string(), |t| t.to_string());
        let what = if self.pause { "pause" } else { "kill" };
        let line = format!(
            "{:<width$}\n",
            format!("{t} {} {what}", self.grace_secs),
            width = LIFECYCLE_LEN - 1
        );
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(sandbox_dir.join(LIFECYCLE_FILE))?;
        f.write_all_at(line.as_bytes(), 0)?;
        f.set_len(line.len() as u64)
    }

    /// Parse what `write` wrote; None for anything else (a torn read).
    fn parse(s: &str) -> Option<Self> {
        let mut it = s.split_whitespace();
        let timeout_secs = match it.next()? {
            "-" => None,
            n => Some(n.parse().ok()?),
        };
        let grace_secs = it.next()?.parse().ok()?;
        let pause = match it.next()? {
            "pause" => true,
            "kill" => false,
            _ => return None,
        };
        it.next().is_none().then_some(Self {
            timeout_secs,
            pause,
            grace_secs,
        })
    }
}

/// What a sandbox's init watches, opened by the launcher while it can
/// still reach the backend's private state directory: the sandbox's own
/// directory (removed: the sandbox has no owner left), the heartbeat (its
/// age: how long no backend has run) and the lifecycle file. The init ends
/// the sandbox (by exiting, which ends its pid namespace) when its
/// directory is gone, or when no backend has run for longer than its idle
/// timeout plus the grace (`Lifecycle`) and its lifecycle kills at the timeout
/// (no request can reach a sandbox while no backend runs, so it has been
/// idle all that time). A paused sandbox is frozen, init included: it stays
/// paused. One that pauses at its timeout runs on until a backend pauses it.
struct Watch {
    dir: OwnedFd,
    heartbeat: Option<OwnedFd>,
    lifecycle: Option<std::fs::File>,
}

impl Watch {
    fn open(dir: &Path, heartbeat: Option<&Path>) -> anyhow::Result<Self> {
        use anyhow::Context;
        let dir_fd = open(
            dir,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .context("open the sandbox's directory")?;
        let heartbeat =
            heartbeat.and_then(|p| open(p, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty()).ok());
        let lifecycle = std::fs::File::open(dir.join(LIFECYCLE_FILE)).ok();
        Ok(Self {
            dir: dir_fd,
            heartbeat,
            lifecycle,
        })
    }

    /// Why the sandbox should end now, if it should.
    fn verdict(&self) -> Option<String> {
        use std::os::unix::fs::FileExt;
        let st = nix::sys::stat::fstat(&self.dir).ok()?;
        if st.st_nlink == 0 {
            return Some("its state directory was removed".into());
        }
        let mut buf = [0u8; LIFECYCLE_LEN];
        let n = self.lifecycle.as_ref()?.read_at(&mut buf, 0).ok()?;
        let life = Lifecycle::parse(std::str::from_utf8(buf.get(..n)?).ok()?)?;
        let timeout = life.timeout_secs?;
        if life.pause {
            return None;
        }
        let beat = nix::sys::stat::fstat(self.heartbeat.as_ref()?)
            .ok()?
            .st_mtime;
        let now = crate::clock::system_now().unix_timestamp();
        (now - beat > timeout.saturating_add(life.grace_secs)).then(|| {
            format!(
                "no backend has run for {} s (idle timeout {timeout} s)",
                now - beat
            )
        })
    }

    /// Look every `WATCH_EVERY` from a thread of the init; exit the init
    /// (and so the sandbox) when the verdict says so.
    fn start(self) {
        let spawned = std::thread::Builder::new()
            .name("watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(WATCH_EVERY);
                    if let Some(why) = self.verdict() {
                        eprintln!("sandbox init: ending the sandbox: {why}");
                        std::process::exit(0);
                    }
                }
            });
        if let Err(e) = spawned {
            eprintln!("sandbox init: no watchdog ({e}); the backend still times the sandbox out");
        }
    }
}
pub const INIT_FILE: &str = "init.json";
/// How a launch that failed at a volume's mount point says so (the backend
/// answers 400 with the rest of the line).
pub const VOLUME_MOUNT_FAILED: &str = "cannot mount volume";
pub const SOCKET: &str = "run/envd.sock";

/// `/proc/self/fd/N/envd.sock` for a descriptor of a sandbox's run directory.
pub fn short_socket_path(run_dir: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}/envd.sock", run_dir.as_raw_fd()))
}

/// Start time of a host process (`/proc/PID/stat` field 22), to tell a live
/// init from a recycled pid.
pub fn process_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: split after the last ')'.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Entry point of `cube-adapter __sandbox-launch DIR`. Must run before any
/// thread is started. Returns the process exit code.
pub fn launcher_main(dir: &Path) -> i32 {
    sys::close_fds_from(3);
    match launch(dir) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("sandbox launch failed: {e:#}");
            1
        }
    }
}

fn launch(dir: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let spec: LaunchSpec =
        serde_json::from_slice(&std::fs::read(dir.join(SPEC_FILE)).context("read spec.json")?)
            .context("parse spec.json")?;
    for procs in &spec.cgroup_procs {
        std::fs::write(procs, format!("{}\n", std::process::id()))
            .with_context(|| format!("join cgroup {}", procs.display()))?;
    }
    let sock_path = dir.join(SOCKET);
    let _ = std::fs::remove_file(&sock_path);
    // Through the directory's descriptor: socket paths are limited to 108
    // bytes, state directories are not.
    let run = open(
        &dir.join("run"),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .context("open the sandbox's run directory")?;
    let listener = std::os::unix::net::UnixListener::bind(short_socket_path(&run))
        .context("bind envd socket")?;
    std::fs::set_permissions(
        &sock_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )?;
    // The egress tap's socket (`egress_tap.rs`), only for a sandbox with a
    // network namespace of its own: elsewhere 127.0.0.1 is the host's.
    let egress_path = dir.join(egress_tap::SOCKET);
    let _ = std::fs::remove_file(&egress_path);
    let egress = if spec.isolation == Isolation::Namespaces && spec.own_netns() {
        let l = std::os::unix::net::UnixListener::bind(egress_tap::in_dir(
            &run,
            egress_tap::SOCKET_NAME.as_ref(),
        ))
        .context("bind the egress tap's socket")?;
        std::fs::set_permissions(
            &egress_path,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )?;
        Some(l)
    } else {
        None
    };
    drop(run);

    let (ready_r, ready_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let (go_r, go_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;

    let init_pid = match spec.isolation {
        Isolation::None => match sys::fork_single_threaded()? {
            Forked::Child => {
                drop(ready_r);
                drop(go_r);
                drop(go_w);
                let _ = nix::unistd::setsid();
                let _ = nix::sys::prctl::set_dumpable(false);
                let env = agent_env(&spec, Some(dir));
                if let Err(e) = super::seccomp::install() {
                    signal_line(&ready_w, &format!("error system-call filter: {e:#}"));
                    std::process::exit(1);
                }
                signal_line(&ready_w, "ready");
                drop(ready_w);
                run_agent(listener, None, env)
            }
            Forked::Parent(child) => {
                drop(ready_w);
                let line = read_line(&ready_r)?;
                anyhow::ensure!(line == "ready", "sandbox agent failed to start: {line}");
                child
            }
        },
        Isolation::Namespaces => match sys::fork_single_threaded()? {
            Forked::Child => {
                drop(ready_r);
                drop(go_w);
                let code = match unshare_child(&spec, dir, listener, egress, &ready_w, &go_r) {
                    Ok(()) => 0,
                    Err(e) => {
                        signal_line(&ready_w, &format!("error {e:#}"));
                        1
                    }
                };
                std::process::exit(code)
            }
            Forked::Parent(child) => {
                drop(ready_w);
                drop(go_r);
                drop(listener);
                drop(egress);
                let mut reader = BufReader::new(std::fs::File::from(ready_r));
                let mut line = String::new();
                reader.read_line(&mut line)?;
                if line.trim() != "unshared" {
                    let _ = waitpid(child, None);
                    anyhow::bail!("creating namespaces failed: {}", line.trim());
                }
                write_id_maps(child, &spec).context("write uid/gid maps")?;
                signal_line(&go_w, "mapped");
                drop(go_w);
                // The child reports the init's pid and the init reports
                // "ready" on the same pipe, in either order (both race).
                let mut init: Option<i32> = None;
                let mut ready = false;
                let mut failure: Option<String> = None;
                while failure.is_none() && !(ready && init.is_some()) {
                    line.clear();
                    if reader.read_line(&mut line)? == 0 {
                        failure = Some("the sandbox's init exited during setup".into());
                        break;
                    }
                    let l = line.trim();
                    if let Some(p) = l.strip_prefix("pid ") {
                        init = Some(p.parse()?);
                    } else if l == "ready" {
                        ready = true;
                    } else {
                        failure = Some(l.trim_start_matches("error ").to_string());
                    }
                }
                let _ = waitpid(child, None);
                if let Some(f) = failure {
                    if let Some(pid) = init {
                        let _ = nix::sys::signal::kill(
                            Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                    anyhow::bail!("sandbox setup failed: {f}");
                }
                let Some(init) = init else {
                    anyhow::bail!("sandbox setup failed: no init pid")
                };
                Pid::from_raw(init)
            }
        },
    };
    let start_time =
        process_start_time(init_pid.as_raw()).context("sandbox init exited at once")?;
    let info = InitInfo {
        pid: init_pid.as_raw(),
        start_time,
    };
    let tmp = dir.join("init.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&info)?)?;
    std::fs::rename(&tmp, dir.join(INIT_FILE))?;
    Ok(())
}

struct Dirs {
    rootfs: OwnedFd,
    workspace: OwnedFd,
    tmp: OwnedFd,
    home: OwnedFd,
    /// Each of `spec.volumes`' `data/`, in order.
    volumes: Vec<OwnedFd>,
    /// This binary, bound at `GATEWAY_PATH` (`open_own_exe`).
    exe: OwnedFd,
}

fn fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn signal_line(fd: &OwnedFd, msg: &str) {
    let line = format!("{}\n", msg.replace('\n', " "));
    let _ = nix::unistd::write(fd, line.as_bytes());
}

fn read_line(fd: &OwnedFd) -> anyhow::Result<String> {
    let mut r = BufReader::new(std::fs::File::from(fd.try_clone()?));
    let mut line = String::new();
    r.read_line(&mut line)?;
    Ok(line.trim().to_string())
}

fn write_id_maps(child: Pid, spec: &LaunchSpec) -> anyhow::Result<()> {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        std::fs::write(format!("/proc/{child}/setgroups"), "deny")?;
    }
    std::fs::write(
        format!("/proc/{child}/uid_map"),
        format!("0 {} {}\n", spec.host_uid, spec.id_count),
    )?;
    std::fs::write(
        format!("/proc/{child}/gid_map"),
        format!("0 {} {}\n", spec.host_gid, spec.id_count),
    )?;
    Ok(())
}

/// In the forked child: unshare, wait for the id maps, fork the init.
fn unshare_child(
    spec: &LaunchSpec,
    dir: &Path,
    listener: std::os::unix::net::UnixListener,
    egress: Option<std::os::unix::net::UnixListener>,
    ready: &OwnedFd,
    go: &OwnedFd,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut flags = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS;
    if !spec.internet && spec.egress.is_none() {
        // With egress the init enters its network namespace itself, once
        // pasta (which stays in the host's) is started.
        flags |= CloneFlags::CLONE_NEWNET;
    }
    unshare(flags).context("unshare")?;
    // Open what the sandbox mounts now: after unshare (so the descriptors
    // name mounts of the new mount namespace, which bind mounts require) and
    // before taking the sandbox's uid (host root still owns, and so may walk,
    // the backend's private state directory).
    let opath = |p: &Path| -> anyhow::Result<OwnedFd> {
        open(
            p,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .with_context(|| format!("open {}", p.display()))
    };
    let dirs = Dirs {
        rootfs: opath(&spec.rootfs)?,
        workspace: opath(&dir.join("state/workspace"))?,
        tmp: opath(&dir.join("state/tmp"))?,
        home: opath(&dir.join("state/home"))?,
        volumes: spec
            .volumes
            .iter()
            .map(|v| opath(&v.source))
            .collect::<anyhow::Result<_>>()?,
        exe: open_own_exe()?,
    };
    let watch = Watch::open(dir, spec.heartbeat.as_deref())?;
    signal_line(ready, "unshared");
    let line = read_line(go)?;
    anyhow::ensure!(line == "mapped", "launcher did not map ids");
    nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0))
        .context("setresgid")?;
    nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0))
        .context("setresuid")?;
    if spec.id_count > 1 {
        nix::unistd::setgroups(&[]).context("setgroups")?;
    }
    match sys::fork_single_threaded()? {
        Forked::Parent(init) => {
            signal_line(ready, &format!("pid {init}"));
            Ok(())
        }
        Forked::Child => {
            let setup = init_setup(spec, &dirs);
            // The descriptors reach outside the sandbox: close them, and make
            // the init and the agent non-dumpable so the sandbox's processes
            // (same uid) can neither trace them nor open /proc/PID/fd.
            drop(dirs);
            let _ = nix::sys::prctl::set_dumpable(false);
            let code = match setup {
                Ok(()) => match lock_pipes().and_then(|p| Ok((p, sys::fork_single_threaded()?))) {
                    Ok(((to_init, from_agent, to_agent, from_init), Forked::Child)) => {
                        drop(from_agent);
                        drop(to_agent);
                        // The agent and what it runs never hold these.
                        drop(watch);
                        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
                        // Lock every mount: a nested user + mount namespace
                        // makes the mounts above un-unmountable and their
                        // read-only/nosuid flags permanent for everything the
                        // sandbox runs, whatever capabilities it holds.
                        // (Dumpable while the init writes our id maps: nothing
                        // of the sandbox runs yet.)
                        let _ = nix::sys::prctl::set_dumpable(true);
                        if unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS).is_err() {
                            std::process::exit(1);
                        }
                        signal_line(&to_init, "unshared");
                        if read_line(&from_init).ok().as_deref() != Some("mapped") {
                            std::process::exit(1);
                        }
                        let _ = nix::sys::prctl::set_dumpable(false);
                        // The egress tap's port, in the sandbox's network
                        // namespace, before anything of the sandbox runs.
                        let tap = match egress.map(egress_tap::Tap::bind).transpose() {
                            Ok(t) => t,
                            Err(e) => {
                                signal_line(
                                    &to_init,
                                    &format!(
                                        "error egress tap: bind 127.0.0.1:{}: {e}",
                                        crate::wire::EGRESS_PROXY_PORT
                                    ),
                                );
                                std::process::exit(1);
                            }
                        };
                        // The system-call filter, with no_new_privs, for
                        // the agent and everything it starts.
                        if let Err(e) = super::seccomp::install() {
                            signal_line(&to_init, &format!("error system-call filter: {e:#}"));
                            std::process::exit(1);
                        }
                        signal_line(&to_init, "sealed");
                        drop(to_init);
                        drop(from_init);
                        // This process never returns to the owners of these.
                        sys::close_inherited(ready);
                        sys::close_inherited(go);
                        run_agent(listener, tap, agent_env(spec, None))
                    }
                    Ok(((to_init, from_agent, to_agent, from_init), Forked::Parent(agent))) => {
                        drop(to_init);
                        drop(from_init);
                        drop(listener);
                        drop(egress);
                        let locked = match read_line(&from_agent) {
                            Ok(l) if l == "unshared" => write_identity_maps(agent, spec.id_count)
                                .map(|()| signal_line(&to_agent, "mapped"))
                                .map_err(|e| format!("map the agent's ids: {e}")),
                            _ => Err("the agent could not lock the sandbox's mounts".to_string()),
                        }
                        .and_then(|()| match read_line(&from_agent) {
                            Ok(l) if l == "sealed" => Ok(()),
                            Ok(l) => Err(l.trim_start_matches("error ").to_string()),
                            Err(e) => Err(format!("the agent did not start: {e}")),
                        });
                        drop(to_agent);
                        match locked {
                            Ok(()) => {
                                watch.start();
                                signal_line(ready, "ready");
                                sys::close_inherited(ready);
                                sys::close_inherited(go);
                                reap_forever(agent)
                            }
                            Err(e) => {
                                signal_line(ready, &format!("error {e}"));
                                1
                            }
                        }
                    }
                    Err(e) => {
                        signal_line(ready, &format!("error fork agent: {e}"));
                        1
                    }
                },
                Err(e) => {
                    signal_line(ready, &format!("error {e:#}"));
                    1
                }
            };
            std::process::exit(code)
        }
    }
}

/// This binary, opened in the new mount namespace to be bound at
/// `GATEWAY_PATH`: by the path `/proc/self/exe` names (the link itself
/// names a mount of the namespace the launcher started in, which a bind
/// mount does not take), checked to be the same file.
fn open_own_exe() -> anyhow::Result<OwnedFd> {
    use anyhow::Context;
    let path = std::fs::read_link("/proc/self/exe").context("read /proc/self/exe")?;
    let fd = open(&path, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())
        .with_context(|| format!("open this program, {}", path.display()))?;
    let opened = nix::sys::stat::fstat(&fd).context("stat this program")?;
    let running = nix::sys::stat::stat("/proc/self/exe").context("stat /proc/self/exe")?;
    anyhow::ensure!(
        opened.st_dev == running.st_dev && opened.st_ino == running.st_ino,
        "{} is no longer this program (replaced meanwhile?)",
        path.display()
    );
    Ok(fd)
}

/// This binary at `GATEWAY_PATH`, read-only, for the sandbox to run as
/// `mcp-gateway` (`gateway.rs`): a bind of the file (nosuid, nodev, the
/// source mount's locked flags kept) in a read-only tmpfs of its own at
/// `GATEWAY_DIR`. The sandbox can run it but neither replace it nor put
/// anything beside it: the file and its directory are mount points (no
/// unlink or rename of either) on read-only mounts, which nothing in the
/// sandbox can unmount or remount (envd's nested user namespace locks
/// them, and the system-call filter refuses every mount call).
fn bind_gateway(nr: &Path, exe: &OwnedFd) -> anyhow::Result<()> {
    use anyhow::Context;
    let in_root = |p: &str| nr.join(p.trim_start_matches('/'));
    let dir = in_root(GATEWAY_DIR);
    std::fs::create_dir(&dir)?;
    let none: Option<&str> = None;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(
        Some("tmpfs"),
        &dir,
        Some("tmpfs"),
        flags,
        Some("mode=0755,size=4k"),
    )
    .context("mount its directory")?;
    let target = in_root(GATEWAY_PATH);
    std::fs::File::create(&target)?;
    bind_ro(&fd_path(exe), &target).context("bind the binary")?;
    mount(
        none,
        &dir,
        none,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | flags,
        none,
    )
    .context("make its directory read-only")?;
    Ok(())
}

type LockPipes = (OwnedFd, OwnedFd, OwnedFd, OwnedFd);

/// Two pipes: agent → init, init → agent.
fn lock_pipes() -> nix::Result<LockPipes> {
    let (from_agent, to_init) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let (from_init, to_agent) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    Ok((to_init, from_agent, to_agent, from_init))
}

/// Map ids 1:1 into the agent's nested user namespace.
fn write_identity_maps(pid: Pid, count: u32) -> std::io::Result<()> {
    std::fs::write(format!("/proc/{pid}/uid_map"), format!("0 0 {count}\n"))?;
    std::fs::write(format!("/proc/{pid}/gid_map"), format!("0 0 {count}\n"))
}

fn agent_env(spec: &LaunchSpec, none_dir: Option<&Path>) -> AgentEnv {
    let path_map = match none_dir {
        Some(dir) => vec![
            (PathBuf::from("/workspace"), dir.join("state/workspace")),
            (PathBuf::from("/tmp"), dir.join("state/tmp")),
            (PathBuf::from("/root"), dir.join("state/home")),
        ],
        None => vec![],
    };
    AgentEnv {
        env_vars: spec.env_vars.clone(),
        run_as_self: none_dir.is_some(),
        path_map,
        faithful: spec.faithful,
        envd_version: spec
            .envd_version
            .as_deref()
            .map(|v| crate::wire::EnvdVersion::parse(Some(v))),
        own_netns: none_dir.is_none() && spec.own_netns(),
    }
}

/// pid 1 of the sandbox: reap every orphan; when the agent dies, so does the
/// sandbox (returning from pid 1 kills the namespace).
fn reap_forever(agent: Pid) -> i32 {
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == agent => return code,
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == agent => return 128 + sig as i32,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return 1,
        }
    }
}

fn run_agent(
    listener: std::os::unix::net::UnixListener,
    tap: Option<egress_tap::Tap>,
    env: AgentEnv,
) -> ! {
    let code = (|| -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(64)
            .enable_all()
            .build()?;
        rt.block_on(async move {
            if let Some(tap) = tap {
                tokio::spawn(async move {
                    if let Err(e) = tap.serve().await {
                        eprintln!("sandbox agent: egress tap: {e}");
                    }
                });
            }
            listener.set_nonblocking(true)?;
            let l = tokio::net::UnixListener::from_std(listener)?;
            super::envd::serve(l, Processes::new(env)).await
        })?;
        Ok(())
    })();
    if let Err(e) = code {
        eprintln!("sandbox agent: {e:#}");
        std::process::exit(1)
    }
    std::process::exit(0)
}

const NEW_ROOT: &str = "/tmp";

/// Build and enter the sandbox's root. Runs as pid 1 of the new namespaces.
fn init_setup(spec: &LaunchSpec, fds: &Dirs) -> anyhow::Result<()> {
    use anyhow::Context;
    if let Some(egress) = &spec.egress {
        super::egress::enter(egress).context("set up the sandbox's network")?;
    }
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .context("make mounts private")?;
    let nr = Path::new(NEW_ROOT);
    mount(
        Some("tmpfs"),
        nr,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755,size=1m"),
    )
    .context("mount new root")?;

    let special = ["proc", "sys", "dev", "tmp", "run", "workspace", "root"];
    let host_hidden = [
        "home",
        "mnt",
        "media",
        "boot",
        "lost+found",
        "srv",
        "opt/containerd",
    ];
    let rootfs = fd_path(&fds.rootfs);
    let mut entries: Vec<_> = std::fs::read_dir(&rootfs)
        .context("read template root")?
        .filter_map(Result::ok)
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let Some(name_s) = name.to_str() else {
            continue;
        };
        if special.contains(&name_s) || name_s.starts_with('.') {
            continue;
        }
        if spec.minimal && name_s != "etc" && !MINIMAL_TOP.contains(&name_s) {
            continue;
        }
        let target = nr.join(&name);
        let ft = e.file_type()?;
        if ft.is_symlink() {
            let t = std::fs::read_link(e.path())?;
            std::os::unix::fs::symlink(&t, &target)?;
        } else if ft.is_dir() {
            std::fs::create_dir(&target)?;
            if spec.host_root && host_hidden.contains(&name_s) {
                continue;
            }
            if spec.minimal && name_s == "etc" {
                minimal_etc(&e.path(), &target, spec.egress.is_some())
                    .context("build a filtered /etc")?;
                continue;
            }
            bind_ro(&e.path(), &target).with_context(|| format!("bind /{name_s}"))?;
        }
    }
    if spec.minimal {
        // Programs expect /var/tmp; it is the sandbox's own /tmp.
        std::fs::create_dir_all(nr.join("var"))?;
        std::os::unix::fs::symlink("/tmp", nr.join("var/tmp"))?;
    }
    for d in special {
        std::fs::create_dir_all(nr.join(d))?;
    }
    let rw = MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(
        Some(&fd_path(&fds.workspace)),
        &nr.join("workspace"),
        none,
        rw,
        none,
    )
    .context("bind /workspace")?;
    mount(Some(&fd_path(&fds.tmp)), &nr.join("tmp"), none, rw, none).context("bind /tmp")?;
    mount(Some(&fd_path(&fds.home)), &nr.join("root"), none, rw, none).context("bind /root")?;
    for d in ["workspace", "tmp", "root"] {
        // Bind mounts take their flags only on a remount.
        mount(none, &nr.join(d), none, rw | MsFlags::MS_REMOUNT, none)
            .with_context(|| format!("remount /{d}"))?;
    }
    // /dev/shm holds at most half the sandbox's memory: without a memory
    // cgroup its pages would otherwise count against nothing.
    setup_dev(&nr.join("dev"), (spec.limits.memory_mb / 2).max(16)).context("set up /dev")?;
    mount(
        Some("proc"),
        &nr.join("proc"),
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        none,
    )
    .context("mount /proc")?;
    let ro = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY;
    if spec.own_netns() {
        // Best effort: sysfs is optional for most tools.
        let _ = mount(Some("sysfs"), &nr.join("sys"), Some("sysfs"), ro, none);
    }
    mount(
        Some("tmpfs"),
        &nr.join("run"),
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755,size=16m"),
    )
    .context("mount /run")?;
    bind_gateway(nr, &fds.exe).with_context(|| format!("put the MCP gateway at {GATEWAY_PATH}"))?;
    if spec.egress.is_some() && !spec.minimal {
        // The template's own /etc/resolv.conf (the minimal one is written
        // in minimal_etc) gives way to pasta's forwarder, if it is a file.
        let target = nr.join("etc/resolv.conf");
        if std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_file()) {
            let src = nr.join("run/.resolv.conf");
            std::fs::write(&src, super::egress::resolv_conf())?;
            mount(Some(&src), &target, none, MsFlags::MS_BIND, none)
                .context("bind /etc/resolv.conf")?;
        }
    }
    // Hide the appliance's own files: an empty read-only tmpfs over a
    // directory, /dev/null over a file. A mask that cannot be put in place
    // fails the launch.
    for m in &spec.mask {
        let Ok(rel) = m.strip_prefix("/") else {
            anyhow::bail!("mask path {} is not absolute", m.display());
        };
        let t = nr.join(rel);
        let Ok(md) = std::fs::symlink_metadata(&t) else {
            continue;
        };
        if md.is_dir() {
            mount(
                Some("tmpfs"),
                &t,
                Some("tmpfs"),
                ro,
                Some("mode=0000,size=4k"),
            )
            .with_context(|| format!("mask {}", m.display()))?;
        } else if md.is_file() {
            mount(Some("/dev/null"), &t, none, MsFlags::MS_BIND, none)
                .with_context(|| format!("mask {}", m.display()))?;
        }
    }
    // Volumes, after the masks (a volume is bound by itself: nothing else
    // of the state directory it is in shows).
    for (v, fd) in spec.volumes.iter().zip(&fds.volumes) {
        bind_volume(nr, fd, v)
            .with_context(|| format!("{VOLUME_MOUNT_FAILED} {} at {}", v.id, v.target.display()))?;
    }

    std::fs::create_dir(nr.join(".oldroot"))?;
    nix::unistd::pivot_root(nr, &nr.join(".oldroot")).context("pivot_root")?;
    nix::unistd::chdir("/")?;
    umount2("/.oldroot", MntFlags::MNT_DETACH).context("detach old root")?;
    std::fs::remove_dir("/.oldroot")?;
    mount(
        none,
        "/",
        none,
        MsFlags::MS_REMOUNT
            | MsFlags::MS_BIND
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        none,
    )
    .context("make / read-only")?;

    nix::unistd::sethostname(&spec.hostname).context("sethostname")?;
    if !spec.internet && spec.egress.is_none() {
        sys::loopback_up().context("bring up lo")?;
    }
    let l = &spec.limits;
    setrlimit(Resource::RLIMIT_NPROC, l.max_processes, l.max_processes).context("RLIMIT_NPROC")?;
    setrlimit(Resource::RLIMIT_NOFILE, l.open_files, l.open_files).context("RLIMIT_NOFILE")?;
    setrlimit(Resource::RLIMIT_CPU, l.cpu_seconds, l.cpu_seconds).context("RLIMIT_CPU")?;
    if !spec.cgroup_memory {
        let bytes = l.memory_mb.saturating_mul(1024 * 1024);
        setrlimit(Resource::RLIMIT_AS, bytes, bytes).context("RLIMIT_AS")?;
    }
    std::env::set_current_dir("/")?;
    Ok(())
}

/// What the `minimal` template shows of the host's root, read-only: its
/// programs and libraries (on a merged-/usr host most of these are links
/// into `/usr`), and `/etc` as `MINIMAL_ETC` filters it. Not `/home`,
/// `/root`, `/var`, `/opt`, `/srv`, `/mnt`, `/boot` or any other tree.
pub const MINIMAL_TOP: &[&str] = &["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// The entries of the host's `/etc` the `minimal` template shows (a
/// trailing `*` matches a prefix): name resolution, the dynamic linker,
/// CA certificates, time zone, shells' defaults, Debian's alternatives
/// (`awk`, `java`, … are links through them) and language runtimes'
/// settings. Not `ssh`, `sudoers`, `shadow`, package managers' credentials
/// (`pip.conf`, `npmrc`, apt's auth), `machine-id`, or the host's services'
/// configuration. `passwd` and `group` are rewritten: only system accounts
/// and groups (ids below 1000, and nobody/nogroup), so the host's people's
/// names do not show.
pub const MINIMAL_ETC: &[&str] = &[
    "passwd",
    "group",
    "hosts",
    "resolv.conf",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "protocols",
    "services",
    "rpc",
    "networks",
    "ethertypes",
    "mime.types",
    "mailcap",
    "os-release",
    "lsb-release",
    "debian_version",
    "shells",
    "profile",
    "profile.d",
    "bash.bashrc",
    "environment",
    "inputrc",
    "login.defs",
    "skel",
    "terminfo",
    "alternatives",
    "ssl",
    "pki",
    "ca-certificates",
    "ca-certificates.conf",
    "crypto-policies",
    "fonts",
    "python3*",
    "perl",
    "java-*",
    "vim",
    "magic",
    "magic.mime",
    "papersize",
];

fn minimal_etc_allows(name: &str) -> bool {
    MINIMAL_ETC.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == *p,
    })
}

/// `passwd` or `group` lines with ids below 1000 (and 65534), `root` first.
fn system_accounts(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let id = line.split(':').nth(2).and_then(|f| f.parse::<u32>().ok());
        if id.is_some_and(|i| i < 1000 || i == 65534) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Fill `dst` (a directory of the new root's tmpfs) with what
/// `MINIMAL_ETC` lets through of the host's `src`.
fn minimal_etc(src: &Path, dst: &Path, egress: bool) -> anyhow::Result<()> {
    use anyhow::Context;
    if egress {
        // Names resolve through pasta's forwarder (the host's resolver may
        // be on its loopback, or a link into its /run).
        std::fs::write(dst.join("resolv.conf"), super::egress::resolv_conf())?;
    }
    let mut entries: Vec<_> = std::fs::read_dir(src)?.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let Some(name_s) = name.to_str() else {
            continue;
        };
        if !minimal_etc_allows(name_s) || (egress && name_s == "resolv.conf") {
            continue;
        }
        let target = dst.join(&name);
        if name_s == "passwd" || name_s == "group" {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let mut kept = system_accounts(&text);
            if !kept.starts_with("root:") && !kept.contains("\nroot:") {
                let root = if name_s == "passwd" {
                    "root:x:0:0:root:/root:/bin/sh\n"
                } else {
                    "root:x:0:\n"
                };
                kept.insert_str(0, root);
            }
            std::fs::write(&target, kept)?;
            continue;
        }
        let ft = e.file_type()?;
        if ft.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(e.path())?, &target)?;
        } else if ft.is_dir() {
            std::fs::create_dir(&target)?;
            bind_ro(&e.path(), &target).with_context(|| format!("bind /etc/{name_s}"))?;
        } else if ft.is_file() {
            std::fs::File::create(&target)?;
            bind_ro(&e.path(), &target).with_context(|| format!("bind /etc/{name_s}"))?;
        }
    }
    Ok(())
}

/// Bind volume `v` (its `data/`, open as `fd`) on its path in the new root
/// `nr`, making the missing directories of the path on the way: each one
/// that exists must be a directory, never a link (nothing of the sandbox
/// runs yet, so nothing changes them meanwhile). Read-only if asked;
/// nosuid and nodev always.
fn bind_volume(nr: &Path, fd: &OwnedFd, v: &VolumeBind) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::path::Component;
    let mut at = nr.to_path_buf();
    for c in v.target.components() {
        match c {
            Component::RootDir => continue,
            Component::Normal(n) => at.push(n),
            _ => anyhow::bail!("the path is not plain"),
        }
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                anyhow::bail!("the path goes through a symbolic link of the template")
            }
            Ok(m) if m.is_dir() => {}
            Ok(_) => anyhow::bail!("the path goes through a file of the template"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir(&at)
                .context(
                    "no mount point can be made there (a read-only directory of the \
                     template? mount volumes under /mnt, /workspace or a new top-level \
                     directory)",
                )?,
            Err(e) => return Err(e.into()),
        }
    }
    bind_with(&fd_path(fd), &at, v.read_only)
}

/// Bind a directory read-only, keeping the source mount's locked flags
/// (a user namespace may not clear nosuid/nodev/noexec/atime flags).
fn bind_ro(src: &Path, dst: &Path) -> anyhow::Result<()> {
    bind_with(src, dst, true)
}

/// Bind a directory and every mount below it (nosuid, nodev; read-only if
/// asked), keeping each mount's locked flags.
///
/// The bind is recursive: in the sandbox's user namespace the host's mounts
/// below `src` (a partition on `/usr/local`, a tmpfs below `/var`, a
/// bind-mounted file in `/etc`, a sandbox's loop-mounted disk) are locked
/// to their parent, and binding the parent alone fails with `EINVAL`. The
/// flags are then set on all of them at once (`mount_setattr`, Linux 5.12
/// and later), or one by one on older kernels, so that nothing below a
/// read-only tree is writable.
fn bind_with(src: &Path, dst: &Path, read_only: bool) -> anyhow::Result<()> {
    use anyhow::Context;
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    let none: Option<&str> = None;
    mount(
        Some(src),
        dst,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )?;
    let mut attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    if read_only {
        attrs |= MOUNT_ATTR_RDONLY;
    }
    let setattr = if std::env::var_os(NO_MOUNT_SETATTR_ENV).is_some() {
        Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
    } else {
        sys::mount_setattr_recursive(dst, attrs)
    };
    match setattr {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            for m in mounts_at_or_below(dst)? {
                remount_keeping_locked(&m, read_only)
                    .with_context(|| format!("remount {}", m.display()))?;
            }
            Ok(())
        }
        Err(e) => Err(anyhow::Error::from(e).context("set the mounts' flags")),
    }
}

/// Set, the launcher takes the path of kernels without `mount_setattr`
/// (before 5.12) on any kernel: for tests of that path.
pub const NO_MOUNT_SETATTR_ENV: &str = "CUBE_ADAPTER_NO_MOUNT_SETATTR";

/// The mount points at `dir` and below it in this mount namespace, parents
/// before their children (`/proc/self/mountinfo`'s order).
pub fn mounts_at_or_below(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| p.starts_with(dir))
        .collect())
}

/// A path as mountinfo writes it: space, tab, newline and backslash as
/// three octal digits after a backslash.
fn unescape_mountinfo(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest
            .get(i + 1..i + 4)
            .and_then(|d| u8::from_str_radix(d, 8).ok());
        match code {
            Some(c) => {
                out.push(char::from(c));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Remount one bind mount nosuid, nodev (and read-only if asked), keeping
/// the flags its source has (a user namespace may not clear them). A mount
/// the sandbox's root cannot reach is left as it is: no process of the
/// sandbox, which has no more rights than its root, can reach it either.
fn remount_keeping_locked(at: &Path, read_only: bool) -> anyhow::Result<()> {
    use nix::sys::statvfs::{FsFlags, statvfs};
    let f = match statvfs(at) {
        Ok(st) => st.flags(),
        Err(nix::errno::Errno::EACCES) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    for (fs, ms) in [
        (FsFlags::ST_RDONLY, MsFlags::MS_RDONLY),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if f.contains(fs) {
            flags |= ms;
        }
    }
    let none: Option<&str> = None;
    mount(none, at, none, flags, none)?;
    Ok(())
}

fn setup_dev(dev: &Path, shm_mb: u64) -> anyhow::Result<()> {
    let none: Option<&str> = None;
    mount(
        Some("tmpfs"),
        dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0755,size=64k"),
    )?;
    for n in ["null", "zero", "full", "random", "urandom", "tty"] {
        let t = dev.join(n);
        std::fs::File::create(&t)?;
        mount(
            Some(&Path::new("/dev").join(n)),
            &t,
            none,
            MsFlags::MS_BIND,
            none,
        )?;
    }
    let pts = dev.join("pts");
    std::fs::create_dir(&pts)?;
    mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    std::os::unix::fs::symlink("pts/ptmx", dev.join("ptmx"))?;
    let shm = dev.join("shm");
    std::fs::create_dir(&shm)?;
    mount(
        Some("tmpfs"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(format!("mode=1777,size={shm_mb}m").as_str()),
    )?;
    for (l, t) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(t, dev.join(l))?;
    }
    Ok(())
}

/// Why a sandbox's namespaces cannot be made here.
#[derive(Debug, thiserror::Error)]
pub enum NoNamespaces {
    /// The probe said why (`probe_main`'s message).
    #[error("{0}")]
    Refused(String),
    #[error("cannot run the namespace probe: {0}")]
    Run(#[source] std::io::Error),
}

/// Probe whether this host lets us create the namespaces a sandbox needs:
/// run a throw-away child that unshares them and maps root.
pub fn probe_namespaces_with(launcher: &Path) -> Result<(), NoNamespaces> {
    let out = std::process::Command::new(launcher)
        .arg("__probe-namespaces")
        .output();
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(NoNamespaces::Refused(
            String::from_utf8_lossy(&o.stderr).trim().to_string(),
        )),
        Err(e) => Err(NoNamespaces::Run(e)),
    }
}

/// Entry point of `__probe-namespaces` (single-threaded).
pub fn probe_main() -> i32 {
    let flags = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWNET;
    match unshare(flags) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!(
                "cannot create user, mount, pid, ipc, uts and network namespaces ({e}); \
                 check kernel.unprivileged_userns_clone / user.max_user_namespaces, \
                 seccomp or container restrictions, or set isolation = \"none\" to run unisolated"
            );
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_lines_have_one_width_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LIFECYCLE_FILE);
        for l in [
            Lifecycle {
                timeout_secs: Some(300),
                pause: false,
                grace_secs: 60,
            },
            Lifecycle {
                timeout_secs: None,
                pause: true,
                grace_secs: 1,
            },
            Lifecycle {
                timeout_secs: Some(i64::from(i32::MAX)),
                pause: false,
                grace_secs: 60,
            },
        ] {
            // Written over a longer line, in place: nothing of it is left.
            l.write(dir.path()).unwrap();
            let s = std::fs::read_to_string(&path).unwrap();
            assert_eq!(s.len(), LIFECYCLE_LEN, "{s:?}");
            assert_eq!(Lifecycle::parse(&s), Some(l));
        }
        for torn in [
            "",
            "300",
            "300 60",
            "300 60 stop",
            "x 60 kill",
            "300 60 kill more",
        ] {
            assert_eq!(Lifecycle::parse(torn), None, "{torn:?}");
        }
    }
}
