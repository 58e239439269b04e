//! The evidence: `audit verify|export|reconcile` (the hash-chained
//! journal, through the running service or on the store) and `receipt
//! verify` (a trusted task's signed receipt, offline).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::common::{Access, Common, access, access_config, runtime, socket_each};
use super::{EXIT_CODES, Exit};
use crate::admin::{self, Request, Response};

#[derive(Subcommand)]
pub enum AuditCommand {
    /// Check the hash chain of the journal. Exit 0 when intact, 1 when not.
    ///
    /// Prints the number of events, the last sequence number, the head hash
    /// and the pending intents. Works while the service runs.
    #[command(after_help = EXIT_CODES)]
    Verify(AuditVerifyArgs),
    /// Print events as JSON lines.
    ///
    /// Digests, never commands, paths or secrets in clear. Works while the
    /// service runs.
    #[command(after_help = EXIT_CODES)]
    Export(AuditExportArgs),
    /// Resolve intents left pending by a crash (service must be stopped).
    ///
    /// Records a `reconciled` outcome for each pending intent, with a digest
    /// of your note (a ticket number, what you checked). It never claims the
    /// operation succeeded and never re-runs it. Exit 3 while the service
    /// runs, 2 without a note.
    #[command(after_help = EXIT_CODES)]
    Reconcile(AuditReconcileArgs),
}

#[derive(Args)]
pub struct AuditVerifyArgs {
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args)]
pub struct AuditExportArgs {
    #[command(flatten)]
    pub common: Common,
    /// First sequence number to print.
    #[arg(long, default_value_t = 1)]
    pub since: u64,
}

#[derive(Args)]
pub struct AuditReconcileArgs {
    #[command(flatten)]
    pub common: Common,
    /// Only this operation id (default: all pending).
    #[arg(long)]
    pub operation: Option<String>,
    /// Why this is resolved (required).
    #[arg(long)]
    pub note: String,
}

#[derive(Subcommand)]
pub enum ReceiptCommand {
    /// Check a trusted task's signed receipt offline.
    ///
    /// FILE is a receipt, or a response that holds one (…/result,
    /// …/receipt). The Ed25519 signature is checked with --public-key (the
    /// appliance's STATE/receipt-ed25519.pub, or the JSON of GET
    /// /v1/receipts/public-key); the reference-compatible HS256 signature
    /// with --hmac-key-file. --state-dir takes both keys from an
    /// appliance's state directory (and its config). Prints the verdict as
    /// JSON. Exit 0: every signature checked holds; 1: one does not; 2:
    /// nothing could be checked.
    Verify(ReceiptVerifyArgs),
}

#[derive(Args)]
pub struct ReceiptVerifyArgs {
    pub file: PathBuf,
    #[arg(long)]
    pub public_key: Option<PathBuf>,
    #[arg(long)]
    pub hmac_key_file: Option<PathBuf>,
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    #[arg(long, env = "CUBE_ADAPTER_CONFIG")]
    pub config: Option<PathBuf>,
}

pub fn verify(args: AuditVerifyArgs) -> Exit {
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let r = match access_config(&cfg) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match admin::call(&p, &Request::AuditVerify) {
            Ok(out) => match out.into_iter().next() {
                Some(Response::AuditVerify { result }) => Ok(result),
                Some(Response::Error { message }) => Err(message),
                Some(_) => Err("bad answer from the service".into()),
                None => Err("no answer from the service".into()),
            },
            Err(e) => {
                eprintln!("error: {e}");
                return Exit::State;
            }
        },
        Ok(Access::Store(store)) => crate::audit::verify(&store)
            .map(|v| serde_json::to_value(v).unwrap_or_default())
            .map_err(|e| e.to_string()),
    };
    match r {
        Ok(v) => {
            println!("audit chain intact: {}", v);
            Exit::Ok
        }
        Err(e) => {
            eprintln!("audit chain BROKEN: {e}");
            Exit::Failed
        }
    }
}

pub fn export(args: AuditExportArgs) -> Exit {
    use std::io::Write;
    let since = args.since;
    let state = match args.common.state_dir() {
        Ok(s) => s,
        Err(c) => return c,
    };
    // Each event is printed as it arrives (or is read): nothing is held
    // but a buffer of output.
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
    let code = match access(&state) {
        Err(c) => c,
        Ok(Access::Socket(p)) => {
            let (mut printed, mut count) = (0u64, None);
            let r = socket_each(&p, &Request::AuditExport { since }, |r| match r {
                Response::AuditEvent { event } => {
                    writeln!(out, "{}", crate::audit::export_line(&event))
                        .map_err(|e| format!("write: {e}"))?;
                    printed += 1;
                    Ok(())
                }
                Response::AuditCount { count: n } => {
                    count = Some(n);
                    Ok(())
                }
                _ => Err("bad answer from the service".into()),
            });
            match (r, count) {
                (Err(c), _) => c,
                (Ok(()), Some(n)) if n == printed => Exit::Ok,
                (Ok(()), Some(n)) => {
                    eprintln!("error: the service counted {n} events and sent {printed}");
                    Exit::Failed
                }
                (Ok(()), None) => {
                    eprintln!(
                        "error: the export ended after {printed} events, before its end (did the service stop?)"
                    );
                    Exit::Failed
                }
            }
        }
        Ok(Access::Store(store)) => {
            match crate::audit::export(&store, since, |e| {
                writeln!(out, "{}", crate::audit::export_line(e))
            }) {
                Ok(_) => Exit::Ok,
                Err(e) => {
                    eprintln!("error: {e}");
                    Exit::Store
                }
            }
        }
    };
    match out.flush() {
        Ok(()) => code,
        Err(e) => {
            eprintln!("error: write: {e}");
            Exit::Failed
        }
    }
}

pub fn reconcile(args: AuditReconcileArgs) -> Exit {
    let (operation, note) = (args.operation.as_deref(), args.note.as_str());
    if note.trim().is_empty() {
        eprintln!("error: --note must say why (a ticket, what was checked)");
        return Exit::Usage;
    }
    let cfg = match args.common.load() {
        Ok(c) => c,
        Err(c) => return c,
    };
    let store = match access_config(&cfg) {
        Err(c) => return c,
        Ok(Access::Socket(sock)) => {
            // Running: an operation a lease is held by (a call with no
            // answer) is reconciled by the service; the rest need it
            // stopped.
            let Some(op) = operation else {
                eprintln!(
                    "error: the service is running: give --operation OP for an operation a lease is held by, or stop it first (`systemctl stop cube-adapter`) to reconcile the intents a crash left"
                );
                return Exit::State;
            };
            let req = crate::admin::Request::AuditReconcileHeld {
                operation: op.to_string(),
                note: note.to_string(),
            };
            return match super::common::ask(&sock, &req) {
                Ok(crate::admin::Response::Reconciled { operations }) => {
                    for op in &operations {
                        println!("reconciled {op}");
                    }
                    Exit::Ok
                }
                Ok(crate::admin::Response::Error { message }) => {
                    eprintln!("error: {message}");
                    Exit::Failed
                }
                Ok(other) => super::common::unexpected(other),
                Err(c) => c,
            };
        }
        Ok(Access::Store(s)) => s,
    };
    let key = match std::fs::read(cfg.state_dir.join("hmac.key")) {
        Ok(k) => k,
        Err(e) => {
            eprintln!(
                "error: cannot read {}: {e}",
                cfg.state_dir.join("hmac.key").display()
            );
            return Exit::Store;
        }
    };
    let journal = match crate::audit::Journal::open(store, cfg.audit.mode, key) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::Store;
        }
    };
    let rt = match runtime() {
        Ok(r) => r,
        Err(c) => return c,
    };
    match rt.block_on(crate::audit::reconcile(&journal, operation, note)) {
        Ok(done) if done.is_empty() => {
            println!("nothing to reconcile: no pending intents");
            Exit::Ok
        }
        Ok(done) => {
            for op in &done {
                println!("reconciled {op}");
            }
            Exit::Ok
        }
        Err(e) => {
            eprintln!("error: {e}");
            Exit::Failed
        }
    }
}

/// The check itself is the broker's (`receipts::verify_command`, which
/// still answers 0, 1 or 2).
pub fn receipt_verify(args: ReceiptVerifyArgs) -> Exit {
    Exit::from_code(crate::broker::receipts::verify_command(
        &args.file,
        args.public_key.as_deref(),
        args.state_dir.as_deref(),
        args.config.as_deref(),
        args.hmac_key_file.as_deref(),
    ))
}
