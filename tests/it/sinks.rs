//! Audit delivery (`[[audit.sinks]]`, issue #21): every journal event
//! reaches each sink at least once and in journal order, through a flaky
//! and then absent collector, across a SIGKILL (from the sink's cursor, not
//! from the start), past a full disk (the API keeps serving, no half line),
//! through rotation, over syslog (RFC 5424, datagram and octet-counted
//! TCP) and on standard output; a reload adds and removes sinks and
//! refuses a bad one. Every receiver is the test's own, on loopback.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{Hmac, Mac};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{BIN, Proc, Server};

const KEY: &str = "0123456789abcdef0123456789abcdef-sink-key";
const TOKEN: &str = "collector-token-not-for-logs";

/// Poll `f` every 100 ms for `secs` seconds; fail naming `what`.
async fn until<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `(seq, event_id)` of each line of JSON-lines text.
fn ids(text: &str) -> Vec<(u64, String)> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            (
                v["seq"].as_u64().unwrap(),
                v["event_id"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// `got` begins with the whole of `journal` (events after it may have
/// come since it was read).
fn assert_prefix(got: &[(u64, String)], journal: &[(u64, String)]) {
    assert!(
        got.len() >= journal.len() && got[..journal.len()] == *journal,
        "delivered {} events, the journal has {}; first difference at {:?}",
        got.len(),
        journal.len(),
        got.iter().zip(journal).position(|(a, b)| a != b)
    );
}

/// `received` with repeats removed (a receiver dedupes by id), checked to
/// be in journal order.
fn deduped(received: &[(u64, String)]) -> Vec<(u64, String)> {
    let mut seen = BTreeSet::new();
    let mut out: Vec<(u64, String)> = vec![];
    for (seq, id) in received {
        if seen.insert(id.clone()) {
            if let Some((last, _)) = out.last() {
                assert!(seq > last, "event {seq} after {last}: out of order");
            }
            out.push((*seq, id.clone()));
        }
    }
    out
}

// ------------------------------------------------------------ the collector

const OK: u8 = 0;
/// Every second request answers 503 (recorded as nothing).
const FLAKY: u8 = 1;
/// Requests are read and never answered.
const HANG: u8 = 2;
/// A body carrying a value recorded as its digest (`~sha256:`) is refused
/// with 413, as a collector with a size limit refuses what it cannot take.
const REFUSE_DIGESTS: u8 = 3;

/// An HTTP collector on 127.0.0.1: it checks each batch's headers (the
/// token, the HMAC of the body, the sequence range) and records the events
/// of the batches it accepted.
struct Collector {
    port: u16,
    mode: Arc<AtomicU8>,
    requests: Arc<AtomicU64>,
    events: Arc<Mutex<Vec<(u64, String)>>>,
    /// The first `seq` of each accepted batch.
    firsts: Arc<Mutex<Vec<u64>>>,
    bad: Arc<Mutex<Vec<String>>>,
    /// Recordings posted to `/audit/recordings/REF`, with their bodies.
    recordings: Posted,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Recordings a collector took: (ref, body).
type Posted = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

#[derive(Clone)]
struct Shared {
    mode: Arc<AtomicU8>,
    requests: Arc<AtomicU64>,
    events: Arc<Mutex<Vec<(u64, String)>>>,
    firsts: Arc<Mutex<Vec<u64>>>,
    bad: Arc<Mutex<Vec<String>>>,
    recordings: Posted,
}

/// A recording posted by the HTTP sink: its headers checked (the token,
/// the body's HMAC, its SHA-256, its ref) and its body kept.
async fn collect_recording(
    axum::extract::State(sh): axum::extract::State<Shared>,
    axum::extract::Path(rec): axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    use sha2::Digest;
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let mut bad = vec![];
    if h("authorization") != format!("Bearer {TOKEN}") {
        bad.push("recording: authorization".to_string());
    }
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(KEY.as_bytes()).unwrap();
    mac.update(&body);
    if h("x-cube-adapter-signature")
        != format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
    {
        bad.push("recording: signature".into());
    }
    if h("x-cube-adapter-recording-sha256") != hex::encode(sha2::Sha256::digest(&body)) {
        bad.push("recording: sha256".into());
    }
    if h("x-cube-adapter-recording") != rec || h("content-type") != "application/x-asciicast" {
        bad.push(format!("recording: headers for {rec}"));
    }
    if !bad.is_empty() {
        sh.bad.lock().unwrap().extend(bad);
        return axum::http::StatusCode::BAD_REQUEST;
    }
    sh.recordings.lock().unwrap().push((rec, body.to_vec()));
    axum::http::StatusCode::OK
}

async fn collect(
    axum::extract::State(sh): axum::extract::State<Shared>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    let n = sh.requests.fetch_add(1, Ordering::SeqCst);
    match sh.mode.load(Ordering::SeqCst) {
        HANG => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            return axum::http::StatusCode::OK;
        }
        FLAKY if n % 2 == 0 => return axum::http::StatusCode::SERVICE_UNAVAILABLE,
        REFUSE_DIGESTS if String::from_utf8_lossy(&body).contains("~sha256:") => {
            return axum::http::StatusCode::PAYLOAD_TOO_LARGE;
        }
        _ => {}
    }
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let mut bad = vec![];
    if h("authorization") != format!("Bearer {TOKEN}") {
        bad.push(format!("authorization: {:?}", h("authorization")));
    }
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(KEY.as_bytes()).unwrap();
    mac.update(&body);
    let want = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
    if h("x-cube-adapter-signature") != want {
        bad.push("signature does not match the body".into());
    }
    if h("x-cube-adapter-sink") != "collector" {
        bad.push(format!("sink header {:?}", h("x-cube-adapter-sink")));
    }
    let batch = ids(std::str::from_utf8(&body).unwrap());
    let range = match (batch.first(), batch.last()) {
        (Some(a), Some(b)) => format!("{}-{}", a.0, b.0),
        _ => String::new(),
    };
    if h("x-cube-adapter-seq") != range {
        bad.push(format!(
            "seq header {:?} for {range}",
            h("x-cube-adapter-seq")
        ));
    }
    let text = String::from_utf8_lossy(&body);
    for secret in [TOKEN, KEY, "echo sink-"] {
        if text.contains(secret) {
            bad.push(format!("the body carries {secret:?}"));
        }
    }
    if !bad.is_empty() {
        sh.bad.lock().unwrap().extend(bad);
        return axum::http::StatusCode::BAD_REQUEST;
    }
    if let Some((first, _)) = batch.first() {
        sh.firsts.lock().unwrap().push(*first);
    }
    sh.events.lock().unwrap().extend(batch);
    axum::http::StatusCode::OK
}

impl Collector {
    async fn start(port: u16) -> Self {
        let sh = Shared {
            mode: Arc::new(AtomicU8::new(OK)),
            requests: Arc::default(),
            events: Arc::default(),
            firsts: Arc::default(),
            bad: Arc::default(),
            recordings: Arc::default(),
        };
        let mut c = Self {
            port,
            mode: sh.mode.clone(),
            requests: sh.requests.clone(),
            events: sh.events.clone(),
            firsts: sh.firsts.clone(),
            bad: sh.bad.clone(),
            recordings: sh.recordings.clone(),
            stop: None,
            task: None,
        };
        c.listen(sh).await;
        c
    }

    async fn listen(&mut self, sh: Shared) {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        self.port = listener.local_addr().unwrap().port();
        let app = axum::Router::new()
            .route("/audit", axum::routing::post(collect))
            .route(
                "/audit/recordings/{rec}",
                axum::routing::post(collect_recording),
            )
            .with_state(sh);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        self.stop = Some(tx);
        self.task = Some(tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        }));
    }

    fn shared(&self) -> Shared {
        Shared {
            mode: self.mode.clone(),
            requests: self.requests.clone(),
            events: self.events.clone(),
            firsts: self.firsts.clone(),
            bad: self.bad.clone(),
            recordings: self.recordings.clone(),
        }
    }

    /// Go away: the port refuses connections until `back`.
    async fn away(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    async fn back(&mut self) {
        let sh = self.shared();
        self.listen(sh).await;
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/audit", self.port)
    }

    fn events(&self) -> Vec<(u64, String)> {
        self.events.lock().unwrap().clone()
    }

    fn assert_clean(&self) {
        let bad = self.bad.lock().unwrap();
        assert!(bad.is_empty(), "the collector saw: {bad:?}");
    }
}

/// The secrets an HTTP sink reads, in `dir`; its TOML.
fn http_sink_toml(dir: &Path, url: &str) -> String {
    std::fs::write(dir.join("sink.key"), KEY).unwrap();
    std::fs::write(dir.join("sink.token"), format!("{TOKEN}\n")).unwrap();
    format!(
        "[[audit.sinks]]\nkind = \"http\"\nname = \"collector\"\nurl = \"{url}\"\nbatch = 7\n\
         hmac_key_file = \"{k}\"\ntoken_file = \"{t}\"\ntimeout_seconds = 2\nmax_backoff_seconds = 1\n",
        k = dir.join("sink.key").display(),
        t = dir.join("sink.token").display(),
    )
}

fn sinks_of(toml_text: &str) -> Vec<cube_adapter::config::sinks::SinkDef> {
    #[derive(serde::Deserialize)]
    struct Doc {
        audit: Audit,
    }
    #[derive(serde::Deserialize)]
    struct Audit {
        sinks: Vec<cube_adapter::config::sinks::SinkDef>,
    }
    toml::from_str::<Doc>(toml_text).unwrap().audit.sinks
}

/// A lease, and `n` execs in it (`echo sink-I`): several events each.
async fn traffic(s: &Server, session: &str, n: usize) {
    let lease = s.acquire(&s.admin, session).await;
    for i in 0..n {
        let (st, v) = s
            .post(
                &s.admin,
                &format!("/v1/leases/{lease}/exec"),
                json!({"command": format!("echo sink-{i}")}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
}

/// `status --json` of a running appliance (its admin socket).
fn status(state: &Path, config: &Path) -> Value {
    let out = Command::new(BIN)
        .args(["status", "--json", "--state-dir"])
        .arg(state)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)))
}

fn sink_status(v: &Value, name: &str) -> Value {
    v["audit"]["sinks"]
        .as_array()
        .unwrap_or_else(|| panic!("no audit.sinks in {v}"))
        .iter()
        .find(|s| s["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

// ------------------------------------------------------------------- tests

/// A collector that refuses (413) every batch holding one kind of event:
/// the sink splits the batch, delivers the others one at a time, skips the
/// one the collector refuses even alone (quarantined: `status` counts it
/// and names it), and goes on with what comes after; nothing is
/// delivered twice out of order and nothing else is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_receiver_refuses_is_quarantined_and_delivery_goes_on() {
    let c = Collector::start(0).await;
    c.mode.store(REFUSE_DIGESTS, Ordering::SeqCst);
    let secrets = tempfile::tempdir().unwrap();
    let sinks = sinks_of(&http_sink_toml(secrets.path(), &c.url()));
    let s = Server::start_with(move |cfg| cfg.audit.sinks = sinks).await;
    traffic(&s, "before", 3).await;
    // Two refused acquires: their `runtime` is recorded as a digest.
    for _ in 0..2 {
        let (st, _) = s
            .post(
                &s.admin,
                "/v1/leases/acquire",
                json!({"runtime": "r".repeat(4 << 20), "session_key": "s"}),
            )
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
    }
    traffic(&s, "after", 3).await;
    let journal = ids(&s.journal());
    let refused: Vec<(u64, String)> = s
        .journal()
        .lines()
        .filter(|l| l.contains("~sha256:"))
        .map(|l| ids(l).remove(0))
        .collect();
    assert_eq!(refused.len(), 2);
    let head = journal.last().unwrap().0;
    let cfg = s.empty_config();
    until(30, "the sink is past the refused events", || async {
        sink_status(&status(&s.state, &cfg), "collector")["lag"] == 0
    })
    .await;
    let got = deduped(&c.events());
    let want: Vec<(u64, String)> = journal
        .iter()
        .filter(|e| !refused.contains(e))
        .cloned()
        .collect();
    assert_prefix(&got, &want);
    assert!(got.last().unwrap().0 >= head);
    let v = sink_status(&status(&s.state, &cfg), "collector");
    assert_eq!(v["quarantined"], 2, "{v}");
    assert_eq!(v["state"], "ok", "{v}");
    let last = v["last_quarantined"].as_str().unwrap();
    assert!(
        last.starts_with(&format!("event {}:", refused[1].0)) && last.contains("413"),
        "{v}"
    );
    // The operator's `status` says so in words.
    let out = s.cli(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 quarantined"), "{text}");
    c.assert_clean();
    s.stop().await;
}

/// A collector that fails half its requests and then goes away for a
/// while: once it is back, every event of the journal reached it at least
/// once, in order, nothing missing (the ids are `audit export`'s); the
/// API served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_delivery_survives_a_flaky_then_absent_collector() {
    let mut c = Collector::start(0).await;
    c.mode.store(FLAKY, Ordering::SeqCst);
    let secrets = tempfile::tempdir().unwrap();
    let sinks = sinks_of(&http_sink_toml(secrets.path(), &c.url()));
    let s = Server::start_with(move |cfg| cfg.audit.sinks = sinks).await;
    traffic(&s, "flaky", 12).await;
    until(60, "the flaky collector catches up", || async {
        let head = ids(&s.journal()).last().map(|e| e.0).unwrap_or(0);
        c.events().last().map(|e| e.0) == Some(head)
    })
    .await;
    assert!(
        c.requests.load(Ordering::SeqCst) >= 4,
        "the collector failed some requests"
    );
    // Away: connections are refused, the API does not notice.
    c.away().await;
    traffic(&s, "away", 8).await;
    let (st, _) = s.get(&s.admin, "/v1/leases").await;
    assert_eq!(st, StatusCode::OK);
    let cfg = s.empty_config();
    until(20, "the sink seen failing", || async {
        sink_status(&status(&s.state, &cfg), "collector")["state"] == "failing"
    })
    .await;
    let v = sink_status(&status(&s.state, &cfg), "collector");
    assert!(v["lag"].as_u64().unwrap() > 0, "{v}");
    assert!(
        v["last_error"].as_str().unwrap().contains("cannot connect"),
        "{v}"
    );
    // And in the metrics.
    let text = crate::metrics::exposition(&s.http, &s.url).await;
    let lag = crate::metrics::sample(
        &text,
        "cube_adapter_audit_sink_lag_events",
        &["sink=\"collector\""],
    );
    assert!(lag.is_some_and(|l| l > 0.0), "{text}");
    let failed = crate::metrics::sample(
        &text,
        "cube_adapter_audit_sink_failures_total",
        &["sink=\"collector\""],
    );
    assert!(failed.is_some_and(|f| f >= 2.0), "{text}");
    // Back, on the same port.
    c.mode.store(OK, Ordering::SeqCst);
    c.back().await;
    let journal = ids(&s.journal());
    let head = journal.last().unwrap().0;
    until(30, "the collector has the whole journal", || async {
        c.events().last().is_some_and(|e| e.0 >= head)
    })
    .await;
    c.assert_clean();
    assert_prefix(&deduped(&c.events()), &journal);
    until(10, "the sink ok again", || async {
        sink_status(&status(&s.state, &cfg), "collector")["state"] == "ok"
    })
    .await;
    let v = sink_status(&status(&s.state, &cfg), "collector");
    assert_eq!(v["lag"], 0, "{v}");
    assert!(v["failures"].as_u64().unwrap() >= 2, "{v}");
    assert_eq!(v["consecutive_failures"], 0, "{v}");
    // The collector's token and key are nowhere in the appliance's answers.
    let text = status(&s.state, &cfg).to_string();
    assert!(!text.contains(TOKEN) && !text.contains(KEY));
    s.stop().await;
    c.away().await;
}

/// SIGKILL while a batch is in flight: the next process delivers from the
/// sink's stored cursor (the first event not acknowledged), not from the
/// journal's start, and the collector ends with the whole journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_delivery_resumes_from_the_cursor() {
    let mut c = Collector::start(0).await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, http_sink_toml(dir.path(), &c.url())).unwrap();
    let _reaper = crate::kit::SandboxReaper(state.join("embedded/sandboxes"));
    let p = Proc::start(&state, &config, &[]).unwrap();
    let admin = std::fs::read_to_string(state.join("admin.token")).unwrap();
    let admin = admin.trim().to_string();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap();
    let execs = |url: String, session: &'static str, n: usize| {
        let http = http.clone();
        let admin = admin.clone();
        async move {
            let v: Value = http
                .post(format!("{url}/v1/leases/acquire"))
                .bearer_auth(&admin)
                .json(&json!({"runtime": "mcp", "session_key": session}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let lease = v["lease_ref"].as_str().unwrap().to_string();
            for i in 0..n {
                let r = http
                    .post(format!("{url}/v1/leases/{lease}/exec"))
                    .bearer_auth(&admin)
                    .json(&json!({"command": format!("echo sink-{i}")}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), StatusCode::OK);
            }
        }
    };
    execs(p.url.clone(), "before", 6).await;
    // Caught up, and long enough for the cursor to be written (once a
    // second at most).
    until(30, "delivered before the kill", || async {
        status(&state, &config)["audit"]["sinks"][0]["lag"] == 0
    })
    .await;
    let acked = c.events().last().unwrap().0;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // The collector stops answering; new events are in flight when the
    // process dies.
    c.mode.store(HANG, Ordering::SeqCst);
    let before = c.requests.load(Ordering::SeqCst);
    execs(p.url.clone(), "during", 3).await;
    until(20, "a batch in flight", || async {
        c.requests.load(Ordering::SeqCst) > before
    })
    .await;
    let mut child = p.child;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();
    // The hanging request is abandoned with its process; new ones are
    // answered.
    c.away().await;
    c.mode.store(OK, Ordering::SeqCst);
    c.back().await;
    let firsts_before = c.firsts.lock().unwrap().len();
    let p = Proc::start(&state, &config, &[]).unwrap();
    until(30, "delivery resumed", || async {
        c.firsts.lock().unwrap().len() > firsts_before
    })
    .await;
    let resumed_at = c.firsts.lock().unwrap()[firsts_before];
    assert_eq!(
        resumed_at,
        acked + 1,
        "the restart resumes at the first event the collector did not acknowledge"
    );
    until(30, "caught up after the restart", || async {
        status(&state, &config)["audit"]["sinks"][0]["lag"] == 0
    })
    .await;
    p.stop();
    let out = Command::new(BIN)
        .args(["audit", "export", "--state-dir"])
        .arg(&state)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(out.status.success());
    let journal = ids(&String::from_utf8(out.stdout).unwrap());
    c.assert_clean();
    assert_eq!(deduped(&c.events()), journal);
    // Stopped, `status` reads the stored cursor: nothing left behind.
    let v = status(&state, &config);
    assert_eq!(v["audit"]["sinks"][0]["state"], "stopped", "{v}");
    assert_eq!(v["audit"]["sinks"][0]["lag"], 0, "{v}");
    c.away().await;
}

/// The file sink on a full disk: the API keeps serving and auditing (the
/// journal is elsewhere), the sink says it is failing, and the file holds
/// only whole lines; with room again it catches up with every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_file_sink_does_not_block_the_api() {
    let disk = tempfile::tempdir().unwrap();
    let _fs = crate::kit::Tmpfs::mount(disk.path(), "64k");
    let path = disk.path().join("audit.jsonl");
    let toml_text = format!(
        "[[audit.sinks]]\nkind = \"file\"\nname = \"disk\"\npath = \"{}\"\nbatch = 3\n",
        path.display()
    );
    let sinks = sinks_of(&toml_text);
    let s = Server::start_with(move |cfg| cfg.audit.sinks = sinks).await;
    let cfg = s.empty_config();
    traffic(&s, "room", 2).await;
    until(20, "the first events written", || async {
        sink_status(&status(&s.state, &cfg), "disk")["lag"] == 0
    })
    .await;
    // Fill the disk.
    let filler = disk.path().join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![b'x'; 1024];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }
    traffic(&s, "full", 10).await;
    let (st, _) = s.get(&s.admin, "/v1/leases").await;
    assert_eq!(
        st,
        StatusCode::OK,
        "the API serves with the sink's disk full"
    );
    until(20, "the sink seen failing", || async {
        sink_status(&status(&s.state, &cfg), "disk")["state"] == "failing"
    })
    .await;
    let v = sink_status(&status(&s.state, &cfg), "disk");
    assert!(v["lag"].as_u64().unwrap() > 0, "{v}");
    assert!(
        v["last_error"].as_str().unwrap().contains("No space left"),
        "{v}"
    );
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.is_empty() || text.ends_with('\n'), "a half line");
    ids(&text); // every line parses
    // Room again.
    std::fs::remove_file(&filler).unwrap();
    until(30, "the sink catches up", || async {
        sink_status(&status(&s.state, &cfg), "disk")["lag"] == 0
    })
    .await;
    let written = ids(&std::fs::read_to_string(&path).unwrap());
    let journal = ids(&s.journal());
    assert_eq!(deduped(&written), written, "every event once, in order");
    assert_prefix(&journal, &written);
    s.stop().await;
}

/// Rotation by size: `PATH`, `PATH.1`, `PATH.2` (the oldest dropped), none
/// past the limit, together the journal's newest events in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_sink_rotates_by_size_and_count() {
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("audit.jsonl");
    let toml_text = format!(
        "[[audit.sinks]]\nkind = \"file\"\nname = \"rotated\"\npath = \"{}\"\nbatch = 1\nmax_bytes = 4096\nkeep = 2\nfsync = \"never\"\n",
        path.display()
    );
    let sinks = sinks_of(&toml_text);
    let s = Server::start_with(move |cfg| cfg.audit.sinks = sinks).await;
    traffic(&s, "rotate", 16).await;
    let cfg = s.empty_config();
    until(20, "delivered", || async {
        sink_status(&status(&s.state, &cfg), "rotated")["lag"] == 0
    })
    .await;
    let name = |n: u32| out.path().join(format!("audit.jsonl.{n}"));
    assert!(!name(3).exists(), "keep = 2");
    let mut all = vec![];
    for p in [name(2), name(1), path.clone()] {
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(
            text.len() <= 4096,
            "{} has {} bytes",
            p.display(),
            text.len()
        );
        all.extend(ids(&text));
    }
    let journal = ids(&s.journal());
    assert!(journal.len() > all.len(), "the oldest file was dropped");
    let at = journal.iter().position(|e| *e == all[0]).unwrap();
    assert!(at > 0, "the oldest file was dropped");
    assert_eq!(
        all,
        journal[at..at + all.len()].to_vec(),
        "contiguous, in order"
    );
    s.stop().await;
}

/// One RFC 5424 message: (PRI, APP-NAME, MSGID, MSG).
fn rfc5424(msg: &str) -> (u32, String, String, Value) {
    let rest = msg.strip_prefix('<').unwrap_or_else(|| panic!("{msg}"));
    let (pri, rest) = rest.split_once('>').unwrap();
    let mut f = rest.splitn(7, ' ');
    assert_eq!(f.next(), Some("1"), "VERSION in {msg}");
    let ts = f.next().unwrap();
    assert!(ts.ends_with('Z') && ts.contains('T'), "TIMESTAMP {ts}");
    let _host = f.next().unwrap();
    let app = f.next().unwrap().to_string();
    let procid = f.next().unwrap();
    assert!(procid.parse::<u32>().is_ok(), "PROCID {procid}");
    let msgid = f.next().unwrap().to_string();
    let sd_msg = f.next().unwrap();
    let body = sd_msg
        .strip_prefix("- ")
        .unwrap_or_else(|| panic!("SD in {msg}"));
    (
        pri.parse().unwrap(),
        app,
        msgid,
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}")),
    )
}

/// Syslog over a unix datagram socket and over TCP (octet counting): each
/// event one RFC 5424 message, facility and severity in PRI, the action as
/// MSGID, the exported event as MSG.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn syslog_over_a_unix_socket_and_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("log.sock");
    let dgram = std::os::unix::net::UnixDatagram::bind(&sock).unwrap();
    // Read as they come: a datagram socket's queue is short (10 by
    // default), and a full one holds the sender back.
    let got = Arc::new(Mutex::new(Vec::<String>::new()));
    {
        let got = got.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = dgram.recv(&mut buf) {
                got.lock()
                    .unwrap()
                    .push(String::from_utf8(buf[..n].to_vec()).unwrap());
            }
        });
    }
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = tcp.local_addr().unwrap().port();
    let toml_text = format!(
        "[[audit.sinks]]\nkind = \"syslog\"\nname = \"local\"\naddress = \"unix:{}\"\n\n\
         [[audit.sinks]]\nkind = \"syslog\"\nname = \"remote\"\naddress = \"tcp:127.0.0.1:{port}\"\nfacility = \"local3\"\napp_name = \"jump-audit\"\n",
        sock.display()
    );
    let sinks = sinks_of(&toml_text);
    let s = Server::start_with(move |cfg| cfg.audit.sinks = sinks).await;
    traffic(&s, "syslog", 3).await;
    let cfg = s.empty_config();
    until(20, "both delivered", || async {
        let v = status(&s.state, &cfg);
        sink_status(&v, "local")["lag"] == 0 && sink_status(&v, "remote")["lag"] == 0
    })
    .await;
    let journal: Vec<Value> = s
        .journal()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Datagrams: one message each.
    let got = got.lock().unwrap().clone();
    // TCP: `LEN SP MSG` frames on one connection.
    let (mut conn, _) = tcp.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut raw = vec![];
    {
        use std::io::Read;
        let mut chunk = [0u8; 65536];
        while let Ok(n) = conn.read(&mut chunk) {
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&chunk[..n]);
        }
    }
    let mut framed = vec![];
    let mut rest = raw.as_slice();
    while !rest.is_empty() {
        let sp = rest.iter().position(|b| *b == b' ').unwrap();
        let len: usize = std::str::from_utf8(&rest[..sp]).unwrap().parse().unwrap();
        framed.push(String::from_utf8(rest[sp + 1..sp + 1 + len].to_vec()).unwrap());
        rest = &rest[sp + 1 + len..];
    }
    for (msgs, facility, app) in [(&got, 10u32, "cube-adapter"), (&framed, 19, "jump-audit")] {
        assert_eq!(msgs.len(), journal.len(), "one message per event");
        for (m, ev) in msgs.iter().zip(&journal) {
            let (pri, a, msgid, body) = rfc5424(m);
            let severity = match ev["outcome"].as_str().unwrap() {
                "error" | "uncertain" => 4,
                "rejected" => 5,
                _ => 6,
            };
            assert_eq!(pri, facility * 8 + severity, "{m}");
            assert_eq!(a, app);
            assert_eq!(msgid, ev["action"].as_str().unwrap());
            assert_eq!(&body, ev);
        }
    }
    s.stop().await;
}

/// The stdout sink through the binary: the events as JSON lines on the
/// service's standard output (journald's, under systemd), marked as the
/// audit stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stdout_sink_writes_json_lines() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[[audit.sinks]]\nkind = \"stdout\"\nname = \"journald\"\n",
    )
    .unwrap();
    let _reaper = crate::kit::SandboxReaper(state.join("embedded/sandboxes"));
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&state)
        .arg("--config")
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The banner (its first line, then lines indented by two spaces) and
    // the audit stream share the output, whole lines each.
    let mut lines = vec![];
    let audit_line = |l: &str, lines: &mut Vec<Value>| {
        if l.starts_with("  ") {
            return;
        }
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        assert_eq!(v["stream"], "cube-adapter-audit", "{l}");
        lines.push(v);
    };
    let url = loop {
        let l = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        if let Some(u) = l.strip_prefix("cube-adapter listening on ") {
            break u.to_string();
        }
        audit_line(&l, &mut lines);
    };
    let admin = std::fs::read_to_string(state.join("admin.token")).unwrap();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap();
    let r = http
        .post(format!("{url}/v1/leases/acquire"))
        .bearer_auth(admin.trim())
        .json(&json!({"runtime": "mcp", "session_key": "stdout"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !lines
        .iter()
        .any(|v: &Value| v["action"] == "acquire" && v["phase"] == "outcome")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no acquire outcome: {lines:?}"
        );
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            audit_line(&l, &mut lines);
        }
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    child.wait().unwrap();
    let out = Command::new(BIN)
        .args(["audit", "export", "--state-dir"])
        .arg(&state)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let journal = ids(&String::from_utf8(out.stdout).unwrap());
    let got: Vec<(u64, String)> = lines
        .iter()
        .map(|v| {
            (
                v["seq"].as_u64().unwrap(),
                v["event_id"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        got,
        journal[..got.len()].to_vec(),
        "the journal's first events, in order"
    );
}

/// SIGHUP adds a sink (it delivers the journal from its start), then
/// removes it (it stops; the other keeps going); a sink that cannot be
/// built (its key file is missing) is refused with the reason and nothing
/// changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_and_removes_sinks_and_refuses_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("config.toml");
    let file_sink = |name: &str| {
        format!(
            "[[audit.sinks]]\nkind = \"file\"\nname = \"{name}\"\npath = \"{}\"\n\n",
            dir.path().join(format!("{name}.jsonl")).display()
        )
    };
    std::fs::write(&config, file_sink("first")).unwrap();
    let _reaper = crate::kit::SandboxReaper(state.join("embedded/sandboxes"));
    let p = Proc::start(&state, &config, &[]).unwrap();
    let pid = nix::unistd::Pid::from_raw(p.child.id() as i32);
    // Something in the journal.
    let admin = std::fs::read_to_string(state.join("admin.token")).unwrap();
    let ca = std::fs::read(state.join("tls/ca.pem")).unwrap();
    let r = reqwest::Client::builder()
        .tls_backend_preconfigured(cube_adapter::tls::client_config(Some(&ca), None).unwrap())
        .build()
        .unwrap()
        .post(format!("{}/v1/leases/acquire", p.url))
        .bearer_auth(admin.trim())
        .json(&json!({"runtime": "mcp", "session_key": "reload"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let reload = |text: String| {
        std::fs::write(&config, text).unwrap();
        let before = status(&state, &config)["last_reload"].clone();
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let v = status(&state, &config);
            if v["last_reload"] != before {
                return v;
            }
            assert!(std::time::Instant::now() < deadline, "no reload");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let names = |v: &Value| -> Vec<String> {
        v["audit"]["sinks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap().to_string())
            .collect()
    };
    // Added.
    let v = reload(file_sink("first") + &file_sink("second"));
    assert_eq!(v["last_reload"]["ok"], true, "{v}");
    assert_eq!(names(&v), ["first", "second"]);
    until(20, "the added sink delivers from the start", || async {
        sink_status(&status(&state, &config), "second")["lag"] == 0
    })
    .await;
    let second = std::fs::read_to_string(dir.path().join("second.jsonl")).unwrap();
    assert_eq!(
        ids(&second).first().map(|e| e.0),
        Some(1),
        "{second:?} {}",
        status(&state, &config)
    );
    // Bad: refused, both keep running.
    let bad = format!(
        "{}{}[[audit.sinks]]\nkind = \"http\"\nname = \"bad\"\nurl = \"http://127.0.0.1:9/\"\nhmac_key_file = \"{}\"\n",
        file_sink("first"),
        file_sink("second"),
        dir.path().join("missing.key").display()
    );
    let v = reload(bad);
    assert_eq!(v["last_reload"]["ok"], false, "{v}");
    let e = v["last_reload"]["error"].as_str().unwrap();
    assert!(
        e.contains("audit sink 'bad'") && e.contains("hmac_key_file"),
        "{e}"
    );
    assert_eq!(names(&v), ["first", "second"]);
    // Removed.
    let v = reload(file_sink("first"));
    assert_eq!(v["last_reload"]["ok"], true, "{v}");
    assert_eq!(names(&v), ["first"]);
    p.stop();
}

/// The shutdown takes its steps in one order, the store closed last, and
/// what the order protects holds: the file sink delivered everything and
/// wrote its cursor while the store was still open (the stopped service's
/// `status` shows no lag; a sink stopped after the store would have lost
/// the cursor it writes at most once a second), the admin socket is gone
/// and the store is free for the next process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_stops_the_sinks_before_it_closes_the_store() {
    use cube_adapter::app::Step;
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("audit.jsonl");
    let toml_text = format!(
        "[[audit.sinks]]\nkind = \"file\"\nname = \"disk\"\npath = \"{}\"\n",
        path.display()
    );
    let config = out.path().join("config.toml");
    std::fs::write(&config, &toml_text).unwrap();
    let sinks = sinks_of(&toml_text);
    let mut s = Server::start_with(move |cfg| cfg.audit.sinks = sinks).await;
    for named in ["embedded server", "admin socket", "revocation watch"] {
        assert!(s.tasks.contains(&named), "{named}: {:?}", s.tasks);
    }
    traffic(&s, "last-words", 3).await;
    let report = s.shut_down().await.unwrap();
    assert_eq!(
        report.steps,
        [
            Step::StopAccepting,
            Step::StopUpkeep,
            Step::DrainEffects,
            Step::StopTasks,
            Step::StopSinks,
            Step::CloseStore,
        ]
    );
    report.served.unwrap();
    assert!(!s.state.join("admin.sock").exists());
    let v = sink_status(&status(&s.state, &config), "disk");
    assert_eq!(v["state"], "stopped", "{v}");
    assert_eq!(v["lag"], 0, "{v}");
    let written = ids(&std::fs::read_to_string(&path).unwrap());
    let journal = ids(&s.journal());
    assert_eq!(written.last(), journal.last(), "the last event delivered");
    assert_eq!(v["cursor"].as_u64(), journal.last().map(|(seq, _)| *seq));
}

/// The file and HTTP sinks carry sealed recordings too: the file sink
/// beside its JSON lines (`recordings/REF.cast`), the HTTP sink to
/// `URL/recordings/REF` (signed, with its SHA-256); both byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_deliver_sealed_recordings() {
    let c = Collector::start(0).await;
    let secrets = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("audit.jsonl");
    let toml_text = format!(
        "{}[[audit.sinks]]\nkind = \"file\"\nname = \"local\"\npath = \"{}\"\n",
        http_sink_toml(secrets.path(), &c.url()),
        path.display()
    );
    let sinks = sinks_of(&toml_text);
    let s = Server::start_with(move |cfg| cfg.audit.sinks = sinks).await;
    let lease = s.acquire(&s.admin, "sink-recordings").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": "seq 1 2000"}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let job = v["job_ref"].as_str().unwrap().to_string();
    let file = crate::recordings::sealed(&s.state, &job, || {
        s.journal()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    })
    .await;
    let rec = file.file_stem().unwrap().to_str().unwrap().to_string();
    let want = std::fs::read(&file).unwrap();
    let copy = out.path().join("recordings").join(format!("{rec}.cast"));
    until(20, "the file sink's copy", || async { copy.exists() }).await;
    assert_eq!(std::fs::read(&copy).unwrap(), want);
    until(20, "the collector's copy", || async {
        c.recordings.lock().unwrap().iter().any(|(r, _)| *r == rec)
    })
    .await;
    let got = c.recordings.lock().unwrap().clone();
    let (_, body) = got.iter().find(|(r, _)| *r == rec).unwrap();
    assert_eq!(body, &want);
    c.assert_clean();
    s.stop().await;
}
