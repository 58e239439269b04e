//! Connection limits of the HTTPS listener (`[connections]`): silent and
//! trickling clients are dropped after the header-read timeout, idle
//! keep-alive connections after the idle timeout (answers in progress are
//! never cut), stalled bodies fail, the connection cap leaves `/healthz`
//! and `/readyz` answerable, and a `serve` process gives its descriptors
//! back once clients go away.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::kit::{Proc, Server};

/// A TLS connection to `url` (`https://127.0.0.1:port`), handshake done.
async fn connect(url: &str, state: &Path) -> TlsStream<TcpStream> {
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let cfg = cube_adapter::tls::client_config(Some(&ca), None).unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = TcpStream::connect(url.trim_start_matches("https://"))
        .await
        .unwrap();
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    connector.connect(name, tcp).await.unwrap()
}

/// Everything the server sends until it closes the connection (a close
/// without TLS close_notify counts as closed), within `limit`.
async fn until_closed(tls: &mut TlsStream<TcpStream>, limit: Duration) -> String {
    let mut out = vec![];
    let read = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the server kept the connection open for {limit:?}; it sent: {}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

/// One answer's bytes (its head and a body of `content-length` bytes).
async fn one_answer(tls: &mut TlsStream<TcpStream>) -> String {
    let mut out = vec![];
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(15), tls.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed before an answer");
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            if out.len() >= end + 4 + len {
                return text;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_trickling_and_idle_clients_are_dropped() {
    let s = Server::start_with(|c| {
        c.connections.header_read_timeout_seconds = 1;
        c.connections.idle_timeout_seconds = 2;
    })
    .await;

    // Completes TLS and sends nothing: dropped after the header timeout.
    let mut silent = connect(&s.url, &s.state).await;
    let t0 = Instant::now();
    assert_eq!(until_closed(&mut silent, Duration::from_secs(15)).await, "");
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );

    // One header line every 400 ms: dropped long before the head would
    // be complete (25 lines, 10 s).
    let mut trickle = connect(&s.url, &s.state).await;
    let t0 = Instant::now();
    let mut lines = 0;
    for i in 0..25 {
        let line = if i == 0 {
            "GET /healthz HTTP/1.1\r\n".to_string()
        } else {
            format!("x-trickle-{i}: yes\r\n")
        };
        if trickle.write_all(line.as_bytes()).await.is_err() || trickle.flush().await.is_err() {
            break;
        }
        lines += 1;
        tokio::time::sleep(Duration::from_millis(400)).await;
        // The server's close shows as EOF on a read that does not block.
        let mut b = [0u8; 64];
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(1), trickle.read(&mut b)).await {
            assert!(matches!(r, Ok(0) | Err(_)), "answered a partial head");
            break;
        }
    }
    assert!(lines < 25, "the trickling client was never dropped");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());

    // A keep-alive connection after its answer: closed after the idle
    // timeout, not the header timeout.
    let mut idle = connect(&s.url, &s.state).await;
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(one_answer(&mut idle).await.starts_with("HTTP/1.1 200"));
    let t0 = Instant::now();
    assert_eq!(until_closed(&mut idle, Duration::from_secs(15)).await, "");
    assert!(
        t0.elapsed() >= Duration::from_millis(1800),
        "{:?}",
        t0.elapsed()
    );
}

/// A long exec outlives the idle and header timeouts: a request being
/// answered is never idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_request_is_not_cut_by_the_idle_timeout() {
    let s = Server::start_with(|c| {
        c.connections.header_read_timeout_seconds = 1;
        c.connections.idle_timeout_seconds = 1;
    })
    .await;
    let lease = s.acquire(&s.admin, "long-exec").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "sleep 3; echo still-here"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert!(v["stdout"].as_str().unwrap().contains("still-here"), "{v}");
}

/// An unauthenticated request is answered without its body being read (it
/// never stalls the server); a body that stalls fails its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_cannot_hold_a_connection() {
    let s = Server::start_with(|c| c.connections.body_read_timeout_seconds = 1).await;

    // 1,000 bytes announced, none sent, no credentials: 401 at once, and
    // the connection is closed (its body is not waited for).
    let mut anon = connect(&s.url, &s.state).await;
    anon.write_all(
        b"POST /v1/leases/acquire HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n",
    )
    .await
    .unwrap();
    let t0 = Instant::now();
    let got = until_closed(&mut anon, Duration::from_secs(15)).await;
    assert!(got.starts_with("HTTP/1.1 401"), "{got}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());

    // Authenticated, 100 bytes announced and 10 sent: the request fails
    // after the body timeout and the connection closes.
    let mut slow = connect(&s.url, &s.state).await;
    let head = format!(
        "POST /v1/leases/acquire HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"runtime\"",
        s.admin
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    let t0 = Instant::now();
    let got = until_closed(&mut slow, Duration::from_secs(15)).await;
    assert!(got.starts_with("HTTP/1.1 4"), "{got}");
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
}

/// At the cap new connections get `/healthz` and `/readyz` only; the rest
/// is closed unanswered. Slots come back when clients leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_health_still_answers() {
    let s = Server::start_with(|c| {
        c.connections.max_total = 4;
        c.connections.max_per_address = 4;
        c.connections.header_read_timeout_seconds = 60;
    })
    .await;
    let mut held = vec![];
    for _ in 0..4 {
        held.push(connect(&s.url, &s.state).await);
    }
    // Over the cap: anything but health is answered 503 connection_limit
    // with Retry-After, and the connection closes.
    let mut over = connect(&s.url, &s.state).await;
    let req = format!(
        "GET /v1/profiles HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\nconnection: close\r\n\r\n",
        s.admin
    );
    over.write_all(req.as_bytes()).await.unwrap();
    let got = until_closed(&mut over, Duration::from_secs(15)).await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.to_ascii_lowercase().contains("retry-after: 5"), "{got}");
    assert!(got.contains("\"connection_limit\""), "{got}");

    // Health answers, on fresh connections (as probes make them), and the
    // connection is closed after the answer.
    for path in ["/healthz", "/readyz"] {
        let mut probe = connect(&s.url, &s.state).await;
        probe
            .write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let got = until_closed(&mut probe, Duration::from_secs(15)).await;
        assert!(got.starts_with("HTTP/1.1 200"), "{path}: {got}");
    }
    let r = s
        .http
        .get(format!("{}/healthz", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // The held connections leave: a normal request is served again.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut c = connect(&s.url, &s.state).await;
        c.write_all(req.as_bytes()).await.unwrap();
        let got = until_closed(&mut c, Duration::from_secs(15)).await;
        if got.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(got.starts_with("HTTP/1.1 503"), "{got}");
        assert!(Instant::now() < deadline, "slots never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Ends the `serve` process when the test ends, also on a panic.
struct Stop(Option<Proc>);

impl Drop for Stop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            p.stop();
        }
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A real `serve` process: after clients that closed, clients that went
/// silent, keep-alive clients and bare TCP connections, its descriptors
/// come back to where they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_come_back_after_clients_leave() {
    cube_adapter::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[connections]\nheader_read_timeout_seconds = 1\nidle_timeout_seconds = 1\n",
    )
    .unwrap();
    let p = Stop(Some(Proc::start(&state, &config, &[]).unwrap()));
    let (url, pid) = {
        let p = p.0.as_ref().unwrap();
        (p.url.clone(), p.child.id())
    };
    let admin = std::fs::read_to_string(state.join("admin.token"))
        .unwrap()
        .trim()
        .to_string();
    let request = |close: bool| {
        format!(
            "GET /v1/profiles HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {admin}\r\n{}\r\n",
            if close { "connection: close\r\n" } else { "" }
        )
    };
    // Warm up (first requests create what lives for the whole run), then
    // take the baseline once the count is steady.
    for _ in 0..3 {
        let mut c = connect(&url, &state).await;
        c.write_all(request(true).as_bytes()).await.unwrap();
        assert!(
            until_closed(&mut c, Duration::from_secs(15))
                .await
                .starts_with("HTTP/1.1 200")
        );
    }
    let steady = || async {
        let mut last = open_fds(pid);
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = open_fds(pid);
            if now == last {
                return now;
            }
            last = now;
        }
        last
    };
    let baseline = steady().await;

    let mut silent = vec![];
    let mut kept = vec![];
    let mut bare = vec![];
    for _ in 0..20 {
        silent.push(connect(&url, &state).await);
    }
    for _ in 0..20 {
        let mut c = connect(&url, &state).await;
        c.write_all(request(false).as_bytes()).await.unwrap();
        assert!(one_answer(&mut c).await.starts_with("HTTP/1.1 200"));
        kept.push(c);
    }
    for _ in 0..10 {
        let mut c = connect(&url, &state).await;
        c.write_all(request(false).as_bytes()).await.unwrap();
        assert!(one_answer(&mut c).await.starts_with("HTTP/1.1 200"));
        drop(c);
    }
    for _ in 0..10 {
        bare.push(
            TcpStream::connect(url.trim_start_matches("https://"))
                .await
                .unwrap(),
        );
    }
    let during = open_fds(pid);
    assert!(
        during >= baseline + 40,
        "the connections should show: {baseline} then {during}"
    );
    // Bare TCP clients go away; the silent and keep-alive ones stay
    // connected and are timed out by the server.
    drop(bare);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = open_fds(pid);
        if now <= baseline + 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{now} descriptors open 30 s after clients left ({baseline} before)"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The server closed them: every client sees its connection end.
    for mut c in silent.into_iter().chain(kept) {
        until_closed(&mut c, Duration::from_secs(5)).await;
    }
}
