//! The appliance against a CubeSandbox that behaves as production does
//! (issue #16): the embedded backend as a faithful stand-in, configured as a
//! separate CubeSandbox backend (`[backend]`) and reached through a tap that
//! records every request and can answer in the backend's place. Leases,
//! idle timeouts, paused sandboxes, creates that time out, `/workspace`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use cube_adapter::config::BackendSection;
use cube_adapter::embedded::Backend;
use serde_json::{Value, json};

use crate::kit::Server;
use crate::kit::backend::settings;

/// One request as the tap saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    body: String,
}

/// What the tap does with a request.
enum Act {
    Forward,
    /// Forward it, then answer this instead of the backend's answer.
    ForwardThenAnswer(u16, &'static str),
}

type Rule = Arc<dyn Fn(&Seen) -> Act + Send + Sync>;

/// A faithful embedded backend on plain HTTP, and a tap in front of it.
struct Rig {
    _dir: tempfile::TempDir,
    backend: Backend,
    tap: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: tokio_util::sync::CancellationToken,
}

impl Rig {
    async fn start(rule: Rule) -> Self {
        Self::start_keyed(rule, None).await
    }

    /// With `key`: CubeAPI calls must present it.
    async fn start_keyed(rule: Rule, key: Option<&str>) -> Self {
        cube_adapter::tls::install_default_provider();
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path());
        s.faithful = Some(cube_adapter::embedded::sandbox::Faithful::default());
        let backend = Backend::open(s, key.map(str::to_string)).unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        backend.spawn_reaper(stop.clone());
        let bl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = format!("http://{}", bl.local_addr().unwrap());
        let app = backend.router();
        tokio::spawn(async move { axum::serve(bl, app).await });

        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let log = seen.clone();
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let tap = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let (log, http, rule, upstream) =
                (log.clone(), http.clone(), rule.clone(), upstream.clone());
            async move {
                let (parts, body) = req.into_parts();
                let body = axum::body::to_bytes(body, 64 << 20).await.unwrap();
                let s = Seen {
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_string(),
                    body: String::from_utf8_lossy(&body).into_owned(),
                };
                log.lock().unwrap().push(s.clone());
                let pq = parts
                    .uri
                    .path_and_query()
                    .map(|p| p.as_str().to_string())
                    .unwrap_or_default();
                let mut r = http.request(parts.method.clone(), format!("{upstream}{pq}"));
                for (k, v) in &parts.headers {
                    if k != "content-length" {
                        r = r.header(k, v);
                    }
                }
                let resp = r.body(body).send().await.unwrap();
                if let Act::ForwardThenAnswer(code, body) = rule(&s) {
                    let _ = resp.bytes().await;
                    return axum::http::Response::builder()
                        .status(code)
                        .header("content-type", "application/json")
                        .body(axum::body::Body::from(body))
                        .unwrap();
                }
                let mut b = axum::http::Response::builder().status(resp.status().as_u16());
                for (k, v) in resp.headers() {
                    b = b.header(k.as_str(), v.as_bytes());
                }
                b.body(axum::body::Body::from_stream(resp.bytes_stream()))
                    .unwrap()
            }
        });
        let tl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tap_url = format!("http://{}", tl.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(tl, tap).await });
        Rig {
            _dir: dir,
            backend,
            tap: tap_url,
            seen,
            stop,
        }
    }

    fn section(&self) -> BackendSection {
        toml::from_str(&format!(
            "api_url = \"{0}\"\nproxy_url = \"{0}\"\ndomain = \"cube.test\"\ninsecure_plain_http = true\n",
            self.tap
        ))
        .unwrap()
    }

    fn seen(&self, method: &str, path_part: &str) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == method && s.path.contains(path_part))
            .cloned()
            .collect()
    }

    fn clear(&self) {
        self.seen.lock().unwrap().clear();
    }

    fn state(&self, id: &str) -> String {
        self.backend.manager.detail(id).unwrap().state
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
        let ids: Vec<String> = self
            .backend
            .manager
            .list(&[], None, 1000)
            .into_iter()
            .map(|s| s.sandbox_id)
            .collect();
        let m = self.backend.manager.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for id in ids {
                    let _ = m.kill(&id).await;
                }
            });
        })
        .join()
        .unwrap();
    }
}

fn forward() -> Rule {
    Arc::new(|_| Act::Forward)
}

async fn server(rig: &Rig, tweak: impl FnOnce(&mut cube_adapter::config::Profile)) -> Server {
    let section = rig.section();
    Server::start_with(move |c| {
        c.backend = Some(section);
        c.gc_interval_seconds = 0;
        tweak(c.profiles.get_mut("offline-code").unwrap());
    })
    .await
}

async fn acquire(s: &Server, session: &str) -> (StatusCode, Value) {
    s.post(
        &s.admin,
        "/v1/leases/acquire",
        json!({"runtime": "mcp", "session_key": session, "profile": "offline-code"}),
    )
    .await
}

async fn exec(s: &Server, lease: &str, command: &str) -> (StatusCode, Value) {
    s.post(
        &s.admin,
        &format!("/v1/leases/{lease}/exec"),
        json!({"command": command, "timeout_ms": 60_000}),
    )
    .await
}

/// The sandbox id behind a lease, from the backend.
fn only_sandbox(rig: &Rig) -> String {
    let all = rig.backend.manager.list(&[], None, 1000);
    assert_eq!(all.len(), 1, "{all:?}");
    all.into_iter().next().unwrap().sandbox_id
}

/// A create that CubeAPI answers with 408 (its 30 s budget) may still
/// finish: the appliance finds the sandbox by the attempt's metadata and
/// kills it, recorded in the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_that_times_out_leaves_no_sandbox() {
    let rig = Rig::start(Arc::new(|s: &Seen| {
        if s.method == "POST" && s.path == "/sandboxes" {
            Act::ForwardThenAnswer(408, r#"{"code":408,"message":"request timed out"}"#)
        } else {
            Act::Forward
        }
    }))
    .await;
    let s = server(&rig, |_| {}).await;
    let (st, v) = acquire(&s, "orphan").await;
    assert_eq!(st, StatusCode::GATEWAY_TIMEOUT, "{v}");
    let mut left = usize::MAX;
    for _ in 0..100 {
        left = rig.backend.manager.count();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        left, 0,
        "the sandbox of the timed-out create is still there"
    );
    assert_eq!(rig.seen("DELETE", "/sandboxes/").len(), 1);
    let j = s.journal();
    assert!(
        j.contains("\"orphan_kill\""),
        "no orphan_kill in the journal"
    );
    s.stop().await;
}

/// The stock image has no /workspace: every new sandbox gets one made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sandboxes_get_a_workspace() {
    let rig = Rig::start(forward()).await;
    let s = server(&rig, |_| {}).await;
    let (st, v) = acquire(&s, "ws").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    // A configured CubeSandbox runs MicroVMs, and says so.
    assert_eq!(v["executor"], "cubesandbox-microvm");
    let made = rig.seen("POST", "/filesystem.Filesystem/MakeDir");
    assert!(
        made.iter().any(|m| m.body.contains("\"/workspace\"")),
        "no MakeDir /workspace: {made:?}"
    );
    s.stop().await;
}

/// Without `cube-lifecycle-manager` nothing resumes a paused sandbox on
/// traffic (`autoResume` false here): a lease released with `pause`, and a
/// sandbox an idle timeout paused behind the appliance's back, are resumed
/// with `connect` before use, and work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_sandboxes_are_resumed_before_use() {
    let rig = Rig::start(forward()).await;
    let s = server(&rig, |p| p.lifecycle.auto_resume = false).await;
    let (st, v) = acquire(&s, "paused").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    let (st, v) = exec(&s, &lease, "echo one > /workspace/f").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let id = only_sandbox(&rig);

    // Released with pause, then used again.
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/release"),
            json!({"action": "pause"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(rig.state(&id), "paused");
    rig.clear();
    let (st, v) = exec(&s, &lease, "cat /workspace/f").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "one\n");
    assert_eq!(rig.seen("POST", "/connect").len(), 1);
    assert_eq!(rig.state(&id), "running");

    // Paused behind the appliance's back (as an idle timeout does).
    rig.backend.manager.pause(&id).await.unwrap();
    rig.clear();
    let (st, v) = exec(&s, &lease, "cat /workspace/f").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "one\n");
    assert_eq!(rig.seen("POST", "/connect").len(), 1);
    assert_eq!(rig.state(&id), "running");
    s.stop().await;
}

/// Timeouts are idle timeouts: an agent using its sandbox keeps it (a
/// 2 s timeout, used for 5 s, is never paused), and a call longer than the
/// timeout is not paused under itself (the stand-in, like CubeProxy,
/// counts a call only when it ends; the appliance renews the sandbox while
/// the call runs). Left alone, the sandbox is paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn use_keeps_a_sandbox_alive_and_long_calls_are_not_paused() {
    let rig = Rig::start(forward()).await;
    let s = server(&rig, |p| {
        p.sandbox_timeout_seconds = 3;
        p.lifecycle.on_timeout = "pause".into();
        p.lifecycle.auto_resume = false;
        p.keepalive_enabled = false;
    })
    .await;
    let (st, v) = acquire(&s, "busy").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    let id = only_sandbox(&rig);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(6) {
        let (st, v) = exec(&s, &lease, "true").await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(rig.state(&id), "running", "paused while in use");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // One call of 7 s against a 3 s idle timeout.
    let watch = {
        let m = rig.backend.manager.clone();
        let id = id.clone();
        tokio::spawn(async move {
            let mut states = BTreeMap::new();
            for _ in 0..70 {
                *states
                    .entry(m.detail(&id).map(|d| d.state).unwrap_or_default())
                    .or_insert(0) += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            states
        })
    };
    let (st, v) = exec(&s, &lease, "sleep 7; echo done").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "done\n");
    let states = watch.await.unwrap();
    assert_eq!(states.keys().collect::<Vec<_>>(), ["running"], "{states:?}");
    assert!(rig.seen("POST", "/connect").is_empty());
    // Left alone, it is paused after its idle timeout.
    let mut paused = false;
    for _ in 0..80 {
        if rig.state(&id) == "paused" {
            paused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(paused, "an idle sandbox was not paused");
    s.stop().await;
}

/// A renewal shorter than the profile's timeout sets that timeout on the
/// sandbox, where it stays (a real CubeSandbox keeps a timeout until it is
/// set again): the next use sets the profile's back, as the appliance's own
/// audited action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_renewal_is_undone_by_the_next_use() {
    let rig = Rig::start(forward()).await;
    let s = server(&rig, |p| p.sandbox_timeout_seconds = 300).await;
    let (st, v) = acquire(&s, "renew").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let lease = v["lease_ref"].as_str().unwrap().to_string();
    rig.clear();
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/renew"),
            json!({"seconds": 30}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let set = rig.seen("POST", "/timeout");
    assert_eq!(set.len(), 1, "{set:?}");
    assert!(set[0].body.contains("30"), "{set:?}");
    let (st, v) = exec(&s, &lease, "true").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let set = rig.seen("POST", "/timeout");
    assert_eq!(set.len(), 2, "{set:?}");
    assert!(set[1].body.contains("300"), "{set:?}");
    // Restored once: the next use sets nothing.
    let (st, v) = exec(&s, &lease, "true").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(rig.seen("POST", "/timeout").len(), 2);
    assert!(s.journal().contains("\"keepalive\""));
    s.stop().await;
}

/// `cube-adapter status` runs the first-connection checklist of
/// docs/operations.md: CubeAPI, CubeProxy, the credentials, the templates,
/// each `[ok]` or `[FAIL]` with what it found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_runs_the_first_connection_checklist() {
    let rig = Rig::start_keyed(forward(), Some("the-right-key")).await;
    let keydir = tempfile::tempdir().unwrap();
    let status = |s: &Server| {
        let out = std::process::Command::new(crate::kit::BIN)
            .args(["status", "--state-dir"])
            .arg(&s.state)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for (key, template, good) in [
        ("the-right-key", "host", true),
        ("a-wrong-key", "host", false),
        ("the-right-key", "no-such-template", false),
    ] {
        let key_file = keydir.path().join(format!("{key}-{template}"));
        std::fs::write(&key_file, key).unwrap();
        let mut section = rig.section();
        section.api_key_file = Some(key_file);
        let s = Server::start_with(move |c| {
            c.backend = Some(section);
            c.profiles.retain(|n, _| n == "offline-code");
            c.profiles.get_mut("offline-code").unwrap().template = template.into();
        })
        .await;
        let out = status(&s);
        assert!(out.contains("[ok]   CubeAPI answers GET /health"), "{out}");
        assert!(
            out.contains("[ok]   CubeProxy answers for *.cube.test"),
            "{out}"
        );
        if good {
            assert!(!out.contains("[FAIL]"), "{out}");
            assert!(
                out.contains(&format!("[ok]   template {template} exists and is READY")),
                "{out}"
            );
        } else if key == "a-wrong-key" {
            assert!(
                out.contains("[FAIL] CubeAPI accepts the appliance's credentials"),
                "{out}"
            );
            assert!(out.contains("api_key_file"), "{out}");
        } else {
            assert!(
                out.contains(&format!(
                    "[FAIL] template {template} exists and is READY: no such template"
                )),
                "{out}"
            );
            // An agent's acquire meets it as a code of its own (#35 item
            // 3): the operator's misconfigured profile, not a command that
            // failed; the message names the template.
            let (st, v) = s
                .post(
                    &s.admin,
                    "/v1/leases/acquire",
                    json!({"runtime": "mcp", "session_key": "t"}),
                )
                .await;
            assert_eq!(
                (st, crate::kit::code(&v)),
                (StatusCode::BAD_GATEWAY, "template_not_found"),
                "{v}"
            );
            assert!(v.to_string().contains(template), "{v}");
        }
        assert!(!out.contains(key), "the key was printed: {out}");
        s.stop().await;
    }
}

/// A create that failed on our side and finished on the backend after the
/// lookups that followed it is found by GC (the appliance's mark, no lease
/// holding it, older than five minutes) and killed, recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_kills_sandboxes_no_lease_holds() {
    let lists = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen_lists = lists.clone();
    let rig = Rig::start(Arc::new(move |s: &Seen| {
        if s.method == "POST" && s.path == "/sandboxes" {
            Act::ForwardThenAnswer(408, r#"{"code":408,"message":"request timed out"}"#)
        } else if s.method == "GET"
            && s.path == "/v2/sandboxes"
            && seen_lists.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0
        {
            // The lookup right after the failed create misses it (the
            // backend had not finished yet).
            Act::ForwardThenAnswer(200, "[]")
        } else {
            Act::Forward
        }
    }))
    .await;
    let clock = cube_adapter::clock::ManualClock::starting_now();
    let section = rig.section();
    let c2 = clock.clone();
    let s = Server::start_with(move |c| {
        c.backend = Some(section);
        c.gc_interval_seconds = 0;
        c.clock = c2.into();
    })
    .await;
    let (st, v) = acquire(&s, "late").await;
    assert_eq!(st, StatusCode::GATEWAY_TIMEOUT, "{v}");
    for _ in 0..50 {
        if lists.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        rig.backend.manager.count(),
        1,
        "the orphan should still be there"
    );
    // GC leaves a young one alone (its create may still be recording it).
    let (st, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(rig.backend.manager.count(), 1);
    clock.advance(time::Duration::minutes(10));
    let (st, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(rig.backend.manager.count(), 0, "GC left the orphan");
    assert!(s.journal().contains("\"orphan_kill\""));
    s.stop().await;
}
