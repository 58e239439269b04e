//! `cube-adapter serve`: assemble store, journal, identity, backend and API,
//! then serve until shutdown.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;

use crate::api::{self, AppState};
use crate::audit::Journal;
use crate::auth::{self, Authenticator, Principal, Role};
use crate::broker::Broker;
use crate::config::Config;
use crate::cube::{BackendConfig, CubeClient, Secret};
use crate::embedded::{Backend, Limits, Settings};
use crate::store::Store;
use crate::tls::{LocalCa, SwappableCert};

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

pub(crate) fn random_key(path: &Path) -> anyhow::Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(k) if k.len() == 32 => Ok(k),
        Ok(_) => anyhow::bail!("{} is not a 32-byte key", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let k = crate::ids::random_bytes(32);
            crate::tls::write_private(path, &k, 0o600)?;
            Ok(k)
        }
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// Host paths no sandbox may see: the appliance's state and secrets.
fn masks(cfg: &Config, state: &Path) -> Vec<PathBuf> {
    let mut v = vec![
        state.to_path_buf(),
        PathBuf::from(crate::config::DEFAULT_STATE_DIR),
        PathBuf::from("/etc/cube-adapter"),
    ];
    if let Some(d) = &cfg.embedded.state_dir {
        v.push(d.clone());
    }
    if let Some(f) = &cfg.tokens_file {
        v.push(f.clone());
    }
    v.extend(cfg.receipts.hmac_key_file.iter().cloned());
    // The audit sinks' secrets, and the file sink's files (events are
    // redacted, but other tenants' activity is no sandbox's business): its
    // directory when it is one of the appliance's own (named
    // cube-adapter…), else the file and its rotated copies.
    for s in &cfg.audit.sinks {
        match s {
            crate::config::sinks::SinkDef::File(f) => match f.path.parent() {
                Some(d)
                    if d.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("cube-adapter")) =>
                {
                    v.push(d.to_path_buf());
                }
                _ => {
                    v.push(f.path.clone());
                    for n in 1..=f.keep {
                        let mut p = f.path.clone().into_os_string();
                        p.push(format!(".{n}"));
                        v.push(PathBuf::from(p));
                    }
                }
            },
            crate::config::sinks::SinkDef::Http(h) => {
                v.extend(h.hmac_key_file.iter().cloned());
                v.extend(h.token_file.iter().cloned());
                v.extend(h.client_key_file.iter().cloned());
            }
            _ => {}
        }
    }
    v.extend(cfg.metrics.token_file.iter().cloned());
    if let Some(n) = &cfg.console.notify {
        v.extend(n.secret_file.iter().cloned());
    }
    // The PostgreSQL store's password, and the console's OIDC client
    // secret (issue 34, L4). CA files (`ca_file`) and client certificates
    // are public and stay visible.
    v.extend(cfg.store.password_file.iter().cloned());
    if let Some(o) = &cfg.console.oidc {
        v.push(o.client_secret_file.clone());
    }
    for def in cfg.backend_defs().values() {
        match def {
            crate::config::BackendDef::Cubesandbox(b) => {
                v.extend(b.api_key_file.iter().cloned());
                v.extend(b.client_key_file.iter().cloned());
            }
            crate::config::BackendDef::Embedded(e) => v.extend(e.state_dir.iter().cloned()),
        }
    }
    v.into_iter()
        .filter_map(|p| {
            std::fs::canonicalize(&p)
                .ok()
                .or(p.is_absolute().then_some(p))
        })
        .collect()
}

/// An unprivileged process that will run embedded sandboxes enters a user
/// namespace with its subordinate ids first (`embedded::subids`), so that
/// each sandbox gets ids of its own. Call single-threaded, before any
/// runtime. Err: it cannot go on (the namespace was entered, unmapped).
pub fn enter_subordinate_ids(isolation: crate::embedded::launch::Isolation) -> Result<(), String> {
    use crate::embedded::subids::{self, Entered, PER_SANDBOX};
    if isolation != crate::embedded::launch::Isolation::Namespaces {
        return Ok(());
    }
    match subids::enter()? {
        Entered::Root => {}
        Entered::Mapped(ids) => tracing::info!(
            ids,
            sandboxes = ids / PER_SANDBOX - 1,
            "sandboxes get subordinate ids of their own"
        ),
        Entered::Unchanged(why) => tracing::warn!(
            reason = %why,
            "sandboxes share this process's one uid and gid (docs/security.md, \"Ids\")"
        ),
    }
    Ok(())
}

/// The embedded backend's settings from the configuration (`serve`, and
/// `sandboxes` on a stopped service's state directory).
pub fn embedded_settings(cfg: &Config, state: &Path, launcher: PathBuf) -> Settings {
    let e = &cfg.embedded;
    // `[backends.NAME] kind = "embedded"` may name its own.
    let own = cfg.embedded_backend().map(|(_, b)| b).unwrap_or_default();
    Settings {
        state_dir: own
            .state_dir
            .or_else(|| e.state_dir.clone())
            .unwrap_or_else(|| state.join("embedded")),
        isolation: e.isolation,
        templates: if own.templates.is_empty() {
            e.templates.clone()
        } else {
            own.templates
        },
        limits: Limits {
            memory_mb: e.memory_mb,
            max_processes: e.max_processes,
            ..Limits::default()
        },
        cpus: e.cpus,
        domain: "cube.local".into(),
        launcher,
        uid_base: crate::embedded::sandbox::DEFAULT_UID_BASE,
        mask: masks(cfg, state),
        keep_free: vec![state.to_path_buf()],
        default_timeout: None,
        orphan_grace_secs: i64::try_from(e.orphan_grace_seconds).unwrap_or(i64::MAX),
        min_free_mb: e.min_free_mb,
        disk_mb: e.disk_mb,
        faithful: e.faithful.then(|| crate::embedded::sandbox::Faithful {
            pause_delay: std::time::Duration::from_millis(e.faithful_pause_ms),
            envd_version: e.faithful_envd_version.clone(),
        }),
    }
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

/// The first start's admin token: issued and written to `file` (0600) when
/// the store has no token and `file` does not exist; `None` otherwise.
pub(crate) async fn bootstrap_admin(
    store: &Store,
    file: &Path,
    clock: &crate::clock::Clock,
) -> anyhow::Result<Option<PathBuf>> {
    if !auth::list_tokens(store)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .is_empty()
        || file.exists()
    {
        return Ok(None);
    }
    let principal = Principal {
        label: None,
        tenant: "admin".into(),
        subject: "bootstrap-admin".into(),
        roles: vec![Role::Admin],
        runtimes: None,
        profiles: None,
        actions: vec!["*".into()],
        task_templates: vec!["*".into()],
        task: None,
        issuer: None,
    };
    let (token, rec) = auth::new_token(principal, Some("bootstrap admin".into()), clock)
        .map_err(|e| anyhow::anyhow!(e))?;
    auth::store_token(store, rec)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    crate::tls::write_private(file, format!("{token}\n").as_bytes(), 0o600)?;
    Ok(Some(file.to_path_buf()))
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
    let cfg = Arc::new(cfg);
    // The system clock unless an in-process test set a manual one.
    let clock = cfg.clock.clone();
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("create {}", cfg.state_dir.display()))?;
    // Absolute from here on: sandboxes mask it by path.
    let state = std::fs::canonicalize(&cfg.state_dir)
        .with_context(|| format!("resolve {}", cfg.state_dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700));
    }
    let store = match cfg.store.postgres() {
        Some(pg) => Store::open_postgres(&state, &pg),
        None => Store::open(&state),
    }
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let key = random_key(&state.join("hmac.key"))?;
    let journal = Journal::open(store.clone(), cfg.audit.mode, key.clone())
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .with_clock(clock.clone());
    let lost = crate::broker::ptys::mark_lost(&store, &clock)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if lost > 0 {
        tracing::warn!(
            count = lost,
            "PTYs of the previous run are lost (their terminals ended with it)"
        );
    }

    // TLS: the appliance's own CA, keys sealed under the store key.
    let ca = Arc::new(LocalCa::load_or_create_clocked(
        &state.join("tls"),
        Some(store.sealer.clone()),
        clock.clone(),
    )?);
    let addr = listener.local_addr()?;
    let names = crate::tls::server_names(&cfg.server_names, addr);
    // Reissued when it no longer covers the names or expires soon; swapped
    // in place on reload.
    let (spem, skey, _) = ca.server_leaf("server", &names, clock.unix())?;
    let served = Arc::new(SwappableCert::new(crate::tls::certified_key(
        &spem,
        skey.as_bytes(),
    )?));
    // Client certificates of the identity CA (a CA of its own: the internal
    // mTLS to the embedded backend trusts only the main CA) may stand for
    // an identity (`token create --client-cert`); none is required.
    let identity_ca = crate::tls::LocalCa::load_or_create_clocked(
        &state.join(crate::tls::IDENTITY_CA_DIR),
        Some(store.sealer.clone()),
        clock.clone(),
    )?;
    // And the company's CA (`[auth.client_ca]`): its certificates stand for
    // the identities listed there. A certificate neither CA issued does not
    // fail the handshake (its bearer token may still count): it is judged
    // after, and stands for nothing.
    let company = match &cfg.auth.client_ca {
        Some(c) => {
            let pem = std::fs::read(&c.ca_file).map_err(|e| {
                anyhow::anyhow!("auth.client_ca: ca_file {}: {e}", c.ca_file.display())
            })?;
            let map = crate::auth::client_ca::CompanyCa::new(c).map_err(|e| anyhow::anyhow!(e))?;
            Some((pem, Arc::new(map)))
        }
        None => None,
    };
    let trust = Arc::new(crate::tls::ClientTrust::new(
        identity_ca.cert_pem.as_bytes(),
        company.as_ref().map(|(pem, _)| pem.as_slice()),
    )?);
    let server_tls = crate::tls::server_config_trusting(served.clone(), trust.clone())?;
    let company_map = company.map(|(_, m)| m);
    let judge: crate::server::PeerJudge = Arc::new(move |chain| {
        use sha2::Digest;
        let first = chain.first()?;
        let sha256: [u8; 32] = sha2::Sha256::digest(first.as_ref()).into();
        match trust.classify(chain) {
            crate::tls::Verdict::Own => Some(crate::auth::PeerCert::own(sha256)),
            crate::tls::Verdict::Company => {
                let p = company_map
                    .as_ref()?
                    .identity(first.as_ref(), &hex::encode(sha256))?;
                Some(crate::auth::PeerCert {
                    sha256,
                    company: Some(p),
                })
            }
            crate::tls::Verdict::Untrusted => None,
        }
    });

    // First start: a bootstrap admin token, written once.
    let admin_token_file = bootstrap_admin(&store, &state.join("admin.token"), &clock).await?;

    // Fixed principals: the shared token and the reference principals file.
    let mut shared = vec![];
    if let Some(t) = &secrets.shared_token {
        anyhow::ensure!(
            t.expose().len() >= 24,
            "CUBE_ADAPTER_TOKEN must be at least 24 characters"
        );
        shared.push((
            t.expose().to_string(),
            Principal {
                label: None,
                tenant: "default".into(),
                subject: "shared-bearer".into(),
                roles: vec![Role::Agent],
                runtimes: None,
                profiles: None,
                actions: vec!["*".into()],
                task_templates: vec!["*".into()],
                task: None,
                issuer: None,
            },
        ));
    }
    let file = crate::ops::tokens_file_principals(&cfg).map_err(|e| anyhow::anyhow!(e))?;
    // Sign-in blocks (repeated failures) are audited, one event per block.
    let (block_tx, block_rx) = tokio::sync::mpsc::channel(256);
    let mut authn = Authenticator::new(store.clone(), shared, file, cfg.hashing_slots)
        .with_clock(clock.clone())
        .with_block_reports(block_tx);
    let console_oidc = match &cfg.console.oidc {
        Some(o) => Some(Arc::new(
            crate::auth::oidc::CodeFlow::new(o).map_err(|e| anyhow::anyhow!(e))?,
        )),
        None => None,
    };
    if !cfg.console.local_users {
        authn = authn.without_local_users();
    }
    if !cfg.auth.oidc.is_empty() {
        let v = Arc::new(
            crate::auth::oidc::Verifier::new(&cfg.auth.oidc).map_err(|e| anyhow::anyhow!(e))?,
        );
        v.prefetch();
        authn = authn.with_oidc(v);
    }

    // The backend: configured, or the embedded one on loopback with mTLS.
    // Tasks that end when `stop` is cancelled, and tasks that are aborted.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut background = vec![];
    let mut abortable = vec![];
    let mut list = vec![];
    for (name, def) in cfg.backend_defs() {
        let b = match def {
            crate::config::BackendDef::Cubesandbox(b) => {
                crate::broker::backends::Backend::from_section(&name, &b)
                    .map_err(|e| anyhow::anyhow!("backend {name}: {e}"))?
            }
            crate::config::BackendDef::Embedded(_) => {
                let settings = embedded_settings(&cfg, &state, launcher.clone());
                let backend = Backend::open(settings, None)
                    .map_err(|e| anyhow::anyhow!("embedded backend: {e}"))?;
                let bl =
                    tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
                let baddr = bl.local_addr()?;
                let (bcert, bkey) =
                    ca.leaf_files("embedded-server", Some(&["127.0.0.1".to_string()]))?;
                let (ccert, ckey) = ca.leaf_files("broker-client", None)?;
                let btls = crate::tls::server_config(
                    &std::fs::read(&bcert)?,
                    ca.read_key(&bkey)?.as_bytes(),
                    Some(ca.cert_pem.as_bytes()),
                )?;
                background.push(backend.spawn_reaper(stop.clone()));
                let router = backend.router();
                let stopped = stop.clone().cancelled_owned();
                background.push(tokio::spawn(async move {
                    if let Err(e) =
                        crate::server::serve(bl, router, Some(Arc::new(btls)), stopped).await
                    {
                        tracing::error!(error = %e, "embedded backend stopped");
                    }
                }));
                let mut bc = BackendConfig::new(name.clone(), format!("https://{baddr}"));
                // The embedded backend serves CubeAPI and CubeProxy on one address.
                bc.proxy_url = Some(crate::cube::ProxyUrl::Url(format!("https://{baddr}")));
                bc.domain = "cube.local".into();
                bc.ca_pem = Some(ca.cert_pem.as_bytes().to_vec());
                bc.client_cert_pem = Some(std::fs::read(&ccert)?);
                bc.client_key_pem = Some(Secret::new(ca.read_key(&ckey)?));
                crate::broker::backends::Backend::new(
                    &name,
                    crate::broker::backends::Kind::Embedded(cfg.embedded.isolation),
                    CubeClient::new(bc)?,
                    format!(
                        "embedded ({:?} isolation) on {baddr}",
                        cfg.embedded.isolation
                    ),
                )
            }
        };
        list.push(b);
    }
    // What `serve` prints and the console shows: the one backend, or each.
    let backend_desc = match list.as_slice() {
        [one] => one.description.clone(),
        many => many
            .iter()
            .map(|b| format!("{}: {}", b.name, b.description))
            .collect::<Vec<_>>()
            .join("; "),
    };
    let backends = crate::broker::Backends::new(list);
    backends.spawn_watch(stop.clone());

    let hs_key = match &cfg.receipts.hmac_key_file {
        Some(f) => crate::broker::receipts::read_hs_key(f).map_err(|e| anyhow::anyhow!(e))?,
        None => crate::broker::receipts::derived_hs_key(&key),
    };
    let signer = crate::broker::receipts::Signer::load_or_create(&state, &store.sealer, hs_key)
        .map_err(|e| anyhow::anyhow!(e))?;
    let broker = Broker::new(
        cfg.clone(),
        store.clone(),
        journal,
        backends,
        key,
        signer,
        clock.clone(),
    );
    // A crash left intents without an outcome: resolved now (the default),
    // or sandbox effects wait for `audit reconcile` (`on_crash = "block"`).
    if cfg.audit.on_crash == crate::config::OnCrash::Resolve
        && !crate::audit::pending(&store)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .is_empty()
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
    // Approval notifications: queued by planning, sent by their own task.
    if let Some((n, task)) =
        crate::console::notify::start(&cfg, addr, stop.clone()).map_err(|e| anyhow::anyhow!(e))?
    {
        broker.set_plan_listener(n);
        background.push(task);
    }
    // Audit delivery: each sink reads the journal from its own cursor.
    {
        let sinks = broker.journal().sinks();
        let prepared = sinks
            .prepare(&cfg.audit.sinks)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        for c in sinks.start(prepared, stop.clone()) {
            tracing::info!("{c}");
        }
        // Their lag and failures at each scrape of /metrics.
        let s2 = sinks.clone();
        broker
            .journal()
            .metrics()
            .set_sink_source(Box::new(move || {
                s2.status()
                    .into_iter()
                    .map(|s| crate::metrics::SinkSample {
                        name: s.name,
                        lag: s.lag,
                        failures: s.failures,
                    })
                    .collect()
            }));
    }
    background.push(tokio::spawn(audit_blocks(
        broker.journal().clone(),
        block_rx,
        stop.clone(),
    )));
    // Revocations made by other replicas (a shared store) reach this one's
    // cache within `auth::STAMP_POLL`.
    background.push(tokio::spawn(authn.clone().watch_revocations(stop.clone())));
    let admin_authn = authn.clone();
    let st = AppState {
        broker: broker.clone(),
        auth: authn,
        metrics: Arc::new(api::Metrics::new(
            cfg.metrics.token().map_err(|e| anyhow::anyhow!(e))?,
            Some(ca.dir.clone()),
        )),
    };
    // `/mcp` runs its tools through the same `/v1` router, in-process.
    let v1 = api::router(st.clone());
    let mut hosts = names.clone();
    hosts.extend(["localhost", "127.0.0.1", "::1"].map(String::from));
    let console = crate::console::router(crate::console::ConsoleState {
        broker: broker.clone(),
        auth: admin_authn.clone(),
        backend: backend_desc.clone(),
        cert_file: ca.dir.join("server.pem"),
        oidc: console_oidc,
    });
    let http_metrics = st.metrics.clone();
    // The request histograms see every route (`/v1`, `/mcp`, the console):
    // a layer on the whole app, where each route's `MatchedPath` is known.
    let app = crate::mcp::http::router(st, v1.clone(), hosts)
        .merge(v1)
        .merge(console)
        .layer(axum::middleware::from_fn_with_state(
            http_metrics,
            api::track,
        ));
    let tls = if cfg.insecure_plain_http {
        anyhow::ensure!(
            addr.ip().is_loopback(),
            "plain HTTP is only allowed on a loopback address"
        );
        None
    } else {
        Some(Arc::new(server_tls))
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    // Operator commands reach the running service here; SIGHUP reloads.
    let reloader = Arc::new(crate::ops::Reloader::new(
        match &reload {
            Reload::Off => None,
            Reload::Signal(source) => Some(source.clone()),
        },
        (*cfg).clone(),
        ca.clone(),
        addr,
        served,
        Some(broker.clone()),
        Some(admin_authn.clone()),
    ));
    let ops = Arc::new(crate::ops::Service {
        store: store.clone(),
        broker: broker.clone(),
        reloader: reloader.clone(),
        state: state.clone(),
        url: format!("{scheme}://{addr}"),
        backend: backend_desc.clone(),
        started_at: clock.text(),
    });
    abortable.push(
        crate::admin::serve(&state.join("admin.sock"), store.clone(), admin_authn, ops)
            .await
            .context("admin socket")?,
    );
    if let Reload::Signal(_) = reload {
        abortable.push(crate::ops::spawn_sighup(reloader).context("SIGHUP handler")?);
    }
    on_started(&Started {
        url: format!("{scheme}://{addr}"),
        ca_file: ca.dir.join("ca.pem"),
        ca_fingerprint: ca.fingerprint(),
        admin_token_file,
        backend: backend_desc,
        store: store.clone(),
    });
    let upkeep = tokio_util::sync::CancellationToken::new();
    broker.spawn_upkeep(upkeep.clone());
    let limits = crate::server::Limits::from_config(&cfg.connections);
    let judge = tls.is_some().then_some(judge);
    // HTTPS answers (API, MCP, console alike) carry HSTS; plain HTTP on
    // loopback does not (a browser ignores it there anyway).
    let app = if tls.is_some() {
        app.layer(axum::middleware::map_response(crate::server::hsts))
    } else {
        app
    };
    let r = crate::server::serve_with_limits(listener, app, tls, limits, judge, shutdown).await;
    upkeep.cancel();
    // Let effects in flight record their outcome before the store closes.
    if !broker.drain(std::time::Duration::from_secs(30)).await {
        tracing::warn!(
            "effects still running after 30 s; their intents stay pending until reconciled"
        );
    }
    // Background tasks end at their next safe point (the embedded backend
    // drains its connections); the admin socket and the signal handler hold
    // nothing half-done and are aborted.
    stop.cancel();
    for h in abortable {
        h.abort();
    }
    for mut h in background {
        if tokio::time::timeout(crate::server::DRAIN_TIMEOUT, &mut h)
            .await
            .is_err()
        {
            h.abort();
        }
    }
    let _ = std::fs::remove_file(state.join("admin.sock"));
    // The sinks write their cursors while the store is still open.
    broker
        .journal()
        .sinks()
        .stop(std::time::Duration::from_secs(5))
        .await;
    // Last: the writer commits what is queued and the file is released.
    store.close().await;
    r.context("serve")
}

/// Record each sign-in block in the journal: who was blocked (a digest of
/// the token id or user name, none when a whole address is), from where
/// (a digest of the address), for how long. One event per block, however
/// many attempts it then refuses.
async fn audit_blocks(
    journal: crate::audit::Journal,
    mut rx: tokio::sync::mpsc::Receiver<crate::auth::throttle::Blocked>,
    stop: tokio_util::sync::CancellationToken,
) {
    use crate::auth::throttle::Credential;
    loop {
        let b = tokio::select! {
            _ = stop.cancelled() => return,
            b = rx.recv() => match b {
                Some(b) => b,
                None => return,
            },
        };
        let mut ev = journal.event("sign_in_throttled");
        ev.outcome = "rejected".into();
        ev.error_code = Some("sign_in_throttled".into());
        ev.identity_digest = match &b.credential {
            Some(Credential::Token(id)) => Some(journal.digest("token_id", id.as_bytes())),
            Some(Credential::User(name)) => Some(journal.digest("user", name.as_bytes())),
            Some(Credential::Unknown) | None => None,
        };
        ev.note_digest = Some(journal.digest("source", b.source.ip().to_string().as_bytes()));
        ev.duration_ms = Some(u64::try_from(b.for_.as_millis()).unwrap_or(u64::MAX));
        if let Err(e) = journal.record(ev).await {
            tracing::warn!(error = %e, "a sign-in block was not audited");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `*_file` of the configuration that holds a secret (all but
    /// CA and client certificates, which are public) is masked in
    /// sandboxes: found by walking the configuration itself, so that a
    /// secret file set here and missing from `masks` fails the test.
    #[test]
    fn every_configured_secret_file_is_masked() {
        let text = r#"
tokens_file = "/srv/s/tokens.json"

[store]
kind = "postgres"
url = "postgres://cube@db.example/cube"
password_file = "/srv/s/pg-password"
ca_file = "/srv/s/pg-ca.pem"

[metrics]
token_file = "/srv/s/metrics.token"

[receipts]
hmac_key_file = "/srv/s/receipts.key"

[console.notify]
url = "https://hooks.example/x"
secret_file = "/srv/s/notify.secret"
ca_file = "/srv/s/notify-ca.pem"

[console.oidc]
issuer = "https://idp.example"
client_id = "console"
client_secret_file = "/srv/s/oidc-client.secret"
redirect_url = "https://cube.example/console/oidc/callback"
ca_file = "/srv/s/idp-ca.pem"

[[audit.sinks]]
kind = "http"
name = "siem"
url = "https://siem.example/in"
ca_file = "/srv/s/siem-ca.pem"
client_cert_file = "/srv/s/siem-client.pem"
client_key_file = "/srv/s/siem-client.key"
hmac_key_file = "/srv/s/siem-hmac.key"
token_file = "/srv/s/siem.token"

[backends.cube]
kind = "cubesandbox"
api_url = "https://cube.example"
api_key_file = "/srv/s/cube-api.key"
ca_file = "/srv/s/cube-ca.pem"
client_cert_file = "/srv/s/cube-client.pem"
client_key_file = "/srv/s/cube-client.key"
"#;
        let cfg: Config = toml::from_str(text).unwrap();
        let masks = masks(&cfg, Path::new("/var/lib/cube-adapter-test"));
        fn secret_files(v: &serde_json::Value, out: &mut Vec<(String, PathBuf)>) {
            match v {
                serde_json::Value::Object(m) => {
                    for (k, v) in m {
                        match v {
                            serde_json::Value::String(p)
                                if k.ends_with("_file")
                                    && k != "ca_file"
                                    && k != "client_cert_file" =>
                            {
                                out.push((k.clone(), PathBuf::from(p)));
                            }
                            _ => secret_files(v, out),
                        }
                    }
                }
                serde_json::Value::Array(a) => a.iter().for_each(|v| secret_files(v, out)),
                _ => {}
            }
        }
        let mut found = vec![];
        secret_files(&serde_json::to_value(&cfg).unwrap(), &mut found);
        assert_eq!(found.len(), 11, "{found:?}");
        for (key, path) in &found {
            assert!(
                masks.contains(path),
                "{key} = {} is not masked",
                path.display()
            );
        }
        for p in ["/srv/s/pg-password", "/srv/s/oidc-client.secret"] {
            assert!(masks.contains(&PathBuf::from(p)), "{p}: {masks:?}");
        }
        for public in ["/srv/s/pg-ca.pem", "/srv/s/cube-client.pem"] {
            assert!(!masks.contains(&PathBuf::from(public)), "{public}");
        }
    }
}
