//! Our `cube/` client against the embedded backend, over mTLS.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use cube_adapter::cube::wire::{CreateSandbox, NetworkPolicy, ProcessEvent, PtySize};
use cube_adapter::cube::{BackendConfig, CubeClient, ErrorKind, StartOptions};
use sha2::Digest;

use crate::kit::{MB, TestBackend, pids_in_ns, sh};

fn b64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

#[tokio::test]
async fn run_collects_stdout_stderr_and_exit_codes() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let out = t
        .client
        .run(&sb, &sh("echo hello; echo oops >&2"), MB)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"hello\n");
    assert_eq!(out.stderr, b"oops\n");
    assert_eq!(out.exit_code, 0);

    let out = t.client.run(&sb, &sh("exit 3"), MB).await.unwrap();
    assert_eq!(out.exit_code, 3);
    assert_eq!(out.status, "exit status 3");

    let out = t.client.run(&sb, &sh("kill -9 $$"), MB).await.unwrap();
    assert_eq!(out.exit_code, 128 + 9);
    assert_eq!(out.status, "signal: killed");

    // Environment, working directory and user.
    let mut o = sh("echo $FOO $HOME; pwd; id -u");
    o.envs = BTreeMap::from([("FOO".into(), "bar".into())]);
    o.cwd = Some("/workspace".into());
    let out = t.client.run(&sb, &o, MB).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "bar /root\n/workspace\n0\n"
    );
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn output_keeps_its_order_within_and_across_streams() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let out = t
        .client
        .run(
            &sb,
            &sh("for i in $(seq 1 2000); do echo out$i; echo err$i >&2; done"),
            10 * MB,
        )
        .await
        .unwrap();
    let want_out: String = (1..=2000).map(|i| format!("out{i}\n")).collect();
    let want_err: String = (1..=2000).map(|i| format!("err{i}\n")).collect();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), want_out);
    assert_eq!(String::from_utf8(out.stderr).unwrap(), want_err);

    // Across streams: each write is made visible before the next starts
    // (`wait` on a short-lived writer), so arrival order is the write order.
    let mut s = t
        .client
        .start(
            &sb,
            &sh("echo a; sleep 0.2; echo b >&2; sleep 0.2; echo c; sleep 0.2; echo d >&2"),
        )
        .await
        .unwrap();
    let mut seen = vec![];
    while let Some(ev) = s.next().await.unwrap() {
        if let ProcessEvent::Data(d) = ev {
            if let Some(o) = d.stdout {
                seen.push(format!(
                    "out:{}",
                    String::from_utf8(b64(&o)).unwrap().trim()
                ));
            }
            if let Some(e) = d.stderr {
                seen.push(format!(
                    "err:{}",
                    String::from_utf8(b64(&e)).unwrap().trim()
                ));
            }
        }
    }
    assert_eq!(seen, ["out:a", "err:b", "out:c", "err:d"]);
    t.client.kill(&sb.id).await.unwrap();
}

/// Host pid of the sandbox's envd agent (the init's first child).
fn agent_pid(init: i32) -> i32 {
    let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
    let mut pids = pids_in_ns(&ns);
    pids.sort();
    pids.into_iter().find(|p| *p != init).unwrap()
}

fn vm_hwm_kb(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test]
async fn fifty_megabytes_stream_through_with_bounded_memory() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let total = 50 * MB;
    // Deterministic, not compressible by accident, and checkable here.
    let cmd = format!("yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {total}");
    let mut s = t.client.start(&sb, &sh(&cmd)).await.unwrap();
    let mut hasher = sha2::Sha256::new();
    let mut n = 0usize;
    let mut end = None;
    while let Some(ev) = s.next().await.unwrap() {
        match ev {
            ProcessEvent::Data(d) => {
                let b = b64(&d.stdout.unwrap());
                n += b.len();
                hasher.update(&b);
            }
            ProcessEvent::End(e) => end = Some(e),
            _ => {}
        }
    }
    assert_eq!(n, total);
    assert_eq!(end.unwrap().code(), Some(0));
    let line = b"0123456789abcdefghijklmnopqrstuvwxyz\n";
    let mut want = sha2::Sha256::new();
    let mut left = total;
    while left > 0 {
        let k = left.min(line.len());
        want.update(&line[..k]);
        left -= k;
    }
    assert_eq!(hasher.finalize(), want.finalize());
    // The agent forwarded 50 MB; its peak resident memory stays small.
    let init = t.backend.manager.init_pid(&sb.id).unwrap();
    let hwm = vm_hwm_kb(agent_pid(init));
    assert!(hwm < 48 * 1024, "agent peak RSS {hwm} KiB");
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn signals_stdin_and_background_reattach() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;

    // SIGTERM through SendSignal.
    let s = t.client.start(&sb, &sh("exec sleep 600")).await.unwrap();
    let pid = s.pid;
    t.client.signal(&sb, pid, false).await.unwrap();
    let out = s.collect(MB).await.unwrap();
    assert_eq!(out.exit_code, 128 + 15);
    // The pid is gone afterwards.
    let e = t.client.signal(&sb, pid, true).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");

    // stdin: send, close, read back.
    let mut o = StartOptions {
        cmd: "/bin/cat".into(),
        ..Default::default()
    };
    o.stdin = true;
    let s = t.client.start(&sb, &o).await.unwrap();
    t.client
        .send_stdin(&sb, s.pid, b"hello\x00world\n")
        .await
        .unwrap();
    t.client.close_stdin(&sb, s.pid).await.unwrap();
    let out = s.collect(MB).await.unwrap();
    assert_eq!(out.stdout, b"hello\x00world\n");
    assert_eq!(out.exit_code, 0);

    // Background: detach, re-attach, see only later output, then the end.
    let mut s = t
        .client
        .start(
            &sb,
            &sh("for i in $(seq 1 30); do echo line$i; sleep 0.05; done"),
        )
        .await
        .unwrap();
    let pid = s.pid;
    let first = loop {
        if let Some(ProcessEvent::Data(d)) = s.next().await.unwrap() {
            break String::from_utf8(b64(&d.stdout.unwrap())).unwrap();
        }
    };
    assert!(first.starts_with("line1\n"), "{first}");
    drop(s); // client disconnect: the process keeps running
    let listed = t.client.list_processes(&sb).await.unwrap();
    assert!(listed.iter().any(|p| p.pid == pid), "{listed:?}");
    let s = t.client.connect_process(&sb, pid).await.unwrap();
    assert_eq!(s.pid, pid);
    let out = s.collect(MB).await.unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        !text.contains("line1\n"),
        "re-attach must not replay: {text}"
    );
    assert!(text.ends_with("line30\n"), "{text}");
    assert_eq!(out.exit_code, 0);
    // After the end the process is gone.
    let e = t.client.connect_process(&sb, pid).await.err().unwrap();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn pty_sizes_and_resize() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let mut o = sh("stty size; read x; stty size; tty");
    o.pty = Some(PtySize { cols: 80, rows: 24 });
    let mut s = t.client.start(&sb, &o).await.unwrap();
    let pid = s.pid;
    let mut text = String::new();
    while !text.contains("24 80") {
        if let Some(ProcessEvent::Data(d)) = s.next().await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&b64(&d.pty.unwrap())));
        }
    }
    t.client
        .resize_pty(
            &sb,
            pid,
            PtySize {
                cols: 120,
                rows: 40,
            },
        )
        .await
        .unwrap();
    t.client.send_pty_input(&sb, pid, b"\n").await.unwrap();
    let out = s.collect(MB).await.unwrap();
    let rest = String::from_utf8_lossy(&out.stdout);
    assert!(rest.contains("40 120"), "{rest}");
    assert!(rest.contains("/dev/pts/"), "{rest}");
    assert_eq!(out.exit_code, 0);
    // Stdin of a PTY process is the terminal: a stdin write is refused.
    let mut o = sh("sleep 5");
    o.pty = Some(PtySize { cols: 80, rows: 24 });
    let s = t.client.start(&sb, &o).await.unwrap();
    let e = t.client.send_stdin(&sb, s.pid, b"x").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal, "{e}");
    t.client.signal(&sb, s.pid, true).await.unwrap();
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn files_binary_paths_and_errors() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let data: Vec<u8> = (0..3 * MB).map(|i| (i * 7 + i / 251) as u8).collect();
    t.client
        .upload(&sb, "/workspace/dir/sub/blob.bin", data.clone())
        .await
        .unwrap();
    let back = t
        .client
        .download(&sb, "/workspace/dir/sub/blob.bin", 10 * MB)
        .await
        .unwrap();
    assert!(back == data, "binary round trip differs");
    let sum = t
        .client
        .run(
            &sb,
            &sh("sha256sum /workspace/dir/sub/blob.bin | cut -c1-64"),
            MB,
        )
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8(sum.stdout).unwrap().trim(),
        hex::encode(sha2::Sha256::digest(&data))
    );
    let st = t
        .client
        .stat(&sb, "/workspace/dir/sub/blob.bin")
        .await
        .unwrap();
    assert_eq!(st.size, data.len() as u64);
    assert_eq!(st.kind, "FILE_TYPE_FILE");
    assert_eq!(st.owner, "root");

    // A part of a file (`Range`, as a job's recording reads its output).
    let f = "/workspace/dir/sub/blob.bin";
    let range = |from: u64, max: usize| {
        let c = &t.client;
        let sb = &sb;
        async move {
            let mut body = c.download_range(sb, f, from, max).await.unwrap()?;
            let mut v = vec![];
            while let Some(p) = body.next().await.unwrap() {
                v.extend_from_slice(&p);
            }
            Some(v)
        }
    };
    let part = range(1_000_000, 1000).await;
    assert!(
        part.as_deref() == data.get(1_000_000..1_001_000),
        "a middle part differs"
    );
    let end = range(data.len() as u64 - 10, MB).await;
    assert!(
        end.as_deref() == data.get(data.len() - 10..),
        "the end differs"
    );
    assert_eq!(
        range(data.len() as u64, MB).await,
        None,
        "nothing past the end"
    );

    // Directory operations.
    t.client.make_dir(&sb, "/workspace/a/b").await.unwrap();
    let e = t.client.make_dir(&sb, "/workspace/a/b").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
    let moved = t
        .client
        .rename(&sb, "/workspace/dir/sub/blob.bin", "/workspace/a/b/c.bin")
        .await
        .unwrap();
    assert_eq!(moved.path, "/workspace/a/b/c.bin");
    let entries = t.client.list_dir(&sb, "/workspace", 3).await.unwrap();
    let paths: Vec<_> = entries.iter().map(|e| e.path.as_str()).collect();
    assert!(paths.contains(&"/workspace/a/b/c.bin"), "{paths:?}");
    t.client.remove(&sb, "/workspace/a").await.unwrap();
    t.client.remove(&sb, "/workspace/a").await.unwrap(); // missing is fine

    // Errors.
    let e = t
        .client
        .download(&sb, "/workspace/missing", MB)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    assert!(e.message.contains("/workspace/missing"), "{e}");
    let e = t.client.download(&sb, "/workspace", MB).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    let e = t.client.stat(&sb, "/nope/nothing").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    let e = t
        .client
        .list_dir(&sb, "/etc/hostname", 1)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    // The template root is read-only, and the host's secrets stay unreadable.
    let e = t
        .client
        .upload(&sb, "/etc/evil", b"x".to_vec())
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Denied, "{e}");
    let out = t
        .client
        .run(&sb, &sh("touch /usr/x; cat /etc/shadow"), MB)
        .await
        .unwrap();
    assert_ne!(out.exit_code, 0);
    let e = t
        .client
        .run(
            &sb,
            &StartOptions {
                cwd: Some("/no/such/dir".into()),
                ..sh("true")
            },
            MB,
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    let e = t
        .client
        .run(
            &sb,
            &StartOptions {
                user: Some("nosuchuser".into()),
                ..sh("true")
            },
            MB,
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Denied, "{e}");
    let e = t
        .client
        .download(&sb, "/workspace/too-big-for-limit", 1)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    t.client.kill(&sb.id).await.unwrap();

    // A killed sandbox: control plane 404, data plane unavailable.
    let e = t.client.get(&sb.id).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    assert!(!e.message.contains("template"), "{e}");
    let e = t.client.stat(&sb, "/workspace").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
}

#[tokio::test]
async fn kill_leaves_no_process_behind() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    // Processes that try to escape: daemonised, own session, ignoring SIGTERM.
    let out = t
        .client
        .run(&sb, &sh("nohup sleep 600 >/dev/null 2>&1 & setsid sleep 600 & (trap '' TERM; sleep 600) & echo started"), MB)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"started\n");
    let init = t.backend.manager.init_pid(&sb.id).unwrap();
    let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
    assert!(pids_in_ns(&ns).len() >= 5, "{:?}", pids_in_ns(&ns));
    t.client.kill(&sb.id).await.unwrap();
    let left: Vec<String> = pids_in_ns(&ns)
        .iter()
        .map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default())
        .collect();
    assert!(
        left.is_empty(),
        "processes survived the kill (init {init}): {left:?}"
    );
    assert!(t.client.get(&sb.id).await.is_err());
}

#[tokio::test]
async fn no_sandbox_reaches_the_hosts_loopback() {
    let t = TestBackend::start().await;
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    host.set_nonblocking(true).unwrap();
    let port = host.local_addr().unwrap().port();
    let probe = format!(
        "ls /sys/class/net; (echo hi > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo reached || echo refused"
    );

    let sb = t
        .sandbox_with(CreateSandbox {
            template_id: "host".into(),
            allow_internet_access: Some(false),
            ..Default::default()
        })
        .await;
    let out = t.client.run(&sb, &sh(&probe), MB).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "lo\nrefused\n");
    // Nothing reached the host listener (a connection would be queued).
    assert!(
        host.accept().is_err(),
        "the sandbox reached a host listener"
    );
    t.client.kill(&sb.id).await.unwrap();

    // With internet access the sandbox has an interface of its own (pasta's
    // tap), and the host's loopback is still out of reach (more in
    // `network::`).
    let sb = t
        .sandbox_with(CreateSandbox {
            template_id: "host".into(),
            allow_internet_access: Some(true),
            ..Default::default()
        })
        .await;
    let out = t.client.run(&sb, &sh(&probe), MB).await.unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.ends_with("refused\n"), "{out}");
    let ifs: Vec<&str> = out.lines().take_while(|l| *l != "refused").collect();
    assert_eq!(ifs.len(), 2, "lo and pasta's interface: {out}");
    assert!(ifs.contains(&"lo"), "{out}");
    assert!(
        host.accept().is_err(),
        "the sandbox reached a host listener"
    );
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn snapshot_rollback_and_independent_clone() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    t.client
        .upload(&sb, "/workspace/a.txt", b"v1".to_vec())
        .await
        .unwrap();
    t.client
        .upload(&sb, "/tmp/t.txt", b"tmp1".to_vec())
        .await
        .unwrap();
    let snap = t
        .client
        .create_snapshot(&sb.id, Some("first"))
        .await
        .unwrap();
    assert!(snap.snapshot_id.starts_with("snap-"));
    assert_eq!(snap.names, ["first"]);
    let listed = t.client.list_snapshots(Some(&sb.id)).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].status, "READY");

    // Change, then roll back: files restored, new files gone, processes ended.
    t.client
        .upload(&sb, "/workspace/a.txt", b"v2".to_vec())
        .await
        .unwrap();
    t.client
        .upload(&sb, "/workspace/b.txt", b"new".to_vec())
        .await
        .unwrap();
    let bg = t.client.start(&sb, &sh("exec sleep 600")).await.unwrap();
    let r = t.client.rollback(&sb.id, &snap.snapshot_id).await.unwrap();
    assert_eq!(r.sandbox_id, sb.id);
    assert_eq!(r.status, "READY");
    assert_eq!(
        t.client
            .download(&sb, "/workspace/a.txt", MB)
            .await
            .unwrap(),
        b"v1"
    );
    assert_eq!(
        t.client.download(&sb, "/tmp/t.txt", MB).await.unwrap(),
        b"tmp1"
    );
    assert_eq!(
        t.client
            .download(&sb, "/workspace/b.txt", MB)
            .await
            .unwrap_err()
            .kind,
        ErrorKind::NotFound
    );
    let out = bg.collect(MB).await.unwrap();
    assert_eq!(out.exit_code, 137);

    // Clone: starts from the snapshot, then lives its own life.
    let clone = t
        .client
        .create_from_snapshot(&snap.snapshot_id, CreateSandbox::default())
        .await
        .unwrap();
    let cl = t.client.addr(&clone);
    assert_ne!(cl.id, sb.id);
    assert_eq!(
        t.client
            .download(&cl, "/workspace/a.txt", MB)
            .await
            .unwrap(),
        b"v1"
    );
    t.client
        .upload(&cl, "/workspace/a.txt", b"clone".to_vec())
        .await
        .unwrap();
    assert_eq!(
        t.client
            .download(&sb, "/workspace/a.txt", MB)
            .await
            .unwrap(),
        b"v1"
    );
    t.client
        .upload(&sb, "/workspace/a.txt", b"origin".to_vec())
        .await
        .unwrap();
    assert_eq!(
        t.client
            .download(&cl, "/workspace/a.txt", MB)
            .await
            .unwrap(),
        b"clone"
    );
    // Files written in the clone belong to the clone's root.
    let out = t
        .client
        .run(
            &cl,
            &sh("stat -c %U /workspace/a.txt; touch /workspace/new && echo ok"),
            MB,
        )
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "root\nok\n");

    t.client.kill(&sb.id).await.unwrap();
    // The snapshot outlives its origin; clones keep working.
    assert_eq!(
        t.client
            .download(&cl, "/workspace/a.txt", MB)
            .await
            .unwrap(),
        b"clone"
    );
    t.client.delete_snapshot(&snap.snapshot_id).await.unwrap();
    assert_eq!(
        t.client
            .delete_snapshot(&snap.snapshot_id)
            .await
            .unwrap_err()
            .kind,
        ErrorKind::NotFound
    );
    assert_eq!(
        t.client
            .rollback(&cl.id, &snap.snapshot_id)
            .await
            .unwrap_err()
            .kind,
        ErrorKind::NotFound
    );
    t.client.kill(&cl.id).await.unwrap();
}

#[tokio::test]
async fn timeout_kills_and_pause_freezes() {
    let t = TestBackend::start().await;
    let sb = t
        .sandbox_with(CreateSandbox {
            template_id: "host".into(),
            timeout: Some(1),
            ..Default::default()
        })
        .await;
    let d = t.client.get(&sb.id).await.unwrap();
    assert!(d.end_at.is_some());
    let mut gone = false;
    for _ in 0..100 {
        if t.client.get(&sb.id).await.is_err() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the sandbox outlived its timeout");

    // With `onTimeout: pause` the timeout pauses instead.
    let sb = t
        .sandbox_with(CreateSandbox {
            template_id: "host".into(),
            timeout: Some(1),
            lifecycle: Some(cube_adapter::cube::wire::Lifecycle {
                on_timeout: Some("pause".into()),
                auto_resume: None,
            }),
            ..Default::default()
        })
        .await;
    let mut paused = false;
    for _ in 0..100 {
        if t.client.get(&sb.id).await.unwrap().state == "paused" {
            paused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(paused, "onTimeout=pause did not pause");
    t.client.kill(&sb.id).await.unwrap();

    // Pause: the proxy answers unavailable (a real one reaches a frozen
    // VM); the client resumes the sandbox with connect and asks again.
    let sb = t.sandbox().await;
    t.client
        .upload(&sb, "/workspace/x", b"1".to_vec())
        .await
        .unwrap();
    t.client.pause(&sb.id).await.unwrap();
    assert_eq!(t.client.get(&sb.id).await.unwrap().state, "paused");
    t.client.stat(&sb, "/workspace/x").await.unwrap();
    assert_eq!(t.client.get(&sb.id).await.unwrap().state, "running");
    t.client.pause(&sb.id).await.unwrap();
    let listed = t
        .client
        .list(&BTreeMap::new(), Some("paused"))
        .await
        .unwrap();
    assert!(listed.iter().any(|s| s.sandbox_id == sb.id));
    t.client.connect(&sb.id, None).await.unwrap();
    assert_eq!(t.client.get(&sb.id).await.unwrap().state, "running");
    assert_eq!(
        t.client.download(&sb, "/workspace/x", MB).await.unwrap(),
        b"1"
    );
    // A paused sandbox can still be killed.
    t.client.pause(&sb.id).await.unwrap();
    t.client.kill(&sb.id).await.unwrap();
    // Keepalive on a live one.
    let sb = t.sandbox().await;
    t.client.set_timeout(&sb.id, 3600).await.unwrap();
    assert!(t.client.get(&sb.id).await.unwrap().end_at.is_some());
    assert_eq!(
        t.client.set_timeout(&sb.id, -5).await.unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn control_plane_errors_templates_and_traffic_token() {
    let t = TestBackend::start().await;
    let e = t
        .client
        .create(&CreateSandbox {
            template_id: "no-such".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    // As a real CubeAPI answers it (500, CubeMaster's 130404), read as
    // not-found by the client.
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert!(e.message.contains("130404"), "{e}");
    let mut env = BTreeMap::new();
    env.insert("LD_PRELOAD".to_string(), "/x.so".to_string());
    let e = t
        .client
        .create(&CreateSandbox {
            template_id: "host".into(),
            env_vars: env,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    let tpls = t.client.list_templates().await.unwrap();
    assert!(tpls.iter().any(|t| t.template_id == "host" && t.is_ready()));
    assert!(t.client.template_ready("host").await.unwrap());
    assert!(!t.client.template_ready("missing").await.unwrap());
    assert_eq!(
        t.client
            .get("0123456789abcdef0123456789abcdef")
            .await
            .unwrap_err()
            .kind,
        ErrorKind::NotFound
    );

    // Metadata and env vars.
    let mut md = BTreeMap::new();
    md.insert("owner".to_string(), "it".to_string());
    let mut env = BTreeMap::new();
    env.insert("GREETING".to_string(), "hi".to_string());
    let s = t
        .client
        .create(&CreateSandbox {
            template_id: "host".into(),
            metadata: md.clone(),
            env_vars: env,
            ..Default::default()
        })
        .await
        .unwrap();
    let sb = t.client.addr(&s);
    let listed = t.client.list(&md, None).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].metadata.get("owner").map(String::as_str),
        Some("it")
    );
    let out = t.client.run(&sb, &sh("echo $GREETING"), MB).await.unwrap();
    assert_eq!(out.stdout, b"hi\n");
    t.client.kill(&sb.id).await.unwrap();

    // Private traffic: the data plane needs the token the create returned.
    let s = t
        .client
        .create(&CreateSandbox {
            template_id: "host".into(),
            network: Some(NetworkPolicy {
                allow_public_traffic: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(s.traffic_access_token.is_some());
    let sb = t.client.addr(&s);
    assert_eq!(
        t.client.run(&sb, &sh("true"), MB).await.unwrap().exit_code,
        0
    );
    let mut no_token = sb.clone();
    no_token.traffic_token = None;
    assert_eq!(
        t.client.stat(&no_token, "/").await.unwrap_err().kind,
        ErrorKind::Denied
    );
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn malformed_requests_get_protocol_errors() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let tls = cube_adapter::tls::client_config(
        Some(&t.ca_pem),
        Some((
            &std::fs::read(t.dir.path().join("tls/client.pem")).unwrap(),
            &std::fs::read(t.dir.path().join("tls/client.key")).unwrap(),
        )),
    )
    .unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .build()
        .unwrap();
    let host = format!("49983-{}.cube.test", sb.id);
    let url = |p: &str| format!("{}{p}", t.url);

    // A bad envelope on a streaming call: HTTP 200 with an end-stream error.
    let r = http
        .post(url("/process.Process/Start"))
        .header("host", &host)
        .header("content-type", "application/connect+json")
        .body(vec![0u8, 0, 0, 0, 9, b'{'])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.unwrap();
    assert_eq!(body[0], 2, "end-stream flag");
    assert!(String::from_utf8_lossy(&body[5..]).contains("invalid_argument"));
    // Unary content type on a streaming call, and streaming on a unary: 415.
    let r = http
        .post(url("/process.Process/Start"))
        .header("host", &host)
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let r = http
        .post(url("/filesystem.Filesystem/Stat"))
        .header("host", &host)
        .header("content-type", "application/connect+json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    // Invalid JSON on a unary call.
    let r = http
        .post(url("/filesystem.Filesystem/Stat"))
        .header("host", &host)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["code"], "invalid_argument");
    // Unknown sandbox on the data plane, bad Host, internal paths.
    let r = http
        .post(url("/filesystem.Filesystem/Stat"))
        .header("host", "49983-deadbeef.cube.test")
        .json(&serde_json::json!({"path":"/"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"],
        "service unavailable"
    );
    let r = http
        .post(url("/_cube/kill-all"))
        .header("host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http
        .get(url("/health"))
        .header("host", format!("8080-{}.cube.test", sb.id))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // Control plane: malformed JSON, oversize body, bad ids.
    let r = http
        .post(url("/sandboxes"))
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["code"], 400);
    let r = http
        .post(url("/sandboxes"))
        .header("content-type", "application/json")
        .body(vec![b' '; 2 * MB])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let r = http.get(url("/sandboxes/bad.id")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let r = http.get(url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = http
        .get(url("/health"))
        .header("host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    // `Range` on `GET /files` is answered as Go's `http.ServeContent` does.
    t.client
        .upload(&sb, "/workspace/ten", b"0123456789".to_vec())
        .await
        .unwrap();
    let files = url("/files?path=/workspace/ten&username=root");
    for (range, status, content_range, body) in [
        ("bytes=2-4", 206, "bytes 2-4/10", &b"234"[..]),
        ("bytes=7-", 206, "bytes 7-9/10", b"789"),
        ("bytes=-2", 206, "bytes 8-9/10", b"89"),
        ("bytes=10-", 416, "bytes */10", b""),
    ] {
        let r = http
            .get(&files)
            .header("host", &host)
            .header("range", range)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{range}");
        assert_eq!(r.headers()["content-range"], content_range, "{range}");
        if status == 206 {
            assert_eq!(&r.bytes().await.unwrap()[..], body, "{range}");
        }
    }
    let r = http.get(&files).header("host", &host).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["accept-ranges"], "bytes");
    assert_eq!(&r.bytes().await.unwrap()[..], b"0123456789");

    // The backend still works after all that.
    assert_eq!(
        t.client
            .run(&sb, &sh("echo fine"), MB)
            .await
            .unwrap()
            .stdout,
        b"fine\n"
    );

    // Without a client certificate the TLS handshake is refused.
    let anon = cube_adapter::tls::client_config(Some(&t.ca_pem), None).unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(anon)
        .build()
        .unwrap();
    assert!(http.get(url("/health")).send().await.is_err());
    t.client.kill(&sb.id).await.unwrap();
}

#[test]
fn client_refuses_plain_http_to_non_loopback() {
    let e = CubeClient::new(BackendConfig::new("x", "http://cube.invalid:3000"))
        .err()
        .unwrap();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.contains("insecure_plain_http"), "{e}");
    let mut cfg = BackendConfig::new("x", "http://cube.invalid:3000");
    cfg.insecure_plain_http = true;
    assert!(CubeClient::new(cfg).is_ok());
    assert!(CubeClient::new(BackendConfig::new("x", "http://127.0.0.1:3000")).is_ok());
    assert!(CubeClient::new(BackendConfig::new("x", "ftp://127.0.0.1")).is_err());
}

#[test]
fn secrets_are_not_printed() {
    let mut cfg = BackendConfig::new("x", "https://127.0.0.1:1");
    cfg.api_key = Some(cube_adapter::cube::Secret::new("sk-very-secret"));
    assert!(!format!("{cfg:?}").contains("sk-very-secret"));
}

#[tokio::test]
async fn connect_timeout_kills_the_process() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let o = StartOptions {
        timeout: Some(Duration::from_millis(500)),
        ..sh("echo before; sleep 30; echo after")
    };
    let out = t.client.run(&sb, &o, MB).await.unwrap();
    assert_eq!(out.stdout, b"before\n");
    assert_eq!(out.status, "signal: killed");
    assert_eq!(out.exit_code, 137);
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn limits_hold_inside_the_sandbox() {
    let t = TestBackend::start_with(|s| {
        s.limits.max_processes = 64;
        s.limits.memory_mb = 64;
    })
    .await;
    let sb = t.sandbox().await;
    // More processes than allowed: forks fail, the sandbox survives.
    let fork = r#"perl -e 'my $ok = 0; for (1..150) { my $p = fork(); next unless defined $p; if ($p == 0) { sleep 2; exit 0 } $ok++ } print "$ok\n"; 1 while wait() > 0'"#;
    let out = t.client.run(&sb, &sh(fork), MB).await.unwrap();
    let forked: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(
        (8..64).contains(&forked),
        "{forked} forks succeeded under a limit of 64"
    );
    assert_eq!(
        t.client
            .run(&sb, &sh("echo alive"), MB)
            .await
            .unwrap()
            .stdout,
        b"alive\n"
    );
    // Allocating past the memory limit fails or is killed; the sandbox lives on.
    let alloc = r#"perl -e '$x = "a" x (200*1024*1024); print "allocated\n"'; echo rc=$?"#;
    let out = t.client.run(&sb, &sh(alloc), MB).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("allocated") && !text.contains("rc=0"),
        "a 200 MB allocation succeeded under a 64 MB limit: {text}"
    );
    assert_eq!(
        t.client
            .run(&sb, &sh("echo alive"), MB)
            .await
            .unwrap()
            .stdout,
        b"alive\n"
    );
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn sandboxes_outlive_a_backend_restart() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    t.client
        .upload(&sb, "/workspace/keep.txt", b"kept".to_vec())
        .await
        .unwrap();
    let bg = t.client.start(&sb, &sh("sleep 600")).await.unwrap();
    let pid = bg.pid;
    drop(bg);
    let state = t.dir.path().to_path_buf();

    // A second backend on the same state directory (as after a restart):
    // it re-adopts the sandbox, whose processes kept running.
    let settings = crate::kit::settings(&state);
    let again = cube_adapter::embedded::Backend::open(settings, None).unwrap();
    assert_eq!(again.manager.count(), 1);
    let d = again.manager.detail(&sb.id).unwrap();
    assert_eq!(d.state, "running");
    // Through the first server, which still shares the sandbox's socket.
    assert_eq!(
        t.client
            .download(&sb, "/workspace/keep.txt", MB)
            .await
            .unwrap(),
        b"kept"
    );
    assert!(
        t.client
            .list_processes(&sb)
            .await
            .unwrap()
            .iter()
            .any(|p| p.pid == pid)
    );
    again.manager.kill(&sb.id).await.unwrap();
    assert_eq!(again.manager.count(), 0);
    // A sandbox that died while no backend ran is cleaned up at start.
    let sb2 = t.sandbox().await;
    let init = t.backend.manager.init_pid(&sb2.id).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(init),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    while std::fs::read_to_string(format!("/proc/{init}/stat")).is_ok_and(|s| !s.contains(") Z")) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let third = cube_adapter::embedded::Backend::open(crate::kit::settings(&state), None).unwrap();
    assert!(third.manager.detail(&sb2.id).is_err());
    assert!(!state.join("embedded/sandboxes").join(&sb2.id).exists());
}

#[tokio::test]
async fn isolation_none_runs_unisolated_and_says_so() {
    let t =
        TestBackend::start_with(|s| s.isolation = cube_adapter::embedded::Isolation::None).await;
    let sb = t.sandbox().await;
    let d = t.client.get(&sb.id).await.unwrap();
    assert_eq!(
        d.metadata.get("cube-adapter.isolation").map(String::as_str),
        Some("none")
    );
    t.client
        .upload(&sb, "/workspace/f.txt", b"plain".to_vec())
        .await
        .unwrap();
    assert_eq!(
        t.client
            .download(&sb, "/workspace/f.txt", MB)
            .await
            .unwrap(),
        b"plain"
    );
    let out = t
        .client
        .run(&sb, &sh("cat f.txt; echo $TMPDIR"), MB)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("plain/"), "{text}");
    assert!(text.contains(&sb.id), "TMPDIR is the sandbox's own: {text}");
    let out = t
        .client
        .run(&sb, &sh("sleep 600 & echo $!"), MB)
        .await
        .unwrap();
    let child: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(std::path::Path::new(&format!("/proc/{child}")).exists());
    t.client.kill(&sb.id).await.unwrap();
    let alive =
        std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|s| !s.contains(") Z"));
    assert!(
        !alive,
        "kill left a process of the unisolated sandbox running"
    );
}

#[tokio::test]
async fn sandbox_processes_hold_nothing_from_outside() {
    let t = TestBackend::start().await;
    // Leak a descriptor without close-on-exec into the backend's process,
    // as a careless parent would: no sandbox process may inherit it.
    let leaked = nix::fcntl::open(
        "/",
        nix::fcntl::OFlag::O_PATH,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    let sb = t.sandbox().await;
    let out = t
        .client
        .run(&sb, &sh("ls /proc/self/fd | sort -n | tr '\\n' ' '; ls /proc/1/fd /proc/2/fd /proc/1/root 2>&1 | grep -c 'Permission denied'"), MB)
        .await
        .unwrap();
    // 0-2 are the pipes, 3 is ls's own directory handle.
    assert_eq!(String::from_utf8_lossy(&out.stdout), "0 1 2 3 3\n");
    drop(leaked);
    t.client.kill(&sb.id).await.unwrap();
}

/// `unshare -Ur` repeated `n` times, then `rest`.
fn nested_userns(n: usize, rest: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new("unshare");
    c.arg("-Ur");
    for _ in 1..n {
        c.args(["unshare", "-Ur"]);
    }
    c.args(rest);
    c
}

#[test]
fn refuses_to_start_without_namespaces_unless_isolation_none() {
    // Find the nesting depth at which the kernel refuses a new user
    // namespace (its limit is 32 levels): there namespaces cannot be created.
    let depth = (1..64)
        .find(|n| {
            !nested_userns(*n, &["true"])
                .output()
                .unwrap()
                .status
                .success()
        })
        .expect("the kernel limits user namespace nesting")
        - 1;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().to_str().unwrap();
    let bin = crate::kit::BIN;
    let out = nested_userns(
        depth,
        &[
            bin,
            "embedded-backend",
            "--listen",
            "127.0.0.1:0",
            "--plain-http",
            "--state-dir",
            state,
        ],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot create user, mount, pid, ipc, uts and network namespaces"),
        "{err}"
    );
    assert!(
        err.contains("isolation"),
        "the error says how to run anyway: {err}"
    );

    // With isolation = none it starts (and says where it listens).
    let mut child = nested_userns(
        depth,
        &[
            bin,
            "embedded-backend",
            "--listen",
            "127.0.0.1:0",
            "--plain-http",
            "--isolation",
            "none",
            "--state-dir",
            state,
        ],
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.contains("listening on http://127.0.0.1:"), "{line}");
}

#[tokio::test]
async fn sandbox_root_cannot_undo_its_mounts() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    // Root in the sandbox, with every capability of its own namespaces: the
    // mounts it was given are locked all the same.
    let probe = "mount -o remount,bind,rw /usr 2>/dev/null && echo remounted-usr; \
                 umount /etc 2>/dev/null && echo unmounted-etc; \
                 umount -l /usr 2>/dev/null && echo detached-usr; \
                 mount -o remount,rw / 2>/dev/null && echo remounted-root; \
                 touch /usr/x 2>/dev/null && echo wrote-usr; \
                 echo probe-done";
    let out = t.client.run(&sb, &sh(probe), MB).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "probe-done\n");
    // The appliance's state directory is masked and stays masked.
    let state = t.dir.path().to_str().unwrap().to_string();
    let hidden = format!(
        "ls -A {state} 2>&1 | wc -l; umount {state} 2>/dev/null && echo unmasked; echo done"
    );
    let out = t.client.run(&sb, &sh(&hidden), MB).await.unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("unmasked"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    t.client.kill(&sb.id).await.unwrap();
}

#[tokio::test]
async fn long_state_directory_paths_work() {
    // Unix socket paths are limited to 108 bytes; state directories are not.
    let t = TestBackend::start_with(|s| {
        s.state_dir = s
            .state_dir
            .join("a-rather-long-directory-name-for-the-state-of-this-backend-0123456789");
    })
    .await;
    let sb = t.sandbox().await;
    assert_eq!(
        t.client
            .run(&sb, &sh("echo long"), MB)
            .await
            .unwrap()
            .stdout,
        b"long\n"
    );
    t.client.kill(&sb.id).await.unwrap();
}

/// A rollback that cannot stop every process of the sandbox refuses and
/// changes nothing. The test makes one process unkillable for the backend:
/// it moves it into a frozen cgroup of the test's own (a cgroup v1 freezer
/// delivers SIGKILL only on thaw), so every hold round finds it still
/// there. With cgroup v2, where a frozen task dies of SIGKILL, the same
/// rollback must instead succeed and leave only init and agent.
#[tokio::test]
async fn a_rollback_that_cannot_hold_the_sandbox_changes_nothing() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    t.client
        .upload(&sb, "/workspace/marker", b"from the snapshot".to_vec())
        .await
        .unwrap();
    let snap = t.client.create_snapshot(&sb.id, None).await.unwrap();
    t.client
        .upload(&sb, "/workspace/marker", b"after the snapshot".to_vec())
        .await
        .unwrap();
    let _bg = t.client.start(&sb, &sh("exec sleep 600")).await.unwrap();
    let init = t.backend.manager.init_pid(&sb.id).unwrap();
    let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
    let sleeper = {
        let mut found = None;
        for _ in 0..200 {
            found = pids_in_ns(&ns).into_iter().find(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.starts_with(b"sleep\x00600"))
            });
            if found.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        found.expect("the sleeper never started")
    };

    let v1 = std::path::Path::new("/sys/fs/cgroup/freezer/tasks").exists();
    let group = if v1 {
        std::path::PathBuf::from(format!(
            "/sys/fs/cgroup/freezer/cube-adapter-test-frozen-{}",
            std::process::id()
        ))
    } else {
        std::path::PathBuf::from(format!(
            "/sys/fs/cgroup/cube-adapter-test-frozen-{}",
            std::process::id()
        ))
    };
    std::fs::create_dir_all(&group).unwrap();
    std::fs::write(group.join("cgroup.procs"), sleeper.to_string())
        .expect("move the sleeper into the test's cgroup (needs root and cgroups)");
    if v1 {
        std::fs::write(group.join("freezer.state"), "FROZEN").unwrap();
    } else {
        std::fs::write(group.join("cgroup.freeze"), "1").unwrap();
    }

    let r = t.client.rollback(&sb.id, &snap.snapshot_id).await;
    let marker = t
        .client
        .download(&sb, "/workspace/marker", MB)
        .await
        .unwrap();
    // Let the sleeper go (thawed, it dies of the SIGKILL it holds) and
    // remove the test's group.
    if v1 {
        std::fs::write(group.join("freezer.state"), "THAWED").unwrap();
    } else {
        std::fs::write(group.join("cgroup.freeze"), "0").unwrap();
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sleeper),
        nix::sys::signal::Signal::SIGKILL,
    );
    for _ in 0..200 {
        if std::fs::remove_dir(&group).is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if v1 {
        let e = r.expect_err("the rollback went ahead with a process it could not stop");
        assert_eq!(e.kind, ErrorKind::Conflict, "{e:?}");
        assert!(
            e.message.contains("nothing restored"),
            "unclear refusal: {}",
            e.message
        );
        assert_eq!(
            marker, b"after the snapshot",
            "a refused rollback changed files"
        );
        // The sandbox runs on: init and agent were let go.
        let out = t.client.run(&sb, &sh("echo alive"), MB).await.unwrap();
        assert_eq!(out.stdout, b"alive\n");
    } else {
        r.expect("with cgroup v2 a frozen task dies of SIGKILL: the rollback must succeed");
        assert_eq!(marker, b"from the snapshot");
    }
    t.client.kill(&sb.id).await.unwrap();
}

/// Unless faithful, the embedded backend never times a sandbox out under a
/// call in flight (a real CubeProxy, and the faithful stand-in, count a call
/// only when it ends); left alone, the sandbox is paused after its idle
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kind_backend_never_pauses_under_a_call() {
    let t = TestBackend::start_with(|s| s.faithful = None).await;
    let sb = t
        .sandbox_with(CreateSandbox {
            template_id: "host".into(),
            timeout: Some(1),
            lifecycle: Some(cube_adapter::cube::wire::Lifecycle {
                on_timeout: Some("pause".into()),
                auto_resume: Some(false),
            }),
            ..Default::default()
        })
        .await;
    let out = t
        .client
        .run(&sb, &StartOptions::shell("sleep 3; echo done"), MB)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"done\n");
    assert_eq!(t.client.get(&sb.id).await.unwrap().state, "running");
    let mut paused = false;
    for _ in 0..50 {
        if t.client.get(&sb.id).await.unwrap().state == "paused" {
            paused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(paused, "an idle sandbox was not paused");
    t.client.kill(&sb.id).await.unwrap();
}
