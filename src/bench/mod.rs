//! `cube-adapter bench …`: repeatable measurements (never assertions).
//!
//! `bench backend` starts the embedded backend in-process on 127.0.0.1:0 with
//! mTLS, exactly as `serve` will use it, and drives it with the `cube/`
//! client: sandbox create → exec → kill cycles, and exec round-trips on a
//! live sandbox.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cube::wire::CreateSandbox;
use crate::cube::{BackendConfig, CubeClient, Secret, StartOptions};
use crate::embedded::{Backend, Isolation, Limits, Settings};

pub(crate) mod appliance;
pub(crate) mod console;
pub mod export;
pub(crate) mod identities;

/// `VmRSS` and its peak `VmHWM` of a process, in KiB (0 when unreadable).
pub fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// `VmRSS` of a process, in KiB (0 when unreadable).
/// Remove a bench's temporary directory and whatever its appliance's
/// sandboxes left there. Sandboxes outlive the appliance by design, and a
/// sandbox's disk is mounted in this mount namespace: the sandboxes'
/// processes are killed and every mount below the directory is detached
/// (deepest first) before it is removed, so no bench leaves a loop device
/// or a sandbox behind, whether it ended its leases or not.
pub(crate) fn remove_tmp(dir: &Path) {
    for sandboxes in [
        dir.join("embedded/sandboxes"),
        dir.join("state/embedded/sandboxes"),
    ] {
        appliance::kill_sandboxes(&sandboxes);
    }
    if let Ok(mounts) = crate::embedded::launch::mounts_at_or_below(dir) {
        for m in mounts.iter().rev() {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A client of a bench's appliance, trusting its CA (`ca`), and the
/// admin token `serve` wrote into `state`.
pub(crate) fn admin_client(state: &Path, ca: &Path) -> anyhow::Result<(reqwest::Client, String)> {
    let ca = std::fs::read(ca)?;
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(crate::tls::client_config(Some(&ca), None)?)
        .pool_max_idle_per_host(256)
        .build()?;
    let admin = std::fs::read_to_string(state.join("admin.token"))?
        .trim()
        .to_string();
    Ok((http, admin))
}

pub fn rss_kib(pid: u32) -> u64 {
    memory_kib(pid).0
}

/// A real `cube-adapter serve` process on 127.0.0.1:0 (its log next to
/// the state directory), stopped with SIGTERM (and waited for) on drop.
pub struct ServeProc {
    child: std::process::Child,
    pub url: String,
}

impl ServeProc {
    pub fn start(launcher: &Path, state: &Path, config: &Path) -> anyhow::Result<Self> {
        use std::io::BufRead;
        let mut child = std::process::Command::new(launcher)
            .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state)
            .arg("--config")
            .arg(config)
            .stdout(std::process::Stdio::piped())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(state.with_extension("log"))?,
            )
            .spawn()?;
        let mut reader = std::io::BufReader::new(
            child
                .stdout
                .take()
                .ok_or_else(|| anyhow::anyhow!("no stdout"))?,
        );
        let mut line = String::new();
        reader.read_line(&mut line)?;
        std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
        let url = line.trim().rsplit(' ').next().unwrap_or("").to_string();
        let p = Self { child, url };
        anyhow::ensure!(p.url.starts_with("https://"), "serve did not start: {line}");
        Ok(p)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its `VmRSS` and `VmHWM` (KiB).
    pub fn memory(&self) -> (u64, u64) {
        memory_kib(self.pid())
    }

    /// Wait until its `/readyz` answers 200 (polled every 2 ms through
    /// `http`, a client that trusts its CA); an error after `deadline`.
    pub async fn wait_ready(
        &self,
        http: &reqwest::Client,
        deadline: Duration,
    ) -> anyhow::Result<()> {
        let until = Instant::now() + deadline;
        loop {
            if let Ok(r) = http.get(format!("{}/readyz", self.url)).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < until,
                "serve at {} was not ready within {deadline:?}",
                self.url
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// How long a bench waits for a started `serve` to be ready.
pub const READY_DEADLINE: Duration = Duration::from_secs(120);

impl Drop for ServeProc {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = self.child.wait();
    }
}

/// Latency summary of one measured step.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub name: String,
    pub n: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
    pub per_second: f64,
}

impl Summary {
    pub fn of(name: &str, samples: &[Duration]) -> Self {
        let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| -> f64 {
            if v.is_empty() {
                return 0.0;
            }
            let idx = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
            v.get(idx).copied().unwrap_or(0.0)
        };
        let total: f64 = v.iter().sum();
        let mean = if v.is_empty() {
            0.0
        } else {
            total / v.len() as f64
        };
        Self {
            name: name.into(),
            n: v.len(),
            p50_ms: q(0.50),
            p90_ms: q(0.90),
            p99_ms: q(0.99),
            max_ms: v.last().copied().unwrap_or(0.0),
            mean_ms: mean,
            per_second: if mean > 0.0 { 1000.0 / mean } else { 0.0 },
        }
    }

    pub fn line(&self) -> String {
        format!(
            "{:<34} n={:<5} p50={:>8.3} ms  p90={:>8.3} ms  p99={:>8.3} ms  max={:>8.3} ms  ({:.0}/s sequential)",
            self.name, self.n, self.p50_ms, self.p90_ms, self.p99_ms, self.max_ms, self.per_second
        )
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: String,
    pub machine: String,
    pub results: Vec<Summary>,
    /// Derived figures (ratios, throughputs, memory), by name.
    #[serde(default)]
    pub figures: std::collections::BTreeMap<String, f64>,
}

impl Report {
    pub fn new(scenario: &str) -> Self {
        Self {
            scenario: scenario.into(),
            machine: machine(),
            results: vec![],
            figures: Default::default(),
        }
    }

    pub fn print(&self) {
        println!("== {} ({})", self.scenario, self.machine);
        for r in &self.results {
            println!("{}", r.line());
        }
        for (k, v) in &self.figures {
            println!("{k:<52} {v:>12.3}");
        }
    }
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpus} CPUs ({model}), Linux {}", kernel.trim())
}

/// `bench all`: every scenario with its defaults, in about two minutes.
pub async fn all(
    launcher: &std::path::Path,
    json_dir: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let backend_opts = BackendBench {
        cycles: 100,
        execs: 1000,
        launcher: launcher.to_path_buf(),
    };
    let reports = [
        ("backend", backend(&backend_opts).await?),
        ("overhead", appliance::overhead(launcher, 300).await?),
        ("sinks", appliance::sinks(launcher, 300).await?),
        ("audit", appliance::audit(&[1, 64], 200).await?),
        ("cycle", appliance::cycle(launcher, &[1, 16, 64], 4).await?),
        ("hot", appliance::hot(launcher, 64, 30).await?),
        ("jobs", appliance::job_output(launcher, 32, 3).await?),
        (
            "memory",
            appliance::memory_and_startup(launcher, 1000, 10).await?,
        ),
        // Smaller than their own defaults (those take ten minutes more).
        (
            "identities",
            identities::identities(launcher, 1000, 2000, 8).await?,
        ),
        ("export", export::export(launcher, 200_000, 3, 0).await?),
        (
            "console",
            console::console(launcher, 20_000, 100_000, 50, 20).await?,
        ),
    ];
    for (name, r) in &reports {
        r.print();
        if let Some(dir) = json_dir {
            std::fs::create_dir_all(dir)?;
            std::fs::write(
                dir.join(format!("{name}.json")),
                serde_json::to_string_pretty(r)?,
            )?;
        }
    }
    println!("all scenarios in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Options of `bench backend`.
#[derive(Debug, Clone)]
pub struct BackendBench {
    pub cycles: usize,
    pub execs: usize,
    pub launcher: PathBuf,
}

/// Run the backend benchmark and return its report.
pub async fn backend(o: &BackendBench) -> anyhow::Result<Report> {
    let dir = std::env::temp_dir().join(format!("cube-bench-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir)?;
    let result = backend_in(o, &dir).await;
    remove_tmp(&dir);
    result
}

/// The embedded backend on 127.0.0.1:0 with mTLS, and a client for it.
pub struct Loopback {
    pub client: CubeClient,
    pub url: String,
    pub ca_file: std::path::PathBuf,
    pub client_cert: std::path::PathBuf,
    pub client_key: std::path::PathBuf,
    pub stop: tokio::sync::oneshot::Sender<()>,
    pub server: tokio::task::JoinHandle<std::io::Result<()>>,
}

pub async fn loopback_backend(
    dir: &std::path::Path,
    launcher: &std::path::Path,
) -> anyhow::Result<Loopback> {
    let settings = Settings {
        state_dir: dir.join("embedded"),
        isolation: Isolation::Namespaces,
        templates: vec![],
        limits: Limits::default(),
        cpus: 0.0,
        domain: "cube.bench".into(),
        launcher: launcher.to_path_buf(),
        uid_base: crate::embedded::sandbox::DEFAULT_UID_BASE,
        mask: vec![dir.to_path_buf()],
        keep_free: vec![],
        default_timeout: None,
        orphan_grace_secs: crate::embedded::launch::ORPHAN_GRACE_SECS,
        min_free_mb: 0,
        disk_mb: crate::embedded::disk::DEFAULT_MB,
        faithful: None,
    };
    let backend = Backend::open(settings, None).map_err(|e| anyhow::anyhow!(e))?;
    let ca = crate::tls::LocalCa::load_or_create(&dir.join("backend-tls"))?;
    let (scert, skey) = ca.leaf_files("server", Some(&["127.0.0.1".to_string()]))?;
    let (ccert, ckey) = ca.leaf_files("client", None)?;
    let tls = crate::tls::server_config(
        &std::fs::read(scert)?,
        &std::fs::read(skey)?,
        Some(ca.cert_pem.as_bytes()),
    )?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("https://{}", listener.local_addr()?);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crate::server::serve(
        listener,
        backend.router(),
        Some(Arc::new(tls)),
        async move {
            let _ = rx.await;
        },
    ));
    let mut cfg = BackendConfig::new("bench", url.clone());
    cfg.domain = "cube.bench".into();
    cfg.ca_pem = Some(ca.cert_pem.as_bytes().to_vec());
    cfg.client_cert_pem = Some(std::fs::read(&ccert)?);
    cfg.client_key_pem = Some(Secret::new(std::fs::read_to_string(&ckey)?));
    let client = CubeClient::new(cfg)?;
    Ok(Loopback {
        client,
        url,
        ca_file: ca.dir.join("ca.pem"),
        client_cert: ccert,
        client_key: ckey,
        stop: tx,
        server,
    })
}

async fn backend_in(o: &BackendBench, dir: &std::path::Path) -> anyhow::Result<Report> {
    let Loopback {
        client,
        stop: tx,
        server,
        ..
    } = loopback_backend(dir, &o.launcher).await?;
    let req = CreateSandbox {
        template_id: "host".into(),
        ..Default::default()
    };
    let direct_true = StartOptions {
        cmd: "/bin/true".into(),
        ..Default::default()
    };
    let shell_true = StartOptions::shell("true");

    // Warm-up: first sandbox, first connections.
    let s = client.create(&req).await?;
    let sb = client.addr(&s);
    for _ in 0..20 {
        client.run(&sb, &direct_true, 1024).await?;
    }
    client.kill(&sb.id).await?;

    let (mut create, mut exec, mut kill, mut cycle) = (vec![], vec![], vec![], vec![]);
    for _ in 0..o.cycles {
        let t0 = Instant::now();
        let s = client.create(&req).await?;
        let t1 = Instant::now();
        let sb = client.addr(&s);
        let out = client.run(&sb, &direct_true, 1024).await?;
        anyhow::ensure!(out.exit_code == 0, "exec true failed: {out:?}");
        let t2 = Instant::now();
        client.kill(&sb.id).await?;
        let t3 = Instant::now();
        create.push(t1 - t0);
        exec.push(t2 - t1);
        kill.push(t3 - t2);
        cycle.push(t3 - t0);
    }

    let s = client.create(&req).await?;
    let sb = client.addr(&s);
    let (mut rt_direct, mut rt_shell, mut rt_stat) = (vec![], vec![], vec![]);
    for _ in 0..o.execs {
        let t = Instant::now();
        client.run(&sb, &direct_true, 1024).await?;
        rt_direct.push(t.elapsed());
    }
    for _ in 0..o.execs.div_ceil(5) {
        let t = Instant::now();
        client.run(&sb, &shell_true, 1024).await?;
        rt_shell.push(t.elapsed());
    }
    for _ in 0..o.execs {
        let t = Instant::now();
        client.stat(&sb, "/workspace").await?;
        rt_stat.push(t.elapsed());
    }
    client.kill(&sb.id).await?;

    // What a sandbox's own disk and network cost at create (the cycles
    // above use the backend's defaults: a disk of its own where it runs as
    // root, no network). Interleaved, so that the machine's drift hits all
    // three alike.
    let kinds = [
        CreateSandbox {
            template_id: "minimal".into(),
            disk_size_mb: Some(0),
            ..Default::default()
        },
        CreateSandbox {
            template_id: "minimal".into(),
            ..Default::default()
        },
        CreateSandbox {
            template_id: "minimal".into(),
            allow_internet_access: Some(true),
            ..Default::default()
        },
    ];
    let mut by_kind: [Vec<Duration>; 3] = Default::default();
    let network = crate::embedded::egress::Tools::find().is_ok();
    for _ in 0..o.cycles.div_ceil(2) {
        for (k, (req, times)) in kinds.iter().zip(by_kind.iter_mut()).enumerate() {
            if k == 2 && !network {
                continue;
            }
            let t = Instant::now();
            let s = client.create(req).await?;
            let sb = client.addr(&s);
            client.run(&sb, &direct_true, 1024).await?;
            times.push(t.elapsed());
            client.kill(&sb.id).await?;
        }
    }
    let _ = tx.send(());
    let _ = server.await;
    let [no_disk, disk, net] = by_kind;

    Ok(Report {
        scenario: "backend".into(),
        machine: machine(),
        figures: Default::default(),
        results: vec![
            Summary::of("sandbox create", &create),
            Summary::of("first exec /bin/true (new sandbox)", &exec),
            Summary::of("sandbox kill", &kill),
            Summary::of("create + exec + kill cycle", &cycle),
            Summary::of("exec /bin/true (live sandbox)", &rt_direct),
            Summary::of("exec bash -l -c true (live)", &rt_shell),
            Summary::of("filesystem Stat (unary RPC)", &rt_stat),
            Summary::of("create + first exec, minimal, no disk of its own", &no_disk),
            Summary::of(
                "create + first exec, minimal, own disk (default size)",
                &disk,
            ),
            Summary::of(
                "create + first exec, minimal, own disk, network (pasta + nft)",
                &net,
            ),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let s = Summary::of("x", &v);
        assert_eq!(s.p50_ms, 50.0);
        assert_eq!(s.p99_ms, 99.0);
        assert_eq!(s.max_ms, 100.0);
        assert_eq!(Summary::of("empty", &[]).n, 0);
    }
}
