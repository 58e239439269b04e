//! Running under systemd: the notification protocol of `Type=notify`.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use crate::appliance::{Proc, SandboxReaper};

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
    let recv = |buf: &mut [u8]| {
        let n = sock.recv(buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let first = recv(&mut buf);
    assert!(
        first.starts_with("READY=1\nSTATUS=listening on https://127.0.0.1:"),
        "{first}"
    );
    let second = recv(&mut buf);
    assert_eq!(second, "WATCHDOG=1");
    p.stop();
    let mut saw_stopping = false;
    for _ in 0..20 {
        let m = recv(&mut buf);
        if m.starts_with("STOPPING=1") {
            saw_stopping = true;
            break;
        }
        assert_eq!(m, "WATCHDOG=1");
    }
    assert!(saw_stopping);
}

/// The shipped unit and the embedded drop-in pass `systemd-analyze verify`
/// without a warning (where systemd's tools exist).
#[test]
fn systemd_units_verify() {
    let Ok(which) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        eprintln!("systemd-analyze is not installed: skipped");
        return;
    };
    assert!(which.status.success());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd");
    let unit = std::fs::read_to_string(root.join("cube-adapter.service"))
        .unwrap()
        .replace("/usr/bin/cube-adapter", crate::common::BIN);
    let dropin = std::fs::read_to_string(root.join("embedded.conf")).unwrap();
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
        let err = String::from_utf8_lossy(&out.stderr);
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
                    || (rest.contains(" = ")
                        && !rest.contains("_file")
                        && !rest.starts_with("proxy_url")) =>
            {
                rest.to_string()
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(example.contains("\n[profiles.offline-code]\n"));
    for (name, body) in [
        ("shipped.toml", text.as_str()),
        ("example.toml", example.as_str()),
    ] {
        let f = dir.path().join(name);
        std::fs::write(&f, body).unwrap();
        let out = std::process::Command::new(crate::common::BIN)
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
