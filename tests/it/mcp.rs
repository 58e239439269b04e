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
    let mut sids = vec![sid.clone()];
    for _ in 1..cap {
        let r = post(a.clone(), None, init.clone()).await;
        assert_eq!(r.status(), StatusCode::OK);
        sids.push(r.headers()["mcp-session-id"].to_str().unwrap().to_string());
        let _ = r.text().await;
    }
    let r = post(b.clone(), None, init.clone()).await;
    assert_eq!(r.status(), StatusCode::OK);
    let _ = r.text().await;
    let r = s
        .http
        .delete(format!("{}/mcp", s.url))
        .bearer_auth(&a)
        .header("mcp-session-id", &sids[cap - 1])
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let r = post(a.clone(), None, init).await;
    assert_eq!(r.status(), StatusCode::OK);
    let _ = r.text().await;
    // `sid` is still this identity's: nothing was ended to make room.
    let r = post(
        a.clone(),
        Some(sid.clone()),
        json!({"jsonrpc": "2.0", "id": 9, "method": "tools/list"}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let _ = r.text().await;
    s.stop().await;
}

/// The `initialize` request of these tests.
fn init_request() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"}}})
}

/// The JSON-RPC answer with `id` in a `/mcp` answer (JSON, or an event
/// stream of `data:` lines).
fn rpc_answer(body: &str, id: u64) -> Value {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        return v;
    }
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find(|v| v["id"] == id)
        .unwrap_or_else(|| panic!("no answer {id} in {body}"))
}

/// One MCP session over `/mcp` (at `url`, with its query), as `token`.
struct Session<'a> {
    s: &'a Server,
    url: String,
    token: String,
    sid: String,
    /// What `initialize` answered.
    info: Value,
}

impl<'a> Session<'a> {
    async fn open(s: &'a Server, query: &str, token: &str) -> Session<'a> {
        let url = format!("{}/mcp{query}", s.url);
        let r = s
            .http
            .post(&url)
            .bearer_auth(token)
            .header("accept", "application/json, text/event-stream")
            .json(&init_request())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let sid = r.headers()["mcp-session-id"].to_str().unwrap().to_string();
        let info = rpc_answer(&r.text().await.unwrap(), 1);
        let me = Session {
            s,
            url,
            token: token.to_string(),
            sid,
            info,
        };
        let r = me
            .send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        assert!(r.status().is_success(), "{}", r.status());
        me
    }

    async fn send(&self, body: Value) -> reqwest::Response {
        self.s
            .http
            .post(&self.url)
            .bearer_auth(&self.token)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-session-id", &self.sid)
            .header("mcp-protocol-version", "2025-06-18")
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// A request's `result`.
    async fn rpc(&self, id: u64, method: &str, params: Value) -> Value {
        let r = self
            .send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        assert_eq!(r.status(), StatusCode::OK);
        let v = rpc_answer(&r.text().await.unwrap(), id);
        v["result"].clone()
    }

    /// `cube_acquire`'s argument schema as `tools/list` gives it.
    async fn acquire_schema(&self) -> Value {
        let tools = self.rpc(2, "tools/list", json!({})).await;
        tools["tools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "cube_acquire")
            .unwrap()["inputSchema"]
            .clone()
    }

    async fn call(&self, id: u64, tool: &str, args: Value) -> Value {
        self.rpc(id, "tools/call", json!({"name": tool, "arguments": args}))
            .await
    }
}

/// The runtime of the lease a `cube_acquire` result names.
async fn lease_runtime(s: &Server, token: &str, result: &Value) -> String {
    let lease = result["structuredContent"]["lease_ref"]
        .as_str()
        .unwrap_or_else(|| panic!("no lease in {result}"));
    let (st, v) = s
        .post(token, &format!("/v1/leases/{lease}/status"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v["runtime"].as_str().unwrap().to_string()
}

/// The runtime is the host's: with `?runtime=` the schema has no runtime,
/// the instructions name the host's, and acquire uses it whatever the model
/// says; without it the identity's single runtime is the default, and an
/// identity with several gets a tool error naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_runtime_is_the_hosts() {
    let s = Server::start().await;
    let any = s.token(&["--tenant", "rt"]);
    let hosted = Session::open(&s, "?runtime=openclaw", &any).await;
    let schema = hosted.acquire_schema().await;
    assert!(schema["properties"].get("runtime").is_none(), "{schema}");
    assert!(
        schema["properties"].get("session_key").is_some(),
        "{schema}"
    );
    let instructions = hosted.info["result"]["instructions"].as_str().unwrap();
    assert!(instructions.contains("runtime openclaw"), "{instructions}");
    assert!(!instructions.contains("runtime mcp"), "{instructions}");
    let r = hosted
        .call(
            3,
            "cube_acquire",
            json!({"session_key": "host-rt", "runtime": "mcp"}),
        )
        .await;
    assert_eq!(lease_runtime(&s, &any, &r).await, "openclaw", "{r}");

    // An unknown runtime in the URL is refused before any session.
    let r = s
        .http
        .post(format!("{}/mcp?runtime=bash", s.url))
        .bearer_auth(&any)
        .header("accept", "application/json, text/event-stream")
        .json(&init_request())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_runtime");

    // No host runtime: optional in the schema, the identity's only one by
    // default.
    let one = s.token(&["--tenant", "rt", "--subject", "one", "--runtime", "dsh"]);
    let plain = Session::open(&s, "", &one).await;
    let schema = plain.acquire_schema().await;
    assert!(schema["properties"].get("runtime").is_some(), "{schema}");
    assert!(
        !schema["required"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == "runtime"),
        "{schema}"
    );
    let instructions = plain.info["result"]["instructions"].as_str().unwrap();
    assert!(!instructions.contains("runtime mcp"), "{instructions}");
    let r = plain
        .call(3, "cube_acquire", json!({"session_key": "default-rt"}))
        .await;
    assert_eq!(lease_runtime(&s, &one, &r).await, "dsh", "{r}");

    // Several allowed and none given: a tool error that names them.
    let two = s.token(&[
        "--tenant",
        "rt",
        "--subject",
        "two",
        "--runtime",
        "dsh",
        "--runtime",
        "hermes",
    ]);
    let plain = Session::open(&s, "", &two).await;
    let r = plain
        .call(3, "cube_acquire", json!({"session_key": "which"}))
        .await;
    assert_eq!(r["isError"], true, "{r}");
    assert_eq!(r["structuredContent"]["code"], "invalid_runtime", "{r}");
    let m = r["structuredContent"]["message"].as_str().unwrap();
    assert!(m.contains("dsh, hermes"), "{m}");
    // The model may still choose among them.
    let r = plain
        .call(
            4,
            "cube_acquire",
            json!({"session_key": "which", "runtime": "hermes"}),
        )
        .await;
    assert_eq!(lease_runtime(&s, &two, &r).await, "hermes", "{r}");
    s.stop().await;
}

/// Hosts that never close their sessions: at the limit the identity's
/// least recently used idle session ends (and the audit journal says so);
/// only when every session is busy is a new one refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_sessions_hosts_never_close() {
    let s = Server::start().await;
    let a = s.token(&["--tenant", "never-closes"]);
    let cap = cube_adapter::mcp::http::MAX_SESSIONS_PER_IDENTITY;
    let mut open = Vec::new();
    for _ in 0..cap {
        open.push(Session::open(&s, "", &a).await);
    }
    // The oldest is used again: the second oldest is now the least
    // recently used.
    let _ = open[0].rpc(2, "tools/list", json!({})).await;
    // A request that opens no session ends none.
    let r = s
        .http
        .post(format!("{}/mcp", s.url))
        .bearer_auth(&a)
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"}))
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("mcp-session-id").is_none());
    assert!(
        !s.journal().contains("mcp_session_evicted"),
        "nothing was evicted for a request that opens no session"
    );
    let newest = Session::open(&s, "", &a).await;
    let r = open[1]
        .send(json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list"}))
        .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND, "the evicted session");
    let _ = open[0].rpc(4, "tools/list", json!({})).await;
    let _ = newest.rpc(2, "tools/list", json!({})).await;
    let exported = s.journal();
    let evicted: Vec<&str> = exported
        .lines()
        .filter(|l| l.contains("\"action\":\"mcp_session_evicted\""))
        .collect();
    assert_eq!(evicted.len(), 1, "{exported}");
    assert!(evicted[0].contains("\"identity_digest\""), "{}", evicted[0]);
    assert!(!exported.contains(&open[1].sid), "session ids are digests");
    open.remove(1);
    open.push(newest);

    // Every session busy (an event stream open on each): refused.
    let mut streams = Vec::new();
    for sess in &open {
        let r = s
            .http
            .get(&sess.url)
            .bearer_auth(&a)
            .header("accept", "text/event-stream")
            .header("mcp-session-id", &sess.sid)
            .header("mcp-protocol-version", "2025-06-18")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        streams.push(r);
    }
    let r = s
        .http
        .post(format!("{}/mcp", s.url))
        .bearer_auth(&a)
        .header("accept", "application/json, text/event-stream")
        .json(&init_request())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "session_quota_exceeded");
    // Another identity is not affected.
    let b = s.token(&["--tenant", "other"]);
    let _ = Session::open(&s, "", &b).await;
    // One stream ends: its session is idle again, and makes room.
    drop(streams.remove(5));
    let mut status = StatusCode::TOO_MANY_REQUESTS;
    for _ in 0..100 {
        let r = s
            .http
            .post(format!("{}/mcp", s.url))
            .bearer_auth(&a)
            .header("accept", "application/json, text/event-stream")
            .json(&init_request())
            .send()
            .await
            .unwrap();
        status = r.status();
        let _ = r.text().await;
        if status != StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(status, StatusCode::OK);
    let r = open[5]
        .send(json!({"jsonrpc": "2.0", "id": 5, "method": "tools/list"}))
        .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND, "the one that went idle");
    drop(streams);
    s.stop().await;
}

/// `[mcp] session_idle_timeout_seconds` ends idle sessions; a session with
/// an event stream open (or a long tool call) is not idle, however quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_idle_sessions_end_after_the_configured_time() {
    let s = Server::start_with(|c| c.mcp.session_idle_timeout_seconds = 60).await;
    let a = s.token(&["--tenant", "idle"]);
    let quiet = Session::open(&s, "", &a).await;
    let streaming = Session::open(&s, "", &a).await;
    let stream = s
        .http
        .get(&streaming.url)
        .bearer_auth(&a)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", &streaming.sid)
        .header("mcp-protocol-version", "2025-06-18")
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), StatusCode::OK);
    // Still there within the minute.
    tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    let _ = quiet.rpc(2, "tools/list", json!({})).await;
    // A minute and the reaper's turn (a tenth of it) after its last use.
    tokio::time::sleep(std::time::Duration::from_secs(68)).await;
    let r = quiet
        .send(json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list"}))
        .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND, "the idle session ended");
    let tools = streaming.rpc(2, "tools/list", json!({})).await;
    assert!(tools["tools"].as_array().is_some(), "{tools}");
    drop(stream);
    s.stop().await;
}

/// `cube-adapter mcp`'s flags win over the environment a host passes on:
/// an exported token, a token file, another URL, CA and runtime in the
/// environment change nothing, and a real tool call goes through with the
/// flags' token, under the flags' runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_stdio_flags_win_over_the_environment() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let s = Server::start().await;
    let token = s.token(&["--tenant", "flags"]);
    let file = s.dir.path().join("agent.token");
    std::fs::write(&file, format!("{token}\n")).unwrap();
    let mut child = tokio::process::Command::new(crate::kit::BIN)
        .arg("mcp")
        .arg("--url")
        .arg(&s.url)
        .arg("--token-file")
        .arg(&file)
        .arg("--ca-file")
        .arg(s.state.join("tls/ca.pem"))
        .args(["--runtime", "hermes", "--profile", "offline-code"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env(
            "CUBE_ADAPTER_TOKEN",
            "cat_000000000000_exported-in-the-shell",
        )
        .env("CUBE_ADAPTER_TOKEN_FILE", "/nonexistent/token")
        .env("CUBE_ADAPTER_URL", "https://cube.invalid:1")
        .env("CUBE_ADAPTER_CA_FILE", "/nonexistent/ca.pem")
        .env("CUBE_ADAPTER_RUNTIME", "openclaw")
        .env("CUBE_ADAPTER_CLIENT_CERT_FILE", "/nonexistent/c.pem")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stderr = child.stderr.take().unwrap();
    for msg in [
        init_request(),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
        json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "cube_acquire", "arguments": {"session_key": "flags", "runtime": "mcp"}}}),
    ] {
        stdin
            .write_all(format!("{msg}\n").as_bytes())
            .await
            .unwrap();
    }
    stdin.flush().await.unwrap();
    let mut answers = std::collections::HashMap::new();
    let read = async {
        while answers.len() < 3 {
            let Some(line) = lines.next_line().await.unwrap() else {
                break;
            };
            let v: Value = serde_json::from_str(&line).unwrap();
            if let Some(id) = v["id"].as_u64() {
                answers.insert(id, v);
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(60), read).await;
    if answers.len() < 3 {
        use tokio::io::AsyncReadExt;
        let _ = child.start_kill();
        let mut err = String::new();
        let _ = stderr.read_to_string(&mut err).await;
        panic!("cube-adapter mcp answered {answers:?}; stderr: {err}");
    }
    let instructions = answers[&1]["result"]["instructions"].as_str().unwrap();
    assert!(instructions.contains("runtime hermes"), "{instructions}");
    let acquire = answers[&2]["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "cube_acquire")
        .unwrap()
        .clone();
    assert!(
        acquire["inputSchema"]["properties"]
            .get("runtime")
            .is_none(),
        "{acquire}"
    );
    let result = &answers[&3]["result"];
    assert_ne!(result["isError"], true, "{result}");
    assert_eq!(lease_runtime(&s, &token, result).await, "hermes");
    drop(stdin);
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
    s.stop().await;
}

/// Two identity variables that conflict, with no flag to settle it: exit 2
/// and a message naming both and the way out (the token never printed).
#[test]
fn mcp_stdio_names_conflicting_variables() {
    let out = std::process::Command::new(crate::kit::BIN)
        .arg("mcp")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("CUBE_ADAPTER_URL", "https://cube.invalid")
        .env("CUBE_ADAPTER_TOKEN", "cat_000000000000_secret-value")
        .env("CUBE_ADAPTER_TOKEN_FILE", "/nonexistent/token")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("CUBE_ADAPTER_TOKEN and CUBE_ADAPTER_TOKEN_FILE")
            && err.contains("--token-file"),
        "{err}"
    );
    assert!(!err.contains("secret-value"), "{err}");
    assert!(out.stdout.is_empty());
}

/// `cube-adapter mcp --help` explains every flag and the precedence.
#[test]
fn mcp_stdio_help_explains_flags_and_precedence() {
    let out = std::process::Command::new(crate::kit::BIN)
        .args(["mcp", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--url",
        "--token-file",
        "--ca-file",
        "--profile",
        "--runtime",
        "--client-cert",
        "--client-key",
        "CUBE_ADAPTER_TOKEN_FILE",
        "Precedence: a flag wins over its environment variable",
    ] {
        assert!(help.contains(flag), "{flag} is not in:\n{help}");
    }
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

/// A plan asked for through `/mcp` names the MCP host as its client info
/// gave it, the reason and the lease (issue #36): approvers see which
/// agent asked and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_through_mcp_names_its_host_and_reason() {
    let s = Server::start_with(crate::tasks::configure).await;
    let token = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "mcp-agent",
        "--description",
        "laptop agent",
        "--action",
        "task:*",
    ]);
    let m = Session::open(&s, "", &token).await;
    let r = m
        .call(
            3,
            "cube_task_plan",
            json!({"template": "word-count", "parameters": {"text": "x", "repeat": 1},
                   "reason": "the user asked for a count"}),
        )
        .await;
    let plan = r["structuredContent"]["plan_ref"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"))
        .to_string();
    let (st, v) = s.get(&token, &format!("/v1/task-plans/{plan}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        v["requested_by"],
        json!({"subject": "mcp-agent", "label": "laptop agent", "agent": "test 1 (MCP)"}),
        "{v}"
    );
    assert_eq!(v["reason"], "the user asked for a count");
    s.stop().await;
}
