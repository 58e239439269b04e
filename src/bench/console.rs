//! `bench console`: the web console of a real `serve` process on a long
//! journal. The journal is filled through the store (the service stopped;
//! events shaped as an agent's exec outcomes, `export::fill_journal`), an
//! admin person is added, the service is started, the person signs in, and
//! each console page that answers 200 is fetched many times over one
//! keep-alive TLS connection (the time from request to the last byte: the
//! server's time plus a loopback round trip). Then the journal is grown to
//! the search size and audit searches by indexed fields are timed. VmRSS
//! of the service idle, before any console use, and after the sign-in and
//! the page views. Targets (`docs/benchmarks.md`): page p99 ≤ 50 ms with
//! 100,000 events, indexed search p50 ≤ 100 ms over 1,000,000, the
//! console ≤ +2 MiB of idle RSS.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::export::{SAMPLE_RATE, SAMPLE_START};
use super::{Report, ServeProc, Summary, rss_kib};

/// The path of the i-th search of a kind.
type PathOf = Box<dyn Fn(usize) -> String>;

const PASSWORD: &str = "bench console password";

/// The console's GET pages (those that answer 200 are measured).
pub const PAGES: &[&str] = &[
    "/console",
    "/console/approvals",
    "/console/tasks",
    "/console/audit",
    "/console/leases",
];

fn tmpdir() -> PathBuf {
    std::env::temp_dir().join(format!("cube-bench-console-{:016x}", rand::random::<u64>()))
}

/// `bench console`: `events` events for the pages (`views` fetches of
/// each), `search_events` for the searches (`searches` of each kind).
pub async fn console(
    launcher: &Path,
    events: u64,
    search_events: u64,
    views: usize,
    searches: usize,
) -> anyhow::Result<Report> {
    let dir = tmpdir();
    std::fs::create_dir_all(&dir)?;
    let r = console_in(launcher, &dir, events, search_events, views, searches).await;
    super::remove_tmp(&dir);
    r
}

/// A signed-in browser: its client and session cookie.
struct Person {
    http: reqwest::Client,
    url: String,
    cookie: String,
}

fn cookie_of(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{name}=")))
        .and_then(|v| v.split(';').next())
        .map(str::to_string)
}

/// A client trusting the state directory's CA.
fn ca_client(state: &Path) -> anyhow::Result<reqwest::Client> {
    let ca = std::fs::read(state.join("tls/ca.pem"))?;
    Ok(reqwest::Client::builder()
        .tls_backend_preconfigured(crate::tls::client_config(Some(&ca), None)?)
        .build()?)
}

/// Unix seconds as the console's time fields send them
/// (`YYYY-MM-DDTHH:MM:SS`, UTC).
fn utc(secs: i64) -> String {
    match time::OffsetDateTime::from_unix_timestamp(secs) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        Err(_) => String::new(),
    }
}

/// Sign `name` in (the service is ready).
async fn sign_in(state: &Path, url: &str, name: &str) -> anyhow::Result<Person> {
    let ca = std::fs::read(state.join("tls/ca.pem"))?;
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(crate::tls::client_config(Some(&ca), None)?)
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let r = http.get(format!("{url}/console/sign-in")).send().await?;
    let form_cookie =
        cookie_of(&r, "__Host-cube_signin").ok_or_else(|| anyhow::anyhow!("no sign-in cookie"))?;
    let html = r.text().await?;
    let at = html
        .find("name=\"csrf\" value=\"")
        .ok_or_else(|| anyhow::anyhow!("no csrf field"))?
        + 19;
    let csrf = html[at..].split('"').next().unwrap_or("").to_string();
    let body = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs([
            ("csrf", csrf.as_str()),
            ("name", name),
            ("password", PASSWORD),
        ])
        .finish();
    let r = http
        .post(format!("{url}/console/sign-in"))
        .header("cookie", form_cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await?;
    anyhow::ensure!(r.status().as_u16() == 303, "sign-in: {}", r.status());
    let cookie =
        cookie_of(&r, "__Host-cube_session").ok_or_else(|| anyhow::anyhow!("no session cookie"))?;
    Ok(Person {
        http,
        url: url.to_string(),
        cookie,
    })
}

impl Person {
    /// One page to its last byte: status and time.
    async fn get(&self, path: &str) -> anyhow::Result<(u16, Duration)> {
        let t = Instant::now();
        let r = self
            .http
            .get(format!("{}{path}", self.url))
            .header("cookie", &self.cookie)
            .send()
            .await?;
        let st = r.status().as_u16();
        let _ = r.bytes().await?;
        Ok((st, t.elapsed()))
    }
}

fn add_admin(launcher: &Path, dir: &Path, state: &Path, config: &Path) -> anyhow::Result<()> {
    let pw = dir.join("pw");
    std::fs::write(&pw, format!("{PASSWORD}\n"))?;
    let out = std::process::Command::new(launcher)
        .args(["user", "add", "root", "--tenant", "ops", "--role", "admin"])
        .arg("--password-file")
        .arg(&pw)
        .arg("--state-dir")
        .arg(state)
        .arg("--config")
        .arg(config)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "user add: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

async fn console_in(
    launcher: &Path,
    dir: &Path,
    events: u64,
    search_events: u64,
    views: usize,
    searches: usize,
) -> anyhow::Result<Report> {
    let mut report = Report::new("console");
    let mib = |kb: u64| kb as f64 / 1024.0;
    let config = dir.join("config.toml");
    std::fs::write(&config, "")?;
    let state = dir.join("state");
    drop(ServeProc::start(launcher, &state, &config)?);
    add_admin(launcher, dir, &state, &config)?;
    let t = Instant::now();
    super::export::fill_journal(&state, events).await?;
    report.figures.insert(
        "journal fill with indexes, events/s (store API)".into(),
        events as f64 / t.elapsed().as_secs_f64(),
    );

    // Pages with `events` events.
    let serve = ServeProc::start(launcher, &state, &config)?;
    let url = serve.url.clone();
    // Ready, then settled: the idle RSS before any console use.
    serve
        .wait_ready(&ca_client(&state)?, super::READY_DEADLINE)
        .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = rss_kib(serve.pid());
    report
        .figures
        .insert("service RSS idle, console unused (MiB)".into(), mib(idle));
    let me = sign_in(&state, &url, "root").await?;
    for page in PAGES {
        let (st, _) = me.get(page).await?;
        if st != 200 {
            report
                .figures
                .insert(format!("{page}: not measured (status {st})"), f64::from(st));
            continue;
        }
        let mut samples = Vec::with_capacity(views);
        for _ in 0..views {
            let (st, d) = me.get(page).await?;
            anyhow::ensure!(st == 200, "{page} answered {st}");
            samples.push(d);
        }
        report.results.push(Summary::of(
            &format!("GET {page} ({}k events)", events / 1000),
            &samples,
        ));
    }
    drop(me);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = rss_kib(serve.pid());
    report.figures.insert(
        "service RSS idle after sign-in and page views (MiB)".into(),
        mib(used),
    );
    report.figures.insert(
        "console's addition to idle RSS (MiB)".into(),
        mib(used.saturating_sub(idle)),
    );
    drop(serve);

    // Searches over `search_events` events.
    if search_events > events {
        let t = Instant::now();
        super::export::fill_journal(&state, search_events - events).await?;
        report.figures.insert(
            "journal grow with indexes, events/s (store API)".into(),
            (search_events - events) as f64 / t.elapsed().as_secs_f64(),
        );
    }
    report.figures.insert(
        "store file (MiB)".into(),
        std::fs::metadata(state.join("state.redb"))?.len() as f64 / 1048576.0,
    );
    let serve = ServeProc::start(launcher, &state, &config)?;
    serve
        .wait_ready(&ca_client(&state)?, super::READY_DEADLINE)
        .await?;
    let me = sign_in(&state, &serve.url, "root").await?;
    let k = search_events / 1000;
    // The sample journal: sandbox_ref = seq/100 in hex, request ids
    // unique, outcome error every 7th, action exec.
    let kinds: Vec<(String, PathOf)> = vec![
        (
            format!("search sandbox_ref ({k}k events)"),
            Box::new(move |i| {
                format!(
                    "/console/audit?sandbox_ref={:08x}",
                    (i as u64 * 7919) % (search_events / 100).max(1)
                )
            }),
        ),
        (
            format!("search request_id ({k}k events)"),
            Box::new(move |i| {
                format!(
                    "/console/audit?request_id=req-{:016x}",
                    (i as u64 * 104_729) % search_events
                )
            }),
        ),
        (
            format!("search action+outcome ({k}k events)"),
            Box::new(|_| "/console/audit?action=exec&outcome=error".into()),
        ),
        (
            format!("search sandbox_ref+outcome ({k}k events)"),
            Box::new(move |i| {
                format!(
                    "/console/audit?outcome=error&sandbox_ref={:08x}",
                    (i as u64 * 7919) % (search_events / 100).max(1)
                )
            }),
        ),
        (
            format!("search time range 1 min ({k}k events)"),
            // A minute of the journal (6,000 events) among all its
            // minutes, from a second into it.
            Box::new(move |i| {
                let minutes = (search_events / (60 * SAMPLE_RATE)).max(1);
                let m = (i as u64 * 7919) % minutes;
                let from = SAMPLE_START + (m * 60 + i as u64 % 50) as i64;
                let to = SAMPLE_START + ((m + 1) * 60) as i64;
                format!(
                    "/console/audit?from={}&to={}&action=exec",
                    utc(from),
                    utc(to)
                )
            }),
        ),
    ];
    for (name, path) in &kinds {
        let mut samples = Vec::with_capacity(searches);
        for i in 0..searches {
            let (st, d) = me.get(&path(i)).await?;
            anyhow::ensure!(st == 200, "{} answered {st}", path(i));
            samples.push(d);
        }
        report.results.push(Summary::of(name, &samples));
    }

    // The whole journal exported through the console (JSONL, every exec
    // event): the service's VmRSS before and at its peak while it streams.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib(serve.pid());
    let t = Instant::now();
    let mut r = me
        .http
        .get(format!("{}/console/audit/export.jsonl?action=exec", me.url))
        .header("cookie", &me.cookie)
        .send()
        .await?;
    anyhow::ensure!(r.status().as_u16() == 200, "export: {}", r.status());
    let (mut lines, mut bytes, mut peak) = (0u64, 0u64, before);
    while let Some(chunk) = r.chunk().await? {
        lines += chunk.iter().filter(|b| **b == b'\n').count() as u64;
        bytes += chunk.len() as u64;
        peak = peak.max(rss_kib(serve.pid()));
    }
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(lines >= search_events, "the export gave {lines} lines");
    let f = &mut report.figures;
    f.insert("console export.jsonl: events".into(), lines as f64);
    f.insert("console export.jsonl: events/s".into(), lines as f64 / secs);
    f.insert(
        "console export.jsonl: MB/s".into(),
        bytes as f64 / secs / 1e6,
    );
    f.insert(
        "console export.jsonl: service RSS before (MiB)".into(),
        mib(before),
    );
    f.insert(
        "console export.jsonl: service RSS peak (MiB)".into(),
        mib(peak),
    );
    drop(serve);
    Ok(report)
}
