//! The MCP gateway of an embedded sandbox (`cube_embedded::gateway`),
//! started through envd exactly as the appliance starts it (the absolute
//! `GATEWAY_PATH`, `--config`, root, the token in the environment), and
//! reached through the backend's proxy at `Host: 50005-<id>.<domain>` by a
//! real MCP client. The stdio server is `tests/mcp/echo-server.js`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use cube_adapter::cube::wire::CreateSandbox;
use cube_adapter::cube::{SandboxAddr, StartOptions};
use cube_adapter::embedded::gateway::{CALLS_LOG, GATEWAY_PATH, SERVER_PID, STATE_DIR, TOKEN_ENV};
use cube_adapter::embedded::wire::MCP_GATEWAY_PORT;
use cube_adapter::embedded::{Isolation, sandbox::MINIMAL_TEMPLATE};
use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;

use crate::kit::backend::is_zombie;
use crate::kit::{BIN, MB, TestBackend, sh};

/// The stdio server the gateway runs: `exec node -e "$SERVER_JS"`.
const SERVER_JS: &str = include_str!("../mcp/echo-server.js");
const TOKEN: &str = "0f8fad5b-d9cb-469f-a165-70867728950e";
/// What a tool call carries that must never reach a log.
const SECRET: &str = "the-value-nobody-logs-7c1e";

/// The Start the appliance makes (and the SDK, with `mcp-gateway`).
fn gateway_start(config: &str, token: Option<&str>) -> StartOptions {
    StartOptions {
        cmd: GATEWAY_PATH.into(),
        args: vec!["--config".into(), config.into()],
        envs: token
            .map(|t| BTreeMap::from([(TOKEN_ENV.to_string(), t.to_string())]))
            .unwrap_or_default(),
        user: Some("root".into()),
        timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    }
}

fn echo_config() -> String {
    serde_json::json!({
        "echo": {"runCmd": "exec node -e \"$SERVER_JS\"", "envs": {"SERVER_JS": SERVER_JS}}
    })
    .to_string()
}

/// An HTTP client of the backend with the client certificate the test kit
/// made (the data plane is mTLS, as the appliance reaches it).
fn http(t: &TestBackend) -> reqwest::Client {
    let tls = t.dir.path().join("tls");
    let cert = std::fs::read(tls.join("client.pem")).unwrap();
    let key = std::fs::read(tls.join("client.key")).unwrap();
    let cfg = cube_adapter::tls::client_config(Some(&t.ca_pem), Some((&cert, &key))).unwrap();
    reqwest::Client::builder()
        .tls_backend_preconfigured(cfg)
        .http1_only()
        .no_proxy()
        .build()
        .unwrap()
}

fn host(sb: &SandboxAddr, port: u16) -> String {
    format!("{port}-{}.{}", sb.id, sb.domain)
}

/// `GET path` on a port of the sandbox, through the proxy.
async fn get(t: &TestBackend, sb: &SandboxAddr, port: u16, path: &str) -> (u16, String) {
    let r = http(t)
        .get(format!("{}{path}", t.url))
        .header(reqwest::header::HOST, host(sb, port))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// A JSON-RPC `initialize` POSTed to `/mcp` with this Authorization.
async fn post_initialize(t: &TestBackend, sb: &SandboxAddr, auth: Option<&str>) -> (u16, String) {
    let mut req = http(t)
        .post(format!("{}/mcp", t.url))
        .header(reqwest::header::HOST, host(sb, MCP_GATEWAY_PORT))
        .header(
            reqwest::header::ACCEPT,
            "application/json, text/event-stream",
        )
        .json(&serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "1"}}
        }));
    if let Some(a) = auth {
        req = req.header(reqwest::header::AUTHORIZATION, a);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Host pids of the gateways this test started: argv[0] `GATEWAY_PATH`,
/// `TOKEN` in their environment.
fn gateway_daemons() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            cmd.split(|b| *b == 0).next() == Some(GATEWAY_PATH.as_bytes())
                && env.windows(TOKEN.len()).any(|w| w == TOKEN.as_bytes())
        })
        .filter(|p| !is_zombie(*p))
        .collect()
}

/// A host process's process group and session (`/proc/PID/stat`).
fn group_and_session(pid: i32) -> (i32, i32) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(") ").unwrap();
    let f: Vec<&str> = rest.split_whitespace().collect();
    (f[2].parse().unwrap(), f[3].parse().unwrap())
}

async fn run_root(t: &TestBackend, sb: &SandboxAddr, cmd: &str) -> (i32, String, String) {
    let mut o = sh(cmd);
    o.user = Some("root".into());
    let out = t.client.run(sb, &o, MB).await.unwrap();
    (
        out.exit_code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_gateway_serves_its_stdio_server_behind_the_token_through_the_proxy() {
    let t = TestBackend::start().await;
    let sb = t
        .sandbox_with(CreateSandbox {
            template_id: MINIMAL_TEMPLATE.into(),
            allow_internet_access: Some(false),
            ..Default::default()
        })
        .await;

    // Nothing listens on the port before the gateway starts.
    assert_eq!(get(&t, &sb, MCP_GATEWAY_PORT, "/health").await.0, 502);

    // The binary is there, read-only, and is this one.
    let (code, out, _) = run_root(&t, &sb, &format!("stat -c %s {GATEWAY_PATH}")).await;
    assert_eq!(code, 0);
    assert_eq!(
        out.trim(),
        std::fs::metadata(BIN).unwrap().len().to_string()
    );

    // Started as the appliance starts it: exit 0 once it serves.
    let out = t
        .client
        .run(&sb, &gateway_start(&echo_config(), Some(TOKEN)), MB)
        .await
        .unwrap();
    assert_eq!(
        out.exit_code,
        0,
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The daemon outlived its starter, in a session and group of its own
    // (out of reach of envd's and the appliance's kill of the Start's tree).
    let daemons = gateway_daemons();
    assert_eq!(daemons.len(), 1, "{daemons:?}");
    assert_eq!(group_and_session(daemons[0]), (daemons[0], daemons[0]));

    // Health needs no token; /mcp needs the right one.
    let (status, body) = get(&t, &sb, MCP_GATEWAY_PORT, "/health").await;
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    for auth in [
        None,
        Some("Bearer wrong-token-0123456789"),
        Some(&*format!("Bearer {TOKEN}x")),
        Some(&*format!("Basic {TOKEN}")),
    ] {
        let (status, body) = post_initialize(&t, &sb, auth).await;
        assert_eq!(status, 401, "{auth:?}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "unauthorized");
    }
    // Other ports of the sandbox stay closed.
    assert_eq!(get(&t, &sb, MCP_GATEWAY_PORT + 1, "/health").await.0, 404);

    // A real MCP session through the proxy.
    let config = StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", t.url))
        .auth_header(TOKEN)
        .custom_headers(HashMap::from([(
            http::header::HOST,
            http::HeaderValue::from_str(&host(&sb, MCP_GATEWAY_PORT)).unwrap(),
        )]));
    let client =
        ().serve(StreamableHttpClientTransport::with_client(http(&t), config))
            .await
            .unwrap();
    let info = client.peer_info().unwrap();
    assert_eq!(info.server_info.as_ref().unwrap().name, "echo-server");
    let mut tools: Vec<String> = client
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    tools.sort();
    assert_eq!(tools, ["echo", "sleep"]);
    let args = serde_json::json!({"text": SECRET});
    let r = client
        .call_tool(
            CallToolRequestParams::new("echo").with_arguments(args.as_object().unwrap().clone()),
        )
        .await
        .unwrap();
    assert_eq!(r.content[0].as_text().unwrap().text, SECRET);
    let r = client
        .call_tool(
            CallToolRequestParams::new("sleep").with_arguments(
                serde_json::json!({"seconds": 0.2})
                    .as_object()
                    .unwrap()
                    .clone(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(r.content[0].as_text().unwrap().text, "slept 0.2 s");

    // What reached the gateway, read inside the sandbox: the call, its
    // tool and size, never its value.
    let log = t
        .client
        .download(&sb, &format!("{STATE_DIR}/{CALLS_LOG}"), MB)
        .await
        .unwrap();
    let log = String::from_utf8(log).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let n = serde_json::to_vec(&args).unwrap().len();
    assert!(lines.contains(&r#"{"method":"initialize"}"#), "{log}");
    assert!(lines.contains(&r#"{"method":"tools/list"}"#), "{log}");
    assert!(
        lines.contains(&&*format!(
            r#"{{"method":"tools/call","tool":"echo","arguments_bytes":{n}}}"#
        )),
        "{log}"
    );
    assert!(!log.contains(SECRET), "{log}");
    let (_, mode, _) = run_root(&t, &sb, &format!("stat -c %a {STATE_DIR}")).await;
    assert_eq!(mode.trim(), "700");

    // No second gateway on the port; bad configurations and tokens are
    // refused with exit 2 before anything starts.
    let out = t
        .client
        .run(&sb, &gateway_start(&echo_config(), Some(TOKEN)), MB)
        .await
        .unwrap();
    assert_eq!(out.exit_code, 1);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot listen"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (config, token, says) in [
        (r#"{"echo":{"envs":{}}}"#.to_string(), Some(TOKEN), "runCmd"),
        (
            r#"{"a":{"runCmd":"x"},"b":{"runCmd":"y"}}"#.into(),
            Some(TOKEN),
            "exactly one",
        ),
        (
            r#"{"a":{"runCmd":"x","port":1}}"#.into(),
            Some(TOKEN),
            "port",
        ),
        ("not json".into(), Some(TOKEN), "not JSON"),
        (echo_config(), None, TOKEN_ENV),
        (echo_config(), Some("short"), TOKEN_ENV),
    ] {
        let out = t
            .client
            .run(&sb, &gateway_start(&config, token), MB)
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.exit_code, 2, "{config}: {err}");
        assert!(err.contains(says), "{config}: {err}");
    }
    // The first gateway still serves.
    assert_eq!(get(&t, &sb, MCP_GATEWAY_PORT, "/health").await.0, 200);

    // The sandbox's root can neither replace the binary nor put anything
    // beside it, nor unmount or remount what holds it.
    let (_, out, _) = run_root(
        &t,
        &sb,
        &format!(
            "r=''; \
             command -v mount umount chmod >/dev/null || r=\"$r no-tools\"; \
             (echo x > {GATEWAY_PATH}) 2>/dev/null && r=\"$r write\"; \
             rm -f {GATEWAY_PATH} 2>/dev/null && r=\"$r unlink\"; \
             mv /run/cube /run/elsewhere 2>/dev/null && r=\"$r rename\"; \
             touch /run/cube/beside 2>/dev/null && r=\"$r create\"; \
             chmod 4777 {GATEWAY_PATH} 2>/dev/null && r=\"$r chmod\"; \
             umount {GATEWAY_PATH} 2>/dev/null && r=\"$r umount\"; \
             umount -l /run/cube 2>/dev/null && r=\"$r umount-dir\"; \
             mount -o remount,rw /run/cube 2>/dev/null && r=\"$r remount\"; \
             mount -t tmpfs tmpfs /run/cube 2>/dev/null && r=\"$r over-mount\"; \
             test -x {GATEWAY_PATH} || r=\"$r gone\"; \
             echo \"done:$r\""
        ),
    )
    .await;
    assert_eq!(out.trim(), "done:", "what the sandbox could do: {out}");

    // The server exits: calls get an MCP error, health says so.
    let (code, _, err) =
        run_root(&t, &sb, &format!("kill -9 $(cat {STATE_DIR}/{SERVER_PID})")).await;
    assert_eq!(code, 0, "{err}");
    let mut unhealthy = (0, String::new());
    for _ in 0..50 {
        unhealthy = get(&t, &sb, MCP_GATEWAY_PORT, "/health").await;
        if unhealthy.0 == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(unhealthy.0, 503, "{}", unhealthy.1);
    let e = client
        .call_tool(
            CallToolRequestParams::new("echo").with_arguments(
                serde_json::json!({"text": "x"})
                    .as_object()
                    .unwrap()
                    .clone(),
            ),
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("exited"), "{e}");
    client.cancel().await.unwrap();

    // It ends with the sandbox.
    t.client.kill(&sb.id).await.unwrap();
    for _ in 0..50 {
        if gateway_daemons().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gateway_daemons(), Vec::<i32>::new());
}

#[tokio::test]
async fn a_sandbox_on_the_hosts_network_has_no_gateway_port() {
    // Unisolated: the sandbox's loopback is the host's.
    let t = TestBackend::start_with(|s| s.isolation = Isolation::None).await;
    let sb = t.sandbox().await;
    let (status, body) = get(&t, &sb, MCP_GATEWAY_PORT, "/health").await;
    assert_eq!((status, body.as_str()), (502, r#"{"error":"bad gateway"}"#));
    let (status, _) = post_initialize(&t, &sb, Some(&format!("Bearer {TOKEN}"))).await;
    assert_eq!(status, 502);
    t.client.kill(&sb.id).await.unwrap();
}
