//! Appliance benchmarks: the whole path an agent's call takes (TLS, auth,
//! policy, two durable audit commits, the backend) against the same call
//! made directly with the `cube/` client.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{Report, Summary};
use crate::config::{BackendSection, Config, Profile};
use crate::cube::wire::CreateSandbox;
use crate::cube::{CubeClient, StartOptions};

/// An embedded backend on loopback (mTLS) plus an appliance in front of it.
pub struct Rig {
    pub url: String,
    pub http: reqwest::Client,
    pub admin: String,
    pub direct: CubeClient,
    pub dir: PathBuf,
    /// The appliance's store (its commit counters).
    pub store: crate::store::Store,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl Rig {
    pub async fn start(dir: &Path, launcher: &Path) -> anyhow::Result<Self> {
        Self::start_with(dir, launcher, vec![]).await
    }

    /// As `start`, with these audit sinks.
    pub async fn start_with(
        dir: &Path,
        launcher: &Path,
        sinks: Vec<crate::config::sinks::SinkDef>,
    ) -> anyhow::Result<Self> {
        Self::start_tweaked(dir, launcher, sinks, |_| {}).await
    }

    /// As `start_with`, the configuration changed by `tweak` last.
    pub async fn start_tweaked(
        dir: &Path,
        launcher: &Path,
        sinks: Vec<crate::config::sinks::SinkDef>,
        tweak: impl FnOnce(&mut Config),
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let lb = super::loopback_backend(dir, launcher).await?;
        let (direct, burl, btx) = (lb.client, lb.url, lb.stop);
        // The appliance, configured with that backend.
        let bench_profile = Profile {
            max_active_leases_per_tenant: 100_000,
            max_command_seconds: 600,
            ..Profile::default()
        };
        let mut profiles = crate::config::shipped_profiles();
        profiles.insert("bench".into(), bench_profile);
        let cfg = Config {
            state_dir: dir.join("state"),
            backend: Some(BackendSection {
                api_url: burl.clone(),
                proxy_url: Some(crate::cube::ProxyUrl::Url(burl)),
                domain: "cube.bench".into(),
                api_key_file: None,
                ca_file: Some(lb.ca_file),
                client_cert_file: Some(lb.client_cert),
                client_key_file: Some(lb.client_key),
                insecure_plain_http: false,
                template: None,
            }),
            profiles,
            ..Config::default()
        };
        let mut cfg = cfg;
        cfg.audit.sinks = sinks;
        tweak(&mut cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let (atx, arx) = tokio::sync::oneshot::channel::<()>();
        let (stx, srx) = tokio::sync::oneshot::channel();
        tokio::spawn(crate::app::serve(
            cfg,
            Default::default(),
            listener,
            launcher.to_path_buf(),
            move |s| {
                let _ = stx.send(s.clone());
            },
            async move {
                let _ = arx.await;
            },
        ));
        let started = tokio::time::timeout(Duration::from_secs(30), srx).await??;
        let (http, admin) = super::admin_client(&dir.join("state"), &started.ca_file)?;
        Ok(Self {
            url: started.url,
            http,
            admin,
            direct,
            dir: dir.to_path_buf(),
            store: started.store.clone(),
            stops: vec![atx, btx],
        })
    }

    pub async fn post(&self, path: &str, body: Value) -> anyhow::Result<Value> {
        let r = self
            .http
            .post(format!("{}{path}", self.url))
            .bearer_auth(&self.admin)
            .json(&body)
            .send()
            .await?;
        let status = r.status();
        let v: Value = r.json().await?;
        anyhow::ensure!(status.is_success(), "{path}: {status} {v}");
        Ok(v)
    }

    pub async fn acquire(&self, session: &str) -> anyhow::Result<String> {
        let v = self
            .post(
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": session, "profile": "bench"}),
            )
            .await?;
        v.get("lease_ref")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("no lease_ref in {v}"))
    }

    pub async fn exec(&self, lease: &str, cmd: &str) -> anyhow::Result<Value> {
        self.post(&format!("/v1/leases/{lease}/exec"), json!({"command": cmd}))
            .await
    }

    pub async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        kill_sandboxes(&self.dir.join("embedded/sandboxes"));
    }
}

/// SIGKILL the init of every sandbox under a directory.
pub fn kill_sandboxes(dir: &Path) {
    for d in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(b) = std::fs::read(d.path().join("init.json")) else {
            continue;
        };
        let Ok(v) = serde_json::from_slice::<Value>(&b) else {
            continue;
        };
        if let Some(pid) = v.get("pid").and_then(Value::as_i64) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// One task per item, each running `per` timed operations, all at once:
/// every latency, and the wall time in seconds.
async fn fan_out<T, F, Fut>(
    items: Vec<T>,
    per: usize,
    op: F,
) -> anyhow::Result<(Vec<Duration>, f64)>
where
    T: Clone + Send + 'static,
    F: Fn(T, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let t0 = Instant::now();
    let mut tasks = vec![];
    for item in items {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(per);
            for i in 0..per {
                let t = Instant::now();
                op(item.clone(), i).await?;
                lat.push(t.elapsed());
            }
            Ok::<_, anyhow::Error>(lat)
        }));
    }
    let mut all = vec![];
    for t in tasks {
        all.extend(t.await??);
    }
    Ok((all, t0.elapsed().as_secs_f64()))
}

fn tmpdir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cube-bench-{name}-{:016x}", rand::random::<u64>()))
}

/// `bench sinks`: the audited exec on two appliances side by side, one
/// without sinks and one delivering to three (a JSONL file, an HTTP
/// collector on loopback, a syslog datagram socket), called alternately so
/// that both meet the same machine; then every sink is checked to have
/// delivered the whole journal.
pub async fn sinks(launcher: &Path, iterations: usize) -> anyhow::Result<Report> {
    use crate::config::sinks::SinkDef;
    let dir = tmpdir("sinks");
    std::fs::create_dir_all(&dir)?;
    // The collector: takes every batch, counts its lines.
    let lines = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let l2 = lines.clone();
    let app = axum::Router::new().route(
        "/audit",
        axum::routing::post(move |body: axum::body::Bytes| {
            let l2 = l2.clone();
            async move {
                let n = body.iter().filter(|b| **b == b'\n').count() as u64;
                l2.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                axum::http::StatusCode::OK
            }
        }),
    );
    let collector = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = collector.local_addr()?.port();
    let served = tokio::spawn(async move { axum::serve(collector, app).await });
    // The syslog socket: read on a thread of its own.
    let sock = dir.join("log.sock");
    let dgram = std::os::unix::net::UnixDatagram::bind(&sock)?;
    let syslogged = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let s2 = syslogged.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        while dgram.recv(&mut buf).is_ok() {
            s2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let defs = [
        format!(
            "kind = \"file\"\nname = \"file\"\npath = \"{}\"",
            dir.join("audit.jsonl").display()
        ),
        format!("kind = \"http\"\nname = \"http\"\nurl = \"http://127.0.0.1:{port}/audit\""),
        format!(
            "kind = \"syslog\"\nname = \"syslog\"\naddress = \"unix:{}\"",
            sock.display()
        ),
    ]
    .iter()
    .map(|t| toml::from_str::<SinkDef>(t))
    .collect::<Result<Vec<_>, _>>()?;
    let plain = Rig::start(&dir.join("plain"), launcher).await?;
    let sunk = Rig::start_with(&dir.join("sinks"), launcher, defs).await?;
    let (lp, ls) = (plain.acquire("sinks").await?, sunk.acquire("sinks").await?);
    for _ in 0..10 {
        plain.exec(&lp, "true").await?;
        sunk.exec(&ls, "true").await?;
    }
    let (mut a, mut b) = (vec![], vec![]);
    for i in 0..iterations {
        // Alternate which goes first, so neither always follows the other.
        let order: [bool; 2] = if i % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for with in order {
            let t = Instant::now();
            if with {
                sunk.exec(&ls, "true").await?;
                b.push(t.elapsed());
            } else {
                plain.exec(&lp, "true").await?;
                a.push(t.elapsed());
            }
        }
    }
    // Every sink caught up with the journal.
    let head = *sunk.store.last_seq().borrow();
    let deadline = Instant::now() + Duration::from_secs(60);
    let file = dir.join("audit.jsonl");
    loop {
        let in_file = std::fs::read(&file)
            .map(|b| b.iter().filter(|c| **c == b'\n').count() as u64)
            .unwrap_or(0);
        let got = [
            in_file,
            lines.load(std::sync::atomic::Ordering::Relaxed),
            syslogged.load(std::sync::atomic::Ordering::Relaxed),
        ];
        if got.iter().all(|n| *n >= head) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the sinks did not catch up: {got:?} of {head} events (file, http, syslog)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pa = Summary::of("exec true, no sinks", &a);
    let pb = Summary::of("exec true, three sinks", &b);
    let mut report = Report::new("sinks");
    report.figures.insert(
        "p50 ratio (three sinks / none)".into(),
        pb.p50_ms / pa.p50_ms,
    );
    report.figures.insert(
        "p99 ratio (three sinks / none)".into(),
        pb.p99_ms / pa.p99_ms,
    );
    report
        .figures
        .insert("events delivered to each sink".into(), head as f64);
    report.results.push(pa);
    report.results.push(pb);
    plain.stop().await;
    sunk.stop().await;
    served.abort();
    super::remove_tmp(&dir);
    Ok(report)
}

/// `bench overhead`: the same exec through the appliance and directly.
pub async fn overhead(launcher: &Path, iterations: usize) -> anyhow::Result<Report> {
    let dir = tmpdir("overhead");
    let rig = Rig::start(&dir, launcher).await?;
    let lease = rig.acquire("overhead").await?;
    let s = rig
        .direct
        .create(&CreateSandbox {
            template_id: "host".into(),
            ..Default::default()
        })
        .await?;
    let sb = rig.direct.addr(&s);
    let mut report = Report::new("overhead");
    for (name, cmd) in [("true", "true"), ("64KiB", "head -c 65536 /dev/zero")] {
        let mut o = StartOptions::shell(cmd);
        o.cwd = Some("/workspace".into());
        o.timeout = Some(Duration::from_secs(60));
        for _ in 0..10 {
            rig.exec(&lease, cmd).await?;
            rig.direct.run(&sb, &o, 64 * 1024).await?;
        }
        let (mut via, mut direct) = (vec![], vec![]);
        let before = rig.store.commit_stats();
        for _ in 0..iterations {
            let t = Instant::now();
            rig.exec(&lease, cmd).await?;
            via.push(t.elapsed());
            let t = Instant::now();
            rig.direct.run(&sb, &o, 64 * 1024).await?;
            direct.push(t.elapsed());
        }
        // The appliance's durable commits during the loop, timed inside its
        // writer (the direct calls commit nothing): the fsyncs it needs, in
        // the conditions it meets them.
        let after = rig.store.commit_stats();
        let made = usize::try_from(after.commits - before.commits).unwrap_or(usize::MAX);
        let recent = rig.store.recent_commits();
        let c = Summary::of(
            &format!("exec {name}: one commit in the exec path"),
            recent
                .get(recent.len().saturating_sub(made)..)
                .unwrap_or_default(),
        );
        let per_exec = made as f64 / iterations.max(1) as f64;
        let v = Summary::of(&format!("exec {name} via appliance"), &via);
        let d = Summary::of(&format!("exec {name} direct (cube client)"), &direct);
        report
            .figures
            .insert(format!("{name}: durable commits per exec"), per_exec);
        report.figures.insert(
            format!("{name}: added p50 beyond the commits ms"),
            v.p50_ms - d.p50_ms - per_exec * c.p50_ms,
        );
        report
            .figures
            .insert(format!("{name}: added p50 ms"), v.p50_ms - d.p50_ms);
        report
            .figures
            .insert(format!("{name}: added p99 ms"), v.p99_ms - d.p99_ms);
        report.results.push(v);
        report.results.push(d);
        report.results.push(c);
    }
    // What the reference's response format costs for 64 KiB of NUL output
    // (a JSON string of 384 KiB): the appliance encodes it, the agent decodes it.
    let body = json!({"exit_code": 0, "stdout": "\0".repeat(64 * 1024), "stderr": ""});
    let mut codec = vec![];
    for _ in 0..iterations {
        let t = Instant::now();
        let bytes = serde_json::to_vec(&body)?;
        let back: Value = serde_json::from_slice(&bytes)?;
        std::hint::black_box(back);
        codec.push(t.elapsed());
    }
    report
        .results
        .push(Summary::of("64KiB response JSON encode + decode", &codec));
    // What one durable commit costs on an otherwise idle machine, for
    // comparison with the commits timed in the exec path above.
    let store = crate::store::Store::open(&dir.join("commit-probe"))?;
    let mut commits = vec![];
    for i in 0..iterations {
        let ev = crate::audit::event::Event {
            action: crate::audit::event::Action::Exec,
            request_id: Some(format!("probe{i}")),
            ..Default::default()
        };
        let t = Instant::now();
        store
            .write(move |txn, chain| chain.append(txn, ev).map(|_| ()))
            .await?;
        commits.push(t.elapsed());
    }
    report
        .results
        .push(Summary::of("one durable commit (fsync), idle", &commits));
    rig.direct.kill(&sb.id).await?;
    rig.stop().await;
    super::remove_tmp(&dir);
    Ok(report)
}

/// `bench cycle`: acquire → exec → release(kill) with N concurrent agents.
pub async fn cycle(
    launcher: &Path,
    concurrency: &[usize],
    cycles_per_agent: usize,
) -> anyhow::Result<Report> {
    let dir = tmpdir("cycle");
    let rig = Arc::new(Rig::start(&dir, launcher).await?);
    let mut report = Report::new("cycle");
    for &n in concurrency {
        let agents: Vec<usize> = (0..n).collect();
        let r = rig.clone();
        let (all, secs) = fan_out(agents, cycles_per_agent, move |a, c| {
            let rig = r.clone();
            async move {
                let lease = rig.acquire(&format!("cycle-{n}-{a}-{c}")).await?;
                rig.exec(&lease, "true").await?;
                rig.post(
                    &format!("/v1/leases/{lease}/release"),
                    json!({"action": "kill"}),
                )
                .await?;
                Ok(())
            }
        })
        .await?;
        let s = Summary::of(&format!("cycle, {n} concurrent agents"), &all);
        report
            .figures
            .insert(format!("cycles/s at {n} agents"), all.len() as f64 / secs);
        report.results.push(s);
    }
    // (Sandboxes a rig still shared leaves are removed with the directory.)
    if let Ok(r) = Arc::try_unwrap(rig) {
        r.stop().await;
    }
    super::remove_tmp(&dir);
    Ok(report)
}

/// `bench hot`: exec on existing leases with N concurrent agents.
pub async fn hot(launcher: &Path, agents: usize, ops_per_agent: usize) -> anyhow::Result<Report> {
    let dir = tmpdir("hot");
    let rig = Arc::new(Rig::start(&dir, launcher).await?);
    let mut leases = vec![];
    for a in 0..agents {
        leases.push(rig.acquire(&format!("hot-{a}")).await?);
    }
    let r = rig.clone();
    let (all, secs) = fan_out(leases.clone(), ops_per_agent, move |lease: String, _| {
        let rig = r.clone();
        async move { rig.exec(&lease, "true").await.map(drop) }
    })
    .await?;
    let mut report = Report::new("hot lease");
    report.results.push(Summary::of(
        &format!("exec true, {agents} agents on own leases"),
        &all,
    ));
    report.figures.insert(
        format!("audited execs/s at {agents} agents"),
        all.len() as f64 / secs,
    );

    // The same load straight at the backend: what bounds the number above.
    let mut sandboxes = vec![];
    for _ in 0..agents {
        let s = rig
            .direct
            .create(&CreateSandbox {
                template_id: "host".into(),
                ..Default::default()
            })
            .await?;
        sandboxes.push(rig.direct.addr(&s));
    }
    let c = rig.direct.clone();
    let (direct, dsecs) = fan_out(sandboxes.clone(), ops_per_agent, move |sb, _| {
        let c = c.clone();
        async move {
            let mut o = StartOptions::shell("true");
            o.cwd = Some("/workspace".into());
            c.run(&sb, &o, 64 * 1024).await.map(drop)?;
            Ok(())
        }
    })
    .await?;
    report.results.push(Summary::of(
        &format!("same exec direct, {agents} sandboxes"),
        &direct,
    ));
    report.figures.insert(
        format!("direct execs/s at {agents} sandboxes (backend bound)"),
        direct.len() as f64 / dsecs,
    );

    // An effect that costs the backend little (a unary `stat`, no process):
    // the appliance's own ceiling for audited operations (intent, effect,
    // outcome: two durable commits each, shared by group commit).
    let r = rig.clone();
    let (stats, ssecs) = fan_out(leases, ops_per_agent * 4, move |lease: String, _| {
        let rig = r.clone();
        async move {
            rig.post(
                &format!("/v1/leases/{lease}/stat"),
                json!({"path": "/workspace"}),
            )
            .await
            .map(drop)
        }
    })
    .await?;
    report.results.push(Summary::of(
        &format!("stat, {agents} agents on own leases"),
        &stats,
    ));
    report.figures.insert(
        format!("audited stats/s at {agents} agents"),
        stats.len() as f64 / ssecs,
    );
    let c = rig.direct.clone();
    let (dstats, dssecs) = fan_out(sandboxes.clone(), ops_per_agent * 4, move |sb, _| {
        let c = c.clone();
        async move {
            c.stat(&sb, "/workspace")
                .await
                .map(drop)
                .map_err(Into::into)
        }
    })
    .await?;
    report.results.push(Summary::of(
        &format!("same stat direct, {agents} sandboxes"),
        &dstats,
    ));
    report.figures.insert(
        format!("direct stats/s at {agents} sandboxes"),
        dstats.len() as f64 / dssecs,
    );
    for sb in sandboxes {
        let _ = rig.direct.kill(&sb.id).await;
    }
    // (Sandboxes a rig still shared leaves are removed with the directory.)
    if let Ok(r) = Arc::try_unwrap(rig) {
        r.stop().await;
    }
    super::remove_tmp(&dir);
    Ok(report)
}

/// `bench audit`: journal commits with group commit vs one fsync per event.
pub async fn audit(writers: &[usize], events_per_writer: usize) -> anyhow::Result<Report> {
    let mut report = Report::new("audit");
    for &w in writers {
        for (mode, batch) in [("group commit", 512usize), ("one fsync per event", 1)] {
            let dir = tmpdir("audit");
            let store = crate::store::Store::open_with(&dir, batch)?;
            let st = store.clone();
            let (all, secs) = fan_out((0..w).collect(), events_per_writer, move |i, j| {
                let store = st.clone();
                async move {
                    let ev = crate::audit::event::Event {
                        action: crate::audit::event::Action::Exec,
                        request_id: Some(format!("w{i}e{j}")),
                        ..Default::default()
                    };
                    store
                        .write(move |txn, chain| chain.append(txn, ev).map(|_| ()))
                        .await?;
                    Ok(())
                }
            })
            .await?;
            let cs = store.commit_stats();
            report.figures.insert(
                format!("events per commit, {w} writers, {mode}"),
                cs.writes as f64 / cs.commits.max(1) as f64,
            );
            report.figures.insert(
                format!("events/s, {w} writers, {mode}"),
                all.len() as f64 / secs,
            );
            report.results.push(Summary::of(
                &format!("commit latency, {w} writers, {mode}"),
                &all,
            ));
            drop(store);
            super::remove_tmp(&dir);
        }
        let g = report
            .figures
            .get(&format!("events/s, {w} writers, group commit"))
            .copied()
            .unwrap_or(0.0);
        let o = report
            .figures
            .get(&format!("events/s, {w} writers, one fsync per event"))
            .copied()
            .unwrap_or(1.0);
        report.figures.insert(
            format!("group commit speed-up, {w} writers (x)"),
            g / o.max(f64::MIN_POSITIVE),
        );
    }
    Ok(report)
}

/// `bench memory` and `bench startup`: a real `serve` process.
pub async fn memory_and_startup(
    launcher: &Path,
    leases: usize,
    starts: usize,
) -> anyhow::Result<Report> {
    let dir = tmpdir("memory");
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        "[profiles.bench]\ntemplate = \"host\"\nmax_active_leases_per_tenant = 100000\n[profiles.offline-code]\n",
    )?;
    let state = dir.join("state");
    let mut report = Report::new("memory and startup");
    let p = super::ServeProc::start(launcher, &state, &config)?;
    let (http, admin) = super::admin_client(&state, &state.join("tls/ca.pem"))?;
    p.wait_ready(&http, super::READY_DEADLINE).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = super::rss_kib(p.pid());
    report.figures.insert("RSS idle (KiB)".into(), idle as f64);
    // Many live leases (each a real sandbox of the embedded backend), in two
    // halves: the second half's growth is the per-lease cost, without the
    // one-off growth (thread pools, allocator arenas) of the first burst.
    let acquire_range = |from: usize, to: usize| {
        let (http, url, admin) = (http.clone(), p.url.clone(), admin.clone());
        async move {
            let sem = Arc::new(tokio::sync::Semaphore::new(16));
            let mut tasks = vec![];
            for i in from..to {
                let (http, url, admin, sem) =
                    (http.clone(), url.clone(), admin.clone(), sem.clone());
                tasks.push(tokio::spawn(async move {
                    let _permit = sem.acquire().await?;
                    let r = http
                        .post(format!("{url}/v1/leases/acquire"))
                        .bearer_auth(&admin)
                        .json(&json!({"runtime": "mcp", "session_key": format!("m{i}"), "profile": "bench"}))
                        .send()
                        .await?;
                    let status = r.status();
                    anyhow::ensure!(status.is_success(), "acquire: {status}: {}", r.text().await.unwrap_or_default());
                    Ok(())
                }));
            }
            for t in tasks {
                t.await??;
            }
            Ok::<_, anyhow::Error>(())
        }
    };
    let half = leases / 2;
    acquire_range(0, half).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mid = super::rss_kib(p.pid());
    acquire_range(half, leases).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let loaded = super::rss_kib(p.pid());
    report
        .figures
        .insert(format!("RSS with {half} live leases (KiB)"), mid as f64);
    report.figures.insert(
        format!("RSS with {leases} live leases (KiB)"),
        loaded as f64,
    );
    report.figures.insert(
        "RSS per live lease, marginal (KiB)".into(),
        (loaded.saturating_sub(mid)) as f64 / (leases - half).max(1) as f64,
    );
    report.figures.insert(
        "RSS per live lease, average (KiB)".into(),
        (loaded.saturating_sub(idle)) as f64 / leases.max(1) as f64,
    );
    drop(p);
    // Startup on the existing state directory (its sandboxes are re-adopted).
    let mut times = vec![];
    for _ in 0..starts {
        let t = Instant::now();
        let p = super::ServeProc::start(launcher, &state, &config)?;
        p.wait_ready(&http, super::READY_DEADLINE).await?;
        times.push(t.elapsed());
        drop(p);
    }
    report.results.push(Summary::of(
        &format!("start to /readyz ready ({leases} sandboxes to re-adopt)"),
        &times,
    ));
    super::remove_tmp(&dir);
    Ok(report)
}

/// `bench jobs`: job-output throughput. A job writes `mib` MiB to stdout
/// (and as much to stderr), then both streams are read to the end through
/// the appliance: by per-stream cursors (1 MiB pages) and by SSE. Times are
/// per round (a page, an SSE chunk); the figures are MB/s end to end.
pub async fn job_output(launcher: &Path, mib: usize, rounds: usize) -> anyhow::Result<Report> {
    use base64::Engine;
    use futures_util::StreamExt;
    let dir = tmpdir("jobs");
    let rig = Rig::start(&dir, launcher).await?;
    let lease = rig.acquire("jobs").await?;
    let mut report = Report::new("job output");
    let cmd = format!(
        "head -c {n} /dev/urandom > /tmp/o; head -c {n} /dev/urandom > /tmp/e; cat /tmp/o; cat /tmp/e >&2",
        n = mib * 1024 * 1024
    );
    let v = rig
        .post(&format!("/v1/leases/{lease}/jobs"), json!({"command": cmd}))
        .await?;
    let job = field(&v, "job_ref")
        .as_str()
        .unwrap_or_default()
        .to_string();
    loop {
        let v = rig
            .post(&format!("/v1/jobs/{job}/status"), json!({}))
            .await?;
        if field(&v, "state") != "running" {
            anyhow::ensure!(field(&v, "state") == "succeeded", "the job failed: {v}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let total = (2 * mib * 1024 * 1024) as f64;
    let (mut pages, mut page_secs) = (vec![], vec![]);
    for _ in 0..rounds {
        let t0 = Instant::now();
        let (mut o, mut e) = (0u64, 0u64);
        loop {
            let t = Instant::now();
            let v = rig
                .post(
                    &format!("/v1/jobs/{job}/output"),
                    json!({"stdout_offset": o, "stderr_offset": e, "max_bytes": 1048576}),
                )
                .await?;
            pages.push(t.elapsed());
            o = field(&v, "stdout_next_offset").as_u64().unwrap_or(o);
            e = field(&v, "stderr_next_offset").as_u64().unwrap_or(e);
            if field(&v, "eof") == true {
                break;
            }
        }
        anyhow::ensure!((o + e) as f64 == total, "read {} of {total} bytes", o + e);
        page_secs.push(t0.elapsed().as_secs_f64());
    }
    report
        .results
        .push(Summary::of("one page (1 MiB per stream)", &pages));
    let mut sse_secs = vec![];
    let mut chunks = vec![];
    for _ in 0..rounds {
        let t0 = Instant::now();
        let r = rig
            .http
            .get(format!(
                "{}/v1/jobs/{job}/events?timeout=600&encoding=base64",
                rig.url
            ))
            .bearer_auth(&rig.admin)
            .send()
            .await?;
        let mut body = r.bytes_stream();
        let (mut buf, mut got) = (Vec::<u8>::new(), 0usize);
        let mut t = Instant::now();
        while let Some(c) = body.next().await {
            buf.extend_from_slice(&c?);
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let block =
                    String::from_utf8_lossy(buf.get(..end).unwrap_or_default()).into_owned();
                buf.drain(..end + 2);
                if block.contains("event: output")
                    && let Some(d) = block.lines().find_map(|l| l.strip_prefix("data: "))
                {
                    let v: Value = serde_json::from_str(d)?;
                    let b64 = base64::engine::general_purpose::STANDARD;
                    for k in ["stdout_base64", "stderr_base64"] {
                        got += b64.decode(field(&v, k).as_str().unwrap_or_default())?.len();
                    }
                    chunks.push(t.elapsed());
                    t = Instant::now();
                }
            }
        }
        anyhow::ensure!(got as f64 == total, "SSE carried {got} of {total} bytes");
        sse_secs.push(t0.elapsed().as_secs_f64());
    }
    report.results.push(Summary::of(
        "one SSE output event (1 MiB per stream)",
        &chunks,
    ));
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    report.figures.insert(
        format!("paging MB/s ({mib} MiB stdout + {mib} MiB stderr, median)"),
        total / 1e6 / med(&mut page_secs),
    );
    report.figures.insert(
        format!("SSE MB/s ({mib} MiB stdout + {mib} MiB stderr, median)"),
        total / 1e6 / med(&mut sse_secs),
    );
    rig.stop().await;
    super::remove_tmp(&dir);
    Ok(report)
}

/// A JSON field, or null.
fn field<'a>(v: &'a Value, k: &str) -> &'a Value {
    v.get(k).unwrap_or(&Value::Null)
}

/// A rig whose `bench` profile records (or not) and runs up to 64 jobs or
/// PTYs a lease.
async fn recording_rig(dir: &Path, launcher: &Path, on: bool) -> anyhow::Result<Rig> {
    Rig::start_tweaked(dir, launcher, vec![], |c| {
        if let Some(p) = c.profiles.get_mut("bench") {
            p.max_jobs_per_lease = 64;
            p.recordings = Some(crate::config::ProfileRecordings {
                enabled: on,
                ..Default::default()
            });
        }
    })
    .await
}

/// `n` PTYs each printing `mib` MiB (base64 of random bytes) and exiting:
/// (seconds until every PTY ended and its recording was sealed, this
/// process's RSS before and its highest RSS sampled meanwhile, in KiB).
async fn pty_flood(rig: &Rig, n: usize, mib: usize) -> anyhow::Result<(f64, u64, u64)> {
    let lease = rig.acquire("recordings").await?;
    let raw = mib * 1024 * 1024 * 3 / 4;
    let me = std::process::id();
    let before = super::rss_kib(me);
    let t0 = Instant::now();
    let mut ptys = vec![];
    for _ in 0..n {
        let v = rig
            .post(
                &format!("/v1/leases/{lease}/ptys"),
                json!({"rows": 24, "cols": 100}),
            )
            .await?;
        ptys.push(
            field(&v, "pty_ref")
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    for p in &ptys {
        rig.post(
            &format!("/v1/ptys/{p}/input"),
            json!({"data": format!("head -c {raw} /dev/urandom | base64 -w 100; exit\n")}),
        )
        .await?;
    }
    let mut peak = before;
    loop {
        peak = peak.max(super::rss_kib(me));
        let mut running = 0;
        for p in &ptys {
            let v = rig
                .http
                .get(format!("{}/v1/ptys/{p}/status", rig.url))
                .bearer_auth(&rig.admin)
                .send()
                .await?
                .json::<Value>()
                .await?;
            if field(&v, "state") == "running" {
                running += 1;
            }
        }
        let recs = rig.store.read_now(crate::store::recordings::all)?;
        let open = recs
            .iter()
            .filter(|r| r.state == crate::store::recordings::RecordingState::Open)
            .count();
        if running == 0 && open == 0 {
            break;
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(900),
            "the PTYs did not end"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok((t0.elapsed().as_secs_f64(), before, peak))
}

/// A job writing `mib` MiB of random bytes to each stream, then every byte
/// read back by cursors: seconds to the job's end, and to the last byte
/// read.
/// One job of `mib` MiB a stream: seconds of its own writing (timed in the
/// sandbox), to the last byte a client read, and until its recording (if
/// any) was sealed.
async fn job_round(rig: &Rig, lease: &str, mib: usize) -> anyhow::Result<(f64, f64, f64)> {
    let n = mib * 1024 * 1024;
    // The job times itself (its own writing, not when a status call saw
    // it end: that includes the appliance's answer).
    let cmd = format!(
        "t0=$(date +%s%N); head -c {n} /dev/urandom; head -c {n} /dev/urandom >&2; \
         t1=$(date +%s%N); echo $((t1 - t0)) > /tmp/bench-job-ns"
    );
    let t0 = Instant::now();
    let v = rig
        .post(&format!("/v1/leases/{lease}/jobs"), json!({"command": cmd}))
        .await?;
    let job = field(&v, "job_ref")
        .as_str()
        .unwrap_or_default()
        .to_string();
    loop {
        let v = rig
            .post(&format!("/v1/jobs/{job}/status"), json!({}))
            .await?;
        if field(&v, "state") != "running" {
            anyhow::ensure!(field(&v, "state") == "succeeded", "the job failed: {v}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut o, mut e) = (0u64, 0u64);
    loop {
        let v = rig
            .post(
                &format!("/v1/jobs/{job}/output"),
                json!({"stdout_offset": o, "stderr_offset": e, "max_bytes": 1048576}),
            )
            .await?;
        o = field(&v, "stdout_next_offset").as_u64().unwrap_or(o);
        e = field(&v, "stderr_next_offset").as_u64().unwrap_or(e);
        if field(&v, "eof") == true {
            break;
        }
    }
    anyhow::ensure!(o + e == 2 * n as u64, "read {} of {} bytes", o + e, 2 * n);
    let read = t0.elapsed().as_secs_f64();
    let v = rig.exec(lease, "cat /tmp/bench-job-ns").await?;
    let ended = field(&v, "stdout")
        .as_str()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .ok_or_else(|| anyhow::anyhow!("the job's own time is missing: {v}"))?
        / 1e9;
    // Until the job's recording (if any) is sealed: its whole cost.
    let until = Instant::now() + Duration::from_secs(120);
    while Instant::now() < until {
        let open = rig
            .store
            .read_now(crate::store::recordings::all)?
            .iter()
            .any(|r| {
                r.subject == job && r.state != crate::store::recordings::RecordingState::Sealed
            });
        if !open {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((ended, read, t0.elapsed().as_secs_f64()))
}

/// Pin every process of the sandboxes `ids` (found by their cgroup, whose
/// last component is the sandbox's id) to the last CPU, and this process's
/// threads to the others: how many sandbox processes were pinned.
fn pin_apart(ids: &[String]) -> anyhow::Result<usize> {
    use nix::sched::{CpuSet, sched_setaffinity};
    use nix::unistd::Pid;
    let cpus = std::thread::available_parallelism()?.get();
    anyhow::ensure!(cpus >= 2, "--pin needs two CPUs or more");
    let (mut sandbox, mut rest) = (CpuSet::new(), CpuSet::new());
    sandbox.set(cpus - 1)?;
    for c in 0..cpus - 1 {
        rest.set(c)?;
    }
    let threads = |pid: &str| -> Vec<i32> {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    for t in threads("self") {
        sched_setaffinity(Pid::from_raw(t), &rest)?;
    }
    let mut n = 0;
    for e in std::fs::read_dir("/proc")?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let cg = std::fs::read_to_string(format!("/proc/{name}/cgroup")).unwrap_or_default();
        let ours = cg.lines().any(|l| {
            l.rsplit('/')
                .next()
                .is_some_and(|leaf| ids.iter().any(|id| id == leaf))
        });
        if ours {
            for t in threads(&name) {
                if sched_setaffinity(Pid::from_raw(t), &sandbox).is_ok() {
                    n += 1;
                }
            }
        }
    }
    anyhow::ensure!(
        n > 0,
        "no process of the sandboxes {ids:?} was found to pin"
    );
    Ok(n)
}

/// The machine's busy CPU time so far, in seconds (`/proc/stat`: every
/// process, the kernel's work for them included).
fn busy_cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: u64 = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .enumerate()
        // user nice system idle iowait irq softirq steal: all but idle and iowait.
        .filter(|(i, _)| matches!(i, 0 | 1 | 2 | 5 | 6 | 7))
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum();
    // USER_HZ is 100 on every Linux this runs on.
    ticks as f64 / 100.0
}

/// `bench recordings`: memory while `ptys` PTYs each stream `mib` MiB with
/// recording on and off, and what recording costs a job's output
/// throughput (`job_mib` MiB a stream, `rounds` rounds, the two appliances
/// alternately).
pub async fn recordings(
    launcher: &Path,
    ptys: usize,
    mib: usize,
    job_mib: usize,
    rounds: usize,
    pin: bool,
) -> anyhow::Result<Report> {
    let dir = tmpdir("recordings");
    let mut report = Report::new("session recordings");
    for (name, on) in [("off", false), ("on", true)] {
        let rig = recording_rig(&dir.join(format!("ptys-{name}")), launcher, on).await?;
        let (secs, before, peak) = pty_flood(&rig, ptys, mib).await?;
        let recorded: u64 = rig
            .store
            .read_now(crate::store::recordings::all)?
            .iter()
            .map(|r| r.bytes)
            .sum();
        report.figures.insert(
            format!("{ptys} PTYs x {mib} MiB, recording {name}: seconds to the end"),
            secs,
        );
        report.figures.insert(
            format!("{ptys} PTYs x {mib} MiB, recording {name}: RSS before (KiB)"),
            before as f64,
        );
        report.figures.insert(
            format!("{ptys} PTYs x {mib} MiB, recording {name}: highest RSS (KiB)"),
            peak as f64,
        );
        report.figures.insert(
            format!("{ptys} PTYs x {mib} MiB, recording {name}: MB recorded"),
            recorded as f64 / 1e6,
        );
        rig.stop().await;
    }
    let off = recording_rig(&dir.join("jobs-off"), launcher, false).await?;
    let on = recording_rig(&dir.join("jobs-on"), launcher, true).await?;
    let (lo, ln) = (off.acquire("jobs").await?, on.acquire("jobs").await?);
    if pin {
        // As with a CubeSandbox, whose sandboxes run on their own vCPUs: the
        // two sandboxes (and all they start) on the last CPU, this process
        // (the appliance, the backend's proxy, the client) on the others.
        let mut ids = vec![];
        for (rig, lease) in [(&off, &lo), (&on, &ln)] {
            let l = rig
                .store
                .read_now(|t| crate::store::leases::get(t, lease))?
                .ok_or_else(|| anyhow::anyhow!("lease {lease} is gone"))?;
            ids.push(l.sandbox_id);
        }
        let n = pin_apart(&ids)?;
        report.figures.insert(
            "sandbox processes pinned to a CPU of their own".into(),
            n as f64,
        );
    }
    let (mut off_end, mut on_end, mut off_read, mut on_read) = (vec![], vec![], vec![], vec![]);
    let (mut off_cpu, mut on_cpu, mut sealed) = (vec![], vec![], vec![]);
    for _ in 0..rounds {
        let c = busy_cpu_secs();
        let (e, r, _) = job_round(&off, &lo, job_mib).await?;
        off_cpu.push(busy_cpu_secs() - c);
        off_end.push(e);
        off_read.push(r);
        let c = busy_cpu_secs();
        let (e, r, s) = job_round(&on, &ln, job_mib).await?;
        on_cpu.push(busy_cpu_secs() - c);
        on_end.push(e);
        on_read.push(r);
        sealed.push(s);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let total = (2 * job_mib * 1024 * 1024) as f64 / 1e6;
    let (oe, ne, or, nr) = (
        med(&mut off_end),
        med(&mut on_end),
        med(&mut off_read),
        med(&mut on_read),
    );
    report.figures.insert(
        format!("job {job_mib}+{job_mib} MiB, recording off: MB/s to its end"),
        total / oe,
    );
    report.figures.insert(
        format!("job {job_mib}+{job_mib} MiB, recording on: MB/s to its end"),
        total / ne,
    );
    report.figures.insert(
        format!("job {job_mib}+{job_mib} MiB, recording off: MB/s to the last byte read"),
        total / or,
    );
    report.figures.insert(
        format!("job {job_mib}+{job_mib} MiB, recording on: MB/s to the last byte read"),
        total / nr,
    );
    report.figures.insert(
        "job throughput with recording / without (to the last byte read)".into(),
        or / nr,
    );
    report.figures.insert(
        "job throughput with recording / without (to its end)".into(),
        oe / ne,
    );
    report.figures.insert(
        format!("job {job_mib}+{job_mib} MiB, recording on: seconds until sealed"),
        med(&mut sealed),
    );
    let (oc, nc) = (med(&mut off_cpu), med(&mut on_cpu));
    report.figures.insert(
        format!("job {job_mib}+{job_mib} MiB, recording off: CPU seconds (machine)"),
        oc,
    );
    report.figures.insert(
        format!("job {job_mib}+{job_mib} MiB, recording on: CPU seconds (machine)"),
        nc,
    );
    report.figures.insert(
        "recording's CPU milliseconds per MB recorded (machine)".into(),
        (nc - oc) * 1000.0 / total,
    );
    off.stop().await;
    on.stop().await;
    super::remove_tmp(&dir);
    Ok(report)
}
