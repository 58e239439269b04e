//! `recording verify`: a session recording checked against the audit
//! journal, offline (`docs/recordings.md`).

use std::io::BufRead;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::common::{Access, Common, access, socket_each};
use super::{EXIT_CODES, Exit};
use crate::admin::{Request, Response};
use crate::audit::event::Event;

#[derive(Subcommand)]
pub enum RecordingCommand {
    /// Check a session recording against the audit journal.
    ///
    /// FILE is a recording as the console downloads it, or as it lies under
    /// STATE/recordings. Each chunk's SHA-256 is compared with its
    /// `recording_chunk` event, and a sealed recording's length and SHA-256
    /// with its `recording_sealed` event; a changed byte names its chunk.
    /// The events come from --journal (what `audit export` printed, or an
    /// audit file sink's JSONL: checked to hold together as a chain), or
    /// else from the appliance's journal (through the running service, or
    /// the store when it is stopped). Prints the verdict as JSON. Exit 0:
    /// every sealed chunk matches; 1: one does not, or the journal's events
    /// do not hold together; 2: nothing could be checked (no such file, no
    /// event of this recording).
    #[command(after_help = EXIT_CODES)]
    Verify(RecordingVerifyArgs),
    /// The recordings, oldest first: ref, kind and what it records, lease,
    /// state, size, and a legal hold.
    ///
    /// Through the running service (exit 3 when it is not running).
    #[command(after_help = EXIT_CODES)]
    List(RecordingListArgs),
    /// Put a recording under legal hold: retention never removes it until
    /// the hold is lifted.
    ///
    /// Through the running service. Recorded as `recording_hold` with a
    /// keyed digest of --note (a ticket, a case). Exit 1 when there is no
    /// such recording.
    #[command(after_help = EXIT_CODES)]
    Hold(RecordingHoldArgs),
    /// Lift a legal hold: retention applies to the recording again.
    #[command(after_help = EXIT_CODES)]
    Unhold(RecordingHoldArgs),
}

#[derive(Args)]
pub struct RecordingListArgs {
    #[command(flatten)]
    pub common: Common,
    /// Only this lease's.
    #[arg(long)]
    pub lease: Option<String>,
    /// Print JSON: the records as stored.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct RecordingHoldArgs {
    #[command(flatten)]
    pub common: Common,
    /// The recording (`rec_…`).
    pub recording: String,
    /// Why (required): a ticket, a case number.
    #[arg(long)]
    pub note: String,
}

/// The service's socket, or exit 3.
fn service(common: &Common) -> Result<std::path::PathBuf, Exit> {
    let state = common.state_dir()?;
    match super::common::reach(&state) {
        super::common::Reach::Running(sock) => Ok(sock),
        _ => {
            eprintln!("error: the service is not running (recordings are kept by it)");
            Err(Exit::State)
        }
    }
}

fn recordings(
    sock: &std::path::Path,
    req: &Request,
) -> Result<Vec<crate::store::recordings::Recording>, Exit> {
    match super::common::ask(sock, req)? {
        Response::Recordings { recordings } => Ok(recordings),
        Response::Error { message } => {
            eprintln!("error: {message}");
            Err(Exit::Failed)
        }
        other => Err(super::common::unexpected(other)),
    }
}

pub fn list(a: RecordingListArgs) -> Exit {
    let sock = match service(&a.common) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let rs = match recordings(&sock, &Request::RecordingList { lease_ref: a.lease }) {
        Ok(r) => r,
        Err(c) => return c,
    };
    if a.json {
        super::common::print_json(&serde_json::to_value(&rs).unwrap_or_default());
        return Exit::Ok;
    }
    for r in rs {
        let state = match r.state {
            crate::store::recordings::RecordingState::Open => "open",
            crate::store::recordings::RecordingState::Sealed => "sealed",
        };
        let bytes = if r.bytes > 0 {
            r.bytes
        } else {
            r.sealed_bytes()
        };
        let hold = r
            .hold
            .map(|h| format!(" held since {}", h.at))
            .unwrap_or_default();
        println!(
            "{} {} {} {} {} {} bytes {}{}",
            r.recording_ref,
            r.kind.as_str(),
            r.subject,
            r.lease_ref,
            state,
            bytes,
            r.created_at,
            hold
        );
    }
    Exit::Ok
}

pub fn hold(a: RecordingHoldArgs, on: bool) -> Exit {
    if a.note.trim().is_empty() {
        eprintln!("error: --note must say why (a ticket, a case)");
        return Exit::Usage;
    }
    let sock = match service(&a.common) {
        Ok(s) => s,
        Err(c) => return c,
    };
    let req = Request::RecordingHold {
        recording_ref: a.recording,
        hold: on,
        note: a.note,
    };
    match recordings(&sock, &req) {
        Ok(rs) => {
            for r in rs {
                println!(
                    "{} {}",
                    r.recording_ref,
                    if on { "held" } else { "not held" }
                );
            }
            Exit::Ok
        }
        Err(c) => c,
    }
}

#[derive(Args)]
pub struct RecordingVerifyArgs {
    /// The recording (`.cast`).
    pub file: PathBuf,
    /// The journal as JSON lines (`audit export`, a file sink).
    #[arg(long)]
    pub journal: Option<PathBuf>,
    #[command(flatten)]
    pub common: Common,
}

/// The events of one recording, and what is wrong with the chain they
/// came from.
fn events_from_file(
    path: &std::path::Path,
    rec: &str,
) -> Result<(Vec<Event>, Vec<String>), String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut all = vec![];
    let mut problems = vec![];
    // The chain is checked link by link: only the previous event is kept
    // besides the recording's own.
    let mut prev: Option<Event> = None;
    for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let ev: Event = serde_json::from_str(&line)
            .map_err(|e| format!("{} line {}: not an audit event: {e}", path.display(), n + 1))?;
        // A sink delivers at least once: an event again is skipped.
        if prev
            .as_ref()
            .is_some_and(|p| p.seq == ev.seq && p.hash == ev.hash)
        {
            continue;
        }
        problems.extend(crate::broker::recordings::check_link(prev.as_ref(), &ev));
        if ev.recording_ref.as_deref() == Some(rec) {
            all.push(ev.clone());
        }
        prev = Some(ev);
    }
    Ok((all, problems))
}

fn events_from_appliance(common: &Common, rec: &str) -> Result<Vec<Event>, Exit> {
    let state = common.state_dir()?;
    let mut out = vec![];
    match access(&state)? {
        Access::Socket(p) => {
            socket_each(&p, &Request::AuditExport { since: 1 }, |r| match r {
                Response::AuditEvent { event } => {
                    if event.recording_ref.as_deref() == Some(rec) {
                        out.push(*event);
                    }
                    Ok(())
                }
                Response::AuditCount { .. } => Ok(()),
                _ => Err("bad answer from the service".into()),
            })?;
        }
        Access::Store(store) => {
            if let Err(e) = crate::audit::export(&store, 1, |e| {
                if e.recording_ref.as_deref() == Some(rec) {
                    out.push(e.clone());
                }
                Ok(())
            }) {
                eprintln!("error: {e}");
                return Err(Exit::Store);
            }
        }
    }
    Ok(out)
}

pub fn verify(args: RecordingVerifyArgs) -> Exit {
    let file = match std::fs::read(&args.file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {}: {e}", args.file.display());
            return Exit::Usage;
        }
    };
    let rec = file
        .split(|c| *c == b'\n')
        .next()
        .and_then(|h| std::str::from_utf8(h).ok())
        .and_then(crate::broker::recordings::read_header)
        .map(|(r, _)| r);
    let Some(rec) = rec else {
        eprintln!(
            "error: {} is not a cube-adapter recording (its first line names none)",
            args.file.display()
        );
        return Exit::Usage;
    };
    let (events, chain) = match &args.journal {
        Some(j) => match events_from_file(j, &rec) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("error: {e}");
                return Exit::Usage;
            }
        },
        None => match events_from_appliance(&args.common, &rec) {
            Ok(e) => (e, vec![]),
            Err(c) => return c,
        },
    };
    if events.is_empty() {
        eprintln!("error: the journal has no event of {rec}");
        return Exit::Usage;
    }
    let mut v = crate::broker::recordings::verify_file(&file, &events);
    v.problems.extend(chain);
    v.ok = v.problems.is_empty();
    println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    if v.ok { Exit::Ok } else { Exit::Failed }
}
