//! The `cube/` client against what a real CubeSandbox does (issue #16):
//! where the API key goes, how the proxy is reached, per-call budgets and
//! `Retry-After`.

use cube_adapter::cube::wire::CreateSandbox;
use cube_adapter::cube::{CubeClient, Secret, StartOptions};

const MB: usize = 1024 * 1024;

/// CubeProxy forwards `X-API-Key` to envd inside the sandbox: the key must
/// go to CubeAPI only. A stand-in proxy records every data-plane request.
#[tokio::test]
async fn api_key_stays_off_the_data_plane() {
    let (api, api_seen) = fake(Arc::new(|_: &Seen, _| status(404, &[], ""))).await;
    let (proxy, proxy_seen) = fake(Arc::new(|s: &Seen, _| match s.path.as_str() {
        "/health" => status(204, &[], ""),
        _ => status(
            502,
            &[("content-type", "application/json")],
            r#"{"error":"bad gateway"}"#,
        ),
    }))
    .await;
    let mut cfg = BackendConfig::new("t", format!("http://{api}"));
    cfg.domain = "cube.test".into();
    cfg.api_key = Some(Secret::new("k-control-plane-only"));
    cfg.proxy_url = Some(ProxyUrl::Url(format!("http://{proxy}")));
    cfg.timeouts.request = Duration::from_secs(5);
    cfg.timeouts.stream_idle = Duration::from_secs(5);
    cfg.timeouts.retries = 0;
    let keyed = CubeClient::new(cfg).unwrap();
    let sb = sandbox_addr("sbx1");

    // Every kind of data-plane call: unary, stream, upload, download, health
    // (the answers are the proxy's errors: only the requests matter here).
    let _ = keyed.run(&sb, &StartOptions::shell("echo hi"), MB).await;
    let _ = keyed.list_processes(&sb).await;
    let _ = keyed.upload(&sb, "/tmp/k.txt", b"data".to_vec()).await;
    let _ = keyed.download(&sb, "/tmp/k.txt", MB).await;
    let _ = keyed.stat(&sb, "/tmp/k.txt").await;
    keyed.envd_health(&sb).await.unwrap();
    let ps = proxy_seen.lock().unwrap().clone();
    assert!(ps.len() >= 6, "a data-plane call was not sent: {ps:?}");
    assert!(
        ps.iter()
            .all(|s| s.host.starts_with("49983-sbx1.cube.test")),
        "{ps:?}"
    );
    assert!(
        ps.iter().all(|s| !s.api_key),
        "the CubeAPI key was sent on the data plane: {ps:?}"
    );

    // The control plane still gets it.
    let _ = keyed.get(&sb.id).await;
    let aps = api_seen.lock().unwrap().clone();
    assert!(!aps.is_empty() && aps.iter().all(|s| s.api_key), "{aps:?}");
}

// ---- a small CubeAPI / CubeProxy stand-in on 127.0.0.1 -------------------

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cube_adapter::cube::{BackendConfig, ErrorKind, ProxyUrl, SandboxAddr};

/// One request as the fake server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    host: String,
    api_key: bool,
}

type Answer = Arc<dyn Fn(&Seen, usize) -> axum::response::Response + Send + Sync>;

/// Serves `answer(request, how many requests before it)` on plain HTTP.
async fn fake(answer: Answer) -> (String, Arc<Mutex<Vec<Seen>>>) {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let log = seen.clone();
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let log = log.clone();
        let answer = answer.clone();
        async move {
            let h = req.headers();
            let s = Seen {
                method: req.method().to_string(),
                path: req.uri().path().to_string(),
                host: h
                    .get("host")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string(),
                api_key: h.contains_key("x-api-key"),
            };
            let n = {
                let mut l = log.lock().unwrap();
                l.push(s.clone());
                l.len() - 1
            };
            let r = answer(&s, n);
            // `x-test-delay-ms` on an answer: hold it that long.
            let delay = r
                .headers()
                .get("x-test-delay-ms")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if let Some(ms) = delay {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            r
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr.to_string(), seen)
}

fn status(code: u16, headers: &[(&'static str, &str)], body: &str) -> axum::response::Response {
    let mut b = axum::http::Response::builder().status(code);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(axum::body::Body::from(body.to_string())).unwrap()
}

fn sandbox_addr(id: &str) -> SandboxAddr {
    SandboxAddr {
        id: id.into(),
        domain: "cube.test".into(),
        traffic_token: None,
        envd_version: None,
    }
}

/// CubeAPI on one address, CubeProxy reached by a dial address: the URL
/// carries `<port>-<id>.<domain>` (Host, and SNI over TLS) while the
/// connection goes to the proxy; the key goes to CubeAPI only; readiness
/// probes the proxy with `49983-probe.<domain>`.
#[tokio::test]
async fn proxy_dial_address_and_probe() {
    let (api, api_seen) = fake(Arc::new(|s: &Seen, _| match s.path.as_str() {
        "/health" => status(200, &[], ""),
        _ => status(404, &[], ""),
    }))
    .await;
    let (proxy, proxy_seen) = fake(Arc::new(|s: &Seen, _| {
        if s.host.starts_with("49983-sbx1.cube.test") {
            status(204, &[], "")
        } else {
            // CubeProxy's own answer for a sandbox it does not know.
            status(
                502,
                &[("content-type", "application/json")],
                r#"{"error":"bad gateway"}"#,
            )
        }
    }))
    .await;
    let mut cfg = BackendConfig::new("t", format!("http://{api}"));
    cfg.domain = "cube.test".into();
    cfg.api_key = Some(Secret::new("k"));
    cfg.insecure_plain_http = true;
    cfg.proxy_url = Some(ProxyUrl::Dial {
        url: "http://cube.test".into(),
        dial: proxy.clone(),
    });
    let c = CubeClient::new(cfg.clone()).unwrap();

    c.envd_health(&sandbox_addr("sbx1")).await.unwrap();
    let r = c.reachability().await;
    assert!(r.ok(), "{:?}", r.problem());
    let ps = proxy_seen.lock().unwrap().clone();
    assert_eq!(ps.len(), 2, "{ps:?}");
    assert_eq!(ps[0].host, "49983-sbx1.cube.test");
    assert_eq!(ps[1].host, "49983-probe.cube.test");
    assert!(
        ps.iter().all(|s| !s.api_key),
        "key sent to the proxy: {ps:?}"
    );
    let aps = api_seen.lock().unwrap().clone();
    assert!(
        aps.iter()
            .all(|s| s.api_key && s.method == "GET" && s.path == "/health"),
        "{aps:?}"
    );

    // CubeAPI down: readiness names it, and only it.
    let mut down = cfg.clone();
    down.api_url = "http://cubeapi.invalid:3000".into();
    let r = CubeClient::new(down).unwrap().reachability().await;
    assert!(r.cube_proxy.is_ok());
    let p = r.problem().unwrap();
    assert!(p.contains("CubeAPI") && !p.contains("CubeProxy"), "{p}");

    // CubeProxy down: the same, the other way round.
    let mut down = cfg.clone();
    down.proxy_url = Some(ProxyUrl::Dial {
        url: "http://cube.test".into(),
        dial: "cubeproxy.invalid:443".into(),
    });
    let r = CubeClient::new(down).unwrap().reachability().await;
    assert!(r.cube_api.is_ok());
    let p = r.problem().unwrap();
    assert!(p.contains("CubeProxy") && !p.contains("CubeAPI"), "{p}");
}

/// Pause (CubeAPI budget 120 s) must not be cut by a shorter client-wide
/// timeout: here a 3 s answer against a 1 s general budget and a 1 s stall
/// timer (today's client cuts it at its 75 s read timeout).
#[tokio::test]
async fn pause_gets_its_own_budget() {
    let (api, _) = fake(Arc::new(|_: &Seen, _| {
        status(204, &[("x-test-delay-ms", "3000")], "")
    }))
    .await;
    let mut cfg = BackendConfig::new("t", format!("http://{api}"));
    cfg.proxy_url = Some(ProxyUrl::Url(format!("http://{api}")));
    cfg.timeouts.request = Duration::from_secs(1);
    cfg.timeouts.stream_idle = Duration::from_secs(1);
    let c = CubeClient::new(cfg).unwrap();
    c.pause("sbx1").await.unwrap();
    // An ordinary call keeps its short budget.
    let e = c.get("sbx1").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
}

/// 503/429 with `Retry-After` are retried for idempotent calls (bounded);
/// a non-idempotent call is not retried.
#[tokio::test]
async fn retry_after_is_honoured_and_bounded() {
    // Busy twice, then fine.
    let (api, seen) = fake(Arc::new(|s: &Seen, n| {
        if s.path == "/sandboxes/sbx1" && n < 2 {
            status(
                503,
                &[("retry-after", "1")],
                r#"{"code":503,"message":"busy"}"#,
            )
        } else if s.path == "/sandboxes/sbx1" {
            status(204, &[], "")
        } else {
            status(
                429,
                &[("retry-after", "1")],
                r#"{"code":429,"message":"slow down"}"#,
            )
        }
    }))
    .await;
    let mut cfg = BackendConfig::new("t", format!("http://{api}"));
    cfg.proxy_url = Some(ProxyUrl::Url(format!("http://{api}")));
    cfg.timeouts.retries = 3;
    cfg.timeouts.retry_total = Duration::from_secs(10);
    let c = CubeClient::new(cfg.clone()).unwrap();
    let t0 = Instant::now();
    c.kill("sbx1").await.unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(seen.lock().unwrap().len(), 3);

    // Always busy: gives up after `retries` more attempts.
    seen.lock().unwrap().clear();
    let e = c.list_templates().await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert_eq!(seen.lock().unwrap().len(), 4);

    // Create is not idempotent: one attempt.
    seen.lock().unwrap().clear();
    let e = c
        .create(&CreateSandbox {
            template_id: "host".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert_eq!(seen.lock().unwrap().len(), 1);

    // The total cap: no retry whose wait would pass it.
    seen.lock().unwrap().clear();
    let mut capped = cfg;
    capped.timeouts.retry_total = Duration::from_millis(500);
    let e = CubeClient::new(capped)
        .unwrap()
        .list_templates()
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// Over TLS: a proxy whose certificate names only `*.cube.test` is reached
/// at its IP address through the dial form (SNI names the sandbox host);
/// the same proxy by URL fails the certificate check.
#[tokio::test]
async fn dial_form_matches_a_wildcard_proxy_certificate() {
    cube_adapter::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let ca = cube_adapter::tls::LocalCa::load_or_create(&dir.path().join("tls")).unwrap();
    let (cert, key) = ca
        .leaf_files("proxy", Some(&["*.cube.test".to_string()]))
        .unwrap();
    let tls = cube_adapter::tls::server_config(
        &std::fs::read(cert).unwrap(),
        &std::fs::read(key).unwrap(),
        None,
    )
    .unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let log = log.clone();
        async move {
            let host = req
                .headers()
                .get("host")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            log.lock().unwrap().push(host);
            axum::http::StatusCode::NO_CONTENT
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(cube_adapter::server::serve(
        listener,
        app,
        Some(Arc::new(tls)),
        std::future::pending(),
    ));

    let mut cfg = BackendConfig::new("t", "https://cubeapi.invalid");
    cfg.domain = "cube.test".into();
    cfg.ca_pem = Some(ca.cert_pem.as_bytes().to_vec());
    cfg.proxy_url = Some(ProxyUrl::Dial {
        url: "https://cube.test".into(),
        dial: addr.to_string(),
    });
    let c = CubeClient::new(cfg.clone()).unwrap();
    c.envd_health(&sandbox_addr("sbx1")).await.unwrap();
    assert_eq!(seen.lock().unwrap().as_slice(), ["49983-sbx1.cube.test"]);

    let mut by_url = cfg;
    by_url.proxy_url = Some(ProxyUrl::Url(format!("https://{addr}")));
    let e = CubeClient::new(by_url)
        .unwrap()
        .envd_health(&sandbox_addr("sbx1"))
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

// ---- against the embedded backend as a faithful stand-in ------------------

use crate::kit::backend::TestBackend;

/// How many processes whose command line contains `needle` run in the
/// sandbox (seen from inside it).
async fn count_procs(t: &TestBackend, sb: &SandboxAddr, needle: &str) -> usize {
    let o = StartOptions::shell(&format!(
        "n=0; for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null | grep -q -- '{needle}' && n=$((n+1)); done; echo $n"
    ));
    let out = t.client.run(sb, &o, MB).await.unwrap();
    // The counting shell's own pipeline holds the needle once.
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse::<usize>()
        .unwrap()
        .saturating_sub(1)
}

/// A real envd at a `Connect-Timeout-Ms` deadline kills only the direct
/// process and ends the stream with `deadline_exceeded`: what the command
/// started runs on and its output is lost. The client keeps the deadline
/// itself, ends the whole process tree and keeps the output so far.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_the_whole_command_and_keeps_its_output() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    let mut o = StartOptions::shell("echo before; sleep 3331 & sleep 3332; echo never");
    o.timeout = Some(Duration::from_millis(1500));
    let started = Instant::now();
    let out = t.client.run(&sb, &o, MB).await.unwrap();
    assert!(out.timed_out, "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "before\n");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let mut left = usize::MAX;
    for _ in 0..20 {
        left = count_procs(&t, &sb, "sleep 333").await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        left, 0,
        "a process of the timed-out command is still running"
    );
    // A command within its time is untouched.
    let mut o = StartOptions::shell("echo ok");
    o.timeout = Some(Duration::from_secs(10));
    let out = t.client.run(&sb, &o, MB).await.unwrap();
    assert!(!out.timed_out);
    assert_eq!(out.exit_code, 0);
}

/// CubeAPI may report an older envd: every RPC names its user (below
/// 0.4.0 calls without one fail), uploads go as multipart (octet-stream
/// needs 0.5.7) and closing stdin (0.5.2) is refused before it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn older_envds_get_the_sdks_fallbacks() {
    let t = TestBackend::start_with(|s| {
        s.faithful = Some(cube_adapter::embedded::sandbox::Faithful {
            envd_version: Some("0.3.0".into()),
            ..Default::default()
        })
    })
    .await;
    let sb = t.sandbox().await;
    assert_eq!(sb.envd_version.as_deref(), Some("0.3.0"));
    t.client.list_processes(&sb).await.unwrap();
    t.client
        .upload(&sb, "/workspace/old.txt", b"multipart".to_vec())
        .await
        .unwrap();
    assert_eq!(
        t.client
            .download(&sb, "/workspace/old.txt", MB)
            .await
            .unwrap(),
        b"multipart"
    );
    t.client.stat(&sb, "/workspace/old.txt").await.unwrap();
    let out = t
        .client
        .run(&sb, &StartOptions::shell("cat /workspace/old.txt"), MB)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"multipart");
    let e = t.client.close_stdin(&sb, out.pid).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    assert!(e.message.contains("0.5.2"), "{e}");
}

/// Idle timeouts as CubeMaster keeps them: `refreshes` sets the timeout
/// (it does not add) and refuses `duration <= 0`; `timeout` sets it too;
/// both start the idle clock again.
#[tokio::test]
async fn refreshes_set_the_idle_timeout_and_refuse_zero() {
    let t = TestBackend::start().await;
    let sb = t.sandbox().await;
    for bad in [0, -1] {
        let e = t.client.refresh(&sb.id, bad).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{bad}: {e}");
    }
    let end = |d: cube_adapter::cube::wire::SandboxDetail| {
        time::OffsetDateTime::parse(
            d.end_at.as_deref().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap()
        .unix_timestamp()
            - cube_adapter::clock::system_now().unix_timestamp()
    };
    t.client.set_timeout(&sb.id, 3600).await.unwrap();
    let left = end(t.client.get(&sb.id).await.unwrap());
    assert!((3590..=3600).contains(&left), "{left}");
    t.client.refresh(&sb.id, 60).await.unwrap();
    let left = end(t.client.get(&sb.id).await.unwrap());
    assert!(
        (50..=60).contains(&left),
        "refresh added instead of setting: {left}"
    );
    t.client.kill(&sb.id).await.unwrap();
}

/// On a real CubeAPI, `DELETE /templates/{id}` with a template's id
/// deletes the template: only snapshot ids are ever sent there.
#[tokio::test]
async fn only_snapshot_ids_are_deleted() {
    let (api, seen) = fake(Arc::new(|_: &Seen, _| status(204, &[], ""))).await;
    let mut cfg = BackendConfig::new("t", format!("http://{api}"));
    cfg.proxy_url = Some(ProxyUrl::Url(format!("http://{api}")));
    cfg.insecure_plain_http = true;
    let c = CubeClient::new(cfg).unwrap();
    for not_a_snapshot in ["host", "cubesandbox-base", "snap-", "snap-xyz"] {
        let e = c.delete_snapshot(not_a_snapshot).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{not_a_snapshot}: {e}");
    }
    assert!(seen.lock().unwrap().is_empty());
    c.delete_snapshot("snap-0123456789abcdef01234567")
        .await
        .unwrap();
    let s = seen.lock().unwrap().clone();
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].path, "/templates/snap-0123456789abcdef01234567");
}
