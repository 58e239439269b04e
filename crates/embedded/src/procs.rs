//! A sandbox's processes: finding them, freezing them, ending them, and
//! holding the sandbox still while the backend (as root) rewrites its files.
//!
//! Listing processes and then killing them is a race a sandbox wins: a chain
//! of processes that fork and exit stays one generation ahead of any
//! list-then-kill sweep. So whatever must end *all* of a sandbox's processes
//! first stops them from forking: the cgroup freezer (v2 or v1) stops every
//! task of the sandbox at once; without one, every process is stopped with
//! SIGSTOP, round after round, until a listing finds nothing running. Only
//! then are they killed, and what is left is checked.

use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::cgroup::Groups;
use super::launch::{self, InitInfo};

/// Why a sandbox could not be held still (`Tree::hold`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotHeld {
    #[error("the sandbox's own processes did not stop")]
    OursRunning,
    #[error("{0} process(es) of the sandbox could not be stopped")]
    Left(usize),
}

/// How many freeze-kill-check rounds [`hold`] tries before it gives up.
const HOLD_ROUNDS: usize = 10;

/// The processes of one sandbox, as the backend knows them. The async
/// methods scan `/proc` on the blocking pool.
#[derive(Debug, Clone)]
pub struct Tree {
    pub init: InitInfo,
    pub groups: Groups,
    /// Own pid namespace (the init is a namespace init, the agent its
    /// child); without, the init *is* the agent.
    pub isolated: bool,
}

impl Tree {
    /// Run a scan of `/proc` (or anything else that blocks) off the async
    /// workers.
    async fn scan<T: Send + Default + 'static>(&self, f: fn(&Tree) -> T) -> T {
        let t = self.clone();
        tokio::task::spawn_blocking(move || f(&t))
            .await
            .unwrap_or_default()
    }

    /// Whether the init still runs (same pid and start time, not a zombie).
    pub fn init_alive(&self) -> bool {
        self.init.pid != 0
            && launch::process_start_time(self.init.pid) == Some(self.init.start_time)
            && !is_zombie(self.init.pid)
    }

    /// Every host pid of the sandbox: its cgroups, plus its pid namespace
    /// (isolated) or the init's process tree (not isolated). Zombies included.
    pub fn pids(&self) -> Vec<i32> {
        let mut pids = self.groups.pids();
        if self.isolated {
            if let Some(ns) = pid_ns(self.init.pid) {
                for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                    let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok())
                    else {
                        continue;
                    };
                    if pid_ns(pid).as_ref() == Some(&ns) {
                        pids.push(pid);
                    }
                }
            }
        } else if self.init.pid != 0 {
            pids.extend(descendants(self.init.pid));
            pids.push(self.init.pid);
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Live (non-zombie) pids.
    fn live(&self) -> Vec<i32> {
        self.pids().into_iter().filter(|p| !is_zombie(*p)).collect()
    }

    /// The backend's own processes in the sandbox: the init and, isolated,
    /// the envd agent (the init's oldest child).
    fn ours(&self) -> Vec<i32> {
        let init = self.init.pid;
        let mut v = vec![init];
        if self.isolated
            && let Some(agent) = descendants(init)
                .into_iter()
                .filter(|p| parent_of(*p) == Some(init))
                .min_by_key(|p| launch::process_start_time(*p).unwrap_or(u64::MAX))
        {
            v.push(agent);
        }
        v
    }

    /// Freeze (true) or thaw (false): the cgroup freezer, else SIGSTOP or
    /// SIGCONT to every process.
    pub async fn freeze(&self, frozen: bool) -> std::io::Result<()> {
        if self.groups.can_freeze() {
            return self.groups.set_frozen(frozen).await;
        }
        if frozen {
            stop_all(self).await;
        } else {
            for pid in self.scan(Tree::pids).await {
                send(pid, Signal::SIGCONT);
            }
        }
        Ok(())
    }

    /// End every process of the sandbox and wait (up to 10 s) until they are
    /// gone. Frozen first where the host has a freezer, so that nothing forks
    /// between the listing and the kill.
    pub async fn terminate(&self, paused: bool) {
        if self.init.pid == 0
            || launch::process_start_time(self.init.pid) != Some(self.init.start_time)
        {
            return;
        }
        let frozen = self.groups.can_freeze() && self.groups.set_frozen(true).await.is_ok();
        let pids = self.scan(Tree::pids).await;
        self.groups.kill_all();
        for pid in &pids {
            send(*pid, Signal::SIGKILL);
        }
        // Frozen (v1) or stopped tasks only die once thawed.
        if frozen || paused {
            if self.groups.can_freeze() {
                let _ = self.groups.set_frozen(false).await;
            }
            for pid in &pids {
                send(*pid, Signal::SIGCONT);
            }
        }
        let mut pause = Duration::from_micros(500);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::time::Instant::now() < deadline {
            // The init dies last: the kernel ends every other process of its
            // pid namespace before the init itself becomes a zombie.
            let pids = self.scan(Tree::pids).await;
            if !self.init_alive() && pids.iter().all(|p| is_zombie(*p)) {
                return;
            }
            for pid in pids {
                send(pid, Signal::SIGKILL);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
        tracing::warn!(
            init = self.init.pid,
            "processes of a killed sandbox outlived 10 s of SIGKILL"
        );
    }

    /// Kill every process but the backend's own (init and agent) and leave
    /// those two stopped, so that nothing of the sandbox runs while the
    /// backend rewrites its files. Each round freezes the sandbox (nothing
    /// can fork), kills the rest and stops ours, thaws (the killed die, ours
    /// stop), then checks: only ours left, and every thread of them stopped.
    /// Fails, with the sandbox running again, when rounds run out.
    pub async fn hold(&self) -> Result<Held, NotHeld> {
        let ours = self.scan(Tree::ours).await;
        let mut left = vec![];
        for _ in 0..HOLD_ROUNDS {
            let frozen = self.groups.can_freeze() && self.groups.set_frozen(true).await.is_ok();
            if !frozen {
                stop_all(self).await;
            }
            for pid in self.scan(Tree::live).await {
                if ours.contains(&pid) {
                    send(pid, Signal::SIGSTOP);
                } else {
                    send(pid, Signal::SIGKILL);
                }
            }
            if frozen {
                let _ = self.groups.set_frozen(false).await;
            }
            // The killed die and ours stop within moments once thawed.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
            let mut pause = Duration::from_micros(200);
            loop {
                left = self
                    .scan(Tree::live)
                    .await
                    .into_iter()
                    .filter(|p| !ours.contains(p))
                    .collect();
                let settled = left.is_empty() && ours.iter().all(|p| stopped(*p));
                if settled {
                    return Ok(Held { ours });
                }
                // Whatever is still there at the deadline is killed again,
                // frozen, in the next round.
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(20));
            }
        }
        let held = Held { ours };
        held.release();
        Err(if left.is_empty() {
            NotHeld::OursRunning
        } else {
            NotHeld::Left(left.len())
        })
    }
}

/// The backend's processes of a sandbox, stopped by [`Tree::hold`].
#[must_use = "a held sandbox stays stopped until released"]
pub struct Held {
    ours: Vec<i32>,
}

impl Held {
    /// Let the init and agent run again.
    pub fn release(&self) {
        for pid in &self.ours {
            send(*pid, Signal::SIGCONT);
        }
    }
}

/// SIGSTOP every process, again and again, until a listing finds every one
/// stopped (or dead) and no new one (at most 200 rounds).
async fn stop_all(tree: &Tree) {
    let mut before: Vec<i32> = vec![];
    for _ in 0..200 {
        let now = tree.scan(Tree::live).await;
        for pid in &now {
            if !stopped(*pid) {
                send(*pid, Signal::SIGSTOP);
            }
        }
        if now == before && now.iter().all(|p| stopped(*p) || is_zombie(*p)) {
            return;
        }
        before = now;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The pid namespace of a host process.
fn pid_ns(pid: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn descendants(root: i32) -> Vec<i32> {
    let all: Vec<(i32, i32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter_map(|p| parent_of(p).map(|pp| (p, pp)))
        .collect();
    let mut out = vec![];
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (c, pp) in &all {
            if *pp == p && !out.contains(c) {
                out.push(*c);
                frontier.push(*c);
            }
        }
    }
    out
}

fn send(pid: i32, sig: Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// The state letter of `/proc/PID/stat` or `/proc/PID/task/TID/stat`.
fn state_of(stat_path: &str) -> Option<char> {
    let s = std::fs::read_to_string(stat_path).ok()?;
    s.get(s.rfind(')')? + 2..)?.chars().next()
}

/// Dead, or dead and waiting to be reaped (a gone pid counts as dead).
pub fn is_zombie(pid: i32) -> bool {
    state_of(&format!("/proc/{pid}/stat")).is_none_or(|c| c == 'Z' || c == 'X')
}

/// Every thread of the process is stopped (SIGSTOP or a tracer's stop).
fn stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for t in tasks.flatten() {
        let path = format!("/proc/{pid}/task/{}/stat", t.file_name().to_string_lossy());
        match state_of(&path) {
            Some('T' | 't') => any = true,
            Some(_) => return false,
            None => {}
        }
    }
    any
}
