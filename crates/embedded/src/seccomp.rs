//! The system-call filter every sandbox process runs under.
//!
//! A deny list, not an allow list: sandboxes run arbitrary toolchains, and
//! what they legitimately call changes with every compiler and runtime;
//! what they never need is short and stable. Denied calls fail with
//! `EPERM` (a program sees an ordinary permission error, not a kill);
//! `clone3` fails with `ENOSYS`, so that the C library falls back to
//! `clone`, whose flags the filter can read. On x86-64, every call of the
//! x32 ABI (a number with `__X32_SYSCALL_BIT` set) is denied, whatever
//! its number: the deny list names x86-64 numbers, and a kernel built with
//! x32 support would otherwise run `keyctl | 0x40000000` as `keyctl`.
//! The list, with reasons, is
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

/// Namespaces only `unshare` can ask for, denied there too: a time
/// namespace (the sandbox's root holds `CAP_SYS_TIME` in its own user
/// namespace, so the kernel would grant one; it is kernel code — clock
/// offsets, a remapped vDSO — no sandbox needs). `CLONE_NEWTIME` is
/// `0x80`, inside the exit-signal byte of `clone`'s flags, so `clone`
/// cannot ask for it (and matching that bit there would refuse ordinary
/// exit signals); `clone3`, which could, is `ENOSYS`.
const UNSHARE_ONLY_FLAGS: &[(&str, libc::c_int)] = &[("CLONE_NEWTIME", libc::CLONE_NEWTIME)];

/// The bit that marks a call of the x32 ABI on x86-64 (`__X32_SYSCALL_BIT`).
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// `AUDIT_ARCH_X86_64`: `EM_X86_64` (62), 64-bit, little-endian.
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;

/// The names of the denied calls (nothing outside the tests reads them
/// yet; docs/security.md lists them in prose).
#[cfg(test)]
fn denied_names() -> impl Iterator<Item = &'static str> {
    DENIED.iter().map(|(n, _)| *n).chain([
        "unshare and clone with CLONE_NEWUSER, CLONE_NEWNET or CLONE_NEWCGROUP",
        "unshare with CLONE_NEWTIME",
        "clone3 (ENOSYS)",
        "every x32 call on x86-64",
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

/// One classic-BPF instruction (`BPF_STMT`/`BPF_JUMP`); `code` is one
/// of the kernel's small opcode sums, which fit its 16 bits.
fn insn(code: u32, k: u32, jt: u8, jf: u8) -> seccompiler::sock_filter {
    seccompiler::sock_filter {
        code: u16::try_from(code).unwrap_or(u16::MAX),
        jt,
        jf,
        k,
    }
}

/// x86-64: every call whose number has the x32 bit fails with `EPERM`,
/// whatever the rest of the number (seccompiler matches whole numbers
/// only, so this is a filter of its own). The kernel hands x32 calls to
/// the filter with the x86-64 audit arch and the bit in `nr`; a call of
/// another arch is killed, as the other filters do.
fn x32_program() -> BpfProgram {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, BPF_W};
    // Offsets in `struct seccomp_data`: `int nr`, then `__u32 arch`.
    const NR: u32 = 0;
    const ARCH: u32 = 4;
    vec![
        insn(BPF_LD | BPF_W | BPF_ABS, ARCH, 0, 0),
        insn(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        insn(BPF_RET | BPF_K, libc::SECCOMP_RET_KILL_PROCESS, 0, 0),
        insn(BPF_LD | BPF_W | BPF_ABS, NR, 0, 0),
        insn(BPF_JMP | BPF_JSET | BPF_K, X32_SYSCALL_BIT, 0, 1),
        insn(
            BPF_RET | BPF_K,
            libc::SECCOMP_RET_ERRNO | (libc::EPERM as u32 & libc::SECCOMP_RET_DATA),
            0,
            0,
        ),
        insn(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW, 0, 0),
    ]
}

/// Rules that match a call whose first argument has any of `flags`.
fn flag_rules(flags: &[(&str, libc::c_int)]) -> anyhow::Result<Vec<SeccompRule>> {
    Ok(flags
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
        .collect::<Result<Vec<_>, _>>()?)
}

/// The compiled filters (the kernel runs every installed filter and takes
/// the strictest answer, so two filters give two errnos; x86-64 has a
/// third, for the x32 ABI).
pub fn programs() -> anyhow::Result<Vec<BpfProgram>> {
    let mut eperm: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    let unshare: Vec<_> = NAMESPACE_FLAGS
        .iter()
        .chain(UNSHARE_ONLY_FLAGS)
        .copied()
        .collect();
    eperm.insert(libc::SYS_clone, flag_rules(NAMESPACE_FLAGS)?);
    eperm.insert(libc::SYS_unshare, flag_rules(&unshare)?);
    let enosys = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);
    let mut v = vec![filter(eperm, libc::EPERM)?, filter(enosys, libc::ENOSYS)?];
    if arch()? == TargetArch::x86_64 {
        v.push(x32_program());
    }
    Ok(v)
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
        let want = if cfg!(target_arch = "x86_64") { 3 } else { 2 };
        assert_eq!(p.len(), want);
        assert!(p.iter().all(|p| !p.is_empty()));
        assert!(denied_names().any(|n| n == "keyctl"));
    }

    /// A classic-BPF interpreter for what the filters use: the kernel's
    /// answer to one call, as `run_filter` would give it.
    fn run(p: &[seccompiler::sock_filter], data: &[u8; 64]) -> u32 {
        use libc::{
            BPF_ABS, BPF_ALU, BPF_AND, BPF_JA, BPF_JEQ, BPF_JGE, BPF_JGT, BPF_JMP, BPF_JSET, BPF_K,
            BPF_LD, BPF_RET, BPF_W,
        };
        let (mut pc, mut a) = (0usize, 0u32);
        loop {
            let i = &p[pc];
            let code = u32::from(i.code);
            pc += 1;
            match code {
                c if c == BPF_LD | BPF_W | BPF_ABS => {
                    let o = i.k as usize;
                    a = u32::from_le_bytes(data[o..o + 4].try_into().unwrap());
                }
                c if c == BPF_ALU | BPF_AND | BPF_K => a &= i.k,
                c if c == BPF_JMP | BPF_JA => pc += i.k as usize,
                c if c & 0x07 == BPF_JMP => {
                    let hit = match code & 0xf0 {
                        x if x == BPF_JEQ => a == i.k,
                        x if x == BPF_JGT => a > i.k,
                        x if x == BPF_JGE => a >= i.k,
                        x if x == BPF_JSET => a & i.k != 0,
                        _ => panic!("jump {code:#x}"),
                    };
                    pc += usize::from(if hit { i.jt } else { i.jf });
                }
                c if c == BPF_RET | BPF_K => return i.k,
                _ => panic!("instruction {code:#x}"),
            }
        }
    }

    /// The answer of all the filters, installed in order: the kernel runs
    /// the newest first and keeps the strictest action (the first seen of
    /// equals).
    fn answer(arch: u32, nr: u32, args: &[u64]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (n, v) in args.iter().enumerate() {
            data[16 + 8 * n..24 + 8 * n].copy_from_slice(&v.to_le_bytes());
        }
        let action = |r: u32| (r & 0xffff_0000) as i32;
        let mut out = libc::SECCOMP_RET_ALLOW;
        for p in programs().unwrap().iter().rev() {
            let r = run(p, &data);
            if action(r) < action(out) {
                out = r;
            }
        }
        out
    }

    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;

    fn native() -> u32 {
        match arch().unwrap() {
            TargetArch::x86_64 => AUDIT_ARCH_X86_64,
            TargetArch::aarch64 => 183 | 0xc000_0000,
            TargetArch::riscv64 => 243 | 0xc000_0000,
        }
    }

    fn nr(n: libc::c_long) -> u32 {
        u32::try_from(n).unwrap()
    }

    #[test]
    fn the_filters_answer_as_the_table_says() {
        let ns = |f: libc::c_int| u64::from(f as u32);
        let sigchld = libc::SIGCHLD as u64;
        for (what, call, args, want) in [
            ("getpid", libc::SYS_getpid, vec![], ALLOW),
            ("keyctl", libc::SYS_keyctl, vec![], EPERM),
            ("mount", libc::SYS_mount, vec![], EPERM),
            ("clone3", libc::SYS_clone3, vec![], ENOSYS),
            ("fork-like clone", libc::SYS_clone, vec![sigchld], ALLOW),
            (
                "clone NEWUSER",
                libc::SYS_clone,
                vec![sigchld | ns(libc::CLONE_NEWUSER)],
                EPERM,
            ),
            (
                "clone NEWPID",
                libc::SYS_clone,
                vec![sigchld | ns(libc::CLONE_NEWPID)],
                ALLOW,
            ),
            (
                "unshare NEWNS",
                libc::SYS_unshare,
                vec![ns(libc::CLONE_NEWNS)],
                ALLOW,
            ),
            (
                "unshare NEWNS|NEWNET",
                libc::SYS_unshare,
                vec![ns(libc::CLONE_NEWNS | libc::CLONE_NEWNET)],
                EPERM,
            ),
            (
                "unshare NEWCGROUP, high bits set",
                libc::SYS_unshare,
                vec![0xffff_ffff_0000_0000 | ns(libc::CLONE_NEWCGROUP)],
                EPERM,
            ),
            (
                "unshare NEWTIME",
                libc::SYS_unshare,
                vec![ns(libc::CLONE_NEWTIME)],
                EPERM,
            ),
        ] {
            assert_eq!(answer(native(), nr(call), &args), want, "{what}");
        }
        // A call of another arch (a 32-bit compat call) is killed.
        assert_eq!(
            answer(0x4000_0003, nr(libc::SYS_getpid), &[]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    /// The x32 ABI: the same calls with `__X32_SYSCALL_BIT` are all
    /// refused, the harmless ones too, and x32's own numbers (512 and up).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_x32_call_is_refused() {
        for call in [
            libc::SYS_getpid,
            libc::SYS_keyctl,
            libc::SYS_bpf,
            libc::SYS_mount,
            libc::SYS_unshare,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_io_uring_setup,
            512,
            547,
        ] {
            let x32 = nr(call) | X32_SYSCALL_BIT;
            assert_eq!(answer(native(), x32, &[0, 0]), EPERM, "x32 {call}");
            // And every other number with the bit set.
            assert_eq!(answer(native(), x32 | 0x0fff_0000, &[]), EPERM);
        }
        assert_eq!(native(), AUDIT_ARCH_X86_64);
    }
}
