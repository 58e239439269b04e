//! `cube-adapter serve`: the appliance assembled in phases, served until
//! shutdown, and taken down in one order (docs/architecture.md, "Start-up
//! and shutdown").
//!
//! [`start`] runs the phases in order, each a function of its own module:
//! open the state (`state`), identities (`identities`), backends
//! (`backends`), the broker (here), delivery (`delivery`) and HTTP
//! (`http`). It returns a [`Running`] service, whose
//! [`Running::shutdown`] is the one place that says how it ends.

mod backends;
mod delivery;
mod http;
mod identities;
mod state;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::broker::Broker;
use crate::config::Config;
use crate::cube::Secret;
use crate::store::Store;

pub use backends::{embedded_settings, enter_subordinate_ids};
pub(crate) use state::{bootstrap_admin, random_key};

/// What `serve` prints once it listens.
#[derive(Debug, Clone)]
pub struct Started {
    pub url: String,
    pub ca_file: PathBuf,
    pub ca_fingerprint: String,
    /// Set on the first start only.
    pub admin_token_file: Option<PathBuf>,
    pub backend: String,
    /// The open store (benchmarks read its commit counters).
    pub store: Store,
}

/// Secrets handed in from the environment (never from the config file).
#[derive(Debug, Clone, Default)]
pub struct EnvSecrets {
    /// `CUBE_ADAPTER_TOKEN`: a shared agent token (reference compatible).
    pub shared_token: Option<Secret>,
}

/// How a running service is reloaded.
#[derive(Debug, Clone)]
pub enum Reload {
    /// No SIGHUP handler (in-process servers: tests, benchmarks). The admin
    /// socket's `reload` still re-reads the certificate.
    Off,
    /// SIGHUP re-reads the certificate and the configuration from here.
    Signal(crate::ops::ConfigSource),
}

/// Run the appliance on `listener` until `shutdown`.
pub async fn serve(
    cfg: Config,
    secrets: EnvSecrets,
    listener: tokio::net::TcpListener,
    launcher: PathBuf,
    on_started: impl FnOnce(&Started),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_with(
        cfg,
        secrets,
        listener,
        launcher,
        on_started,
        shutdown,
        Reload::Off,
    )
    .await
}

/// As `serve`, reloaded on SIGHUP as `reload` says.
pub async fn serve_with(
    cfg: Config,
    secrets: EnvSecrets,
    listener: tokio::net::TcpListener,
    launcher: PathBuf,
    on_started: impl FnOnce(&Started),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    reload: Reload,
) -> anyhow::Result<()> {
    let running = start(cfg, secrets, listener, launcher, reload).await?;
    on_started(running.started());
    running.run_until(shutdown).await
}

/// Start the appliance on `listener`: every phase in order. On an error
/// the phases already run are dropped with it (their tasks end with the
/// runtime; the store's writer commits what was queued).
pub async fn start(
    cfg: Config,
    secrets: EnvSecrets,
    listener: tokio::net::TcpListener,
    launcher: PathBuf,
    reload: Reload,
) -> anyhow::Result<Running> {
    let cfg = Arc::new(cfg);
    let addr = listener.local_addr()?;
    let mut tasks = Tasks::default();
    let opened = state::open(&cfg).await?;
    let tls = identities::tls(&cfg, &opened, addr)?;
    let callers = identities::callers(&cfg, &opened, &secrets).await?;
    let (backends, backend) =
        backends::start(&cfg, &opened.state, &tls.ca, &launcher, &mut tasks).await?;
    let broker = broker(&cfg, &opened, backends).await?;
    delivery::start(
        &cfg,
        &broker,
        &callers.authn,
        callers.blocks,
        addr,
        &mut tasks,
    )?;
    // The CA, as `serve` prints it (`http` takes the TLS settings).
    let (ca_file, ca_fingerprint) = (tls.ca.dir.join("ca.pem"), tls.ca.fingerprint());
    let admin_token_file = callers.admin_token_file;
    let http = http::start(
        http::Parts {
            cfg: &cfg,
            opened: &opened,
            tls,
            authn: callers.authn,
            console_oidc: callers.console_oidc,
            broker: &broker,
            backend: &backend,
            addr,
            reload: &reload,
        },
        &mut tasks,
    )
    .await?;
    let upkeep = CancellationToken::new();
    broker.spawn_upkeep(upkeep.clone());
    broker.spawn_egress_watch(upkeep.clone());
    broker.spawn_resume();
    if let Some(at) = cfg.egress.listen {
        let l = tokio::net::TcpListener::bind(at)
            .await
            .map_err(|e| anyhow::anyhow!("[egress] listen {at}: {e}"))?;
        tracing::info!(addr = %at, "the egress proxy listens for sandboxes on the network");
        broker.spawn_egress_listener(l, upkeep.clone());
    }
    let accept = CancellationToken::new();
    let limits = crate::server::Limits::from_config(&cfg.connections);
    let server = tokio::spawn(crate::server::serve_with_limits(
        listener,
        http.app,
        http.tls,
        limits,
        http.judge,
        accept.clone().cancelled_owned(),
    ));
    Ok(Running {
        started: Started {
            url: http.url,
            ca_file,
            ca_fingerprint,
            admin_token_file,
            backend,
            store: opened.store.clone(),
        },
        state: opened.state,
        store: opened.store,
        broker,
        upkeep,
        accept,
        server,
        served: None,
        tasks,
    })
}

/// Phase 4: the broker over the journal and the backends, with its receipt
/// signer. Intents a crash left without an outcome are resolved now (the
/// default), or sandbox effects wait for `audit reconcile`
/// (`on_crash = "block"`).
async fn broker(
    cfg: &Arc<Config>,
    o: &state::Opened,
    backends: crate::broker::Backends,
) -> anyhow::Result<Broker> {
    let hs_key = match &cfg.receipts.hmac_key_file {
        // As messages: their text already says their source, which `{:#}`
        // would print again.
        Some(f) => crate::broker::receipts::read_hs_key(f).map_err(anyhow::Error::msg)?,
        None => crate::broker::receipts::derived_hs_key(&o.key),
    };
    let signer = crate::broker::receipts::Signer::load_or_create(&o.state, &o.store.sealer, hs_key)
        .map_err(anyhow::Error::msg)?;
    let broker = Broker::new(
        cfg.clone(),
        o.store.clone(),
        o.journal.clone(),
        backends,
        o.key.clone(),
        signer,
        cfg.clock.clone(),
    );
    // The egress CA: made at the first start, so that a template or
    // preset can trust STATE/egress/ca.pem before a profile intercepts.
    let egress_ca = crate::tls::LocalCa::load_or_create_clocked(
        &o.state.join(crate::tls::EGRESS_CA_DIR),
        Some(o.store.sealer.clone()),
        cfg.clock.clone(),
    )?;
    broker.egress().set_ca(egress_ca);
    broker
        .recordings()
        .set_dir(o.state.join(crate::broker::recordings::DIR));
    if cfg.audit.on_crash == crate::config::OnCrash::Resolve
        && !crate::audit::pending(&o.store)?.is_empty()
    {
        let r = broker
            .recover_after_crash()
            .await
            .map_err(|e| anyhow::anyhow!("crash recovery: {}", e.message))?;
        tracing::warn!(
            done = r.done,
            failed = r.failed,
            uncertain = r.uncertain,
            orphans_killed = r.orphans_killed,
            "intents left by an earlier run are resolved (audit_recover events); the uncertain ones are for review"
        );
    }
    Ok(broker)
}

/// The service's background tasks, by name. Drained ones end at their next
/// safe point once `stop` is cancelled (given `server::DRAIN_TIMEOUT`);
/// aborted ones hold nothing half-done.
#[derive(Default)]
pub(crate) struct Tasks {
    /// Cancelled at shutdown (`Step::StopTasks`).
    pub stop: CancellationToken,
    drained: Vec<(&'static str, JoinHandle<()>)>,
    aborted: Vec<(&'static str, JoinHandle<()>)>,
}

impl Tasks {
    pub fn drained(&mut self, name: &'static str, h: JoinHandle<()>) {
        self.drained.push((name, h));
    }

    pub fn aborted(&mut self, name: &'static str, h: JoinHandle<()>) {
        self.aborted.push((name, h));
    }

    fn names(&self) -> Vec<&'static str> {
        self.drained
            .iter()
            .chain(&self.aborted)
            .map(|(n, _)| *n)
            .collect()
    }

    /// Cancel `stop`, abort the aborted ones and wait for the others; one
    /// that does not end in time is aborted, by name in the log.
    async fn end(self) {
        self.stop.cancel();
        for (_, h) in &self.aborted {
            h.abort();
        }
        for (name, mut h) in self.drained {
            if tokio::time::timeout(crate::server::DRAIN_TIMEOUT, &mut h)
                .await
                .is_err()
            {
                tracing::warn!(task = name, "did not stop in time: aborted");
                h.abort();
            }
        }
    }
}

/// One step of the shutdown, in the order `Running::shutdown` takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No new connection; those open finish (`server::DRAIN_TIMEOUT`).
    StopAccepting,
    /// Expiry, reaping and the other periodic work stop.
    StopUpkeep,
    /// Effects in flight record their outcome (up to 30 s; those still
    /// running keep a pending intent, resolved at the next start).
    DrainEffects,
    /// Background tasks end: the embedded backend, notifications, the
    /// revocation watch; the admin socket and SIGHUP handler are aborted.
    StopTasks,
    /// The audit sinks catch up with the journal (up to 2.5 s) and write
    /// their cursors.
    StopSinks,
    /// Last: the writer commits what is queued and the store is released.
    CloseStore,
}

/// How a shutdown went.
#[derive(Debug)]
pub struct Shutdown {
    /// The steps, in the order taken.
    pub steps: Vec<Step>,
    /// The listener's own end: an error if it failed before it was asked
    /// to stop.
    pub served: std::io::Result<()>,
}

/// A started appliance: serving until `shutdown`.
pub struct Running {
    started: Started,
    state: PathBuf,
    store: Store,
    broker: Broker,
    upkeep: CancellationToken,
    accept: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
    /// The listener's result, if it ended before the shutdown.
    served: Option<std::io::Result<()>>,
    tasks: Tasks,
}

impl Running {
    pub fn started(&self) -> &Started {
        &self.started
    }

    /// The background tasks, by name.
    pub fn task_names(&self) -> Vec<&'static str> {
        self.tasks.names()
    }

    /// Serve until `shutdown` (or until the listener fails), then shut
    /// down.
    pub async fn run_until(
        mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        tokio::select! {
            () = shutdown => {}
            r = &mut self.server => self.served = Some(joined(r)),
        }
        let s = self.shutdown().await;
        s.served.map_err(|e| anyhow::anyhow!("serve: {e}"))
    }

    /// End the service, in this order and only here: stop accepting →
    /// stop upkeep → drain effects in flight → end background tasks → stop
    /// the sinks (they write their cursors while the store is open) →
    /// close the store.
    pub async fn shutdown(self) -> Shutdown {
        let mut steps = vec![];
        let mut step = |s: Step| {
            tracing::info!(step = ?s, "shutdown");
            steps.push(s);
        };
        step(Step::StopAccepting);
        self.accept.cancel();
        let served = match self.served {
            Some(r) => r,
            None => joined(self.server.await),
        };
        step(Step::StopUpkeep);
        self.upkeep.cancel();
        step(Step::DrainEffects);
        if !self.broker.drain(Duration::from_secs(30)).await {
            tracing::warn!(
                "effects still running after 30 s; their intents stay pending until reconciled"
            );
        }
        step(Step::StopTasks);
        self.tasks.end().await;
        let _ = std::fs::remove_file(self.state.join("admin.sock"));
        step(Step::StopSinks);
        self.broker
            .journal()
            .sinks()
            .stop(Duration::from_secs(5))
            .await;
        step(Step::CloseStore);
        self.store.close().await;
        Shutdown { steps, served }
    }
}

fn joined(r: Result<std::io::Result<()>, tokio::task::JoinError>) -> std::io::Result<()> {
    r.unwrap_or_else(|e| Err(std::io::Error::other(e)))
}
