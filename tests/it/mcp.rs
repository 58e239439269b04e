//! MCP with real clients: the official `mcp` Python SDK against `/mcp` over
//! HTTPS, and the transport rules of `/mcp` itself.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::Server;

/// Run the SDK script in one mode against a running appliance.
async fn sdk(s: &Server, mode: &str, url: &str, token: &str, approver: &str) {
    sdk_as(s, mode, url, Who::Token(token), approver).await
}

/// Who the SDK script acts as.
enum Who<'a> {
    Token(&'a str),
    /// A directory with `client.pem` and `client.key`.
    Cert(&'a std::path::Path),
}

async fn sdk_as(s: &Server, mode: &str, url: &str, who: Who<'_>, approver: &str) {
    let py = crate::kit::sdk_python();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/mcp_smoke.py");
    let mut cmd = tokio::process::Command::new(&py);
    let suffix = match who {
        Who::Token(t) => {
            cmd.env("MCP_TOKEN", t);
            ""
        }
        Who::Cert(d) => {
            cmd.env("MCP_CERT", d.join("client.pem"))
                .env("MCP_KEY", d.join("client.key"));
            ", certificate"
        }
    };
    let out = cmd
        .arg(&script)
        .env("MCP_MODE", mode)
        .env("MCP_URL", url)
        .env("MCP_CA", s.state.join("tls/ca.pem"))
        .env("MCP_BIN", crate::kit::BIN)
        .env("MCP_API", &s.url)
        .env("MCP_APPROVER", approver)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(&format!("mcp-smoke ({mode}{suffix}): all ok")),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The official `mcp` SDK, unmodified: over HTTPS to `/mcp`, and over stdio
/// through `cube-adapter mcp` (which reaches `/v1` over HTTPS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_mcp_sdk_over_https_and_stdio() {
    let s = Server::start_with(|c| {
        crate::tasks::configure(c);
        c.profiles
            .get_mut("offline-code")
            .unwrap()
            .checkpoints_enabled = true;
    })
    .await;
    let token = s.token(&["--tenant", "mcp-tenant"]);
    let approver = s.token(&[
        "--tenant",
        "mcp-tenant",
        "--subject",
        "a-person",
        "--role",
        "approver",
        "--action",
        "task:approve",
    ]);
    sdk(&s, "http", &format!("{}/mcp", s.url), &token, &approver).await;
    sdk(&s, "stdio", &s.url, &token, &approver).await;
    s.stop().await;
}

/// `cube-adapter mcp` refuses bad transport settings with a clear message
/// and exit 2, before any connection is tried (the host is under
/// `.invalid`: nothing could be reached anyway).
#[test]
fn mcp_stdio_refuses_unsafe_transports() {
    for (env, want) in [
        (
            vec![
                ("CUBE_ADAPTER_URL", "http://cube.invalid:18080"),
                ("CUBE_ADAPTER_TOKEN", "t"),
            ],
            "refusing plain HTTP",
        ),
        (
            vec![("CUBE_ADAPTER_URL", "https://cube.invalid")],
            "no identity",
        ),
        (
            vec![
                ("CUBE_ADAPTER_URL", "http://127.0.0.1:9"),
                ("CUBE_ADAPTER_CLIENT_CERT_FILE", "/nonexistent.pem"),
                ("CUBE_ADAPTER_CLIENT_KEY_FILE", "/nonexistent.key"),
            ],
            "only sent over https",
        ),
    ] {
        let mut cmd = std::process::Command::new(crate::kit::BIN);
        cmd.arg("mcp").env_clear().env("PATH", "/usr/bin:/bin");
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{env:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{env:?}: {err}");
        assert!(
            out.stdout.is_empty(),
            "nothing on stdout (it is the MCP channel)"
        );
    }
}

/// A session belongs to the identity that opened it; unknown methods are
/// -32601 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_sessions_are_per_identity() {
    let s = Server::start().await;
    let a = s.token(&["--tenant", "ta"]);
    let b = s.token(&["--tenant", "tb"]);
    let post = |token: String, session: Option<String>, body: Value| {
        let (http, url) = (s.http.clone(), format!("{}/mcp", s.url));
        async move {
            let mut r = http
                .post(url)
                .bearer_auth(token)
                .header("accept", "application/json, text/event-stream")
                .json(&body);
            if let Some(sid) = session {
                r = r.header("mcp-session-id", sid);
            }
            r.send().await.unwrap()
        }
    };
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"}}});
    let r = post(a.clone(), None, init).await;
    assert_eq!(r.status(), StatusCode::OK);
    let sid = r.headers()["mcp-session-id"].to_str().unwrap().to_string();
    let _ = r.text().await;
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    let r = post(b.clone(), Some(sid.clone()), call.clone()).await;
    assert_eq!(
        r.status(),
        StatusCode::NOT_FOUND,
        "another identity used the session"
    );
    let r = post(a.clone(), Some("made-up".into()), call.clone()).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = post(
        a.clone(),
        Some(sid.clone()),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await;
    assert!(r.status().is_success(), "{}", r.status());
    let r = post(
        a.clone(),
        Some(sid.clone()),
        json!({"jsonrpc": "2.0", "id": 3, "method": "server/discover"}),
    )
    .await;
    let body = r.text().await.unwrap();
    assert!(body.contains("-32601"), "{body}");
    let r = post(a.clone(), Some(sid.clone()), call).await;
    let body = r.text().await.unwrap();
    assert!(body.contains("cube_acquire"), "{body}");

    // 401 carries the bearer challenge; a bad token never reaches MCP.
    let r = post("cat_000000000000_nope".into(), None, json!({})).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    assert_eq!(r.headers()["cache-control"], "no-store");

    // Sessions per identity are capped; closing one frees a place, and
    // another identity is not affected.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"}}});
    let cap = cube_adapter::mcp::http::MAX_SESSIONS_PER_IDENTITY;
    for _ in 1..cap {
        let r = post(a.clone(), None, init.clone()).await;
        assert_eq!(r.status(), StatusCode::OK);
        let _ = r.text().await;
    }
    let r = post(a.clone(), None, init.clone()).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "session_quota_exceeded");
    let r = post(b.clone(), None, init.clone()).await;
    assert_eq!(r.status(), StatusCode::OK);
    let _ = r.text().await;
    let r = s
        .http
        .delete(format!("{}/mcp", s.url))
        .bearer_auth(&a)
        .header("mcp-session-id", &sid)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let r = post(a.clone(), None, init).await;
    assert_eq!(r.status(), StatusCode::OK);
    s.stop().await;
}

/// Terminal tools are listed only when the host's profile allows PTYs, and
/// the appliance refuses a PTY on such a profile whatever the client lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_tools_follow_the_profile() {
    let s = Server::start_with(|c| {
        c.profiles.get_mut("offline-code").unwrap().ptys_enabled = false;
    })
    .await;
    let list = |profile: &'static str| {
        let (http, url, admin) = (
            s.http.clone(),
            format!("{}/mcp?profile={profile}", s.url),
            s.admin.clone(),
        );
        async move {
            let rpc = |token: &str, sid: Option<&str>, body: Value| {
                let mut r = http
                    .post(&url)
                    .bearer_auth(token)
                    .header("accept", "application/json, text/event-stream")
                    .json(&body);
                if let Some(sid) = sid {
                    r = r.header("mcp-session-id", sid);
                }
                r.send()
            };
            let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "test", "version": "1"}}});
            let r = rpc(&admin, None, init).await.unwrap();
            let sid = r.headers()["mcp-session-id"].to_str().unwrap().to_string();
            let _ = r.text().await;
            let _ = rpc(
                &admin,
                Some(&sid),
                json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            )
            .await;
            let r = rpc(
                &admin,
                Some(&sid),
                json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
            )
            .await
            .unwrap();
            r.text().await.unwrap()
        }
    };
    let plain = list("offline-code").await;
    assert!(
        plain.contains("cube_exec") && !plain.contains("cube_pty_create"),
        "{plain}"
    );
    let with = list("persistent-code").await;
    assert!(with.contains("cube_pty_create"), "{with}");
    let lease = s.acquire(&s.admin, "no-pty").await;
    let (st, v) = s
        .post(&s.admin, &format!("/v1/leases/{lease}/ptys"), json!({}))
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["code"], "action_denied");
    s.stop().await;
}

/// A client certificate from the appliance's CA stands for an identity on
/// `/v1`, on `/mcp` and through `cube-adapter mcp`, with no token: the
/// official SDK runs the whole script with it; revoked, it is refused; an
/// unregistered certificate of the same CA is nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_are_identities() {
    let s = Server::start_with(|c| {
        crate::tasks::configure(c);
        c.profiles
            .get_mut("offline-code")
            .unwrap()
            .checkpoints_enabled = true;
    })
    .await;
    let dir = s.dir.path().join("laptop");
    let out = std::process::Command::new(crate::kit::BIN)
        .args(["token", "create", "--state-dir"])
        .arg(&s.state)
        .arg("--config")
        .arg(s.empty_config())
        .args([
            "--tenant",
            "cert-tenant",
            "--subject",
            "laptop",
            "--runtime",
            "mcp",
            "--client-cert",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert_eq!(id.len(), 12, "{id}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("client.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // Never overwritten.
    let again = std::process::Command::new(crate::kit::BIN)
        .args(["token", "create", "--state-dir"])
        .arg(&s.state)
        .args(["--config"])
        .arg(s.empty_config())
        .args(["--tenant", "x", "--client-cert"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2));

    let approver = s.token(&[
        "--tenant",
        "cert-tenant",
        "--subject",
        "a-person",
        "--role",
        "approver",
        "--action",
        "task:approve",
    ]);
    sdk_as(
        &s,
        "http",
        &format!("{}/mcp", s.url),
        Who::Cert(&dir),
        &approver,
    )
    .await;
    sdk_as(&s, "stdio", &s.url, Who::Cert(&dir), &approver).await;

    let ca = std::fs::read(s.state.join("tls/ca.pem")).unwrap();
    let with_cert = |cert: &std::path::Path, key: &std::path::Path| {
        let tls = cube_adapter::tls::client_config(
            Some(&ca),
            Some((&std::fs::read(cert).unwrap(), &std::fs::read(key).unwrap())),
        )
        .unwrap();
        reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .build()
            .unwrap()
    };
    let c = with_cert(&dir.join("client.pem"), &dir.join("client.key"));
    let r = c
        .get(format!("{}/v1/profiles", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // A token, where one is sent, decides.
    let r = c
        .get(format!("{}/v1/profiles", s.url))
        .bearer_auth("cat_000000000000_not-a-real-token-at-all-xxxxxxxx")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    // Another certificate of the identity CA, never registered: nobody.
    let other = s.dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let sealer = cube_adapter::store::Sealer::load_or_create(&s.state.join("secret.key")).unwrap();
    let id_ca = cube_adapter::tls::LocalCa::load_or_create_sealed(
        &s.state.join(cube_adapter::tls::IDENTITY_CA_DIR),
        Some(sealer),
    )
    .unwrap();
    let (cert, key) = id_ca.issue_client("laptop").unwrap();
    std::fs::write(other.join("c.pem"), cert).unwrap();
    std::fs::write(other.join("c.key"), key).unwrap();
    let r = with_cert(&other.join("c.pem"), &other.join("c.key"))
        .get(format!("{}/v1/profiles", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    // The identity CA is not the main one, whose client certificates the
    // embedded backend accepts: a server requiring main-CA client
    // certificates (as the backend does) refuses an identity's.
    let main_ca = std::fs::read_to_string(s.state.join("tls/ca.pem")).unwrap();
    assert_ne!(main_ca, id_ca.cert_pem);
    let main =
        cube_adapter::tls::LocalCa::load_or_create(&s.dir.path().join("scratch-ca")).unwrap();
    let (scert, skey) = main.issue_server(&["127.0.0.1".to_string()]).unwrap();
    let backend_tls = cube_adapter::tls::server_config(
        scert.as_bytes(),
        skey.as_bytes(),
        Some(main_ca.as_bytes()),
    )
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(backend_tls));
    let accepted = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        acceptor.accept(tcp).await.is_ok()
    });
    let tls = cube_adapter::tls::client_config(
        Some(main.cert_pem.as_bytes()),
        Some((
            &std::fs::read(dir.join("client.pem")).unwrap(),
            &std::fs::read(dir.join("client.key")).unwrap(),
        )),
    )
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let _ = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
        .connect(name, tcp)
        .await;
    assert!(
        !accepted.await.unwrap(),
        "a main-CA mTLS server refuses an identity's certificate"
    );
    // Revoked: refused.
    crate::kit::revoke(&s.state, &format!("cat_{id}_x"));
    let r = c
        .get(format!("{}/v1/profiles", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "unauthorized");
    s.stop().await;
}
