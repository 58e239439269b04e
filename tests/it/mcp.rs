//! MCP with real clients: the official `mcp` Python SDK against `/mcp` over
//! HTTPS, and the transport rules of `/mcp` itself.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::appliance::Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_mcp_sdk_over_https() {
    let s = Server::start().await;
    let token = s.token(&["--tenant", "mcp-tenant"]);
    let py = crate::sdk::sdk_python();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/mcp_smoke.py");
    let (url, ca) = (format!("{}/mcp", s.url), s.state.join("tls/ca.pem"));
    let out = tokio::process::Command::new(&py)
        .arg(&script)
        .env("MCP_URL", &url)
        .env("MCP_TOKEN", &token)
        .env("MCP_CA", &ca)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("mcp-smoke: all ok"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.stop().await;
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
    let r = post(a.clone(), Some(sid), call).await;
    let body = r.text().await.unwrap();
    assert!(body.contains("cube_acquire"), "{body}");
    s.stop().await;
}
