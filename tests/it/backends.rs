//! Several backends (issue 20): two standalone embedded backends in two
//! processes, named `staging` and `production`, behind one appliance.
//! Profiles route to them; the same session on both is two sandboxes;
//! workspaces (volumes on `production`) come back after a kill and after an
//! appliance restart, read-only ones refuse writes, checkpoints with a
//! mount need the profile's say-so, kills and GC destroy what they own and
//! nothing still mounted; `production` stopped answers its profiles 503
//! `backend_unavailable` while `staging` serves, and it serves again when
//! it returns. A reload (SIGHUP) adds a backend and refuses to remove one
//! with live leases.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cube_adapter::config::{BackendDef, BackendSection, Profile, Workspace, WorkspaceMode};
use cube_adapter::cube::{BackendConfig, CubeClient, ProxyUrl};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{BIN, Server, code};

const DOMAIN: &str = "cube.test";

/// A standalone embedded backend process on a fixed port and state
/// directory, so that it can be stopped and started again as itself.
struct Standalone {
    child: Option<Child>,
    dir: PathBuf,
    port: u16,
}

impl Standalone {
    fn start(dir: &Path, port: u16) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut child = Command::new(BIN)
            .args(["embedded-backend", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .args(["--plain-http", "--domain", DOMAIN, "--state-dir"])
            .arg(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let url = line.trim().rsplit(' ').next().unwrap_or_default();
        let port = url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the backend did not say where it listens: {line:?}"));
        Self {
            child: Some(child),
            dir: dir.to_path_buf(),
            port,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn section(&self) -> BackendSection {
        BackendSection {
            api_url: self.url(),
            proxy_url: Some(ProxyUrl::Url(self.url())),
            domain: DOMAIN.into(),
            api_key_file: None,
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            insecure_plain_http: true,
            template: None,
        }
    }

    fn client(&self) -> CubeClient {
        let mut c = BackendConfig::new("test", self.url());
        c.proxy_url = Some(ProxyUrl::Url(self.url()));
        c.domain = DOMAIN.into();
        c.insecure_plain_http = true;
        CubeClient::new(c).unwrap()
    }

    /// Whether one of its sandboxes' ids starts with `sandbox_ref`.
    fn holds(&self, sandbox_ref: &str) -> bool {
        std::fs::read_dir(self.dir.join("embedded/sandboxes"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(sandbox_ref))
    }

    async fn volumes(&self) -> Vec<String> {
        self.client()
            .list_volumes()
            .await
            .unwrap()
            .into_iter()
            .map(|v| v.volume_id)
            .collect()
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        self.stop();
        crate::kit::end_sandboxes(&self.dir.join("embedded/sandboxes"));
    }
}

fn profile(backend: &str, workspace: Workspace) -> Profile {
    Profile {
        backend: Some(backend.into()),
        workspace,
        ..Profile::default()
    }
}

fn per_session(retain: bool) -> Workspace {
    Workspace {
        mode: WorkspaceMode::PerSessionVolume,
        retain_on_kill: retain,
        ..Workspace::default()
    }
}

fn configure(
    cfg: &mut cube_adapter::config::Config,
    state: &Path,
    st: &Standalone,
    pr: &Standalone,
) {
    cfg.state_dir = state.to_path_buf();
    cfg.gc_interval_seconds = 0;
    cfg.backends = [
        ("staging".to_string(), BackendDef::Cubesandbox(st.section())),
        (
            "production".to_string(),
            BackendDef::Cubesandbox(pr.section()),
        ),
    ]
    .into();
    let ckpt = |allow: bool| Profile {
        checkpoints_enabled: true,
        allow_checkpoint_with_mounts: allow,
        ..profile("production", per_session(true))
    };
    cfg.profiles = [
        ("stage-code", profile("staging", Workspace::default())),
        ("prod-code", profile("production", per_session(true))),
        ("prod-scratch", profile("production", per_session(false))),
        (
            "prod-ro",
            profile(
                "production",
                Workspace {
                    mode: WorkspaceMode::ExistingVolume,
                    volume_id: Some("team-data".into()),
                    mount_path: "/data".into(),
                    read_only: true,
                    ..Workspace::default()
                },
            ),
        ),
        (
            "prod-shared",
            Profile {
                lease_idle_ttl_seconds: 1,
                ..profile(
                    "production",
                    Workspace {
                        mode: WorkspaceMode::PerSessionVolume,
                        volume_name: Some("team-shared".into()),
                        read_only: true,
                        retain_on_kill: false,
                        ..Workspace::default()
                    },
                )
            },
        ),
        ("prod-ckpt", ckpt(false)),
        ("prod-ckpt-mounts", ckpt(true)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
}

async fn acquire(s: &Server, profile: &str, session: &str) -> (StatusCode, Value) {
    s.post(
        &s.admin,
        "/v1/leases/acquire",
        json!({"runtime": "mcp", "session_key": session, "profile": profile}),
    )
    .await
}

async fn lease(s: &Server, profile: &str, session: &str) -> Value {
    let (st, v) = acquire(s, profile, session).await;
    assert_eq!(st, StatusCode::OK, "{profile}: {v}");
    v
}

async fn exec(s: &Server, lease: &Value, command: &str) -> Value {
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{}/exec", lease["lease_ref"].as_str().unwrap()),
            json!({"command": command}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{command}: {v}");
    v
}

async fn kill(s: &Server, lease: &Value) {
    let (st, v) = s
        .post(
            &s.admin,
            &format!(
                "/v1/leases/{}/release",
                lease["lease_ref"].as_str().unwrap()
            ),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
}

/// Poll `f` until it holds, for at most `secs`.
async fn until<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiles_run_on_their_backends_with_their_workspaces() {
    let root = tempfile::tempdir().unwrap();
    let st = Standalone::start(&root.path().join("staging"), 0);
    let mut pr = Standalone::start(&root.path().join("production"), 0);
    let state = root.path().join("appliance");
    let s = Server::start_with(|c| configure(c, &state, &st, &pr)).await;

    // Routing: the same session under each backend's profile is two
    // sandboxes, each on its own backend.
    let a = lease(&s, "stage-code", "same-session").await;
    let b = lease(&s, "prod-code", "same-session").await;
    assert_ne!(a["lease_ref"], b["lease_ref"]);
    let (ar, br) = (
        a["sandbox_ref"].as_str().unwrap(),
        b["sandbox_ref"].as_str().unwrap(),
    );
    assert!(
        st.holds(ar) && !pr.holds(ar),
        "staging's sandbox on staging"
    );
    assert!(
        pr.holds(br) && !st.holds(br),
        "production's sandbox on production"
    );
    assert_eq!(a["persistent_workspace"], false);
    assert_eq!(b["persistent_workspace"], true);
    // Isolation: what one writes the other does not see.
    exec(&s, &a, "echo staging > /tmp/where").await;
    let v = exec(&s, &b, "cat /tmp/where 2>&1; echo rc=$?").await;
    assert!(v["stdout"].as_str().unwrap().contains("rc=1"), "{v}");
    let (stt, v) = s
        .get(
            &s.admin,
            &format!("/v1/leases/{}/status", b["lease_ref"].as_str().unwrap()),
        )
        .await;
    assert_eq!(stt, StatusCode::OK);
    assert_eq!(v["volume_attached"], true, "{v}");

    // A retained workspace comes back after a kill…
    exec(&s, &b, "echo kept > /workspace/keep.txt").await;
    kill(&s, &b).await;
    assert!(!pr.holds(br));
    let b2 = lease(&s, "prod-code", "same-session").await;
    assert_ne!(b2["lease_ref"], b["lease_ref"]);
    let v = exec(&s, &b2, "cat /workspace/keep.txt").await;
    assert_eq!(v["stdout"], "kept\n");
    // …and after the appliance restarts.
    kill(&s, &b2).await;
    s.stop().await;
    let s = Server::start_with(|c| configure(c, &state, &st, &pr)).await;
    let b3 = lease(&s, "prod-code", "same-session").await;
    let v = exec(&s, &b3, "cat /workspace/keep.txt").await;
    assert_eq!(v["stdout"], "kept\n");

    // Read-only: the operator's volume refuses writes and is never
    // destroyed.
    let (stt, v) = acquire(&s, "prod-ro", "ro").await;
    assert_eq!(stt, StatusCode::BAD_GATEWAY, "no such volume yet: {v}");
    pr.client()
        .create_volume(&cube_adapter::cube::wire::CreateVolume {
            name: "team-data".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let ro = lease(&s, "prod-ro", "ro").await;
    let v = exec(&s, &ro, "touch /data/x 2>&1; echo rc=$?").await;
    let out = v["stdout"].as_str().unwrap();
    assert!(
        out.contains("Read-only file system") && out.contains("rc=1"),
        "{out}"
    );
    kill(&s, &ro).await;
    assert!(pr.volumes().await.contains(&"team-data".to_string()));

    // Checkpoints with a mount need allow_checkpoint_with_mounts; a fork
    // keeps the profile's workspace.
    let c = lease(&s, "prod-ckpt", "ckpt").await;
    let (stt, v) = s
        .post(
            &s.admin,
            &format!(
                "/v1/leases/{}/checkpoints",
                c["lease_ref"].as_str().unwrap()
            ),
            json!({"name": "one"}),
        )
        .await;
    assert_eq!(stt, StatusCode::CONFLICT, "{v}");
    assert_eq!(code(&v), "checkpoint_with_mount_denied");
    let c = lease(&s, "prod-ckpt-mounts", "ckpt-ok").await;
    exec(
        &s,
        &c,
        "echo in-volume > /workspace/v.txt; echo in-root > /root/r.txt",
    )
    .await;
    let (stt, v) = s
        .post(
            &s.admin,
            &format!(
                "/v1/leases/{}/checkpoints",
                c["lease_ref"].as_str().unwrap()
            ),
            json!({"name": "one"}),
        )
        .await;
    assert_eq!(stt, StatusCode::CREATED, "{v}");
    let ck = v["checkpoint_ref"].as_str().unwrap().to_string();
    let (stt, f) = s
        .post(
            &s.admin,
            &format!(
                "/v1/leases/{}/checkpoints/{ck}/fork",
                c["lease_ref"].as_str().unwrap()
            ),
            json!({"branch": "b1"}),
        )
        .await;
    assert_eq!(stt, StatusCode::CREATED, "{f}");
    assert_eq!(f["persistent_workspace"], true, "{f}");
    let v = exec(&s, &f, "cat /root/r.txt; ls /workspace").await;
    // The root comes from the snapshot; the fork's workspace is its own.
    assert_eq!(v["stdout"], "in-root\n", "{v}");
    assert!(pr.holds(f["sandbox_ref"].as_str().unwrap()));

    // Cleanup: a kill destroys an owned volume not to be retained.
    let before = pr.volumes().await;
    let x = lease(&s, "prod-scratch", "scratch").await;
    let made: Vec<String> = pr
        .volumes()
        .await
        .into_iter()
        .filter(|v| !before.contains(v))
        .collect();
    assert_eq!(made.len(), 1, "{made:?}");
    kill(&s, &x).await;
    assert!(!pr.volumes().await.contains(&made[0]));
    // GC never destroys a volume another lease still mounts.
    let g1 = lease(&s, "prod-shared", "g1").await;
    let g2 = lease(&s, "prod-shared", "g2").await;
    assert!(pr.volumes().await.contains(&"team-shared".to_string()));
    kill(&s, &g1).await;
    assert!(pr.volumes().await.contains(&"team-shared".to_string()));
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (stt, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(stt, StatusCode::OK, "{v}");
    assert!(v["collected"].as_u64().unwrap() >= 1, "{v}");
    let (stt, _) = s
        .get(
            &s.admin,
            &format!("/v1/leases/{}/status", g2["lease_ref"].as_str().unwrap()),
        )
        .await;
    assert_eq!(stt, StatusCode::NOT_FOUND, "collected");
    assert!(!pr.volumes().await.contains(&"team-shared".to_string()));

    // Production stops: its profiles get 503 backend_unavailable (with
    // Retry-After) while staging's keep working.
    let port = pr.port;
    pr.stop();
    until(20, "production seen down", || async {
        let (stt, v) = acquire(&s, "prod-code", "down").await;
        stt == StatusCode::SERVICE_UNAVAILABLE && code(&v) == "backend_unavailable"
    })
    .await;
    let (stt, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{}/exec", b3["lease_ref"].as_str().unwrap()),
            json!({"command": "true"}),
        )
        .await;
    assert_eq!(stt, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(code(&v), "backend_unavailable");
    let r = s
        .http
        .post(format!("{}/v1/leases/acquire", s.url))
        .bearer_auth(&s.admin)
        .json(&json!({"runtime": "mcp", "session_key": "down", "profile": "prod-code"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["retry-after"], "5");
    let v = exec(&s, &a, "cat /tmp/where").await;
    assert_eq!(v["stdout"], "staging\n");
    lease(&s, "stage-code", "while-down").await;
    // Readiness holds while one backend is ready, and names none of them
    // (#34 L9: `status` has the detail, below).
    let (stt, v) = s.get("", "/readyz").await;
    assert_eq!(stt, StatusCode::OK, "{v}");
    assert_eq!(v["checks"]["cube_api"], "degraded", "{v}");
    assert!(!v.to_string().contains("production"), "{v}");
    let out = s.cli(&["status", "--json"]);
    let stv: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stv["backends"]["production"]["up"], false, "{stv}");
    assert_eq!(stv["backends"]["staging"]["up"], true, "{stv}");
    let out = s.cli(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("backend production:") && text.contains("DOWN"),
        "{text}"
    );

    // It returns: its profiles serve again, its sandboxes as they were.
    let pr2 = Standalone::start(&root.path().join("production"), port);
    until(20, "production seen up", || async {
        acquire(&s, "prod-code", "down").await.0 == StatusCode::OK
    })
    .await;
    let v = exec(&s, &b3, "cat /workspace/keep.txt").await;
    assert_eq!(v["stdout"], "kept\n");

    // The journal names the backend of each effect.
    let j = s.journal();
    assert!(j.contains("\"backend\":\"production\"") && j.contains("\"backend\":\"staging\""));
    s.stop().await;
    drop(pr2);
}

/// SIGHUP adds a backend; removing one with live leases is refused with
/// the reason, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_a_backend_and_keeps_one_with_leases() {
    let root = tempfile::tempdir().unwrap();
    let st = Standalone::start(&root.path().join("staging"), 0);
    let mut pr = Standalone::start(&root.path().join("production"), 0);
    let state = root.path().join("appliance");
    let config = root.path().join("config.toml");
    let section = |name: &str, b: &Standalone| {
        format!(
            "[backends.{name}]\nkind = \"cubesandbox\"\napi_url = \"{u}\"\nproxy_url = {{ url = \"http://{DOMAIN}\", dial = \"127.0.0.1:{port}\" }}\ndomain = \"{DOMAIN}\"\ninsecure_plain_http = true\n\n[profiles.{name}-code]\nbackend = \"{name}\"\n\n",
            u = b.url(),
            port = b.port
        )
    };
    std::fs::write(&config, section("staging", &st)).unwrap();
    let p = crate::kit::Proc::start(&state, &config, &[]).unwrap();
    let pid = nix::unistd::Pid::from_raw(p.child.id() as i32);
    let admin = std::fs::read_to_string(state.join("admin.token")).unwrap();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap();
    let acquire = |profile: &str| {
        http.post(format!("{}/v1/leases/acquire", p.url))
            .bearer_auth(admin.trim())
            .json(&json!({"runtime": "mcp", "session_key": "s", "profile": profile}))
            .send()
    };
    assert_eq!(
        acquire("production-code").await.unwrap().status(),
        StatusCode::FORBIDDEN
    );
    let status = || {
        let out = Command::new(BIN)
            .args(["status", "--json", "--state-dir"])
            .arg(&state)
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    // Added.
    std::fs::write(
        &config,
        section("staging", &st) + &section("production", &pr),
    )
    .unwrap();
    let before = status()["last_reload"].clone();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    until(20, "the reload", || async {
        status()["last_reload"]["at"] != before
    })
    .await;
    let v = status();
    assert_eq!(v["last_reload"]["ok"], true, "{v}");
    assert!(v["backends"]["production"].is_object(), "{v}");
    let r = acquire("production-code").await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let l: Value = r.json().await.unwrap();
    assert!(pr.holds(l["sandbox_ref"].as_str().unwrap()));
    // Removed while its lease lives: refused, and it keeps serving.
    std::fs::write(&config, section("staging", &st)).unwrap();
    let before = status()["last_reload"].clone();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    until(20, "the second reload", || async {
        status()["last_reload"]["at"] != before
    })
    .await;
    let v = status();
    assert_eq!(v["last_reload"]["ok"], false, "{v}");
    let e = v["last_reload"]["error"].as_str().unwrap();
    assert!(
        e.contains("backend 'production' has 1 live lease(s)"),
        "{e}"
    );
    assert_eq!(
        acquire("production-code").await.unwrap().status(),
        StatusCode::OK
    );
    // The added backend's health is watched like the others'.
    pr.stop();
    until(20, "the added backend seen down", || async {
        acquire("production-code").await.unwrap().status() == StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    p.stop();
    drop(pr);
    drop(st);
}

/// A forwarder to a backend's CubeAPI that holds every `GET /health` for
/// `hold` before passing it on, as a busy backend answers its health probe
/// only behind the real work queued before it. Other requests pass at once.
async fn hold_health(backend_port: u16, hold: Duration) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            tokio::spawn(async move {
                let Ok(upstream) =
                    tokio::net::TcpStream::connect(("127.0.0.1", backend_port)).await
                else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut ur, mut uw) = upstream.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut ur, &mut cw).await;
                });
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if buf[..n].starts_with(b"GET /health ") {
                        tokio::time::sleep(hold).await;
                    }
                    if uw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// A busy backend is not declared down (#35): its health probe gets no
/// answer within its 3 s (held back, as behind real work) while its real
/// calls are answered, and every call succeeds, none 503. Once it answers
/// no real call any more (idle here), the failing probes do take it down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_backend_whose_calls_complete_is_not_declared_down() {
    let root = tempfile::tempdir().unwrap();
    let b = Standalone::start(&root.path().join("busy"), 0);
    let api = hold_health(b.port, Duration::from_secs(8)).await;
    let state = root.path().join("appliance");
    let s = Server::start_with(|c| {
        c.state_dir = state.clone();
        c.gc_interval_seconds = 0;
        let mut section = b.section();
        section.api_url = format!("http://127.0.0.1:{api}");
        c.backends = [("busy".to_string(), BackendDef::Cubesandbox(section))].into();
        c.profiles = [(
            "busy-code".to_string(),
            profile("busy", Workspace::default()),
        )]
        .into();
    })
    .await;
    let l = lease(&s, "busy-code", "busy").await;
    // Four probes' worth of calls (each probe fails after 3 s): every one
    // succeeds, the backend stays up.
    let end = Instant::now() + Duration::from_secs(16);
    let mut calls = 0;
    while Instant::now() < end {
        let v = exec(&s, &l, "echo busy").await;
        assert_eq!(v["stdout"], "busy\n");
        calls += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(calls > 10, "{calls}");
    let up = || async {
        let text = crate::metrics::exposition(&s.http, &s.url).await;
        crate::metrics::sample(&text, "cube_adapter_backend_up", &["backend=\"busy\""])
    };
    assert_eq!(up().await, Some(1.0));
    // Idle (nothing answered any more: /metrics asks no backend), its
    // probes still failing: down.
    until(
        40,
        "the idle backend with failing probes seen down",
        || async { up().await == Some(0.0) },
    )
    .await;
    s.stop().await;
}
