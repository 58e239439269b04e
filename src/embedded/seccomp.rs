//! The system-call filter every sandbox process runs under.
//!
//! A deny list, not an allow list: sandboxes run arbitrary toolchains, and
//! what they legitimately call changes with every compiler and runtime;
//! what they never need is short and stable. Denied calls fail with
//! `EPERM` (a program sees an ordinary permission error, not a kill);
//! `clone3` fails with `ENOSYS`, so that the C library falls back to
//! `clone`, whose flags the filter can read. The list, with reasons, is
//! in `docs/security.md` ("System calls"); keep the two together.
//!
//! Installed by the sandbox's agent, after it has locked the sandbox's
//! mounts in its own user namespace and before it starts its runtime, so
//! every process of the sandbox inherits it (a filter cannot be removed,
//! only narrowed) together with `no_new_privs`.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Calls a sandbox never needs: kernel keyrings, BPF and perf, kernel
/// modules and kexec, file handles that reach around the mount namespace,
/// new mounts and namespaces, io_uring, and host-wide clocks and switches.
const DENIED: &[(&str, libc::c_long)] = &[
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("open_tree", libc::SYS_open_tree),
    ("move_mount", libc::SYS_move_mount),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("setns", libc::SYS_setns),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("reboot", libc::SYS_reboot),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("syslog", libc::SYS_syslog),
    ("acct", libc::SYS_acct),
    ("quotactl", libc::SYS_quotactl),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
    #[cfg(target_arch = "x86_64")]
    ("uselib", libc::SYS_uselib),
];

/// Namespaces no sandbox process may make (`unshare` or `clone` with any
/// of these flags): a user namespace (where most unprivileged kernel
/// escapes start), a network namespace (the sandbox's root would hold
/// CAP_NET_ADMIN over it, and so reach netfilter), a cgroup namespace.
/// Pid, mount, ipc and uts namespaces stay allowed: they add no rights
/// (mounts are denied above), and jobs use a pid namespace so that what a
/// job starts ends with it.
const NAMESPACE_FLAGS: &[(&str, libc::c_int)] = &[
    ("CLONE_NEWUSER", libc::CLONE_NEWUSER),
    ("CLONE_NEWNET", libc::CLONE_NEWNET),
    ("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP),
];

/// The names of the denied calls, for docs and `status`.
pub fn denied_names() -> impl Iterator<Item = &'static str> {
    DENIED.iter().map(|(n, _)| *n).chain([
        "unshare and clone with CLONE_NEWUSER, CLONE_NEWNET or CLONE_NEWCGROUP",
        "clone3 (ENOSYS)",
    ])
}

fn arch() -> anyhow::Result<TargetArch> {
    Ok(match std::env::consts::ARCH {
        "x86_64" => TargetArch::x86_64,
        "aarch64" => TargetArch::aarch64,
        "riscv64" => TargetArch::riscv64,
        other => anyhow::bail!("no system-call filter for {other}"),
    })
}

/// One filter that answers every matching call with `errno`.
fn filter(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32) -> anyhow::Result<BpfProgram> {
    let f = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        arch()?,
    )?;
    Ok(f.try_into()?)
}

/// The compiled filters (the kernel runs every installed filter and takes
/// the strictest answer, so two filters give two errnos).
pub fn programs() -> anyhow::Result<Vec<BpfProgram>> {
    let mut eperm: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    let ns_rules = || {
        NAMESPACE_FLAGS
            .iter()
            .map(|(_, flag)| {
                let bit = *flag as u64;
                SeccompRule::new(vec![SeccompCondition::new(
                    0,
                    SeccompCmpArgLen::Qword,
                    SeccompCmpOp::MaskedEq(bit),
                    bit,
                )?])
            })
            .collect::<Result<Vec<_>, _>>()
    };
    eperm.insert(libc::SYS_clone, ns_rules()?);
    eperm.insert(libc::SYS_unshare, ns_rules()?);
    let enosys = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);
    Ok(vec![
        filter(eperm, libc::EPERM)?,
        filter(enosys, libc::ENOSYS)?,
    ])
}

/// Install the filters on the calling thread (and so on everything it
/// starts afterwards), with `no_new_privs`. Call it single-threaded.
pub fn install() -> anyhow::Result<()> {
    for p in programs()? {
        seccompiler::apply_filter(&p)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_compile_for_this_machine() {
        let p = programs().unwrap();
        assert_eq!(p.len(), 2);
        assert!(p.iter().all(|p| !p.is_empty()));
        assert!(denied_names().any(|n| n == "keyctl"));
    }
}
