//! The escape battery: what code inside an embedded sandbox tries, as an
//! attacker would, and must not get (docs/security.md). Each test runs the
//! attempt inside a real sandbox and checks the kernel's answer.

use serde_json::json;

use crate::kit::{MB, TestBackend, sh};

/// `syscall(nr, args…)` from Python's ctypes inside the sandbox: prints
/// `NAME RESULT ERRNO` per call.
fn syscalls(calls: &[(&str, libc::c_long, &[i64])]) -> String {
    let mut py = String::from(
        "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\nl.syscall.restype = ctypes.c_long\n",
    );
    for (name, nr, args) in calls {
        let args: Vec<String> = args.iter().map(|a| format!("ctypes.c_long({a})")).collect();
        py.push_str(&format!(
            "ctypes.set_errno(0); r = l.syscall({nr}{}{}); print('{name}', r, ctypes.get_errno())\n",
            if args.is_empty() { "" } else { ", " },
            args.join(", ")
        ));
    }
    format!("/usr/bin/python3 - <<'EOF'\n{py}EOF")
}

/// Every sandbox process runs with `no_new_privs` under the system-call
/// filter; the calls it denies fail with EPERM (clone3 with ENOSYS, so the
/// C library falls back to a clone the filter can read), while ordinary
/// processes, threads and pipes keep working.
#[tokio::test]
async fn sandboxes_run_under_the_system_call_filter() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let out = t
        .client
        .run(
            &sb,
            &sh("grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status"),
            MB,
        )
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "NoNewPrivs:\t1\nSeccomp:\t2\n"
    );

    // KEYCTL_GET_KEYRING_ID of the session keyring (which an unfiltered
    // process gets), a BPF map, a perf counter, userfaultfd, io_uring, a
    // file handle, a mount, a namespace switch, a module, the clock.
    let ns = (libc::CLONE_NEWUSER | libc::CLONE_NEWNS) as i64;
    let calls: &[(&str, libc::c_long, &[i64])] = &[
        ("keyctl", libc::SYS_keyctl, &[0, -3, 1]),
        ("add_key", libc::SYS_add_key, &[0, 0, 0, 0, 0]),
        ("bpf", libc::SYS_bpf, &[0, 0, 0]),
        (
            "perf_event_open",
            libc::SYS_perf_event_open,
            &[0, 0, -1, -1, 0],
        ),
        ("userfaultfd", libc::SYS_userfaultfd, &[0]),
        ("io_uring_setup", libc::SYS_io_uring_setup, &[1, 0]),
        ("open_by_handle_at", libc::SYS_open_by_handle_at, &[0, 0, 0]),
        ("mount", libc::SYS_mount, &[0, 0, 0, 0, 0]),
        ("setns", libc::SYS_setns, &[0, 0]),
        ("unshare", libc::SYS_unshare, &[ns]),
        (
            "unshare_newnet",
            libc::SYS_unshare,
            &[libc::CLONE_NEWNET as i64],
        ),
        (
            "clone_newns",
            libc::SYS_clone,
            &[ns | libc::SIGCHLD as i64, 0, 0, 0, 0],
        ),
        ("init_module", libc::SYS_init_module, &[0, 0, 0]),
        ("clock_settime", libc::SYS_clock_settime, &[0, 0]),
        ("clone3", libc::SYS_clone3, &[0, 0]),
    ];
    let out = t.client.run(&sb, &sh(&syscalls(calls)), MB).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.exit_code,
        0,
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, _, _) in calls {
        let want = if *name == "clone3" {
            libc::ENOSYS
        } else {
            libc::EPERM
        };
        assert!(
            text.lines().any(|l| l == format!("{name} -1 {want}")),
            "{name} should fail with errno {want}:\n{text}"
        );
    }

    // What programs do all day still works: fork and exec, threads, pipes,
    // a PTY-less shell pipeline, and the tools that use user namespaces
    // say so plainly.
    let out = t
        .client
        .run(
            &sb,
            &sh("/usr/bin/python3 -c 'import threading, subprocess; t = threading.Thread(target=print, args=(\"thread\",)); t.start(); t.join(); print(subprocess.run([\"echo\", \"child\"], capture_output=True, text=True).stdout.strip())' | sort; unshare -U true 2>&1"),
            MB,
        )
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("child\nthread\n"), "{text}");
    assert!(text.contains("Operation not permitted"), "{text}");
    t.client.kill(&sb.id).await.unwrap();
}

/// x86-64: a call of the x32 ABI (the number with `__X32_SYSCALL_BIT`,
/// `0x40000000`) is refused with EPERM whatever it is, so that a kernel
/// with x32 enabled cannot be asked for `keyctl` under another number.
/// On a kernel without x32 (most distributions' default) an unfiltered
/// x32 call fails with ENOSYS instead: EPERM is the filter's answer, so
/// the test tells a fixed filter from the old one on either kind of kernel.
/// `unshare(CLONE_NEWTIME)` is refused too (the sandbox's root could make
/// a time namespace otherwise).
#[cfg(target_arch = "x86_64")]
#[tokio::test]
async fn x32_calls_and_time_namespaces_are_refused() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    const X32: libc::c_long = 0x4000_0000;
    let calls: &[(&str, libc::c_long, &[i64])] = &[
        ("x32_getpid", X32 | libc::SYS_getpid, &[]),
        ("x32_keyctl", X32 | libc::SYS_keyctl, &[0, -3, 1]),
        ("x32_bpf", X32 | libc::SYS_bpf, &[0, 0, 0]),
        (
            "x32_unshare",
            X32 | libc::SYS_unshare,
            &[libc::CLONE_NEWUSER as i64],
        ),
        ("x32_own_number", X32 | 512, &[0, 0, 0, 0]),
        (
            "unshare_newtime",
            libc::SYS_unshare,
            &[libc::CLONE_NEWTIME as i64],
        ),
    ];
    let out = t.client.run(&sb, &sh(&syscalls(calls)), MB).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.exit_code,
        0,
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, _, _) in calls {
        assert!(
            text.lines()
                .any(|l| l == format!("{name} -1 {}", libc::EPERM)),
            "{name} should fail with EPERM:\n{text}"
        );
    }
    // The plain call still works (the bit, not the call, is refused).
    let out = t
        .client
        .run(
            &sb,
            &sh(&syscalls(&[("getpid", libc::SYS_getpid, &[])])),
            MB,
        )
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("getpid ") && !text.contains(" -1 "),
        "{text}"
    );
    t.client.kill(&sb.id).await.unwrap();
}

/// Whether a host process lives (and is not a zombie).
fn alive(pid: i32) -> bool {
    !crate::kit::backend::is_zombie(pid)
}

/// Wait up to `secs` for `pid` to end; whether it did.
async fn ends_within(pid: i32, secs: u64) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    !alive(pid)
}

/// No orphans: a sandbox's own init ends it when no backend has run for
/// its idle timeout plus the grace (its lifecycle kills at the timeout),
/// with no backend to do it; one that never times out, or pauses at its
/// timeout, lives on; and one whose state directory is removed ends at
/// once, backend or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_end_themselves_when_orphaned() {
    use cube_adapter::cube::wire::{CreateSandbox, Lifecycle};
    let t = TestBackend::start_with(|s| s.orphan_grace_secs = 1).await;
    let create = |timeout: Option<i64>, on_timeout: &str| CreateSandbox {
        template_id: "host".into(),
        timeout,
        lifecycle: Some(Lifecycle {
            on_timeout: Some(on_timeout.into()),
            auto_resume: Some(false),
        }),
        ..Default::default()
    };
    let kill = t.sandbox_with(create(Some(2), "kill")).await;
    let pause = t.sandbox_with(create(Some(2), "pause")).await;
    let never = t.sandbox_with(create(None, "kill")).await;
    let init = |sb: &cube_adapter::cube::SandboxAddr| t.backend.manager.init_pid(&sb.id).unwrap();
    let (k, p, n) = (init(&kill), init(&pause), init(&never));
    // Busy, so that only its own init can end it: a loop that ignores
    // SIGTERM, in its own session.
    for sb in [&kill, &pause, &never] {
        let out = t
            .client
            .run(sb, &sh("setsid sh -c 'trap \"\" TERM; while :; do sleep 1; done' >/dev/null 2>&1 & echo up"), MB)
            .await
            .unwrap();
        assert_eq!(out.stdout, b"up\n");
    }
    t.stop_upkeep();
    // Heartbeat ≤ 5 s old, timeout 2 s, grace 1 s, looked at every 5 s.
    assert!(
        ends_within(k, 30).await,
        "the orphan that kills at its timeout ended itself"
    );
    assert!(alive(p) && alive(n), "the others live on");
    let ns = std::fs::read_link(format!("/proc/{n}/ns/pid")).unwrap();
    assert!(crate::kit::pids_in_ns(&ns).len() >= 3, "its processes too");

    // Its state directory removed (as a temporary directory is): it ends
    // itself, everything in it with it.
    let dir = t.dir.path().join("embedded/sandboxes").join(&never.id);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        ends_within(n, 20).await,
        "the sandbox whose directory is gone ended itself"
    );
    // (The kernel kills the rest of a pid namespace when its init ends;
    // they leave /proc as they are reaped, not all at that instant.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !crate::kit::pids_in_ns(&ns).is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        crate::kit::pids_in_ns(&ns).is_empty(),
        "nothing of it is left"
    );
    assert!(
        alive(p),
        "the one that pauses at its timeout waits for a backend"
    );
}

/// An operator finds the sandboxes a service left (they outlive it by
/// design) and ends them: `sandboxes list` with the service running or
/// stopped, `sandboxes kill` only once it is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_of_a_stopped_service_are_listed_and_killed() {
    let mut s = crate::kit::Server::start().await;
    let lease = s.acquire(&s.admin, "left-behind").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "echo $$"}),
        )
        .await;
    assert_eq!(st, reqwest::StatusCode::OK, "{v}");

    let out = s.cli(&["sandboxes", "list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let listed: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["state"], "running");
    let pid = listed[0]["init_pid"].as_i64().unwrap() as i32;
    let id = listed[0]["sandbox_id"].as_str().unwrap().to_string();

    let out = s.cli(&["sandboxes", "kill", "--all"]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "refused while the service runs: {out:?}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("running"),
        "{out:?}"
    );
    assert!(alive(pid));

    s.halt().await;
    assert!(alive(pid), "sandboxes outlive the service");
    let out = s.cli(&["sandboxes", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&id) && text.contains("running"), "{text}");
    let out = s.cli(&["sandboxes", "kill", &id[..8]]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("killed {id}\n")
    );
    assert!(!alive(pid), "its init is gone");
    let out = s.cli(&["sandboxes", "list", "--json"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "", "{out:?}");
    let out = s.cli(&["sandboxes", "kill", "deadbeefcafe"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}

/// The default template (`minimal`) shows of the host only its programs,
/// libraries and a filtered `/etc`: no `/home`, `/root`, `/var`, `/opt`,
/// `/srv` or other tree of the host, no host secrets or people in `/etc`;
/// and programs still run (the dynamic linker, Debian's alternatives,
/// name resolution). `host` shows more, by the operator's choice only.
#[tokio::test]
async fn the_default_template_shows_programs_not_the_host() {
    // A file of the host's, somewhere a sandbox of `host` can read it.
    let marker_dir = tempfile::Builder::new()
        .prefix("cube-escape-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let marker = marker_dir.path().join("secret.txt");
    std::fs::write(&marker, "host data\n").unwrap();
    std::fs::set_permissions(
        marker_dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::set_permissions(&marker, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let t = TestBackend::start().await;
    let minimal = t
        .sandbox_with(cube_adapter::cube::wire::CreateSandbox {
            template_id: "minimal".into(),
            ..Default::default()
        })
        .await;
    let look = format!(
        "ls -A /; echo ---; ls -A /etc | tr '\\n' ' '; echo; echo ---; \
         cut -d: -f3 /etc/passwd | sort -n | tr '\\n' ' '; echo; echo ---; \
         cat {} 2>&1; ls /var/lib 2>&1; echo ---; \
         awk 'BEGIN {{ print \"awk works\" }}'; /usr/bin/python3 -c 'print(\"python works\")'; \
         getent hosts localhost | head -n 1; id -un; echo tmp > /var/tmp/x && cat /tmp/x",
        marker.display()
    );
    let out = t.client.run(&minimal, &sh(&look), MB).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let parts: Vec<&str> = text.split("---\n").collect();
    assert_eq!(
        parts.len(),
        5,
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let top: Vec<&str> = parts[0].lines().collect();
    for hidden in ["home", "opt", "srv", "mnt", "boot", "media"] {
        assert!(!top.contains(&hidden), "/{hidden} shows: {top:?}");
    }
    assert!(top.contains(&"usr") && top.contains(&"etc"), "{top:?}");
    let etc = parts[1];
    for hidden in [" shadow ", " sudoers ", " ssh ", " machine-id ", " apt "] {
        assert!(
            !format!(" {etc}").contains(hidden),
            "/etc{hidden}shows: {etc}"
        );
    }
    assert!(
        etc.contains("passwd") && etc.contains("resolv.conf"),
        "{etc}"
    );
    for uid in parts[2].split_whitespace() {
        let uid: u32 = uid.parse().unwrap();
        assert!(
            uid < 1000 || uid == 65534,
            "a person's account shows: {}",
            parts[2]
        );
    }
    assert!(
        parts[3].contains("No such file"),
        "the host's /var shows: {}",
        parts[3]
    );
    assert!(!parts[3].contains("host data"), "{}", parts[3]);
    let works = parts[4];
    for w in ["awk works", "python works", "localhost", "root\n", "tmp\n"] {
        assert!(works.contains(w), "{w:?} missing: {works}");
    }

    // `host`, an operator's explicit choice, shows the host's /var.
    let host = t.sandbox().await;
    let out = t
        .client
        .run(&host, &sh(&format!("cat {}", marker.display())), MB)
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "host data\n");
}

/// A tiny root filesystem: bash and the libraries it links, and a file
/// naming the template, as an uncompressed tar (what `mmdebstrap` makes).
pub(crate) fn tiny_rootfs_tar(dir: &std::path::Path) -> std::path::PathBuf {
    let root = dir.join("tiny");
    let ldd = std::process::Command::new("ldd")
        .arg("/bin/bash")
        .output()
        .unwrap();
    let mut files = vec![std::path::PathBuf::from("/bin/bash")];
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        if let Some(p) = line.split_whitespace().find(|w| w.starts_with('/')) {
            files.push(p.into());
        }
    }
    for f in &files {
        let to = root.join(f.strip_prefix("/").unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(f, &to).unwrap();
    }
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/template-name"), "tiny\n").unwrap();
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
    let tar = dir.join("tiny.tar");
    let mut b = tar::Builder::new(std::fs::File::create(&tar).unwrap());
    b.follow_symlinks(false);
    b.append_dir_all(".", &root).unwrap();
    b.finish().unwrap();
    tar
}

/// `cube-adapter template add NAME --rootfs FILE.tar` imports a root
/// filesystem that a running service offers at once: a profile naming it
/// gets sandboxes that see that root, not the host's; a template in use
/// cannot be removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_root_filesystem_is_a_template() {
    let s = crate::kit::Server::start_with(|c| {
        if let Some(p) = c.profiles.get_mut("offline-code") {
            p.template = "tiny".into();
        }
    })
    .await;
    let tar = tiny_rootfs_tar(s.dir.path());
    let cli = |args: &[&str]| s.cli(&[&["template"], args].concat());
    let out = cli(&["add", "minimal", "--rootfs", tar.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "a built-in name: {out:?}");
    let out = cli(&["add", "tiny", "--rootfs", tar.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("imported template tiny"),
        "{out:?}"
    );
    let out = cli(&["list"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("tiny "),
        "{out:?}"
    );

    let lease = s.acquire(&s.admin, "tiny").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "echo \"$(< /etc/template-name)\"; [ -e /usr/bin/python3 ] && echo host || echo own-root"}),
        )
        .await;
    assert_eq!(st, reqwest::StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "tiny\nown-root\n", "{v}");

    let out = cli(&["remove", "tiny"]);
    assert_eq!(out.status.code(), Some(1), "in use: {out:?}");
    let (st, _) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, reqwest::StatusCode::OK);
    let out = cli(&["remove", "tiny"]);
    assert!(out.status.success(), "{out:?}");
}

/// The numbers on the first line of a command's output (`df` sizes).
fn first_line_numbers(text: &str) -> Vec<u64> {
    text.lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect()
}

/// Memory-backed file systems are bounded: `/dev/shm` holds at most half
/// the sandbox's memory and `/run` 16 MiB, so filling them ends in ENOSPC
/// inside the sandbox, not in the host's memory.
#[tokio::test]
async fn shared_memory_and_run_are_bounded() {
    let t = TestBackend::start_with(|s| s.limits.memory_mb = 64).await;
    let sb = t.sandbox().await;
    let out = t
        .client
        .run(
            &sb,
            &sh(
                "df -m --output=size /dev/shm /run | tail -n +2 | tr -s ' \\n' ' '; echo; \
                 head -c 40000000 /dev/zero > /dev/shm/fill; echo shm=$?; rm -f /dev/shm/fill; \
                 head -c 20000000 /dev/zero > /run/fill 2>&1; echo run=$?",
            ),
            MB,
        )
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let sizes = first_line_numbers(&text);
    assert_eq!(sizes, vec![32, 16], "{text}");
    assert!(text.contains("shm=1") && text.contains("run=1"), "{text}");
}

/// A sandbox fills only its own disk: `/workspace`, `/tmp` and `/root`
/// share one file system of the size asked for, filling it is "No space
/// left on device" inside, the host's disk gives it no more than that, the
/// next sandbox is made as usual, and a killed sandbox leaves no mount or
/// loop device behind. A backend started in another mount namespace (a new
/// service process) mounts the same disk again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_fills_only_its_own_disk() {
    use std::os::unix::fs::MetadataExt;
    let t = TestBackend::start().await;
    let sb = t
        .sandbox_with(cube_adapter::cube::wire::CreateSandbox {
            template_id: "minimal".into(),
            disk_size_mb: Some(64),
            ..Default::default()
        })
        .await;
    let out = t
        .client
        .run(
            &sb,
            &sh(
                "df -m --output=size /workspace /tmp /root | tail -n +2 | tr -s ' \\n' ' '; echo; \
                 echo kept > /workspace/kept; \
                 head -c 100000000 /dev/zero 2>&1 > /workspace/fill; echo ws=$?; \
                 head -c 1000000 /dev/zero > /root/more 2>&1; echo root=$?",
            ),
            MB,
        )
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let sizes = first_line_numbers(&text);
    assert_eq!(sizes.len(), 3, "{text}");
    assert!(sizes.iter().all(|m| (50..=64).contains(m)), "{text}");
    assert!(text.contains("ws=1"), "{text}");
    assert!(text.contains("No space left on device"), "{text}");
    assert!(text.contains("root=1"), "the same disk: {text}");

    let dir = t.dir.path().join("embedded/sandboxes").join(&sb.id);
    let img = dir.join(cube_adapter::embedded::disk::IMAGE);
    let used = std::fs::metadata(&img).unwrap().blocks() * 512;
    assert!(
        used <= 64 * 1024 * 1024,
        "the host's disk gave {used} bytes"
    );
    let other = t.sandbox().await;
    let out = t
        .client
        .run(
            &other,
            &sh("echo fine > /workspace/f && cat /workspace/f"),
            MB,
        )
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "fine\n");

    // A new mount namespace does not see the host's mount of the disk: the
    // backend mounts the same loop device again, and the files are there.
    cube_adapter::embedded::disk::release(&dir);
    assert!(!dir.join("state/workspace/kept").exists());
    cube_adapter::embedded::disk::remount(&dir).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("state/workspace/kept")).unwrap(),
        "kept\n"
    );

    let canonical = img.canonicalize().unwrap();
    t.client.kill(&sb.id).await.unwrap();
    let mounted = |p: &std::path::Path| {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(p.to_str().unwrap()))
    };
    assert!(!mounted(&dir.join("state")), "unmounted");
    assert!(!dir.exists(), "removed");
    let mut attached = true;
    for _ in 0..100 {
        attached = std::fs::read_dir("/sys/block").unwrap().flatten().any(|e| {
            std::fs::read_to_string(e.path().join("loop/backing_file"))
                .is_ok_and(|b| b.trim().starts_with(canonical.to_str().unwrap()))
        });
        if !attached {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(!attached, "the loop device detached");
}

/// Profiles size their sandboxes' disks: `disk_mb`, else `[embedded]
/// disk_mb` (4 GiB by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiles_size_the_disk() {
    let s = crate::kit::Server::start_with(|c| {
        let small = cube_adapter::config::Profile {
            disk_mb: 32,
            ..Default::default()
        };
        c.profiles.insert("small".into(), small);
    })
    .await;
    let mut sizes = vec![];
    for profile in ["small", "offline-code"] {
        let out = s
            .run_in_profile(profile, "df -m --output=size /workspace | tail -n 1")
            .await;
        sizes.push(out.trim().parse::<u64>().unwrap());
    }
    assert!((20..=32).contains(&sizes[0]), "{sizes:?}");
    assert!((3800..=4096).contains(&sizes[1]), "{sizes:?}");
}

/// The attempts an agent's code makes from inside, in a sandbox of each
/// built-in template: each must fail. The backend's own state (a secret
/// beside it, another sandbox's files), the host's processes, its loopback
/// (the backend listens there), raw sockets, device nodes, the init's
/// memory and kernel settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attacks_from_inside_a_sandbox_fail() {
    let t = TestBackend::start().await;
    // A secret of the appliance's, in the state directory the backend
    // masks (as `serve` masks its own).
    let secret = t.dir.path().join("secret.key");
    std::fs::write(&secret, "appliance secret\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let port = t.url.rsplit(':').next().unwrap().to_string();
    let other = t.sandbox().await;
    t.client
        .run(&other, &sh("echo other-sandbox > /workspace/theirs"), MB)
        .await
        .unwrap();
    let theirs = t
        .dir
        .path()
        .join("embedded/sandboxes")
        .join(&other.id)
        .join("state/workspace/theirs");
    assert!(
        theirs.exists(),
        "the other sandbox's file is where the test looks"
    );

    for template in ["minimal", "host"] {
        let sb = t
            .sandbox_with(cube_adapter::cube::wire::CreateSandbox {
                template_id: template.into(),
                ..Default::default()
            })
            .await;
        let attempts: &[(&str, String)] = &[
            ("appliance secret", format!("cat {} 2>&1", secret.display())),
            ("other sandbox", format!("cat {} 2>&1", theirs.display())),
            ("host processes", "ls /proc | grep -c '^[0-9]'".into()),
            ("host init", "tr '\\0' ' ' < /proc/1/cmdline; echo".into()),
            ("backend port", format!("(echo > /dev/tcp/127.0.0.1/{port}) 2>&1 && echo CONNECTED")),
            ("raw socket", "/usr/bin/python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)' 2>&1 | tail -n 1".into()),
            ("device node", "mknod /tmp/disk b 8 0 2>&1; mknod /workspace/disk b 8 0 2>&1".into()),
            ("init memory", "cat /proc/1/mem 2>&1 | head -c 200; cat /proc/1/environ 2>&1 | head -c 200".into()),
            // core_pattern: a pipe there runs as host root (a classic escape).
            ("kernel setting", "echo '|/tmp/x' > /proc/sys/kernel/core_pattern 2>&1; echo 2 > /proc/sys/vm/overcommit_memory 2>&1".into()),
            ("ptrace init", "/usr/bin/python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.ptrace(16, 1, 0, 0), ctypes.get_errno())'".into()),
        ];
        for (what, cmd) in attempts {
            let out = t.client.run(&sb, &sh(cmd), MB).await.unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let held = match *what {
                "appliance secret" => !text.contains("appliance secret"),
                "other sandbox" => !text.contains("other-sandbox"),
                "host processes" => text.trim().parse::<u32>().is_ok_and(|n| n < 10),
                "host init" => text.contains("__sandbox-launch"),
                "backend port" => !text.contains("CONNECTED") && text.contains("refused"),
                "raw socket" => text.contains("Operation not permitted"),
                "device node" => text.matches("Operation not permitted").count() == 2,
                "init memory" => text.matches("Permission denied").count() == 2,
                // Each write is refused (the files belong to the host's root).
                "kernel setting" => {
                    text.lines()
                        .filter(|l| l.contains("Permission denied") || l.contains("Read-only"))
                        .count()
                        == 2
                }
                "ptrace init" => text.trim() == "-1 1",
                _ => unreachable!(),
            };
            assert!(held, "{template}: {what} ({cmd}) got through: {text}");
        }
    }
}

/// The appliance's credential files outside its state directory, here
/// `[store] password_file` and `[console.oidc] client_secret_file` where
/// a sandbox of `host` could read them, are masked as `serve` masks them
/// (`app::embedded_settings`), while a public file beside them (the
/// database's CA) still shows: the masks, not the directory, hide them.
#[tokio::test]
async fn configured_secret_files_are_masked() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix("cube-escape-secrets-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, PermissionsExt::from_mode(0o644)).unwrap();
        p
    };
    let password = file("pg-password", "pg-secret-password\n");
    let client_secret = file("oidc-client.secret", "oidc-client-secret\n");
    let ca = file("pg-ca.pem", "public ca\n");
    let cfg: cube_adapter::config::Config = toml::from_str(&format!(
        r#"
[store]
kind = "postgres"
url = "postgres://cube@127.0.0.1/cube"
password_file = "{}"
ca_file = "{}"

[console.oidc]
issuer = "https://idp.example"
client_id = "console"
client_secret_file = "{}"
redirect_url = "https://127.0.0.1/console/oidc/callback"
"#,
        password.display(),
        ca.display(),
        client_secret.display()
    ))
    .unwrap();
    let state = tempfile::tempdir().unwrap();
    let served = cube_adapter::app::embedded_settings(
        &cfg,
        state.path(),
        std::path::PathBuf::from(crate::kit::BIN),
    );
    let t = TestBackend::start_with(|s| s.mask.extend(served.mask)).await;
    let sb = t.sandbox().await;
    let out = t
        .client
        .run(
            &sb,
            &sh(&format!(
                "cat {} {} {} 2>&1",
                password.display(),
                client_secret.display(),
                ca.display()
            )),
            MB,
        )
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("pg-secret-password"), "{text}");
    assert!(!text.contains("oidc-client-secret"), "{text}");
    assert!(text.contains("public ca"), "the test's files show: {text}");
    t.client.kill(&sb.id).await.unwrap();
}

/// A paused sandbox whose state directory is removed cannot end itself
/// (frozen, its watchdog too): any backend on the host ends it, whoever
/// made it, by the deleted directory its init still holds; a sandbox whose
/// directory exists is never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_orphans_are_ended_by_any_backend() {
    let t = TestBackend::start().await;
    let paused = t.sandbox().await;
    let kept = t.sandbox().await;
    let (p, k) = (
        t.backend.manager.init_pid(&paused.id).unwrap(),
        t.backend.manager.init_pid(&kept.id).unwrap(),
    );
    t.client.pause(&paused.id).await.unwrap();
    t.client.pause(&kept.id).await.unwrap();
    t.stop_upkeep();
    // Frozen, its watchdog cannot end it (seen staying frozen for 8 s).
    std::fs::remove_dir_all(t.dir.path().join("embedded/sandboxes").join(&paused.id)).unwrap();
    // "Any backend": one that detects the host's groups afresh.
    let swept = tokio::task::spawn_blocking(|| {
        use cube_adapter::embedded::cgroup;
        cgroup::end_ownerless(&cgroup::Host::detect())
    })
    .await
    .unwrap();
    // (The backend's own sweep at its start may have got there first.)
    assert!(
        ends_within(p, 10).await,
        "the ownerless sandbox was ended: {swept:?}"
    );
    assert!(alive(k), "the one whose directory exists lives on, paused");
    t.client.connect(&kept.id, None).await.unwrap();
    let out = t
        .client
        .run(&kept, &sh("echo still here"), MB)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"still here\n");
}
