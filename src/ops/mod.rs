//! Operations on a running or stopped appliance: reload (SIGHUP and the
//! admin socket), status, certificate renewal and consistent backups. The
//! operator commands behind them (`init`, `status`, `cert …`, `backup`,
//! `restore`) are in `cli::ops` and `cli::backup`.

pub mod tar;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::store::ReadOps;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::admin::Response;
use crate::broker::Broker;
use crate::config::{Config, Flags};
use crate::store::{Store, StoreError, codec, tables};
use crate::tls::{CertInfo, LocalCa, SwappableCert};

// What the service answers is the admin protocol's.
pub use crate::admin::{Manifest, ReloadReport, Request, StoreSummary};

/// Where `serve` re-reads its configuration from on reload.
#[derive(Debug, Clone, Default)]
pub struct ConfigSource {
    /// `--config` (None: the default path, missing is fine).
    pub path: Option<PathBuf>,
    /// The environment `serve` started with (a process's own environment
    /// does not change; reading it again would not either).
    pub env: Vec<(String, String)>,
    pub flags: Flags,
}

/// Top-level configuration keys a reload applies. Every other key keeps
/// its running value until the next restart (`restart_required`). The
/// principals file (`tokens_file`) is re-read at every reload; a new path
/// for it waits for a restart (sandboxes mask the path they started with).
pub const RELOADABLE: &[&str] = &[
    "backend",
    "backends",
    "server_names",
    "profiles",
    "tasks",
    "mcp_policies",
    "presets",
    "egress",
    "recordings",
    "plan_retention_seconds",
];

/// What a reload does to the backends: the definitions that will run, the
/// clients to add or replace, the names to remove, and changes that wait
/// for a restart (the embedded backend's).
struct BackendPlan {
    defs: BTreeMap<String, crate::config::BackendDef>,
    add: Vec<Arc<crate::broker::backends::Backend>>,
    remove: Vec<String>,
    later: Vec<String>,
}

/// Compare the running backends with the new configuration's. A backend
/// removed while leases still run on it is refused with the reason.
fn plan_backends(
    broker: &crate::broker::Broker,
    running: &Config,
    new: &Config,
) -> Result<BackendPlan, OpsError> {
    use crate::config::BackendDef;
    let run_defs = running.backend_defs();
    let new_defs = new.backend_defs();
    let mut plan = BackendPlan {
        defs: BTreeMap::new(),
        add: vec![],
        remove: vec![],
        later: vec![],
    };
    for (n, d) in &new_defs {
        match (run_defs.get(n), d) {
            (Some(r), _) if r.same_as(d) => {
                plan.defs.insert(n.clone(), r.clone());
            }
            (None | Some(BackendDef::Cubesandbox(_)), BackendDef::Cubesandbox(sec)) => {
                let b =
                    crate::broker::backends::Backend::from_section(n, sec).map_err(|source| {
                        OpsError::Backend {
                            name: n.clone(),
                            source,
                        }
                    })?;
                plan.add.push(b);
                plan.defs.insert(n.clone(), d.clone());
            }
            (Some(r), _) => {
                plan.later.push(format!("backends.{n}"));
                plan.defs.insert(n.clone(), r.clone());
            }
            (None, BackendDef::Embedded(_)) => plan.later.push(format!("backends.{n}")),
        }
    }
    let counts = broker.lease_counts().map_err(OpsError::LeaseCounts)?;
    for n in run_defs.keys().filter(|n| !new_defs.contains_key(*n)) {
        let live = counts.get(n).copied().unwrap_or(0);
        if live > 0 {
            return Err(OpsError::BackendInUse {
                name: n.clone(),
                leases: live,
            });
        }
        if let Some(d) = run_defs.get(n).filter(|d| d.is_embedded()) {
            // Its server runs until a restart.
            plan.later.push(format!("backends.{n}"));
            plan.defs.insert(n.clone(), d.clone());
        } else {
            plan.remove.push(n.clone());
        }
    }
    Ok(plan)
}

/// Reloads the running service's certificate and reloadable settings.
pub struct Reloader {
    source: Option<ConfigSource>,
    running: Mutex<Config>,
    ca: Arc<LocalCa>,
    addr: SocketAddr,
    cert: Arc<SwappableCert>,
    last: Mutex<Option<ReloadReport>>,
    /// The policy and the identities a reload swaps (absent in tools that
    /// only serve).
    broker: Option<crate::broker::Broker>,
    auth: Option<crate::auth::Authenticator>,
    reloading: Mutex<()>,
}

/// Top-level keys whose values differ between two configurations.
pub fn changed_keys(a: &Config, b: &Config) -> Vec<String> {
    let (Ok(Value::Object(a)), Ok(Value::Object(b))) =
        (serde_json::to_value(a), serde_json::to_value(b))
    else {
        return vec!["(configuration)".into()];
    };
    let mut keys: Vec<String> = a
        .keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

impl Reloader {
    pub fn new(
        source: Option<ConfigSource>,
        running: Config,
        ca: Arc<LocalCa>,
        addr: SocketAddr,
        cert: Arc<SwappableCert>,
        broker: Option<crate::broker::Broker>,
        auth: Option<crate::auth::Authenticator>,
    ) -> Self {
        Self {
            source,
            running: Mutex::new(running),
            ca,
            addr,
            cert,
            last: Mutex::new(None),
            broker,
            auth,
            reloading: Mutex::new(()),
        }
    }

    fn running(&self) -> Config {
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn last(&self) -> Option<ReloadReport> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn remember(&self, r: ReloadReport) -> ReloadReport {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(r.clone());
        r
    }

    fn refused(&self, error: String) -> ReloadReport {
        tracing::error!(error = %error, "reload refused; nothing changed");
        self.remember(ReloadReport {
            ok: false,
            at: self.ca.clock().text(),
            error: Some(error),
            applied: vec![],
            restart_required: vec![],
            reissued: false,
            certificate: self.current_cert().ok(),
        })
    }

    /// The certificate being served (from its file).
    pub fn current_cert(&self) -> Result<CertInfo, OpsError> {
        let p = self.ca.dir.join("server.pem");
        let pem = std::fs::read(&p).map_err(OpsError::file("read", &p))?;
        Ok(crate::tls::cert_info(&pem)?)
    }

    /// Re-read the configuration and the server certificate (reissued when
    /// it does not cover the names or is about to expire). Everything is
    /// prepared first and swapped in at the end: a refused reload changes
    /// nothing. Blocking (key generation): call from the blocking pool.
    pub fn reload(&self) -> ReloadReport {
        // One reload at a time (SIGHUP and the admin socket).
        let _one = self.reloading.lock().unwrap_or_else(|p| p.into_inner());
        let running = self.running();
        let new = match &self.source {
            Some(s) => match Config::load(s.path.as_deref(), &s.env, &s.flags) {
                Ok((c, warnings)) => {
                    for w in warnings {
                        tracing::warn!("{w}");
                    }
                    c
                }
                Err(e) => return self.refused(format!("configuration: {e}")),
            },
            None => running.clone(),
        };
        let changed = changed_keys(&running, &new);
        // `[[audit.sinks]]` reloads; the rest of `[audit]` waits for a restart.
        let sinks_changed = running.audit.sinks != new.audit.sinks;
        let audit_rest_changed = {
            let mut a = new.audit.clone();
            a.sinks = running.audit.sinks.clone();
            a != running.audit
        };
        let mut restart_required: Vec<String> = changed
            .iter()
            .filter(|k| !RELOADABLE.contains(&k.as_str()))
            .filter(|k| k.as_str() != "audit" || audit_rest_changed)
            .cloned()
            .collect();
        let names = crate::tls::server_names(&new.server_names, self.addr);
        let (pem, key, reissued) =
            match self
                .ca
                .server_leaf("server", &names, self.ca.clock().unix())
            {
                Ok(x) => x,
                Err(e) => return self.refused(format!("server certificate: {e}")),
            };
        let (ck, info) = match (
            crate::tls::certified_key(&pem, key.as_bytes()),
            crate::tls::cert_info(&pem),
        ) {
            (Ok(ck), Ok(info)) => (ck, info),
            (Err(e), _) | (_, Err(e)) => {
                return self.refused(format!("server certificate: {e}"));
            }
        };
        // The policy (profiles, task templates) and the principals file:
        // checked and prepared before anything is swapped.
        // The broker gets the running configuration with only the
        // reloadable keys taken from the file.
        let mut applied_cfg = running.clone();
        let backends = match &self.broker {
            Some(b) => match plan_backends(b, &running, &new) {
                Ok(x) => Some(x),
                Err(e) => return self.refused(e.to_string()),
            },
            None => None,
        };
        if let Some(plan) = &backends {
            applied_cfg.backend = None;
            applied_cfg.backends = plan.defs.clone();
            restart_required.extend(plan.later.iter().cloned());
        }
        applied_cfg.server_names = new.server_names.clone();
        applied_cfg.profiles = new.profiles.clone();
        applied_cfg.tasks = new.tasks.clone();
        applied_cfg.mcp_policies = new.mcp_policies.clone();
        applied_cfg.presets = new.presets.clone();
        applied_cfg.egress = new.egress.clone();
        // Its listener is bound at start.
        if new.egress.listen != running.egress.listen
            || new.egress.advertise != running.egress.advertise
        {
            applied_cfg.egress.listen = running.egress.listen;
            applied_cfg.egress.advertise = running.egress.advertise.clone();
            restart_required.push("egress.listen".into());
        }
        applied_cfg.plan_retention_seconds = new.plan_retention_seconds;
        applied_cfg.audit.sinks = new.audit.sinks.clone();
        if let Err(e) = applied_cfg.validate() {
            return self.refused(format!("configuration: {e}"));
        }
        let policy = match &self.broker {
            Some(b) => match b.prepare_reload(&applied_cfg) {
                Ok(p) => Some(p),
                Err(e) => return self.refused(format!("configuration: {e}")),
            },
            None => None,
        };
        let sinks = match (&self.broker, sinks_changed) {
            (Some(b), true) => match b.journal().sinks().prepare(&new.audit.sinks) {
                Ok(p) => Some(p),
                Err(e) => return self.refused(format!("configuration: {e}")),
            },
            _ => None,
        };
        let principals = match tokens_file_principals(&running) {
            Ok(p) => p,
            Err(e) => return self.refused(format!("tokens_file: {e}")),
        };
        // Nothing below can fail: swap.
        self.cert.swap(ck);
        if let (Some(b), Some(plan)) = (&self.broker, &backends) {
            for n in &plan.remove {
                b.backends().remove(n);
                tracing::info!(backend = %n, "backend removed");
            }
            for x in &plan.add {
                tracing::info!(backend = %x.name, description = %x.description, "backend added or replaced");
                b.backends().insert(x.clone());
            }
        }
        if let (Some(b), Some(p)) = (&self.broker, policy) {
            b.apply_reload(p);
        }
        if let Some(a) = &self.auth {
            a.replace_file_principals(principals);
        }
        let mut applied = vec!["certificate".to_string()];
        if let (Some(b), Some(p)) = (&self.broker, sinks) {
            for c in b.journal().sinks().apply(p) {
                tracing::info!("{c}");
            }
            applied.push("audit.sinks".to_string());
        }
        {
            let mut r = self.running.lock().unwrap_or_else(|p| p.into_inner());
            for k in RELOADABLE {
                if changed.iter().any(|c| c == k) {
                    applied.push((*k).to_string());
                }
            }
            if running.tokens_file.is_some() {
                applied.push("tokens_file (re-read)".to_string());
            }
            if let Some(plan) = &backends
                && (!plan.add.is_empty() || !plan.remove.is_empty())
            {
                applied.push("backends".to_string());
            }
            r.backend = applied_cfg.backend.clone();
            r.backends = applied_cfg.backends.clone();
            r.server_names = new.server_names.clone();
            r.profiles = new.profiles.clone();
            r.tasks = new.tasks.clone();
            r.plan_retention_seconds = new.plan_retention_seconds;
            if sinks_changed && self.broker.is_some() {
                r.audit.sinks = new.audit.sinks.clone();
            }
        }
        if restart_required.is_empty() {
            tracing::info!(reissued, applied = ?applied, "reloaded");
        } else {
            tracing::warn!(
                keys = ?restart_required,
                "reloaded; these changed keys keep their running values until a restart"
            );
        }
        self.remember(ReloadReport {
            ok: true,
            at: self.ca.clock().text(),
            error: None,
            applied,
            restart_required,
            reissued,
            certificate: Some(info),
        })
    }

    /// Issue a new server certificate for the running names and serve it.
    pub fn renew(&self) -> Result<CertInfo, OpsError> {
        let names = crate::tls::server_names(&self.running().server_names, self.addr);
        let (cert, key) = self.ca.reissue_server("server", &names)?;
        let pem = std::fs::read(&cert).map_err(OpsError::file("read", &cert))?;
        let key = self.ca.read_key(&key)?;
        let ck = crate::tls::certified_key(&pem, key.as_bytes())?;
        let info = crate::tls::cert_info(&pem)?;
        self.cert.swap(ck);
        tracing::info!(not_after = %info.not_after, "server certificate renewed");
        Ok(info)
    }
}

/// Reload on every SIGHUP (systemd's `ExecReload=/bin/kill -HUP $MAINPID`)
/// until the task is aborted. The handler is installed before this returns,
/// so a SIGHUP after it cannot kill the process.
pub fn spawn_sighup(reloader: Arc<Reloader>) -> std::io::Result<tokio::task::JoinHandle<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = signal(SignalKind::hangup())?;
    Ok(tokio::spawn(async move {
        while hup.recv().await.is_some() {
            // Type=notify (not notify-reload, which needs systemd 253):
            // RELOADING=1 … READY=1 shows the reload in `systemctl status`.
            crate::systemd::notify("RELOADING=1\nSTATUS=reloading");
            let r = reloader.clone();
            let report = tokio::task::spawn_blocking(move || r.reload()).await;
            let status = match report {
                Ok(r) if r.ok && r.restart_required.is_empty() => "reloaded".to_string(),
                Ok(r) if r.ok => format!(
                    "reloaded; restart required for {}",
                    r.restart_required.join(", ")
                ),
                Ok(r) => format!("reload refused: {}", r.error.unwrap_or_default()),
                Err(e) => format!("reload failed: {e}"),
            };
            crate::systemd::notify(&format!("READY=1\nSTATUS={status}"));
        }
    }))
}

/// Summarise the store (cheap: no chain walk; `audit verify` does that).
/// Tables a copy does not have yet read as empty.
pub fn summarize(txn: &impl ReadOps) -> Result<StoreSummary, StoreError> {
    #[derive(Deserialize)]
    struct LeaseState {
        state: String,
        #[serde(default)]
        held_by: Option<String>,
    }
    #[derive(Deserialize)]
    struct TokenState {
        #[serde(default)]
        revoked_at: Option<String>,
    }
    let mut s = StoreSummary::default();
    if let Some(v) = txn.meta("schema_version")? {
        s.schema_version = codec::decode(&v)?;
    }
    if let Some(v) = txn.meta("instance_id")? {
        s.instance_id = codec::decode(&v)?;
    }
    s.audit_last_seq = txn.last_seq()?;
    s.uncertain_outcomes = txn.by_count(&crate::store::audit_index::key(
        crate::store::audit_index::Field::Outcome,
        crate::store::event::Outcome::Uncertain.as_str(),
    ))?;
    s.pending_intents = txn.pending()?.len() as u64;
    for l in txn.records::<LeaseState>(tables::LEASES)? {
        *s.leases.entry(l.state).or_default() += 1;
        s.held_operations += u64::from(l.held_by.is_some());
    }
    s.active_leases = ["running", "paused"]
        .iter()
        .filter_map(|k| s.leases.get(*k))
        .sum();
    for r in txn.records::<TokenState>(tables::TOKENS)? {
        if r.revoked_at.is_some() {
            s.tokens_revoked += 1;
        } else {
            s.tokens_active += 1;
        }
    }
    Ok(s)
}

/// What the running service tells `status` and `backup`.
pub struct Service {
    pub store: Store,
    pub broker: Broker,
    pub reloader: Arc<Reloader>,
    pub state: PathBuf,
    pub url: String,
    pub backend: String,
    pub started_at: String,
}

/// How long `status` waits for the backend.
const BACKEND_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

impl crate::admin::Service for Service {
    fn handle(
        &self,
        req: Request,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send + '_>> {
        Box::pin(async move { self.answer(req).await.unwrap_or_else(Response::error) })
    }

    fn journal(&self) -> Option<crate::audit::Journal> {
        Some(self.broker.journal().clone())
    }
}

impl Service {
    async fn answer(&self, req: Request) -> Result<Response, OpsError> {
        Ok(match req {
            Request::Status => Response::Status {
                status: self.status().await,
            },
            Request::Reload => {
                let r = self.reloader.clone();
                Response::Reload {
                    report: tokio::task::spawn_blocking(move || r.reload()).await?,
                }
            }
            Request::CertRenew => {
                let r = self.reloader.clone();
                Response::Certificate {
                    info: tokio::task::spawn_blocking(move || r.renew()).await??,
                }
            }
            Request::Backup => {
                let s = snapshot(&self.store, &self.state).await?;
                Response::Backup {
                    dir: s.dir,
                    manifest: s.manifest,
                }
            }
            Request::LeaseEgress { lease_ref, only } => {
                let destinations = self
                    .broker
                    .egress_destinations(&lease_ref, only)
                    .await
                    .map_err(OpsError::Broker)?;
                Response::LeaseEgress {
                    lease_ref,
                    destinations,
                }
            }
            Request::RecordingList { lease_ref } => Response::Recordings {
                recordings: self
                    .broker
                    .all_recordings(lease_ref.as_deref())
                    .await
                    .map_err(OpsError::Broker)?,
            },
            Request::RecordingHold {
                recording_ref,
                hold,
                note,
            } => Response::Recordings {
                recordings: vec![
                    self.broker
                        .recording_hold(&recording_ref, hold, &note)
                        .await
                        .map_err(OpsError::Broker)?,
                ],
            },
            _ => return Err(OpsError::NotForService),
        })
    }

    /// The status document (`cube-adapter status --json`).
    pub async fn status(&self) -> Value {
        let j = self.broker.journal();
        let audit = match j.check() {
            Ok(()) => "ok".to_string(),
            Err(crate::audit::AuditError::Blocked) => "reconciliation_required".to_string(),
            Err(e) => format!("unavailable: {e}"),
        };
        let cfg = self.broker.config();
        let live: Vec<crate::store::leases::Lease> = self
            .store
            .read(crate::store::leases::all)
            .await
            .unwrap_or_default();
        let backends = self.broker.backends().all();
        let docs = futures_util::future::join_all(backends.iter().map(|b| {
            let mut templates: Vec<String> = cfg
                .profiles
                .values()
                .filter(|p| cfg.profile_backend(p) == Some(b.name.as_str()))
                .map(|p| p.template.clone())
                .collect();
            templates.sort();
            templates.dedup();
            let network = if cfg.embedded_backend().is_some_and(|(n, _)| n == b.name) {
                network_checks(&cfg)
            } else {
                vec![]
            };
            backend_status(b, templates, network)
        }))
        .await;
        let mut by_name = serde_json::Map::new();
        let mut any_ok = false;
        let mut first = None;
        for (b, (mut doc, ok)) in backends.iter().zip(docs) {
            any_ok |= ok;
            let leases = live.iter().filter(|l| l.backend == b.name).count();
            if let Some(o) = doc.as_object_mut() {
                o.insert("leases".into(), json!(leases));
            }
            if first.is_none() || b.name == crate::config::DEFAULT_BACKEND {
                first = Some((doc.clone(), ok));
            }
            by_name.insert(b.name.clone(), doc);
        }
        let (mut backend_doc, _) = first.unwrap_or((json!({}), false));
        if let Some(o) = backend_doc.as_object_mut() {
            o.insert("description".into(), json!(self.backend));
        }
        let backend_ok = any_ok;
        let store = {
            let s = self.store.clone();
            match s.read(summarize).await {
                Ok(v) => serde_json::to_value(v).unwrap_or_default(),
                Err(e) => json!({"error": e.to_string()}),
            }
        };
        let now = self.broker.clock().unix();
        let cert = self.reloader.current_cert().ok().map(|c| {
            let days = c.days_left(now);
            json!({"certificate": c, "days_left": days})
        });
        json!({
            "running": true,
            "ready": j.is_ready() && backend_ok && !self.store.failed(),
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "url": self.url,
            "started_at": self.started_at,
            "state_dir": self.state,
            "audit": {
                "mode": j.mode().as_str(),
                "state": audit,
                "on_crash": self.broker.config().audit.on_crash,
                "sinks": j.sinks().status(),
            },
            "backend": backend_doc,
            "backends": by_name,
            "store": store,
            // A replica of a shared PostgreSQL store: its id, and whether
            // it runs the background work now.
            "replica": self.store.replica().map(|id| json!({
                "id": id,
                "background": *self.store.turn().borrow(),
            })),
            "server_certificate": cert,
            "last_reload": self.reloader.last(),
        })
    }
}

/// One backend's part of the status document: its checklist (CubeAPI,
/// CubeProxy, credentials, each of its profiles' templates) and whether
/// all of it holds.
async fn backend_status(
    b: &crate::broker::backends::Backend,
    templates: Vec<String>,
    network: Vec<(String, std::result::Result<String, NetworkMissing>)>,
) -> (Value, bool) {
    let mut checks = BTreeMap::new();
    // The first-connection checklist (docs/operations.md, "Connecting
    // to CubeSandbox"): each check with what it found.
    let mut checklist: Vec<Value> = vec![];
    let mut check = |what: String, r: std::result::Result<String, String>| {
        let ok = r.is_ok();
        let detail = r.unwrap_or_else(|e| e);
        checklist.push(json!({"check": what, "ok": ok, "detail": detail}));
        ok
    };
    let cube = &b.client;
    let timed_out = || "no answer within the check's time".to_string();
    let (reach, key) = tokio::join!(
        tokio::time::timeout(BACKEND_CHECK, cube.reachability()),
        tokio::time::timeout(BACKEND_CHECK, cube.list_templates()),
    );
    let reach = reach.ok();
    let mut backend_ok = check(
        "CubeAPI answers GET /health".into(),
        match &reach {
            Some(r) => r
                .cube_api
                .clone()
                .map(|()| "ok".into())
                .map_err(|e| e.message),
            None => Err(timed_out()),
        },
    );
    backend_ok &= check(
        format!(
            "CubeProxy answers for *.{} (address, TLS certificate)",
            cube.config().domain
        ),
        match &reach {
            Some(r) => r
                .cube_proxy
                .clone()
                .map(|()| "ok".into())
                .map_err(|e| e.message),
            None => Err(timed_out()),
        },
    );
    backend_ok &= check(
        "CubeAPI accepts the appliance's credentials (GET /templates)".into(),
        match key {
            Ok(Ok(_)) => Ok("accepted".into()),
            Ok(Err(e)) if e.kind == crate::cube::ErrorKind::Denied => Err(format!(
                "refused ({}): check the backend's api_key_file",
                e.message
            )),
            Ok(Err(e)) => Err(e.message),
            Err(_) => Err(timed_out()),
        },
    );
    let reach = match reach {
        Some(r) => r.problem(),
        None => Some("CubeAPI/CubeProxy check timed out".to_string()),
    };
    for t in templates {
        let v = match tokio::time::timeout(BACKEND_CHECK, cube.get_template(&t)).await {
            Ok(Ok(info)) if info.is_ready() => Ok(info.status.to_ascii_lowercase()),
            Ok(Ok(info)) => Err(format!("not ready (status {})", info.status)),
            Ok(Err(e)) if e.kind == crate::cube::ErrorKind::NotFound => {
                Err("no such template on the backend".to_string())
            }
            Ok(Err(e)) => Err(format!("error: {}", e.message)),
            Err(_) => Err(timed_out()),
        };
        let short = match &v {
            Ok(s) => s.clone(),
            Err(d) if d.starts_with("not ready") => "not_ready".to_string(),
            Err(_) => "error".to_string(),
        };
        backend_ok &= check(format!("template {t} exists and is READY"), v);
        checks.insert(t, short);
    }
    // A profile whose sandboxes cannot have their network fails alone:
    // the backend still serves the others.
    for (profile, r) in network {
        check(
            format!("profile {profile}: what its sandboxes' network needs (pasta, nft)"),
            r.map_err(|e| e.to_string()),
        );
    }
    (
        json!({
            "description": b.description,
            "ok": backend_ok,
            "up": b.is_up(),
            "problem": b.problem(),
            "unreachable": reach,
            "templates": checks,
            "checklist": checklist,
        }),
        backend_ok,
    )
}

/// A consistent copy of the store in a directory of the state dir.
pub struct Snapshot {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

fn copy_synced(from: &Path, to: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut src = std::fs::File::open(from)?;
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)?;
    let n = std::io::copy(&mut src, &mut dst)?;
    dst.sync_all()?;
    Ok(n)
}

pub(crate) fn sha256_file(p: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    let mut f = std::fs::File::open(p)?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

/// Copy the store while it serves.
///
/// The copy runs on the store's writer thread, between two commits: redb
/// writes the file only from that thread and never overwrites pages of the
/// last commit, so the file then holds exactly the last durable commit (as
/// a crash at that moment would leave it). Writers wait for the copy (a
/// few hundred MB/s). The copy is then opened on its own, which replays
/// redb's crash recovery, closed cleanly, and its audit chain is verified.
pub async fn snapshot(store: &Store, state: &Path) -> Result<Snapshot, OpsError> {
    if store.postgres().is_some() {
        return Err(OpsError::Postgres);
    }
    let id = crate::ids::random_hex(6);
    let dir = state.join(format!("backup-{id}"));
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(OpsError::file("create", &dir))?;
    }
    let src = store.path().to_path_buf();
    let dst = dir.join("state.redb");
    let d2 = dst.clone();
    let copied = store
        .write(move |_txn, _chain| {
            copy_synced(&src, &d2).map_err(|e| StoreError::Io(format!("copy the store: {e}")))
        })
        .await;
    let result = match copied {
        Ok(_) => tokio::task::spawn_blocking(move || check_copy(&dst))
            .await
            .map_err(OpsError::from)
            .and_then(|r| r),
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(manifest) => Ok(Snapshot { dir, manifest }),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}

/// Open a copied store on its own (recovery), verify its chain, close it.
pub fn check_copy(path: &Path) -> Result<Manifest, OpsError> {
    // A small page cache: reading the whole chain of a large copy must not
    // grow the running service by the size of the file (redb's default
    // cache is 1 GiB, and the memory stays with the process).
    let db = redb::Database::builder()
        .set_cache_size(4 * 1024 * 1024)
        .create(path)
        .map_err(OpsError::OpenCopy)?;
    let (summary, (events, _, head)) = {
        use redb::ReadableDatabase;
        let txn = db.begin_read()?;
        let s = summarize(&txn)?;
        let c = crate::audit::verify_chain(&txn).map_err(OpsError::CopyChain)?;
        (s, c)
    };
    db.close().map_err(OpsError::CloseCopy)?;
    let bytes = std::fs::metadata(path)?.len();
    Ok(Manifest {
        format: 1,
        version: env!("CARGO_PKG_VERSION").into(),
        created_at: crate::clock::now().0,
        summary,
        audit_events: events,
        audit_head: head,
        state_redb_bytes: bytes,
        state_redb_sha256: sha256_file(path)?,
    })
}

/// Files whose mode lets others than their owner (and for the config,
/// its group) read them: warnings `serve` logs at start.
pub fn loose_files(config_file: &Path, cfg: &Config) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut warn = vec![];
    let mut check = |p: &Path, mask: u32, what: &str| {
        if let Ok(m) = std::fs::metadata(p)
            && m.permissions().mode() & mask != 0
        {
            warn.push(format!(
                "{} ({what}) has mode {:o}: others can read it",
                p.display(),
                m.permissions().mode() & 0o777
            ));
        }
    };
    check(config_file, 0o004, "configuration");
    let state = &cfg.state_dir;
    for k in ["secret.key", "hmac.key", "admin.token", "state.redb"] {
        check(&state.join(k), 0o044, "secret");
    }
    if let Ok(rd) = std::fs::read_dir(state.join("tls")) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().ends_with(".key") {
                check(&e.path(), 0o044, "private key");
            }
        }
    }
    let mut secrets: Vec<&PathBuf> = cfg
        .tokens_file
        .iter()
        .chain(cfg.metrics.token_file.iter())
        .collect();
    let defs = cfg.backend_defs();
    for d in defs.values() {
        if let crate::config::BackendDef::Cubesandbox(b) = d {
            secrets.extend(b.api_key_file.iter().chain(b.client_key_file.iter()));
        }
    }
    for f in secrets {
        check(f, 0o004, "credential");
    }
    warn
}

/// Before `serve` starts: refuse a set-uid or set-gid start, keep the
/// process out of core dumps and same-user ptrace (its memory holds the
/// keys), and name files others can read.
pub fn preflight(config_file: &Path, cfg: &Config) -> Result<Vec<String>, OpsError> {
    use nix::unistd::{getegid, geteuid, getgid, getuid};
    if getuid() != geteuid() || getgid() != getegid() {
        return Err(OpsError::SetId {
            uid: getuid(),
            gid: getgid(),
            euid: geteuid(),
            egid: getegid(),
        });
    }
    nix::sys::prctl::set_dumpable(false).map_err(OpsError::Dumpable)?;
    let mut warnings = loose_files(config_file, cfg);
    warnings.extend(
        network_checks(cfg)
            .into_iter()
            .filter_map(|(profile, r)| r.err().map(|e| format!("profile {profile}: {e}"))),
    );
    Ok(warnings)
}

/// For each profile on the embedded backend whose sandboxes have network
/// access: whether this host has what that needs (`pasta`, `nft`), or what
/// is missing. For `config check`, `status` and the start-up log: without
/// them, every acquire of the profile fails (502 `network_unavailable`).
pub fn network_checks(cfg: &Config) -> Vec<(String, std::result::Result<String, NetworkMissing>)> {
    let Some((embedded, _)) = cfg.embedded_backend() else {
        return vec![];
    };
    let tools = crate::embedded::egress::Tools::find();
    cfg.profiles
        .iter()
        .filter(|(_, p)| p.network_access() && cfg.profile_backend(p) == Some(embedded.as_str()))
        .map(|(name, _)| {
            let r = match &tools {
                Ok(t) => Ok(format!("{} and {}", t.pasta.display(), t.nft.display())),
                Err(missing) => Err(NetworkMissing {
                    missing: missing.clone(),
                }),
            };
            (name.clone(), r)
        })
        .collect()
}

/// The reference-format principals of `tokens_file` (none without one).
pub fn tokens_file_principals(
    cfg: &Config,
) -> Result<Vec<(String, crate::auth::Principal)>, OpsError> {
    match &cfg.tokens_file {
        Some(f) => {
            let text = std::fs::read_to_string(f).map_err(OpsError::file("read", f))?;
            crate::auth::load_tokens_file(&text).map_err(|source| OpsError::Principals {
                path: f.clone(),
                source,
            })
        }
        None => Ok(vec![]),
    }
}

/// Why an operation on the appliance (a reload's backends, a certificate,
/// a backup, a start's preflight, a migration) failed. `Display` is what
/// the operator reads.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// A CubeSandbox backend whose client cannot be made.
    #[error("backends.{name}: {source}")]
    Backend {
        name: String,
        source: crate::broker::backends::SectionError,
    },
    /// The live leases per backend cannot be counted.
    #[error("backends: {0}")]
    LeaseCounts(#[source] crate::broker::Error),
    /// A backend a reload would remove still has leases.
    #[error(
        "backend '{name}' has {leases} live lease(s): release or kill them (or let GC collect them) before removing it, or keep it in the configuration"
    )]
    BackendInUse { name: String, leases: usize },
    /// A file or directory (`what`: `read`, `create`).
    #[error("{what} {}: {source}", .path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file of the copy (its size, its digest).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The CA or the server certificate.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A blocking task that did not finish.
    #[error(transparent)]
    Join(#[from] tokio::task::JoinError),
    /// The broker refused or failed (its code and message).
    #[error("{}: {}", .0.code.as_str(), .0.message)]
    Broker(#[source] crate::broker::Error),
    /// An admin request `ops::Service` does not answer.
    #[error("not a request about the service")]
    NotForService,
    /// A backup of a PostgreSQL store (its own tools do that).
    #[error(
        "the store is in PostgreSQL: back the database up with its own tools \
         (pg_dump, or continuous archiving), and each replica's state directory \
         with them (docs/operations.md, \"Several replicas\")"
    )]
    Postgres,
    #[error("open the copy: {0}")]
    OpenCopy(#[source] redb::DatabaseError),
    #[error(transparent)]
    ReadCopy(#[from] redb::TransactionError),
    #[error("the copy's audit chain: {0}")]
    CopyChain(#[source] StoreError),
    #[error("close the copy: {0}")]
    CloseCopy(#[source] redb::DatabaseError),
    /// A set-uid or set-gid start.
    #[error(
        "refusing to run with real uid/gid {uid}/{gid} and effective {euid}/{egid} (set-uid or set-gid): run it as the service user"
    )]
    SetId {
        uid: nix::unistd::Uid,
        gid: nix::unistd::Gid,
        euid: nix::unistd::Uid,
        egid: nix::unistd::Gid,
    },
    #[error("prctl(PR_SET_DUMPABLE): {0}")]
    Dumpable(#[source] nix::Error),
    /// The principals file does not load.
    #[error("{}: {source}", .path.display())]
    Principals {
        path: PathBuf,
        source: crate::auth::TokensFileError,
    },
    /// The redb store's chain, before a migration.
    #[error("the redb store's audit chain does not verify: {0}")]
    SourceChain(#[source] StoreError),
    #[error("commit the copy: {0}")]
    Commit(#[source] StoreError),
    /// The migrated chain, read back from the database.
    #[error("the copy's audit chain does not verify in the database: {0}")]
    TargetChain(#[source] StoreError),
    /// The migrated chain is not the one copied.
    #[error(
        "the copy's chain differs: {db_events} events up to {db_last_seq} (head {db_head}) in the database, \
         {events} up to {last_seq} (head {head}) in the redb store"
    )]
    ChainDiffers {
        events: u64,
        last_seq: u64,
        head: String,
        db_events: u64,
        db_last_seq: u64,
        db_head: String,
    },
}

impl OpsError {
    /// [`OpsError::File`], for `map_err`.
    fn file(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| Self::File { what, path, source }
    }
}

/// What this host lacks for a profile's sandboxes' network: `missing`
/// in the embedded backend's words (`egress::Tools::find`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{missing}: its acquires fail (502 network_unavailable) until then")]
pub struct NetworkMissing {
    pub missing: crate::embedded::egress::MissingTools,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_keys_names_top_level_keys() {
        let a = Config::default();
        let mut b = a.clone();
        assert!(changed_keys(&a, &b).is_empty());
        b.server_names = vec!["x.example".into()];
        b.gc_interval_seconds = 5;
        assert_eq!(
            changed_keys(&a, &b),
            vec![
                "gc_interval_seconds".to_string(),
                "server_names".to_string()
            ]
        );
        // `[metrics]` is read at start: a change waits for a restart.
        let mut c = a.clone();
        c.metrics.token_file = Some("/etc/cube-adapter/metrics.token".into());
        assert_eq!(changed_keys(&a, &c), vec!["metrics".to_string()]);
        assert!(!RELOADABLE.contains(&"metrics"));
    }

    #[test]
    fn loose_files_are_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            state_dir: dir.path().to_path_buf(),
            ..Config::default()
        };
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        let conf = dir.path().join("config.toml");
        let key = dir.path().join("secret.key");
        std::fs::write(&conf, "").unwrap();
        std::fs::write(&key, "k").unwrap();
        mode(&conf, 0o640);
        mode(&key, 0o600);
        assert!(loose_files(&conf, &cfg).is_empty());
        mode(&conf, 0o644);
        mode(&key, 0o640);
        let w = loose_files(&conf, &cfg);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w.iter()
                .any(|x| x.contains("secret.key") && x.contains("640"))
        );
        // The metrics token is a credential too.
        let token = dir.path().join("metrics.token");
        std::fs::write(&token, "t").unwrap();
        mode(&token, 0o644);
        let mut cfg = cfg;
        cfg.metrics.token_file = Some(token);
        let w = loose_files(&conf, &cfg);
        assert!(
            w.iter()
                .any(|x| x.contains("metrics.token") && x.contains("credential")),
            "{w:?}"
        );
    }
}

/// What `store migrate --to postgres` did.
#[derive(Debug, Clone)]
pub struct Migrated {
    /// Events in the chain, its last `seq` and head, verified on both sides.
    pub events: u64,
    pub last_seq: u64,
    pub head: String,
    pub copied: crate::store::pg::copy::Copied,
}

/// Copy a stopped redb store into an empty PostgreSQL database: the chain
/// is verified before, the copy is one transaction (nothing of it is left
/// when it fails), and the chain is verified again in the database against
/// the same events and head. The redb store is not changed.
pub fn migrate_to_postgres(
    store: &Store,
    settings: &crate::store::pg::Settings,
) -> Result<Migrated, OpsError> {
    use crate::store::pg::{self, PgTx, copy};
    let (events, last_seq, head) = store
        .read_now(crate::audit::verify_chain)
        .map_err(OpsError::SourceChain)?;
    let db = pg::Pg::connect(settings)?;
    pg::migrate(&db)?;
    let tx = PgTx::write(db.conn()?);
    let copied = (|| {
        tx.lock_chain()?;
        if !copy::is_empty(&tx)? {
            return Err(crate::store::StoreError::Conflict(
                "the database already holds a store: migrate into an empty database".into(),
            ));
        }
        let chain = crate::store::Chain {
            next_seq: last_seq + 1,
            last_hash: head.clone(),
        };
        store.read_now(|rx| {
            let t = rx.redb().ok_or_else(|| {
                crate::store::StoreError::Unavailable("the source is not a redb store".into())
            })?;
            copy::copy(t, &tx, &chain)
        })
    })();
    let copied = match copied {
        Ok(c) => {
            tx.finish(true).map_err(OpsError::Commit)?;
            c
        }
        Err(e) => {
            let _ = tx.finish(false);
            return Err(e.into());
        }
    };
    let rx = crate::store::Rx::Pg(PgTx::read(db.conn()?));
    let (e2, l2, h2) = crate::audit::verify_chain(&rx).map_err(OpsError::TargetChain)?;
    if (e2, l2, &h2) != (events, last_seq, &head) {
        return Err(OpsError::ChainDiffers {
            events,
            last_seq,
            head,
            db_events: e2,
            db_last_seq: l2,
            db_head: h2,
        });
    }
    Ok(Migrated {
        events,
        last_seq,
        head,
        copied,
    })
}
