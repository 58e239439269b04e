//! `bench export`: the memory of a real `serve` process while
//! `cube-adapter audit export` streams a long journal through its admin
//! socket. The journal is written directly through the store (the service
//! stopped), then the service is started on it and the export goes through
//! the CLI, as an operator runs it. VmRSS is sampled from /proc while the
//! exports run and after each: it should stay flat (the export is streamed
//! in bounded batches), whatever the number of events.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Report;
use crate::audit::event::{Action, Event, Outcome, Phase};
use crate::store::Store;

/// Events per write transaction while filling the journal.
const FILL_BATCH: u64 = 10_000;

/// How often RSS is sampled during an export.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// Sample events per second of journal time: event `i` is stamped
/// [`SAMPLE_START`] + `i / SAMPLE_RATE` seconds, so a minute holds 6,000.
pub const SAMPLE_RATE: u64 = 100;
/// When the sample journal starts (2025-01-01T00:00:00Z, Unix seconds).
pub const SAMPLE_START: i64 = 1_735_689_600;

/// Append `events` events to the journal of the (stopped) store in
/// `state`, shaped as an agent's exec outcomes are (digests, refs, a
/// duration, an exit code): the journal a busy appliance leaves. They go
/// on from the journal's last `seq` (a second fill continues the first:
/// later times, new request ids and sandboxes).
pub async fn fill_journal(state: &Path, events: u64) -> anyhow::Result<()> {
    let store = Store::open(state)?;
    let start = store.read_now(crate::audit::last_seq)?;
    let mut done = 0u64;
    while done < events {
        let n = FILL_BATCH.min(events - done);
        let first = start + done;
        store
            .write(move |txn, chain| {
                for i in first..first + n {
                    chain.append(txn, sample_event(i))?;
                }
                Ok(())
            })
            .await?;
        done += n;
    }
    store.close().await;
    Ok(())
}

/// Event `i`'s time: [`SAMPLE_RATE`] a second from [`SAMPLE_START`].
fn sample_time(i: u64) -> String {
    let secs = i64::try_from(i / SAMPLE_RATE).unwrap_or(i64::MAX / 2);
    let micros = (i % SAMPLE_RATE) * (1_000_000 / SAMPLE_RATE);
    match time::OffsetDateTime::from_unix_timestamp(SAMPLE_START.saturating_add(secs)) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{micros:06}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
        ),
        Err(_) => "2025-01-01T00:00:00Z".into(),
    }
}

fn sample_event(i: u64) -> Event {
    let hex = |tag: &str| format!("{:032x}", (u128::from(i) << 8) | tag.len() as u128);
    Event {
        event_id: format!("{:032x}", u128::from(i) + (1 << 100)),
        ts: sample_time(i),
        operation_id: Some(hex("operation")),
        phase: Phase::Outcome,
        action: Action::Exec,
        outcome: if i.is_multiple_of(7) {
            Outcome::Error
        } else {
            Outcome::Ok
        },
        runtime: Some("mcp".into()),
        tenant_digest: Some(hex("tenant")),
        identity_digest: Some(hex("identity")),
        session_digest: Some(hex("session")),
        profile: Some("offline-code".into()),
        request_id: Some(format!("req-{i:016x}")),
        lease_ref: Some(format!("lease_{:020x}", i / 100)),
        sandbox_ref: Some(format!("{:08x}", i / 100)),
        duration_ms: Some(i % 5000),
        command_digest: Some(hex("command")),
        exit_code: Some(i32::from(i.is_multiple_of(7))),
        ..Default::default()
    }
}

use super::rss_kib;

/// What one export did, and the service's memory meanwhile.
pub struct ExportRun {
    pub lines: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// The highest VmRSS of the service while the export ran (KiB).
    pub service_peak_kib: u64,
    /// The highest VmRSS of the `audit export` process itself (KiB).
    pub client_peak_kib: u64,
}

/// Run `launcher audit export` on `state` to its end (its output counted,
/// not kept), sampling the RSS of the service `service_pid` and of the
/// export itself as it runs.
pub async fn run_export(
    launcher: &Path,
    state: &Path,
    config: &Path,
    service_pid: u32,
) -> anyhow::Result<ExportRun> {
    let t0 = Instant::now();
    let mut child = std::process::Command::new(launcher)
        .args(["audit", "export", "--state-dir"])
        .arg(state)
        .arg("--config")
        .arg(config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let client_pid = child.id();
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let count = tokio::task::spawn_blocking(move || -> std::io::Result<(u64, u64)> {
        use std::io::Read;
        let (mut lines, mut bytes) = (0u64, 0u64);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = stdout.read(&mut buf)?;
            if n == 0 {
                return Ok((lines, bytes));
            }
            let got = buf.get(..n).unwrap_or_default();
            lines += got.iter().filter(|b| **b == b'\n').count() as u64;
            bytes += n as u64;
        }
    });
    let (mut service_peak_kib, mut client_peak_kib) = (0u64, 0u64);
    while !count.is_finished() {
        service_peak_kib = service_peak_kib.max(rss_kib(service_pid));
        client_peak_kib = client_peak_kib.max(rss_kib(client_pid));
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    let (lines, bytes) = count.await??;
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
    anyhow::ensure!(
        out.status.success(),
        "audit export failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(ExportRun {
        lines,
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
        service_peak_kib,
        client_peak_kib,
    })
}

fn tmpdir() -> PathBuf {
    std::env::temp_dir().join(format!("cube-bench-export-{:016x}", rand::random::<u64>()))
}

/// `bench export`: fill a journal with `events` events, start `serve` on
/// it and run `exports` exports through its admin socket, one after the
/// other; VmRSS of the service before, during (peak) and after each. With
/// `load` > 0, that many agents each hold a lease and make audited calls
/// (`stat`) all the while: the soak of a busy appliance.
pub async fn export(
    launcher: &Path,
    events: u64,
    exports: usize,
    load: usize,
) -> anyhow::Result<Report> {
    let dir = tmpdir();
    std::fs::create_dir_all(&dir)?;
    let result = export_in(launcher, &dir, events, exports, load).await;
    super::remove_tmp(&dir);
    result
}

/// How often each load agent makes its call: 64 agents make 64 audited
/// calls a second, a busy appliance's pace, and the journal the exports
/// read grows by some 8,000 events a minute, not by all two cores can write.
const LOAD_EVERY: Duration = Duration::from_secs(1);

/// Agents making audited calls on leases of their own until stopped.
struct Load {
    stop: tokio_util::sync::CancellationToken,
    calls: Vec<tokio::task::JoinHandle<(u64, u64)>>,
    http: reqwest::Client,
    url: String,
    admin: String,
    leases: Vec<String>,
}

impl Load {
    /// `agents` leases of the `bench` profile, each polled with `stat`
    /// every `LOAD_EVERY`.
    async fn start(url: &str, state: &Path, agents: usize) -> anyhow::Result<Self> {
        let (http, admin) = super::admin_client(state, &state.join("tls/ca.pem"))?;
        let stop = tokio_util::sync::CancellationToken::new();
        let (mut calls, mut leases) = (vec![], vec![]);
        for a in 0..agents {
            let r = http
                .post(format!("{url}/v1/leases/acquire"))
                .bearer_auth(&admin)
                .json(&serde_json::json!({
                    "runtime": "mcp", "session_key": format!("load-{a}"), "profile": "bench"
                }))
                .send()
                .await?;
            let st = r.status();
            let v: serde_json::Value = r.json().await?;
            anyhow::ensure!(st.is_success(), "acquire: {st} {v}");
            let lease = v
                .get("lease_ref")
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_string();
            leases.push(lease.clone());
            let (http, admin, stop, url) =
                (http.clone(), admin.clone(), stop.clone(), url.to_string());
            calls.push(tokio::spawn(async move {
                let (mut ok, mut failed) = (0u64, 0u64);
                while !stop.is_cancelled() {
                    let r = http
                        .post(format!("{url}/v1/leases/{lease}/stat"))
                        .bearer_auth(&admin)
                        .json(&serde_json::json!({"path": "/workspace"}))
                        .send()
                        .await;
                    match r {
                        Ok(r) if r.status().is_success() => ok += 1,
                        _ => failed += 1,
                    }
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::time::sleep(LOAD_EVERY) => {}
                    }
                }
                (ok, failed)
            }));
        }
        Ok(Self {
            stop,
            calls,
            http,
            url: url.to_string(),
            admin,
            leases,
        })
    }

    /// Stop the agents and release their leases: (calls answered, calls
    /// failed). A lease left held would leave its sandbox running, its disk
    /// mounted, when the bench removes the state directory.
    async fn finish(self) -> (u64, u64) {
        self.stop.cancel();
        let mut all = (0, 0);
        for c in self.calls {
            if let Ok((ok, failed)) = c.await {
                all.0 += ok;
                all.1 += failed;
            }
        }
        for lease in &self.leases {
            let released = self
                .http
                .post(format!("{}/v1/leases/{lease}/release", self.url))
                .bearer_auth(&self.admin)
                .json(&serde_json::json!({"action": "kill"}))
                .send()
                .await;
            if !matches!(&released, Ok(r) if r.status().is_success()) {
                tracing::warn!(lease, "bench: a load lease was not released");
            }
        }
        all
    }
}

async fn export_in(
    launcher: &Path,
    dir: &Path,
    events: u64,
    exports: usize,
    load: usize,
) -> anyhow::Result<Report> {
    let mut report = Report::new("export");
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        "[profiles.bench]\ntemplate = \"minimal\"\nmax_active_leases_per_tenant = 10000\n",
    )?;
    let state = dir.join("state");
    // A first start makes the state directory (keys, certificate, token).
    drop(super::ServeProc::start(launcher, &state, &config)?);
    let t = Instant::now();
    fill_journal(&state, events).await?;
    let fill = t.elapsed().as_secs_f64();
    report.figures.insert(
        "journal fill, events/s (store API)".into(),
        events as f64 / fill,
    );
    report.figures.insert(
        "store file (MiB)".into(),
        std::fs::metadata(state.join("state.redb"))?.len() as f64 / 1048576.0,
    );

    let serve = super::ServeProc::start(launcher, &state, &config)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = rss_kib(serve.pid());
    report
        .figures
        .insert("service RSS idle (KiB)".into(), idle as f64);
    let load = if load > 0 {
        Some(Load::start(&serve.url, &state, load).await?)
    } else {
        None
    };
    let mut peak = idle;
    let mut last_after = idle;
    let mut after_fifth = None;
    let mut expected = None;
    // Beyond ten exports (a soak), only the RSS after each is reported.
    let detailed = exports <= 10;
    // The exports, in a block of their own: the load's leases are released
    // whether they succeed or not.
    let exported: anyhow::Result<()> = async {
        for i in 1..=exports {
            let run = run_export(launcher, &state, &config, serve.pid()).await?;
            // Every export prints the whole journal (the first start's own
            // events included): the same number of lines each time, or more
            // under load.
            let first = *expected.get_or_insert(run.lines);
            if run.lines < events || (load.is_none() && first != run.lines) {
                anyhow::bail!("export {i} printed {} lines of {events}", run.lines);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            last_after = rss_kib(serve.pid());
            if i == 5 {
                after_fifth = Some(last_after);
            }
            peak = peak.max(run.service_peak_kib);
            let f = &mut report.figures;
            if !detailed {
                f.insert(
                    format!("export {i:03}: service RSS after (KiB)"),
                    last_after as f64,
                );
                continue;
            }
            f.insert(
                format!("export {i}: service RSS peak (KiB)"),
                run.service_peak_kib as f64,
            );
            f.insert(
                format!("export {i}: service RSS after (KiB)"),
                last_after as f64,
            );
            f.insert(
                format!("export {i}: audit export RSS peak (KiB)"),
                run.client_peak_kib as f64,
            );
            f.insert(
                format!("export {i}: events/s"),
                run.lines as f64 / run.seconds,
            );
            f.insert(
                format!("export {i}: MB/s"),
                run.bytes as f64 / run.seconds / 1e6,
            );
        }
        Ok(())
    }
    .await;
    if let Some(load) = load {
        let (ok, failed) = load.finish().await;
        report
            .figures
            .insert("load: audited calls answered".into(), ok as f64);
        report
            .figures
            .insert("load: audited calls failed".into(), failed as f64);
    }
    drop(serve);
    exported?;
    if let Some(fifth) = after_fifth {
        report
            .figures
            .insert("service RSS after export 5 (KiB)".into(), fifth as f64);
        report.figures.insert(
            format!("service RSS after export {exports}, over after export 5 (%)"),
            (last_after as f64 / fifth as f64 - 1.0) * 100.0,
        );
    }
    report.figures.insert(
        "events exported by the first run".into(),
        expected.unwrap_or(0) as f64,
    );
    report.figures.insert(
        "service RSS growth, peak over idle (KiB)".into(),
        peak.saturating_sub(idle) as f64,
    );
    report.figures.insert(
        "service RSS growth, after the last export over idle (KiB)".into(),
        last_after.saturating_sub(idle) as f64,
    );
    Ok(report)
}
