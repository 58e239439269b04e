//! Running under systemd: the notification protocol of `Type=notify`.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use crate::kit::{Proc, SandboxReaper};

/// `serve` says READY=1 once it listens, feeds the watchdog, and says
/// STOPPING=1 when asked to stop.
#[test]
fn serve_notifies_systemd() {
    cube_adapter::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "").unwrap();
    let _reaper = SandboxReaper(state.join("embedded/sandboxes"));
    let sock_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let p = Proc::start(
        &state,
        &config,
        &[
            ("NOTIFY_SOCKET", sock_path.to_str().unwrap()),
            ("WATCHDOG_USEC", "200000"),
        ],
    )
    .unwrap();
    let mut buf = [0u8; 512];
    // A signal to this process (another test's child ending) interrupts a
    // blocking receive: EINTR is tried again, not a failure.
    let recv = |buf: &mut [u8]| loop {
        match sock.recv(buf) {
            Ok(n) => break String::from_utf8_lossy(&buf[..n]).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => panic!("no notification: {e}"),
        }
    };
    let first = recv(&mut buf);
    assert!(
        first.starts_with("READY=1\nSTATUS=listening on https://127.0.0.1:"),
        "{first}"
    );
    let second = recv(&mut buf);
    assert_eq!(second, "WATCHDOG=1");
    // Ask it to stop without waiting for it to exit, and read while it
    // stops: the socket queues only a few datagrams, so watchdog pings sent
    // during a slow shutdown (a loaded machine) would fill it and the
    // service's non-blocking STOPPING=1 would be dropped.
    let mut p = p;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let mut saw_stopping = false;
    for _ in 0..1000 {
        let m = recv(&mut buf);
        if m.starts_with("STOPPING=1") {
            saw_stopping = true;
            break;
        }
        assert_eq!(m, "WATCHDOG=1");
    }
    p.child.wait().unwrap();
    assert!(saw_stopping);
}

/// The shipped unit and the embedded drop-in pass `systemd-analyze verify`
/// without a warning (`.ci/run` installs systemd's tools; a machine without
/// them fails here rather than passing unchecked).
#[test]
fn systemd_units_verify() {
    let which = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .expect("systemd-analyze is needed (Debian's systemd package; .ci/run installs it)");
    assert!(which.status.success());
    let version: u32 = String::from_utf8_lossy(&which.stdout)
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("systemd-analyze --version names its version");
    let old_systemd = version < 254;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd");
    let unit = std::fs::read_to_string(root.join("cube-adapter.service"))
        .unwrap()
        .replace("/usr/bin/cube-adapter", crate::kit::BIN);
    let dropin = std::fs::read_to_string(root.join("embedded.conf"))
        .unwrap()
        .replace("/usr/bin/cube-adapter", crate::kit::BIN);
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("cube-adapter.service");
    std::fs::write(&plain, &unit).unwrap();
    // The unit with the drop-in's settings applied after its own.
    let embedded = dir.path().join("cube-adapter-embedded.service");
    std::fs::write(&embedded, format!("{unit}\n{dropin}")).unwrap();
    for f in [&plain, &embedded] {
        let out = std::process::Command::new("systemd-analyze")
            .arg("verify")
            .arg(f)
            .output()
            .unwrap();
        // systemd before 254 does not know DelegateSubgroup= and ignores it
        // (the drop-in says what that costs); nothing else may warn.
        let err: String = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| !(old_systemd && l.contains("Unknown key 'DelegateSubgroup'")))
            .collect();
        assert!(
            out.status.success() && err.trim().is_empty(),
            "{}: {err}",
            f.display()
        );
    }
    let sysusers = std::fs::read_to_string(root.join("cube-adapter.sysusers")).unwrap();
    assert!(sysusers.lines().any(|l| l.starts_with("u cube-adapter ")));
}

/// The shipped default configuration (and its commented profile example)
/// passes `config check`.
#[test]
fn shipped_config_checks() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/config.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // As shipped, and with the example profile uncommented.
    let example: String = text
        .lines()
        .map(|l| match l.strip_prefix("# ") {
            Some(rest)
                if rest.starts_with("[profiles")
                    || rest.starts_with("[mcp_policies")
                    || rest.starts_with("[presets")
                    || rest.starts_with("[[presets")
                    || rest.starts_with("[egress")
                    || (rest.contains(" = ")
                        && (!rest.contains("_file") || rest.starts_with("secret_file"))
                        && !rest.starts_with("proxy_url")) =>
            {
                rest.to_string()
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(example.contains("\n[profiles.offline-code]\n"));
    assert!(example.contains("\n[mcp_policies.controlled-echo]\n"));
    assert!(example.contains("\n[presets.openclaw-deepseek]\n"));
    assert!(example.contains("\n[profiles.builds.egress]\n"));
    for (name, body) in [
        ("shipped.toml", text.as_str()),
        ("example.toml", example.as_str()),
    ] {
        let f = dir.path().join(name);
        std::fs::write(&f, body).unwrap();
        let out = std::process::Command::new(crate::kit::BIN)
            .args(["config", "check", "--config"])
            .arg(&f)
            .env_remove("CUBE_ADAPTER_CONFIG")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

// ---- operations (#7): reload, status, certificates, init, backup --------

fn run(args: &[&str], state: &std::path::Path, config: &std::path::Path) -> std::process::Output {
    std::process::Command::new(crate::kit::BIN)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .arg("--config")
        .arg(config)
        .env_remove("CUBE_ADAPTER_CONFIG")
        .output()
        .unwrap()
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The certificate a TLS server presents.
async fn served_cert(url: &str, ca_pem: &[u8]) -> cube_adapter::tls::CertInfo {
    let addr = url.trim_start_matches("https://").to_string();
    let cfg = cube_adapter::tls::client_config(Some(ca_pem), None).unwrap();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(name, tcp)
        .await
        .unwrap();
    let der = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    let pem = format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, der.as_ref())
    );
    cube_adapter::tls::cert_info(pem.as_bytes()).unwrap()
}

/// `status --json` until `done` holds (a reload runs on its own task).
fn status_until(
    state: &std::path::Path,
    config: &std::path::Path,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v = json_of(&run(&["status", "--json"], state, config));
        if done(&v) {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "status never got there: {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGHUP: `server_names` and the certificate apply at once, other changed
/// keys are reported as needing a restart, an invalid file is refused and
/// changes nothing; `cert renew` swaps the certificate of a running
/// service; `status` reports it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_certificate_and_configuration() {
    let (rig, p) = crate::kit::ProcRig::start();
    // The CLI reads a file of its own: the service's is made invalid below.
    let cli = rig.state.with_file_name("cli.toml");
    std::fs::write(&cli, "").unwrap();
    let ca = std::fs::read(rig.state.join("tls/ca.pem")).unwrap();
    let first = served_cert(&p.url, &ca).await;
    assert!(!first.names.contains(&"reload.example".to_string()));

    let out = run(&["status", "--json"], &rig.state, &cli);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v = json_of(&out);
    assert_eq!(v["running"], true);
    assert_eq!(v["audit"]["state"], "ok");
    assert!(v["last_reload"].is_null());

    std::fs::write(
        &rig.config,
        "server_names = [\"reload.example\"]\ngc_interval_seconds = 7\n",
    )
    .unwrap();
    let pid = nix::unistd::Pid::from_raw(p.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    let v = status_until(&rig.state, &cli, |v| !v["last_reload"].is_null());
    let r = &v["last_reload"];
    assert_eq!(r["ok"], true, "{v}");
    assert_eq!(r["reissued"], true);
    assert_eq!(
        r["applied"],
        serde_json::json!(["certificate", "server_names"])
    );
    assert_eq!(
        r["restart_required"],
        serde_json::json!(["gc_interval_seconds"])
    );
    let second = served_cert(&p.url, &ca).await;
    assert!(
        second.names.contains(&"reload.example".to_string()),
        "{second:?}"
    );
    assert_ne!(second.sha256, first.sha256);
    // The service goes on serving with its tokens.
    let (st, _) = rig.call(format!("{}/v1/profiles", p.url), None).await;
    assert_eq!(st, 200);

    // An invalid file: refused, nothing changes, the service keeps running.
    std::fs::write(
        &rig.config,
        "server_names = [\"other.example\"]\nbogus = 1\n",
    )
    .unwrap();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    let v = status_until(&rig.state, &cli, |v| v["last_reload"]["ok"] == false);
    assert!(
        v["last_reload"]["error"]
            .as_str()
            .unwrap()
            .contains("bogus"),
        "{v}"
    );
    assert_eq!(served_cert(&p.url, &ca).await.sha256, second.sha256);

    // `cert renew` while running: served at once, and `cert show` agrees.
    std::fs::write(&rig.config, "server_names = [\"reload.example\"]\n").unwrap();
    let out = run(&["cert", "renew", "--json"], &rig.state, &cli);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let renewed = json_of(&out);
    assert_eq!(renewed["served_now"], true);
    let third = served_cert(&p.url, &ca).await;
    assert_eq!(
        renewed["certificate"]["sha256"].as_str().unwrap(),
        third.sha256
    );
    assert_ne!(third.sha256, second.sha256);
    assert!(third.names.contains(&"reload.example".to_string()));
    let shown = json_of(&run(&["cert", "show", "--json"], &rig.state, &cli));
    assert_eq!(
        shown["server"]["certificate"]["sha256"],
        third.sha256.as_str()
    );
    assert!(shown["server"]["days_left"].as_i64().unwrap() > 300);
    p.stop();
    let out = run(&["status"], &rig.state, &cli);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("not running"));
}

/// `init` creates what a first start would, is idempotent and refuses to
/// overwrite a token file; `backup` makes a consistent archive while the
/// service runs (and when it is stopped) that restores into a working
/// state directory with the same journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_then_backup_and_restore() {
    cube_adapter::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "").unwrap();
    let _reaper = crate::kit::SandboxReaper(state.join("embedded/sandboxes"));

    let out = run(&["status", "--json"], &state, &config);
    assert_eq!(out.status.code(), Some(3), "not initialised: {out:?}");

    let out = run(&["init"], &state, &config);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("admin token:  written to"), "{text}");
    let token = std::fs::read_to_string(state.join("admin.token")).unwrap();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    for f in [
        "state.redb",
        "secret.key",
        "hmac.key",
        "tls/server.pem",
        "tls/server.key",
    ] {
        assert!(state.join(f).exists(), "{f}");
    }
    // Again: nothing changes, no second admin token.
    let out = run(&["init"], &state, &config);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("none issued"));
    assert_eq!(
        std::fs::read_to_string(state.join("admin.token")).unwrap(),
        token
    );
    assert_eq!(std::fs::read(state.join("tls/ca.pem")).unwrap(), ca);
    let listed = json_of(&run(&["token", "list", "--json"], &state, &config));
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let existing = dir.path().join("taken.token");
    std::fs::write(&existing, "keep me").unwrap();
    let out = std::process::Command::new(crate::kit::BIN)
        .args(["init", "--admin-token-file"])
        .arg(&existing)
        .arg("--state-dir")
        .arg(&state)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert_eq!(std::fs::read_to_string(&existing).unwrap(), "keep me");
    let out = run(&["cert", "show", "--warn-days", "400"], &state, &config);
    assert_eq!(out.status.code(), Some(1), "397-day leaf: {out:?}");

    // The service starts on what init made (the same admin token works).
    let p = crate::kit::Proc::start(&state, &config, &[]).unwrap();
    let out = run(&["init"], &state, &config);
    assert_eq!(out.status.code(), Some(3), "init while running: {out:?}");
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap();
    let r: serde_json::Value = http
        .post(format!("{}/v1/leases/acquire", p.url))
        .bearer_auth(token.trim())
        .json(&serde_json::json!({"runtime": "mcp", "session_key": "backup"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let lease = r["lease_ref"].as_str().unwrap().to_string();
    let r = http
        .post(format!("{}/v1/leases/{lease}/exec", p.url))
        .bearer_auth(token.trim())
        .json(&serde_json::json!({"command": "echo hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // A backup while it runs.
    let archive = dir.path().join("b1.tar");
    let out = run(&["backup", archive.to_str().unwrap()], &state, &config);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("taken while the service ran"));
    {
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(&archive).unwrap().permissions().mode();
        assert_eq!(m & 0o777, 0o600);
    }
    let out = run(&["backup", archive.to_str().unwrap()], &state, &config);
    assert_eq!(out.status.code(), Some(2), "an existing file: {out:?}");
    // No snapshot left behind in the state directory.
    assert!(
        !std::fs::read_dir(&state)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("backup-"))
    );
    let running = json_of(&run(&["status", "--json"], &state, &config));
    assert_eq!(running["store"]["active_leases"], 1, "{running}");
    p.stop();
    let stopped = json_of(&run(&["status", "--json"], &state, &config));
    let events_after_stop = stopped["store"]["audit_last_seq"].as_u64().unwrap();

    // Restore into an absent directory: checked, then the journal
    // verifies, the tokens and the sealed keys work (an offline `cert
    // renew` unseals the CA key).
    let restored = dir.path().join("restored");
    let out = run(&["restore", archive.to_str().unwrap()], &restored, &config);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = run(&["restore", archive.to_str().unwrap()], &restored, &config);
    assert_eq!(out.status.code(), Some(2), "not empty: {out:?}");
    // A damaged archive restores nothing.
    let mut bytes = std::fs::read(&archive).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    let damaged = dir.path().join("damaged.tar");
    std::fs::write(&damaged, &bytes).unwrap();
    let elsewhere = dir.path().join("elsewhere");
    let out = run(&["restore", damaged.to_str().unwrap()], &elsewhere, &config);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(!elsewhere.exists());
    assert!(
        !std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains(".restore-")),
        "no staging directory left"
    );
    // The manifest as the archive has it (GNU tar reads our archives).
    let out = std::process::Command::new("tar")
        .arg("-xOf")
        .arg(&archive)
        .arg("MANIFEST.json")
        .output()
        .expect("tar is needed (Debian's tar package: GNU tar)");
    assert!(out.status.success(), "{out:?}");
    let manifest: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!restored.join("MANIFEST.json").exists());
    let out = run(&["audit", "verify"], &restored, &config);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("\"events\":{}", manifest["audit_events"])),
        "{text} vs {manifest}"
    );
    assert!(
        manifest["audit_events"].as_u64().unwrap() >= 4,
        "{manifest}"
    );
    assert!(manifest["audit_events"].as_u64().unwrap() <= events_after_stop);
    assert_eq!(manifest["summary"]["active_leases"], 1);
    let listed = json_of(&run(&["token", "list", "--json"], &restored, &config));
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let out = run(&["cert", "renew"], &restored, &config);
    assert_eq!(out.status.code(), Some(0), "{out:?}");

    // Stopped: the command takes the copy itself.
    let archive2 = dir.path().join("b2.tar");
    let out = run(&["backup", archive2.to_str().unwrap()], &state, &config);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("the service was stopped"));
    let out = std::process::Command::new("tar")
        .arg("-tf")
        .arg(&archive2)
        .output()
        .expect("tar is needed (Debian's tar package: GNU tar)");
    let names = String::from_utf8_lossy(&out.stdout);
    for n in [
        "MANIFEST.json",
        "state.redb",
        "secret.key",
        "hmac.key",
        "tls/ca.pem",
        "tls/ca.key",
    ] {
        assert!(names.lines().any(|l| l == n), "{n} missing: {names}");
    }
    assert!(
        !names
            .lines()
            .any(|l| l == "admin.token" || l.starts_with("embedded/")),
        "{names}"
    );
}

/// The rpm scriptlet creates the same user as the sysusers file.
#[test]
fn rpm_scriptlet_matches_sysusers() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let sysusers = std::fs::read_to_string(root.join("systemd/cube-adapter.sysusers")).unwrap();
    let line = sysusers
        .lines()
        .find(|l| l.starts_with("u cube-adapter "))
        .unwrap();
    let pre = std::fs::read_to_string(root.join("packaging/rpm/pre.sh")).unwrap();
    assert!(pre.contains(&format!("SYSUSERS='{line}'")), "{pre}");
    let unit = std::fs::read_to_string(root.join("systemd/cube-adapter.service")).unwrap();
    assert!(unit.contains("\nExecReload=/bin/kill -HUP $MAINPID\n"));
}

/// `status` exits 1 while the journal is blocked by a pending intent (a
/// crash between intent and outcome) and says why, running or stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_a_blocked_journal() {
    cube_adapter::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "[audit]\non_crash = \"block\"\n").unwrap();
    let _reaper = crate::kit::SandboxReaper(state.join("embedded/sandboxes"));
    let mut p = crate::kit::Proc::start(
        &state,
        &config,
        &[("CUBE_ADAPTER_FAILPOINT", "after_intent")],
    )
    .unwrap();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let token = std::fs::read_to_string(state.join("admin.token")).unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap();
    let r: serde_json::Value = http
        .post(format!("{}/v1/leases/acquire", p.url))
        .bearer_auth(token.trim())
        .json(&serde_json::json!({"runtime": "mcp", "session_key": "blocked"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let lease = r["lease_ref"].as_str().unwrap().to_string();
    let died = http
        .post(format!("{}/v1/leases/{lease}/exec", p.url))
        .bearer_auth(token.trim())
        .json(&serde_json::json!({"command": "true"}))
        .send()
        .await;
    assert!(died.is_err());
    p.child.wait().unwrap();

    let out = run(&["status", "--json"], &state, &config);
    assert_eq!(out.status.code(), Some(3), "stopped: {out:?}");
    let v = json_of(&out);
    assert_eq!(v["audit"]["state"], "reconciliation_required");
    assert_eq!(v["store"]["pending_intents"], 1);

    let p = crate::kit::Proc::start(&state, &config, &[]).unwrap();
    let out = run(&["status", "--json"], &state, &config);
    assert_eq!(out.status.code(), Some(1), "running, not ready: {out:?}");
    let v = json_of(&out);
    assert_eq!(v["running"], true);
    assert_eq!(v["ready"], false);
    assert_eq!(v["audit"]["state"], "reconciliation_required");
    assert_eq!(v["store"]["active_leases"], 1);
    p.stop();
}
