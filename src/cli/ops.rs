//! `init` (first run without the service), `status` (health, journal,
//! leases, tokens, certificate, last reload) and `cert show|renew` (the
//! server certificate). Each asks the running service on STATE/admin.sock
//! when it answers, and works on the stopped service's store otherwise.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use super::common::{
    Common, Reach, adopt_owner, ask, not_initialised, open_stopped, print_json, reach, runtime,
    unexpected,
};
use super::{EXIT_CODES, Exit};
use crate::admin::{Request, Response};
use crate::ops::StoreSummary;
use crate::tls::{CertInfo, LocalCa};

#[derive(Args)]
pub struct InitArgs {
    #[command(flatten)]
    pub common: Common,
    /// Where to write the bootstrap admin token (default STATE/admin.token).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub common: Common,
    /// Print JSON (the same document in both cases; `running` tells which).
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum CertCommand {
    /// The CA and the server certificate: names, validity, fingerprints.
    ///
    /// Reads the public files in STATE/tls (running or not). Exit 1 when
    /// the server certificate has --warn-days or fewer left, so that a
    /// timer can alert.
    #[command(after_help = EXIT_CODES)]
    Show(CertShowArgs),
    /// Issue a new server certificate from the local CA.
    ///
    /// With the service running, it issues the certificate and serves it
    /// at once (open connections keep the old one); stopped, the next start
    /// serves it. The names are the host's names and addresses plus
    /// `server_names` from the configuration. The CA (ten years) is kept:
    /// agents keep trusting the appliance. The service also reissues the
    /// certificate by itself at start and on reload (SIGHUP) when it no
    /// longer covers the names or has 30 days or fewer left.
    #[command(after_help = EXIT_CODES)]
    Renew(CertRenewArgs),
}

#[derive(Args)]
pub struct CertShowArgs {
    #[command(flatten)]
    pub common: Common,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 at this many days left or fewer.
    #[arg(long, default_value_t = 30)]
    pub warn_days: i64,
}

#[derive(Args)]
pub struct CertRenewArgs {
    #[command(flatten)]
    pub common: Common,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

// ---------------------------------------------------------------- init

pub fn init(args: InitArgs) -> Exit {
    let token_file = args.admin_token_file.as_deref();
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = cfg.state_dir.clone();
    if let Reach::Running(_) = reach(&state) {
        eprintln!(
            "error: the service is running on {}: it initialised it already (see `cube-adapter status`)",
            state.display()
        );
        return Exit::State;
    }
    if let Some(f) = token_file
        && f.exists()
    {
        eprintln!(
            "error: {} exists: init never overwrites a token file (choose another path)",
            f.display()
        );
        return Exit::Usage;
    }
    let existed = |p: &str| state.join(p).exists();
    let had_store = existed("state.redb");
    let had_ca = existed("tls/ca.pem");
    if let Err(e) = std::fs::create_dir_all(&state) {
        eprintln!("error: create {}: {e}", state.display());
        return Exit::Store;
    }
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700));
    }
    let store = match open_stopped(&state) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    let r = rt.block_on(async {
        crate::app::random_key(&state.join("hmac.key"))?;
        let ca = LocalCa::load_or_create_sealed(&state.join("tls"), Some(store.sealer.clone()))?;
        let names = crate::tls::server_names(&cfg.server_names, cfg.listen);
        let (pem, _, reissued) = ca.server_leaf("server", &names, ca.clock().unix())?;
        let info = crate::tls::cert_info(&pem)?;
        let file = token_file
            .map(Path::to_path_buf)
            .unwrap_or_else(|| state.join("admin.token"));
        let token =
            crate::app::bootstrap_admin(&store, &file, &crate::clock::Clock::System).await?;
        let summary = store.read_now(crate::ops::summarize)?;
        Ok::<_, anyhow::Error>((ca.fingerprint(), info, reissued, token, summary))
    });
    drop(store);
    adopt_owner(&state);
    let (fp, info, reissued, token, summary) = match r {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: {e:#}");
            return Exit::Store;
        }
    };
    let kept = |had: bool| if had { "kept" } else { "created" };
    println!("initialised {}", state.display());
    println!(
        "  store:        {} (schema {}, instance {})",
        kept(had_store),
        summary.schema_version,
        summary.instance_id
    );
    println!("  CA:           {}, SHA-256 {fp}", kept(had_ca));
    println!(
        "  server cert:  {} for {}, valid until {}",
        if reissued || !had_ca {
            "issued"
        } else {
            "kept"
        },
        info.names.join(", "),
        info.not_after
    );
    match token {
        Some(f) => println!(
            "  admin token:  written to {} (read it once, then keep it somewhere safe)",
            f.display()
        ),
        None => println!(
            "  admin token:  none issued (tokens exist, or {} is there already)",
            state.join("admin.token").display()
        ),
    }
    println!("next: systemctl enable --now cube-adapter && cube-adapter status");
    Exit::Ok
}

// -------------------------------------------------------------- status

fn offline_status(
    state: &Path,
    on_crash: crate::config::OnCrash,
    sinks: &[crate::config::sinks::SinkDef],
) -> Result<Value, Exit> {
    if !state.join("state.redb").exists() {
        return Err(not_initialised(state));
    }
    let store = open_stopped(state)?;
    let summary: StoreSummary = store.read_now(crate::ops::summarize).map_err(|e| {
        eprintln!("error: {e}");
        Exit::Store
    })?;
    // Each configured sink's stored cursor (none yet: it starts at its
    // `from`), and how far behind the journal it is.
    let cursors = store
        .read_now(crate::audit::sinks::stored_cursors)
        .unwrap_or_default();
    let head = summary.audit_last_seq;
    let sinks: Vec<Value> = sinks
        .iter()
        .map(|d| {
            let c = cursors.get(d.name()).copied();
            json!({
                "name": d.name(),
                "kind": d.kind(),
                "cursor": c.unwrap_or(0),
                "lag": c.map(|c| head.saturating_sub(c)),
                "state": if c.is_some() { "stopped" } else { "not_started" },
            })
        })
        .collect();
    let now = crate::clock::now().1;
    let cert = std::fs::read(state.join("tls/server.pem"))
        .ok()
        .and_then(|p| crate::tls::cert_info(&p).ok())
        .map(|c| {
            let days = c.days_left(now);
            json!({"certificate": c, "days_left": days})
        });
    Ok(json!({
        "running": false,
        "ready": false,
        "version": env!("CARGO_PKG_VERSION"),
        "state_dir": state,
        "audit": {
            // Held operations wait for an operator, not for a start.
            "state": match (summary.pending_intents.saturating_sub(summary.held_operations), on_crash) {
                (0, _) => "ok",
                (_, crate::config::OnCrash::Block) => "reconciliation_required",
                (_, crate::config::OnCrash::Resolve) => "resolved_at_next_start",
            },
            "on_crash": on_crash,
            "uncertain_outcomes": summary.uncertain_outcomes,
            "sinks": sinks,
        },
        "store": summary,
        "server_certificate": cert,
    }))
}

fn print_status(v: &Value) {
    let s = |p: &str| {
        v.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let running = v.get("running").and_then(Value::as_bool) == Some(true);
    let ready = v.get("ready").and_then(Value::as_bool) == Some(true);
    if running {
        println!(
            "cube-adapter {}: running (pid {}) at {}, {}",
            s("/version"),
            n("/pid"),
            s("/url"),
            if ready { "ready" } else { "NOT READY" }
        );
        // Each backend (one: as before, under `backend`).
        let several = v
            .get("backends")
            .and_then(Value::as_object)
            .filter(|m| m.len() > 1);
        let one = v.get("backend").cloned().unwrap_or_default();
        let list: Vec<(String, Value)> = match several {
            Some(m) => m.iter().map(|(k, x)| (k.clone(), x.clone())).collect(),
            None => vec![(String::new(), one)],
        };
        for (name, b) in list {
            print_backend(&name, &b);
        }
        println!(
            "  audit:        {} mode, {}",
            s("/audit/mode"),
            s("/audit/state")
        );
    } else {
        println!(
            "cube-adapter {}: not running (state {})",
            s("/version"),
            s("/state_dir")
        );
        println!("  audit:        {}", s("/audit/state"));
    }
    for sink in v
        .pointer("/audit/sinks")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let t = |k: &str| sink.get(k).and_then(Value::as_str).unwrap_or("");
        let lag = sink
            .get("lag")
            .and_then(Value::as_u64)
            .map_or("unknown".to_string(), |l| l.to_string());
        let state = match sink
            .get("consecutive_failures")
            .and_then(Value::as_u64)
            .filter(|n| *n > 0)
        {
            Some(n) => format!(
                "FAILING ({n} in a row: {})",
                sink.get("last_error").and_then(Value::as_str).unwrap_or("")
            ),
            None => t("state").to_string(),
        };
        let quarantined = match sink.get("quarantined").and_then(Value::as_u64) {
            Some(n) if n > 0 => format!(
                "; {n} quarantined (refused by the receiver even alone, skipped; last {})",
                t("last_quarantined")
            ),
            _ => String::new(),
        };
        println!(
            "  audit sink:   {} ({}): {state}, {lag} events behind{quarantined}",
            t("name"),
            t("kind"),
        );
    }
    if let Some(id) = v.pointer("/replica/id").and_then(Value::as_str) {
        let bg = v.pointer("/replica/background").and_then(Value::as_bool) == Some(true);
        println!(
            "  replica:      {id} of a PostgreSQL store; {}",
            if bg {
                "runs the background work (GC, keepalive, audit delivery)"
            } else {
                "another replica runs the background work"
            }
        );
    }
    let held = n("/store/held_operations");
    println!(
        "  journal:      {} events, {} pending intents{}, {} uncertain outcomes{}",
        n("/store/audit_last_seq"),
        n("/store/pending_intents"),
        if held > 0 {
            format!(" ({held} held: a lease blocked until `audit reconcile --operation`)")
        } else {
            String::new()
        },
        n("/store/uncertain_outcomes"),
        if n("/store/uncertain_outcomes") > 0 {
            " (for review: cube-adapter audit export, outcome \"uncertain\")"
        } else {
            ""
        }
    );
    let by_state: Vec<String> = v
        .pointer("/store/leases")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, x)| format!("{k} {}", x.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    println!(
        "  leases:       {} active ({})",
        n("/store/active_leases"),
        if by_state.is_empty() {
            "none stored".to_string()
        } else {
            by_state.join(", ")
        }
    );
    println!(
        "  tokens:       {} active, {} revoked",
        n("/store/tokens_active"),
        n("/store/tokens_revoked")
    );
    if v.pointer("/server_certificate/certificate").is_some() {
        println!(
            "  certificate:  valid until {} ({} days)",
            s("/server_certificate/certificate/not_after"),
            v.pointer("/server_certificate/days_left")
                .and_then(Value::as_i64)
                .unwrap_or(0)
        );
    }
    if let Some(r) = v.get("last_reload").filter(|r| !r.is_null()) {
        let ok = r.get("ok").and_then(Value::as_bool) == Some(true);
        let restart: Vec<&str> = r
            .get("restart_required")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        println!(
            "  last reload:  {} {}{}",
            r.get("at").and_then(Value::as_str).unwrap_or(""),
            if ok {
                "applied".to_string()
            } else {
                format!(
                    "REFUSED: {}",
                    r.get("error").and_then(Value::as_str).unwrap_or("")
                )
            },
            if restart.is_empty() {
                String::new()
            } else {
                format!("; restart required for {}", restart.join(", "))
            }
        );
    }
}

/// Exit 0 running and ready, 1 running but not ready, 3 not running.
pub fn status(args: StatusArgs) -> Exit {
    let json = args.json;
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let v = match reach(&cfg.state_dir) {
        Reach::Running(sock) => match ask(&sock, &Request::Status) {
            Ok(Response::Status { status }) => status,
            Ok(r) => return unexpected(r),
            Err(c) => return c,
        },
        Reach::Stopped => {
            match offline_status(&cfg.state_dir, cfg.audit.on_crash, &cfg.audit.sinks) {
                Ok(v) => v,
                Err(c) => return c,
            }
        }
    };
    if json {
        print_json(&v);
    } else {
        print_status(&v);
    }
    match (
        v.get("running").and_then(Value::as_bool),
        v.get("ready").and_then(Value::as_bool),
    ) {
        (Some(true), Some(true)) => Exit::Ok,
        (Some(true), _) => Exit::Failed,
        _ => Exit::State,
    }
}

// ---------------------------------------------------------------- cert

fn read_cert(p: &Path) -> Result<CertInfo, String> {
    let pem = std::fs::read(p).map_err(|e| format!("read {}: {e}", p.display()))?;
    crate::tls::cert_info(&pem).map_err(|e| format!("{}: {e}", p.display()))
}

/// Exit 0, or 1 when the server certificate has `warn_days` or fewer left.
pub fn cert_show(args: CertShowArgs) -> Exit {
    let (json, warn_days) = (args.json, args.warn_days);
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let tls = cfg.state_dir.join("tls");
    if !tls.join("ca.pem").exists() || !tls.join("server.pem").exists() {
        return not_initialised(&cfg.state_dir);
    }
    let (ca, server) = match (
        read_cert(&tls.join("ca.pem")),
        read_cert(&tls.join("server.pem")),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("error: {e}");
            return Exit::Store;
        }
    };
    let now = crate::clock::now().1;
    let (ca_days, days) = (ca.days_left(now), server.days_left(now));
    if json {
        print_json(&json!({
            "ca": {"file": tls.join("ca.pem"), "certificate": ca, "days_left": ca_days},
            "server": {"file": tls.join("server.pem"), "certificate": server, "days_left": days},
        }));
    } else {
        println!("CA      {}", tls.join("ca.pem").display());
        println!("  subject:   {}", ca.subject);
        println!("  SHA-256:   {}", ca.sha256);
        println!(
            "  valid:     {} .. {} ({ca_days} days left)",
            ca.not_before, ca.not_after
        );
        println!("server  {}", tls.join("server.pem").display());
        println!("  names:     {}", server.names.join(", "));
        println!("  SHA-256:   {}", server.sha256);
        println!(
            "  valid:     {} .. {} ({days} days left)",
            server.not_before, server.not_after
        );
    }
    if days <= warn_days {
        eprintln!(
            "warning: the server certificate has {days} days left: `cube-adapter cert renew`"
        );
        return Exit::Failed;
    }
    Exit::Ok
}

/// A new server certificate: issued by the running service and served at
/// once, or written for the next start when the service is stopped.
pub fn cert_renew(args: CertRenewArgs) -> Exit {
    let json = args.json;
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let state = &cfg.state_dir;
    let (info, live) = match reach(state) {
        Reach::Running(sock) => match ask(&sock, &Request::CertRenew) {
            Ok(Response::Certificate { info }) => (info, true),
            Ok(r) => return unexpected(r),
            Err(c) => return c,
        },
        Reach::Stopped => {
            if !state.join("secret.key").exists() || !state.join("tls/ca.pem").exists() {
                return not_initialised(state);
            }
            // Held while the files are written: the service cannot start
            // in between and read half of them.
            let store = match open_stopped(state) {
                Ok(s) => s,
                Err(c) => return c,
            };
            let r = (|| {
                let ca =
                    LocalCa::load_or_create_sealed(&state.join("tls"), Some(store.sealer.clone()))?;
                let names = crate::tls::server_names(&cfg.server_names, cfg.listen);
                let (cert, _) = ca.reissue_server("server", &names)?;
                crate::tls::cert_info(
                    &std::fs::read(&cert).map_err(|e| {
                        crate::tls::TlsError::Io(format!("read {}", cert.display()), e)
                    })?,
                )
            })();
            drop(store);
            adopt_owner(state);
            match r {
                Ok(i) => (i, false),
                Err(e) => {
                    eprintln!("error: {e}");
                    return Exit::Store;
                }
            }
        }
    };
    if json {
        print_json(&json!({"certificate": info, "served_now": live}));
    } else {
        println!(
            "server certificate renewed: valid until {}, names {}",
            info.not_after,
            info.names.join(", ")
        );
        println!(
            "  {}",
            if live {
                "the running service serves it now (connections open keep the old one)"
            } else {
                "the service is stopped: it serves it from its next start"
            }
        );
    }
    Exit::Ok
}

/// One backend of `status`: what it is, its templates, its checklist;
/// DOWN when its health watch finds it so.
fn print_backend(name: &str, b: &Value) {
    let templates: Vec<String> = b
        .get("templates")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, x)| format!("{k}: {}", x.as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    let desc = b.get("description").and_then(Value::as_str).unwrap_or("");
    let down = b.get("up").and_then(Value::as_bool) == Some(false);
    let label = if name.is_empty() {
        "backend:".to_string()
    } else {
        format!("backend {name}:")
    };
    let leases = b.get("leases").and_then(Value::as_u64).unwrap_or(0);
    println!(
        "  {label:<13} {desc} ({}){}{}",
        templates.join(", "),
        if name.is_empty() {
            String::new()
        } else {
            format!(", {leases} lease(s)")
        },
        if down {
            format!(
                ", DOWN: {}",
                b.get("problem")
                    .and_then(Value::as_str)
                    .unwrap_or("no answer")
            )
        } else {
            String::new()
        }
    );
    for c in b
        .get("checklist")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let ok = c.get("ok").and_then(Value::as_bool) == Some(true);
        let what = c.get("check").and_then(Value::as_str).unwrap_or("");
        let detail = c.get("detail").and_then(Value::as_str).unwrap_or("");
        if ok {
            println!("    [ok]   {what}");
        } else {
            println!("    [FAIL] {what}: {detail}");
        }
    }
}
