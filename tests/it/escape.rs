//! The escape battery: what code inside an embedded sandbox tries, as an
//! attacker would, and must not get (docs/security.md). Each test runs the
//! attempt inside a real sandbox and checks the kernel's answer.

use cube_adapter::cube::StartOptions;
use serde_json::json;

use crate::kit::TestBackend;

const MB: usize = 1024 * 1024;

fn sh(cmd: &str) -> StartOptions {
    StartOptions::shell(cmd)
}

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
    assert!(
        crate::kit::pids_in_ns(&ns).is_empty(),
        "nothing of it is left"
    );
    assert!(
        alive(p),
        "the one that pauses at its timeout waits for a backend"
    );
}

/// `cube-adapter sandboxes` with the service's flags.
fn sandboxes_cli(s: &crate::kit::Server, args: &[&str]) -> std::process::Output {
    std::process::Command::new(crate::kit::BIN)
        .arg("sandboxes")
        .args(args)
        .arg("--state-dir")
        .arg(&s.state)
        .arg("--config")
        .arg(s.empty_config())
        .output()
        .unwrap()
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

    let out = sandboxes_cli(&s, &["list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let listed: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["state"], "running");
    let pid = listed[0]["init_pid"].as_i64().unwrap() as i32;
    let id = listed[0]["sandbox_id"].as_str().unwrap().to_string();

    let out = sandboxes_cli(&s, &["kill", "--all"]);
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
    let out = sandboxes_cli(&s, &["list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&id) && text.contains("running"), "{text}");
    let out = sandboxes_cli(&s, &["kill", &id[..8]]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("killed {id}\n")
    );
    assert!(!alive(pid), "its init is gone");
    let out = sandboxes_cli(&s, &["list", "--json"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "", "{out:?}");
    let out = sandboxes_cli(&s, &["kill", "deadbeefcafe"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}
