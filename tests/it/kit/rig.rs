//! Real `cube-adapter serve` processes: `Proc` (one process on 127.0.0.1:0
//! and its URL), `ProcRig` (a state directory, its first process and an
//! admin client; its sandboxes are ended on drop), and `revoke` (a token,
//! through the CLI).

use std::path::PathBuf;

use reqwest::StatusCode;
use serde_json::Value;

use super::{BIN, SandboxReaper};

/// A state directory for `serve` processes, and a client for them (made
/// once the first process has created the CA and the admin token).
pub struct ProcRig {
    _reaper: SandboxReaper,
    pub state: PathBuf,
    pub config: PathBuf,
    pub http: reqwest::Client,
    pub admin: String,
    _dir: tempfile::TempDir,
}

impl ProcRig {
    /// A fresh state directory and a first `serve` process on it.
    pub fn start() -> (Self, Proc) {
        Self::start_with("", &[])
    }

    /// As `start`, the configuration file holding `config` and the first
    /// process started with `env`.
    pub fn start_with(config: &str, env: &[(&str, &str)]) -> (Self, Proc) {
        Self::start_by(config, |state, config| Proc::start(state, config, env))
    }

    /// As `start_with`, the process run by `wrap` (a command that ends by
    /// running its arguments), its standard error kept in `log`.
    pub fn start_wrapped(config: &str, wrap: &[&str], log: &std::path::Path) -> (Self, Proc) {
        Self::start_by(config, |state, config| {
            Proc::start_wrapped(wrap, state, config, &[], log)
        })
    }

    fn start_by(
        config: &str,
        start: impl FnOnce(&std::path::Path, &std::path::Path) -> Result<Proc, String>,
    ) -> (Self, Proc) {
        cube_adapter::tls::install_default_provider();
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let config_file = dir.path().join("config.toml");
        std::fs::write(&config_file, config).unwrap();
        let config = config_file;
        let reaper = SandboxReaper(state.join("embedded/sandboxes"));
        let p = start(&state, &config).unwrap();
        let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
            .build()
            .unwrap();
        let admin = std::fs::read_to_string(state.join("admin.token"))
            .unwrap()
            .trim()
            .to_string();
        let rig = Self {
            _reaper: reaper,
            state,
            config,
            http,
            admin,
            _dir: dir,
        };
        (rig, p)
    }

    /// SIGKILL a process and start another on the same state.
    pub fn kill_and_restart(&self, p: Proc) -> Proc {
        Self::kill(p);
        self.start_again()
    }

    /// SIGKILL a process (and reap it).
    pub fn kill(mut p: Proc) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        p.child.wait().unwrap();
    }

    /// Another process on the same state.
    pub fn start_again(&self) -> Proc {
        Proc::start(&self.state, &self.config, &[]).unwrap()
    }

    /// Acquire a lease for `session` as the admin: its ref.
    pub async fn acquire(&self, url: &str, session: &str) -> String {
        let (st, v) = self
            .call(
                format!("{url}/v1/leases/acquire"),
                Some(serde_json::json!({"runtime": "mcp", "session_key": session})),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        v["lease_ref"].as_str().unwrap().to_string()
    }

    /// `cube-adapter ARGS… --state-dir STATE --config CONFIG`.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        super::cli_at(&self.state, &self.config, args)
    }

    /// `recording verify FILE` passes.
    pub fn assert_recording_verifies(&self, file: &std::path::Path) {
        let out = self.cli(&["recording", "verify", file.to_str().unwrap()]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    /// `status --json`.
    pub fn status(&self) -> Value {
        let out = self.cli(&["status", "--json"]);
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
    }

    /// `audit export`: the journal, an event a line.
    pub fn journal(&self) -> Vec<Value> {
        let out = self.cli(&["audit", "export"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// POST (with a body) or GET (without) as the admin.
    pub async fn call(&self, url: String, body: Option<Value>) -> (StatusCode, Value) {
        self.call_as(&self.admin, url, body).await
    }

    /// As `call`, with another token.
    pub async fn call_as(
        &self,
        token: &str,
        url: String,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let (method, r) = match body {
            Some(b) => ("POST", self.http.post(url).bearer_auth(token).json(&b)),
            None => ("GET", self.http.get(url).bearer_auth(token)),
        };
        super::spec::answer(method, r.send().await.unwrap()).await
    }
}

/// Revoke a token (by its id) through the CLI.
pub fn revoke(state: &std::path::Path, token: &str) {
    let id = token.split('_').nth(1).unwrap().to_string();
    let out = std::process::Command::new(BIN)
        .args(["token", "revoke", "--state-dir"])
        .arg(state)
        .arg(&id)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `cube-adapter serve` process on 127.0.0.1:0 and its URL.
pub struct Proc {
    pub child: std::process::Child,
    pub url: String,
}

impl Proc {
    pub fn start(
        state: &std::path::Path,
        config: &std::path::Path,
        env: &[(&str, &str)],
    ) -> Result<Self, String> {
        let log = std::env::var_os("CUBE_TEST_SERVE_LOG").map(PathBuf::from);
        Self::launch(std::process::Command::new(BIN), state, config, env, log)
    }

    /// As `start`, run by `wrap` (a command that ends by running its
    /// arguments: `unshare … sh -c '…; exec "$@"' sh`), standard error
    /// kept in `log`.
    pub fn start_wrapped(
        wrap: &[&str],
        state: &std::path::Path,
        config: &std::path::Path,
        env: &[(&str, &str)],
        log: &std::path::Path,
    ) -> Result<Self, String> {
        let mut cmd = std::process::Command::new(wrap[0]);
        cmd.args(&wrap[1..]).arg(BIN);
        Self::launch(cmd, state, config, env, Some(log.to_path_buf()))
    }

    fn launch(
        mut cmd: std::process::Command,
        state: &std::path::Path,
        config: &std::path::Path,
        env: &[(&str, &str)],
        log: Option<PathBuf>,
    ) -> Result<Self, String> {
        use std::io::BufRead;
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state)
            .arg("--config")
            .arg(config)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if !line.starts_with("cube-adapter listening on ") {
            let out = child.wait_with_output().unwrap();
            return Err(format!("{line}{}", String::from_utf8_lossy(&out.stderr)));
        }
        // Keep draining both pipes: a server whose stdout is closed would
        // fail its next print.
        let mut stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
        std::thread::spawn(move || match log {
            Some(f) => {
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(f)
                    .unwrap();
                std::io::copy(&mut stderr, &mut f)
            }
            None => std::io::copy(&mut stderr, &mut std::io::sink()),
        });
        Ok(Self {
            url: line.trim().rsplit(' ').next().unwrap().to_string(),
            child,
        })
    }

    pub fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}
