//! The appliance in-process: `cube_adapter::app::serve` on 127.0.0.1:0 with
//! a fresh state directory, a TLS client trusting its generated CA, and the
//! admin token; plus `raw_request` (bytes over TLS) and `code` (an error
//! answer's `error.code`).

use std::path::PathBuf;
use std::sync::Arc;

use cube_adapter::config::Config;
use reqwest::StatusCode;
use serde_json::{Value, json};

use super::BIN;

pub struct Server {
    pub dir: tempfile::TempDir,
    pub url: String,
    pub http: reqwest::Client,
    pub admin: String,
    pub state: PathBuf,
    /// The embedded backend's state directory as configured
    /// (`embedded.state_dir`, else `STATE/embedded`): its sandboxes are
    /// ended on drop.
    embedded: PathBuf,
    /// The running appliance's background tasks, by name.
    pub tasks: Vec<&'static str>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<cube_adapter::app::Shutdown>>,
}

impl Server {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(tweak: impl FnOnce(&mut Config)) -> Self {
        Self::start_full(tweak, Default::default()).await
    }

    pub async fn start_full(
        tweak: impl FnOnce(&mut Config),
        secrets: cube_adapter::app::EnvSecrets,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_on(listener, tweak, secrets).await
    }

    /// As `start_full`, on a listener the test bound (it needs the address
    /// before the appliance starts: a provider's redirect URI).
    pub async fn start_on(
        listener: tokio::net::TcpListener,
        tweak: impl FnOnce(&mut Config),
        secrets: cube_adapter::app::EnvSecrets,
    ) -> Self {
        cube_adapter::tls::install_default_provider();
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config {
            state_dir: dir.path().join("state"),
            profiles: cube_adapter::config::shipped_profiles(),
            ..Config::default()
        };
        // Tests run against the embedded backend as a faithful stand-in for
        // a real CubeSandbox (issue #16); a test may turn it off.
        cfg.embedded.faithful = true;
        tweak(&mut cfg);
        let state = cfg.state_dir.clone();
        let embedded = cfg
            .embedded
            .state_dir
            .clone()
            .unwrap_or_else(|| state.join("embedded"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let running = cube_adapter::app::start(
            cfg,
            secrets,
            listener,
            PathBuf::from(BIN),
            cube_adapter::app::Reload::Off,
        )
        .await
        .unwrap_or_else(|e| panic!("server failed to start: {e:#}"));
        let started = running.started().clone();
        let tasks = running.task_names();
        let task = tokio::spawn(async move {
            let _ = rx.await;
            running.shutdown().await
        });
        let ca = std::fs::read(&started.ca_file).unwrap();
        let tls = cube_adapter::tls::client_config(Some(&ca), None).unwrap();
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .build()
            .unwrap();
        let admin = std::fs::read_to_string(state.join("admin.token"))
            .unwrap()
            .trim()
            .to_string();
        Self {
            dir,
            url: started.url,
            http,
            admin,
            state,
            embedded,
            tasks,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    pub async fn stop(mut self) {
        self.halt().await;
    }

    /// Stop serving (as `stop`), keeping the state directory until dropped.
    pub async fn halt(&mut self) {
        let _ = self.shut_down().await;
    }

    /// Stop serving (as `halt`), with how the shutdown went (`None`: it
    /// had already been stopped).
    pub async fn shut_down(&mut self) -> Option<cube_adapter::app::Shutdown> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // The shutdown closes the store last: the file is free after it.
        match self.task.take() {
            Some(t) => Some(t.await.unwrap()),
            None => None,
        }
    }

    /// POST a JSON body; the status and JSON answer, checked against
    /// `docs/openapi.yaml` (`kit::spec`).
    pub async fn post(&self, token: &str, path: &str, body: Value) -> (StatusCode, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.url))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap();
        super::spec::answer("POST", r).await
    }

    /// GET; the status and JSON answer, checked as `post`'s.
    pub async fn get(&self, token: &str, path: &str) -> (StatusCode, Value) {
        let r = self
            .http
            .get(format!("{}{path}", self.url))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        super::spec::answer("GET", r).await
    }

    /// Issue a token through the CLI (reaches the running server's admin socket).
    pub fn token(&self, args: &[&str]) -> String {
        let out = self.cli(&[&["token", "create"], args].concat());
        assert!(
            out.status.success(),
            "token create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let t = String::from_utf8(out.stdout).unwrap();
        assert_eq!(t.lines().count(), 1, "the token alone on stdout");
        t.trim().to_string()
    }

    /// An empty config file, so that no host config is read.
    pub fn empty_config(&self) -> PathBuf {
        let p = self.dir.path().join("empty.toml");
        if !p.exists() {
            std::fs::write(&p, "").unwrap();
        }
        p
    }

    pub async fn acquire(&self, token: &str, session: &str) -> String {
        let (s, v) = self
            .post(
                token,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": session}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v["lease_ref"].as_str().unwrap().to_string()
    }

    /// As the admin, acquire a lease of `profile` for `session`: its ref.
    pub async fn acquire_in(&self, profile: &str, session: &str) -> String {
        let (st, v) = self
            .post(
                &self.admin,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": session, "profile": profile}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        v["lease_ref"].as_str().unwrap().to_string()
    }

    /// As the admin, acquire a lease of `profile` (session named after it)
    /// and run `command` there through `/v1` exec: its stdout.
    pub async fn run_in_profile(&self, profile: &str, command: &str) -> String {
        let lease = self.acquire_in(profile, profile).await;
        let (st, v) = self
            .post(
                &self.admin,
                &format!("/v1/leases/{lease}/exec"),
                json!({"command": command}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        v["stdout"].as_str().unwrap().to_string()
    }

    /// `cube-adapter ARGS… --state-dir STATE --config EMPTY`: a command on
    /// this appliance's state directory, as an operator runs it.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        super::cli_at(&self.state, &self.empty_config(), args)
    }

    /// `token list --json`: the tokens as the CLI lists them.
    pub fn token_list(&self) -> Vec<Value> {
        let out = self.cli(&["token", "list", "--json"]);
        assert!(out.status.success(), "token list: {out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The audit journal as `audit export` prints it, one JSON event a line.
    pub fn journal(&self) -> String {
        let out = self.cli(&["audit", "export"]);
        assert!(
            out.status.success(),
            "audit export: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// The journal's events of one action, oldest first.
    pub fn events(&self, action: &str) -> Vec<Value> {
        self.journal()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["action"] == action)
            .collect()
    }

    /// SIGKILL every sandbox's init, as the kernel's OOM killer or a crash
    /// would, and wait until they are dead: the sandboxes die under their
    /// leases.
    pub fn kill_sandboxes(&self) {
        let inits = super::end_sandboxes(&self.embedded.join("sandboxes"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while inits.iter().any(|p| !super::backend::is_zombie(*p))
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    pub fn sandboxes(&self) -> usize {
        std::fs::read_dir(self.embedded.join("sandboxes"))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        super::end_sandboxes(&self.embedded.join("sandboxes"));
    }
}

/// Send raw bytes over TLS and return what comes back first.
pub async fn raw_request(s: &Server, req: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ca = std::fs::read(s.state.join("tls/ca.pem")).unwrap();
    let cfg = cube_adapter::tls::client_config(Some(&ca), None).unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let addr = s.url.trim_start_matches("https://").to_string();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tls.read(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// The `error.code` of an error answer (`""` if none).
pub fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}
