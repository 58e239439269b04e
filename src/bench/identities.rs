//! `bench identities`: the memory of a real `serve` process as agents
//! connect the way they do, each with a token of its own. N distinct
//! tokens (issued through the admin socket) each acquire a lease (a real
//! sandbox of the embedded backend); then M HTTP Basic sign-ins with random
//! user names fail. RSS (`VmRSS`) and its peak (`VmHWM`) from
//! `/proc/<pid>/status` before, with the leases, and after the sign-ins.
//! Targets (`docs/benchmarks.md`): ≤ 64 MiB with 1,000 tokens each holding
//! a lease; ≤ +8 MiB after 10,000 failed sign-ins.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use super::{Report, Summary};
use crate::admin::{Request, Response};
use crate::auth::{Principal, Role};

fn tmpdir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "cube-bench-identities-{:016x}",
        rand::random::<u64>()
    ))
}

/// `bench identities`: `tokens` distinct tokens each holding a lease, then
/// `sign_ins` failed HTTP Basic sign-ins with random names (`concurrency`
/// at a time).
pub async fn identities(
    launcher: &Path,
    tokens: usize,
    sign_ins: usize,
    concurrency: usize,
) -> anyhow::Result<Report> {
    let dir = tmpdir();
    std::fs::create_dir_all(&dir)?;
    let r = identities_in(&dir, launcher, tokens, sign_ins, concurrency).await;
    super::remove_tmp(&dir);
    r
}

async fn identities_in(
    dir: &Path,
    launcher: &Path,
    tokens: usize,
    sign_ins: usize,
    concurrency: usize,
) -> anyhow::Result<Report> {
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        "[profiles.bench]\ntemplate = \"host\"\nmax_active_leases_per_tenant = 100000\n[profiles.offline-code]\n",
    )?;
    let state = dir.join("state");
    let serve = super::ServeProc::start(launcher, &state, &config)?;
    let ca = std::fs::read(state.join("tls/ca.pem"))?;
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(crate::tls::client_config(Some(&ca), None)?)
        .build()?;
    let url = serve.url.clone();
    serve.wait_ready(&http, super::READY_DEADLINE).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut report = Report::new("identities");
    let mib = |kb: u64| kb as f64 / 1024.0;
    let (idle, _) = serve.memory();
    report.figures.insert("RSS idle (MiB)".into(), mib(idle));

    // N distinct tokens, issued by the running service (admin socket).
    let sock = state.join("admin.sock");
    let issue_started = Instant::now();
    let issued: Vec<String> = tokio::task::spawn_blocking(move || {
        (0..tokens)
            .map(|i| {
                let principal = Principal {
                    label: None,
                    tenant: "bench".into(),
                    subject: format!("agent-{i}"),
                    roles: vec![Role::Agent],
                    runtimes: None,
                    profiles: None,
                    actions: crate::auth::default_actions(&[Role::Agent]),
                    task_templates: vec!["*".into()],
                    task: None,
                    issuer: None,
                };
                let out = crate::admin::call(
                    &sock,
                    &Request::TokenCreate {
                        principal,
                        description: Some("bench identities".into()),
                    },
                )
                .map_err(|e| anyhow::anyhow!(e))?;
                match out.into_iter().next() {
                    Some(Response::Token { token }) => Ok(token),
                    Some(Response::Error { message }) => Err(anyhow::anyhow!(message)),
                    _ => Err(anyhow::anyhow!("token create: unexpected answer")),
                }
            })
            .collect::<anyhow::Result<Vec<String>>>()
    })
    .await??;
    let issue_secs = issue_started.elapsed().as_secs_f64();

    // Each token acquires a lease, 16 at a time; each acquire is that
    // token's first check.
    let sem = Arc::new(tokio::sync::Semaphore::new(16));
    let mut tasks = vec![];
    for (i, token) in issued.into_iter().enumerate() {
        let (http, url, sem) = (http.clone(), url.clone(), sem.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire().await?;
            let t = Instant::now();
            let r = http
                .post(format!("{url}/v1/leases/acquire"))
                .bearer_auth(&token)
                .json(
                    &json!({"runtime": "mcp", "session_key": format!("id{i}"), "profile": "bench"}),
                )
                .send()
                .await?;
            let status = r.status();
            anyhow::ensure!(
                status.is_success(),
                "acquire: {status}: {}",
                r.text().await.unwrap_or_default()
            );
            Ok::<_, anyhow::Error>(t.elapsed())
        }));
    }
    let mut acquire = vec![];
    for t in tasks {
        acquire.push(t.await??);
    }
    report.results.push(Summary::of(
        "acquire, each with its own token (first use)",
        &acquire,
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (loaded, loaded_peak) = serve.memory();
    report.figures.insert(
        format!("RSS with {tokens} tokens each holding a lease (MiB)"),
        mib(loaded),
    );
    report.figures.insert(
        format!("RSS peak with {tokens} tokens each holding a lease (MiB)"),
        mib(loaded_peak),
    );
    report.figures.insert(
        "token issue through the admin socket (per second)".into(),
        tokens as f64 / issue_secs.max(1e-9),
    );

    // M failed HTTP Basic sign-ins with random names.
    let refused = Arc::new(AtomicUsize::new(0));
    let throttled = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = vec![];
    for _ in 0..concurrency.max(1) {
        let (http, url) = (http.clone(), url.clone());
        let (refused, throttled, next) = (refused.clone(), throttled.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut lat = vec![];
            while next.fetch_add(1, Ordering::SeqCst) < sign_ins {
                let name = format!("u{}", crate::ids::random_hex(8));
                let t = Instant::now();
                let r = http
                    .get(format!("{url}/v1/leases"))
                    .basic_auth(&name, Some("not the password, 1234"))
                    .send()
                    .await?;
                lat.push(t.elapsed());
                match r.status().as_u16() {
                    401 => refused.fetch_add(1, Ordering::SeqCst),
                    429 => throttled.fetch_add(1, Ordering::SeqCst),
                    s => anyhow::bail!("a sign-in with a random name answered {s}"),
                };
            }
            Ok::<_, anyhow::Error>(lat)
        }));
    }
    let mut sign_in = vec![];
    for w in workers {
        sign_in.extend(w.await??);
    }
    let sign_in_secs = started.elapsed().as_secs_f64();
    report.results.push(Summary::of(
        "failed HTTP Basic sign-in (random name)",
        &sign_in,
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (after, after_peak) = serve.memory();
    report.figures.insert(
        format!("RSS after {sign_ins} failed sign-ins (MiB)"),
        mib(after),
    );
    report.figures.insert(
        format!("RSS peak after {sign_ins} failed sign-ins (MiB)"),
        mib(after_peak),
    );
    report.figures.insert(
        "RSS growth over the sign-ins (MiB)".into(),
        mib(after) - mib(loaded),
    );
    report.figures.insert(
        "sign-ins answered 401".into(),
        refused.load(Ordering::SeqCst) as f64,
    );
    report.figures.insert(
        "sign-ins answered 429 (queue or throttle)".into(),
        throttled.load(Ordering::SeqCst) as f64,
    );
    report.figures.insert(
        "failed sign-ins per second".into(),
        sign_ins as f64 / sign_in_secs.max(1e-9),
    );
    drop(serve);
    Ok(report)
}
