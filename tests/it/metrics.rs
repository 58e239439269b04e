//! `/metrics` (#21 item 2): real traffic, then a real Prometheus (Debian's
//! `prometheus`) started on 127.0.0.1 scrapes the appliance over HTTPS with
//! the metrics token and is asked through its HTTP API; the exposition
//! passes `promtool check metrics` and the shipped alert rules pass
//! `promtool check rules`. Without the token, or with a wrong one, 401.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{Server, code};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";

/// A tool the test needs: fail (never skip) when it is missing.
fn need(tool: &str) {
    assert!(
        Path::new(tool).exists(),
        "{tool} is missing: install Debian's `prometheus` package (apt-get install -y prometheus; .ci/run does)"
    );
}

/// Prometheus, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Start Prometheus scraping `target` (`host:port`) every second over
    /// HTTPS, trusting `ca`, sending the token in `token_file`.
    fn start(dir: &Path, target: &str, ca: &Path, token_file: &Path) -> Self {
        need(PROMETHEUS);
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
                 scrape_configs:\n  - job_name: cube-adapter\n    scheme: https\n\
                 \x20   tls_config:\n      ca_file: {ca}\n\
                 \x20   authorization:\n      credentials_file: {token}\n\
                 \x20   static_configs:\n      - targets: ['{target}']\n",
                ca = ca.display(),
                token = token_file.display(),
            ),
        )
        .unwrap();
        // A free loopback port for its web API.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = dir.join("prometheus.log");
        let child = Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    /// An instant query's result vector (empty until it has data).
    async fn query(&self, http: &reqwest::Client, q: &str) -> Vec<Value> {
        let Ok(r) = http
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", q)])
            .send()
            .await
        else {
            return vec![];
        };
        let Ok(v) = r.json::<Value>().await else {
            return vec![];
        };
        assert_ne!(v["status"], "error", "query {q}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Poll `q` until its single value satisfies `ok`; the value.
    async fn wait_for(&self, http: &reqwest::Client, q: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut last = vec![];
        while Instant::now() < deadline {
            last = self.query(http, q).await;
            if let [one] = last.as_slice() {
                let v: f64 = one["value"][1].as_str().unwrap().parse().unwrap();
                if ok(v) {
                    return v;
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!(
            "Prometheus never answered `{q}` as expected (last: {last:?}); its log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }
}

/// `/metrics` of an appliance at `url` (no token configured).
pub(crate) async fn exposition(http: &reqwest::Client, url: &str) -> String {
    let r = http.get(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.text().await.unwrap()
}

async fn scrape(s: &Server, token: Option<&str>) -> (StatusCode, String) {
    let mut req = s.http.get(format!("{}/metrics", s.url));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.unwrap();
    let st = r.status();
    (st, r.text().await.unwrap())
}

/// `promtool check metrics` on `text` (stdin): its exit status and output.
fn promtool_metrics(text: &str) -> (bool, String) {
    use std::io::Write;
    need(PROMTOOL);
    let mut c = Command::new(PROMTOOL)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The value of the one sample of `name` whose line carries all `labels`.
pub(crate) fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .find(|l| labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Without a metrics token, `/metrics` is open but names no tenant or
/// profile (#34 L9): their series are summed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_metrics_name_no_tenant_or_profile() {
    let s = Server::start().await;
    for key in ["open-1", "open-2"] {
        let (st, v) = s
            .post(
                &s.admin,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": key}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    let text = exposition(&s.http, &s.url).await;
    assert!(
        !text.contains("tenant=") && !text.contains("profile="),
        "{text}"
    );
    let active = sample(&text, "cube_adapter_leases", &["state=\"running\""]);
    assert_eq!(active, Some(2.0), "{text}");
    let ops = sample(
        &text,
        "cube_adapter_operations_total",
        &["action=\"acquire\"", "outcome=\"ok\""],
    );
    assert!(ops.is_some_and(|n| n >= 2.0), "{text}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_what_the_traffic_did() {
    let tmp = tempfile::tempdir().unwrap();
    let token = "metrics-token-0123456789abcdef";
    let token_file = tmp.path().join("metrics.token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let tf = token_file.clone();
    // An audit sink, for the sinks' series.
    let sink: cube_adapter::config::sinks::SinkDef = toml::from_str(&format!(
        "kind = \"file\"\nname = \"local\"\npath = \"{}\"\n",
        tmp.path().join("audit.jsonl").display()
    ))
    .unwrap();
    let s = Server::start_with(move |c| {
        c.gc_interval_seconds = 0;
        c.metrics.token_file = Some(tf);
        c.audit.sinks = vec![sink];
    })
    .await;

    // Without the token, or with a wrong one: 401 with the envelope.
    for bad in [None, Some("not-the-metrics-token-at-all")] {
        let (st, body) = scrape(&s, bad).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(code(&v), "unauthorized", "{v}");
        assert!(!body.contains(token), "the token is never echoed");
    }
    // An agent's token is not the metrics token either.
    let (st, _) = scrape(&s, Some(&s.admin)).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);

    // Traffic: two leases, a command in one, the other released.
    let kept = s.acquire(&s.admin, "metrics-kept").await;
    let gone = s.acquire(&s.admin, "metrics-gone").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{kept}/exec"),
            json!({"command": "echo counted"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stdout"], "counted\n");
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{gone}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    // A 404 from a route template with a parameter.
    let (st, _) = s
        .get(&s.admin, "/v1/leases/lease_doesnotexist/status")
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);

    // The exposition itself.
    let (st, text) = scrape(&s, Some(token)).await;
    assert_eq!(st, StatusCode::OK, "{text}");
    let (ok, said) = promtool_metrics(&text);
    assert!(
        ok && said.trim().is_empty(),
        "promtool check metrics: {said}\n{text}"
    );
    assert!(!text.contains(token), "the token is never in the metrics");
    let exec_route = "route=\"/v1/leases/{lease_ref}/exec\"";
    assert_eq!(
        sample(
            &text,
            "cube_adapter_http_request_duration_seconds_count",
            &[exec_route, "method=\"POST\"", "status_class=\"2xx\""],
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "cube_adapter_http_request_duration_seconds_count",
            &[
                "route=\"/v1/leases/{lease_ref}/status\"",
                "status_class=\"4xx\""
            ],
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        !text.contains("lease_doesnotexist"),
        "raw paths never become labels"
    );
    assert_eq!(
        sample(
            &text,
            "cube_adapter_operation_duration_seconds_count",
            &["action=\"exec\"", "outcome=\"ok\"", "backend=\"default\""],
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "cube_adapter_operations_total",
            &["action=\"release\"", "outcome=\"ok\""],
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(sample(&text, "cube_adapter_active_leases", &[]), Some(1.0));
    assert_eq!(sample(&text, "cube_adapter_audit_blocked", &[]), Some(0.0));
    assert_eq!(
        sample(&text, "cube_adapter_audit_uncertain_outcomes", &[]),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "cube_adapter_backend_up", &["backend=\"default\""]),
        Some(1.0)
    );
    let commits = sample(
        &text,
        "cube_adapter_audit_commit_duration_seconds_count",
        &[],
    )
    .unwrap();
    assert!(
        commits >= 4.0,
        "acquire ×2, exec, release commit: {commits}"
    );
    let expiry = sample(
        &text,
        "cube_adapter_tls_certificate_expiry_timestamp_seconds",
        &["certificate=\"server\""],
    )
    .unwrap();
    let now = cube_adapter::clock::system_now().unix_timestamp() as f64;
    assert!(expiry > now, "the served certificate is valid: {expiry}");
    assert!(sample(&text, "process_resident_memory_bytes", &[]).unwrap() > 0.0);
    assert!(sample(&text, "process_open_fds", &[]).unwrap() > 0.0);

    // The shipped alert rules are valid.
    need(PROMTOOL);
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/prometheus/alerts.yml");
    let out = Command::new(PROMTOOL)
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // A real Prometheus scrapes it over HTTPS with the token.
    let target = s.url.strip_prefix("https://").unwrap().to_string();
    let prom = Prometheus::start(
        tmp.path(),
        &target,
        &s.state.join("tls/ca.pem"),
        &token_file,
    );
    let http = reqwest::Client::new();
    prom.wait_for(&http, "up{job=\"cube-adapter\"}", |v| v == 1.0)
        .await;
    let q = |m: &str| format!("sum({m})");
    prom.wait_for(
        &http,
        &q(&format!(
            "cube_adapter_http_request_duration_seconds_count{{{exec_route},status_class=\"2xx\"}}"
        )),
        |v| v >= 1.0,
    )
    .await;
    prom.wait_for(
        &http,
        &q("cube_adapter_operation_duration_seconds_count{action=\"exec\",outcome=\"ok\"}"),
        |v| v >= 1.0,
    )
    .await;
    prom.wait_for(
        &http,
        &q("cube_adapter_audit_commit_duration_seconds_count"),
        |v| v >= commits,
    )
    .await;
    prom.wait_for(&http, &q("cube_adapter_leases{state=\"running\"}"), |v| {
        v == 1.0
    })
    .await;
    prom.wait_for(&http, "cube_adapter_active_leases", |v| v == 1.0)
        .await;
    // The sink's series: it delivered everything, and never failed.
    prom.wait_for(
        &http,
        &q("cube_adapter_audit_sink_lag_events{sink=\"local\"}"),
        |v| v == 0.0,
    )
    .await;
    prom.wait_for(
        &http,
        &q("cube_adapter_audit_sink_failures_total{sink=\"local\"}"),
        |v| v == 0.0,
    )
    .await;
    // Its own scrapes are counted too, under their route template.
    prom.wait_for(
        &http,
        &q("cube_adapter_http_request_duration_seconds_count{route=\"/metrics\",status_class=\"2xx\"}"),
        |v| v >= 2.0,
    )
    .await;
    // Every expression of the shipped dashboard is valid PromQL to this
    // Prometheus, and every cube_adapter_* name in it and in the alert
    // rules is one the appliance exports.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging");
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("grafana/cube-adapter.json")).unwrap(),
    )
    .unwrap();
    let mut exprs = vec![];
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    assert!(
        exprs.len() >= 20,
        "a real dashboard: {} queries",
        exprs.len()
    );
    for e in &exprs {
        let e = e
            .replace("$__rate_interval", "1m")
            .replace("$instance", ".*")
            .replace("$job", ".*");
        let r: Value = http
            .get(format!("{}/api/v1/query", prom.url))
            .query(&[("query", e.as_str())])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["status"], "success", "dashboard query {e}: {r}");
    }
    let rules_text = std::fs::read_to_string(&rules).unwrap();
    let names = |t: &str| -> Vec<String> {
        let mut v = vec![];
        let mut rest = t;
        while let Some(i) = rest.find("cube_adapter_") {
            let n: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + n.len()..];
            v.push(n);
        }
        v
    };
    for n in names(&exprs.join("\n"))
        .into_iter()
        .chain(names(&rules_text))
    {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| n.strip_suffix(s))
            .unwrap_or(&n);
        assert!(
            text.contains(&format!("# TYPE {base} ")),
            "{n} (in the dashboard or the rules) is not exported"
        );
    }
    drop(prom);
    s.stop().await;
}

/// A token file too short, or missing, stops `config check` and the start,
/// naming the file and never its content.
#[test]
fn a_bad_token_file_is_refused_without_its_content() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short.token");
    std::fs::write(&short, "s3cret").unwrap();
    let mut c = cube_adapter::config::Config::default();
    c.metrics.token_file = Some(short.clone());
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("short.token") && !e.contains("s3cret"), "{e}");
    c.metrics.token_file = Some(dir.path().join("absent.token"));
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("absent.token"), "{e}");
}
