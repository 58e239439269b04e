//! The egress tap of an embedded sandbox (`cube_embedded::egress_tap`):
//! what a sandbox's process sends to `127.0.0.1:3128` in its own network
//! namespace reaches the appliance's side as a TCP stream, through the
//! sandbox's `run/egress.sock`; nothing listens on the host's loopback.

use std::path::PathBuf;
use std::time::Duration;

use cube_adapter::embedded::Isolation;
use cube_adapter::embedded::egress_tap::{attach, egress_socket};
use cube_adapter::embedded::wire::EGRESS_PROXY_PORT;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::kit::{Server, TestBackend};

/// The one sandbox's egress socket.
fn socket(s: &Server) -> PathBuf {
    let state = s.state.join("embedded");
    let mut ids: Vec<String> = std::fs::read_dir(state.join("sandboxes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    egress_socket(&state, &ids.remove(0))
}

async fn exec(s: &Server, lease: &str, command: &str) -> Value {
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": command}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v
}

/// Whether something of the host's listens on its `127.0.0.1:3128`.
fn host_port_open() -> bool {
    std::net::TcpStream::connect(("127.0.0.1", EGRESS_PROXY_PORT)).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_connections_to_its_egress_port_reach_the_attached_appliance() {
    let host_before = host_port_open();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let start = || {
        let state = state.clone();
        Server::start_with(move |c| c.state_dir = state)
    };
    let mut first = start().await;
    let s = &first;
    let lease = s.acquire_in("offline-code", "tap").await;
    let sock = socket(s);
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&sock).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);

    // Attached: a connection arrives at once; the answer goes back.
    let mut rx = attach(&sock).await.unwrap();
    let talk = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{EGRESS_PROXY_PORT} && echo 'GET / HTTP/1.0' >&3 \
         && timeout 20 head -n1 <&3"
    );
    let serve = async {
        let conn = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("no connection through the tap")
            .expect("the tap closed");
        let mut conn = BufReader::new(conn);
        let mut line = String::new();
        conn.read_line(&mut line).await.unwrap();
        conn.get_mut()
            .write_all(b"HTTP/1.0 200 through the tap\n")
            .await
            .unwrap();
        line
    };
    let (out, line) = tokio::join!(exec(s, &lease, &talk), serve);
    assert_eq!(line, "GET / HTTP/1.0\n");
    assert_eq!(out["stdout"], "HTTP/1.0 200 through the tap\n", "{out}");
    assert_eq!(out["exit_code"], 0, "{out}");

    // The appliance restarts: its attachment goes, the sandbox (re-adopted)
    // keeps its tap, and a connection made while nothing is attached waits
    // for the next attachment.
    drop(rx);
    first.halt().await;
    let second = start().await;
    let s = &second;
    let out = exec(
        s,
        &lease,
        &format!("exec 3<>/dev/tcp/127.0.0.1/{EGRESS_PROXY_PORT} && echo early >&3"),
    )
    .await;
    assert_eq!(out["exit_code"], 0, "{out}");
    let mut rx = attach(&sock).await.unwrap();
    let mut conn = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("the held connection was not delivered")
        .expect("the tap closed");
    let mut got = String::new();
    conn.read_to_string(&mut got).await.unwrap();
    assert_eq!(got, "early\n");

    // The port is the sandbox's own, not the host's.
    if host_before {
        eprintln!(
            "skipped: something of the host's already listens on 127.0.0.1:{EGRESS_PROXY_PORT}"
        );
    } else {
        assert!(
            !host_port_open(),
            "the host's 127.0.0.1:{EGRESS_PROXY_PORT} answers"
        );
    }

    // The sandbox ends: the attachment's channel closes.
    s.kill_sandboxes();
    drop(first);
    let end = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await;
    assert!(end.expect("the channel stayed open").is_none());
}

/// Unisolated, the sandbox's loopback is the host's: no tap.
#[tokio::test]
async fn a_sandbox_on_the_hosts_network_has_no_egress_tap() {
    let t = TestBackend::start_with(|s| s.isolation = Isolation::None).await;
    let sb = t.sandbox().await;
    let sock = egress_socket(&t.dir.path().join("embedded"), &sb.id);
    assert!(sock.parent().unwrap().is_dir(), "{}", sock.display());
    assert!(!sock.exists(), "{}", sock.display());
    assert!(attach(&sock).await.is_err());
    t.client.kill(&sb.id).await.unwrap();
}
