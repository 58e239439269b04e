//! Subordinate ids: how an unprivileged service gives each sandbox a uid
//! range of its own.
//!
//! The packaged service runs as the `cube-adapter` user, which the package
//! gives a range of subordinate uids and gids (`/etc/subuid`,
//! `/etc/subgid`). At start, before any thread, the service enters a user
//! namespace of its own where it is root (mapped to `cube-adapter`) and ids
//! 1 and up are that range, mapped by the setuid helpers `newuidmap` and
//! `newgidmap` (Debian's `uidmap`). From there the embedded backend works as
//! it does under root: each sandbox's root is a 65536-id slice of the range
//! (`Manager::id_space`), the backend may chown its sandboxes' files, and it
//! still holds no privilege on the host.

use std::path::{Path, PathBuf};

/// Ids each sandbox gets.
pub const PER_SANDBOX: u32 = 65536;

/// One `/etc/subuid` or `/etc/subgid` range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub start: u32,
    pub count: u32,
}

/// The first range of `name` (or of the numeric `id`) in a subordinate-id
/// file that holds at least two sandboxes' worth of ids (one is kept free
/// below the first sandbox).
pub fn find(text: &str, name: &str, id: u32) -> Option<Range> {
    text.lines().find_map(|l| {
        let mut f = l.trim().split(':');
        let (owner, start, count) = (f.next()?, f.next()?, f.next()?);
        if owner != name && owner != id.to_string() {
            return None;
        }
        let r = Range {
            start: start.parse().ok()?,
            count: count.parse().ok()?,
        };
        (r.count >= 2 * PER_SANDBOX - 1).then_some(r)
    })
}

fn tool(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/sbin", "/bin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Whether this process runs in a user namespace other than the host's.
pub fn in_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map")
        .map(|m| m.split_whitespace().collect::<Vec<_>>() != ["0", "0", "4294967295"])
        .unwrap_or(false)
}

/// The ids usable for sandboxes here: `(first, slots)`, the first id of
/// the first sandbox's slice and how many slices fit; None when this
/// process is not root in its user namespace, or the namespace maps fewer
/// than two slices. Under the host's root, every id is usable (`slots` is
/// None: no bound).
pub fn id_space() -> Option<(u32, Option<u32>)> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    if !in_user_namespace() {
        return Some((0, None));
    }
    let read = |f: &str| std::fs::read_to_string(f).unwrap_or_default();
    slices(&read("/proc/self/uid_map"), &read("/proc/self/gid_map"))
        .map(|slots| (PER_SANDBOX, Some(slots)))
}

/// How many sandbox slices a namespace's uid and gid maps hold: the ids
/// mapped contiguously from 1 up in both, less the first slice (0 is the
/// service itself); None when not one.
fn slices(uid_map: &str, gid_map: &str) -> Option<u32> {
    let mapped_from_one = |text: &str| -> u64 {
        let mut ranges: Vec<(u64, u64)> = text
            .lines()
            .filter_map(|l| {
                let f: Vec<u64> = l
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                match f.as_slice() {
                    [inside, _, count] => Some((*inside, *count)),
                    _ => None,
                }
            })
            .collect();
        ranges.sort();
        let mut end = 1u64;
        for (inside, count) in ranges {
            if inside <= end && inside + count > end {
                end = inside + count;
            }
        }
        end
    };
    let end = mapped_from_one(uid_map).min(mapped_from_one(gid_map));
    let slots = (end / u64::from(PER_SANDBOX)).saturating_sub(1);
    let slots = u32::try_from(slots).unwrap_or(u32::MAX);
    (slots > 0).then_some(slots)
}

/// What `enter` did.
#[derive(Debug, PartialEq, Eq)]
pub enum Entered {
    /// Root on the host already: nothing to do.
    Root,
    /// In a user namespace of its own, with this many subordinate ids.
    Mapped(u32),
    /// Left as it was, for this reason: sandboxes share its one uid.
    Unchanged(Unchanged),
}

/// Why the process stays as it was (sandboxes share its one uid and gid).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unchanged {
    #[error("entering a user namespace needs a single-threaded process")]
    Threads,
    #[error("uid {0} has no account name")]
    NoAccount(u32),
    #[error(
        "{0} has no subordinate uids and gids in /etc/subuid and /etc/subgid \
         (at least {min} each)",
        min = 2 * PER_SANDBOX - 1
    )]
    NoRanges(String),
    #[error("newuidmap and newgidmap (Debian's uidmap) are needed")]
    NoHelpers,
    #[error("no_new_privs is set (systemd: NoNewPrivileges=yes)")]
    NoNewPrivs,
    #[error(
        "newuidmap and newgidmap need {} in the bounding set (systemd: \
         CapabilityBoundingSet=)", .0.join(", ")
    )]
    Bounding(Vec<&'static str>),
    #[error("cannot create a user namespace: {0}")]
    Unshare(nix::Error),
}

/// Why the process cannot go on: it may be in a namespace of its own with
/// no ids mapped.
#[derive(Debug, thiserror::Error)]
pub enum EnterError {
    #[error("{0}")]
    System(#[from] nix::Error),
    #[error(
        "{} or {} refused to map {user}'s subordinate ids (under systemd, the \
         embedded drop-in lets them: NoNewPrivileges=no, CapabilityBoundingSet=CAP_SETUID \
         CAP_SETGID CAP_DAC_OVERRIDE CAP_SYS_ADMIN)",
        newuidmap.display(),
        newgidmap.display()
    )]
    Refused {
        newuidmap: PathBuf,
        newgidmap: PathBuf,
        user: String,
    },
}

/// What `newuidmap` and `newgidmap` (setuid root) need in the bounding set
/// to write another process's maps: CAP_SETUID, CAP_SETGID (the ids),
/// CAP_DAC_OVERRIDE (the map files are the target's) and CAP_SYS_ADMIN
/// (the kernel's condition for a map of more than one's own id). The
/// service never holds them itself; once it is in its namespace, no program
/// it runs can gain them (a host root's setuid bit means nothing where host
/// root is not mapped).
pub const HELPER_CAPS: &[(u32, &str)] = &[
    (7, "CAP_SETUID"),
    (6, "CAP_SETGID"),
    (1, "CAP_DAC_OVERRIDE"),
    (21, "CAP_SYS_ADMIN"),
];

/// Whether the setuid helpers could gain what they need here: no
/// `no_new_privs`, `HELPER_CAPS` in the bounding set.
fn helpers_can_gain_privileges() -> Result<(), Unchanged> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()))
    };
    if field("NoNewPrivs:").as_deref() == Some("1") {
        return Err(Unchanged::NoNewPrivs);
    }
    let bnd = field("CapBnd:")
        .and_then(|v| u64::from_str_radix(&v, 16).ok())
        .unwrap_or(0);
    let missing: Vec<&str> = HELPER_CAPS
        .iter()
        .filter(|(bit, _)| bnd & (1u64 << bit) == 0)
        .map(|(_, name)| *name)
        .collect();
    if !missing.is_empty() {
        return Err(Unchanged::Bounding(missing));
    }
    Ok(())
}

/// Enter a user namespace where this (unprivileged) process is root and
/// its subordinate ids are mapped from 1 up. Call single-threaded, before
/// any runtime starts. Err(why): the namespace was entered but the ids
/// could not be mapped, and the process cannot go on.
pub fn enter() -> Result<Entered, EnterError> {
    match prepare() {
        Ok(Some(p)) => p.run(),
        Ok(None) => Ok(Entered::Root),
        Err(why) => Ok(Entered::Unchanged(why)),
    }
}

struct Plan {
    name: String,
    uid: nix::unistd::Uid,
    gid: nix::unistd::Gid,
    uids: Range,
    gids: Range,
    newuidmap: PathBuf,
    newgidmap: PathBuf,
}

fn prepare() -> Result<Option<Plan>, Unchanged> {
    let uid = nix::unistd::geteuid();
    let gid = nix::unistd::getegid();
    if uid.is_root() {
        return Ok(None);
    }
    let threads = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:").map(|n| n.trim().to_string()))
        });
    if threads.as_deref() != Some("1") {
        return Err(Unchanged::Threads);
    }
    let name = nix::unistd::User::from_uid(uid)
        .ok()
        .flatten()
        .map(|u| u.name)
        .ok_or(Unchanged::NoAccount(uid.as_raw()))?;
    let read = |f: &str| std::fs::read_to_string(f).unwrap_or_default();
    let (Some(uids), Some(gids)) = (
        find(&read("/etc/subuid"), &name, uid.as_raw()),
        find(&read("/etc/subgid"), &name, gid.as_raw()),
    ) else {
        return Err(Unchanged::NoRanges(name));
    };
    let (Some(newuidmap), Some(newgidmap)) = (tool("newuidmap"), tool("newgidmap")) else {
        return Err(Unchanged::NoHelpers);
    };
    helpers_can_gain_privileges()?;
    Ok(Some(Plan {
        name,
        uid,
        gid,
        uids,
        gids,
        newuidmap,
        newgidmap,
    }))
}

impl Plan {
    fn run(&self) -> Result<Entered, EnterError> {
        use nix::sys::wait::{WaitStatus, waitpid};

        use super::sys::{self, Forked};
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let me = nix::unistd::getpid();
        let helper = match sys::fork_single_threaded()? {
            Forked::Child => {
                drop(w);
                let mut b = [0u8; 1];
                let go = matches!(nix::unistd::read(&r, &mut b), Ok(1)) && b[0] == b'g';
                let map = |tool: &Path, own: u32, range: Range| {
                    std::process::Command::new(tool)
                        .arg(me.to_string())
                        .args(["0", &own.to_string(), "1"])
                        .args(["1", &range.start.to_string(), &range.count.to_string()])
                        .status()
                        .is_ok_and(|s| s.success())
                };
                let ok = go
                    && map(&self.newuidmap, self.uid.as_raw(), self.uids)
                    && map(&self.newgidmap, self.gid.as_raw(), self.gids);
                std::process::exit(if ok { 0 } else { 1 })
            }
            Forked::Parent(p) => p,
        };
        drop(r);
        let unshared = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER);
        let _ = nix::unistd::write(&w, if unshared.is_ok() { b"g" } else { b"n" });
        drop(w);
        let mapped = matches!(waitpid(helper, None), Ok(WaitStatus::Exited(_, 0)));
        if let Err(e) = unshared {
            return Ok(Entered::Unchanged(Unchanged::Unshare(e)));
        }
        if !mapped {
            // Unmapped, in a namespace of our own: nothing here could work.
            return Err(EnterError::Refused {
                newuidmap: self.newuidmap.clone(),
                newgidmap: self.newgidmap.clone(),
                user: self.name.clone(),
            });
        }
        Ok(Entered::Mapped(self.uids.count.min(self.gids.count)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_found_by_name_or_uid_and_must_be_large_enough() {
        let text = "alice:100000:65536\ncube-adapter:1073741824:67108864\n998:5000000:200000\n";
        assert_eq!(
            find(text, "cube-adapter", 998),
            Some(Range {
                start: 1073741824,
                count: 67108864
            })
        );
        assert_eq!(
            find(text, "svc", 998),
            Some(Range {
                start: 5000000,
                count: 200000
            })
        );
        assert_eq!(find(text, "alice", 1000), None, "too small for a sandbox");
        assert_eq!(find("bad line\n:::\n", "x", 1), None);
    }

    #[test]
    fn slices_count_what_both_maps_hold_from_one_up() {
        let packaged = "         0        999          1\n         1 1073741824   67108864\n";
        assert_eq!(slices(packaged, packaged), Some(1023));
        let small = "0 999 1\n1 100000 65536\n";
        assert_eq!(slices(packaged, small), None, "one slice, and 0's");
        assert_eq!(slices("0 999 1\n", "0 999 1\n"), None);
        let two = "0 999 1\n1 100000 196607\n";
        assert_eq!(slices(two, two), Some(2));
        let gap = "0 999 1\n70000 100000 900000\n";
        assert_eq!(slices(gap, gap), None, "not contiguous from 1");
    }
}
