//! The local admin socket (`STATE/admin.sock`, 0600): while `serve` holds
//! the store, operator commands reach it here. One protocol: one JSON
//! [`Request`] per connection (tagged by `cmd`), and [`Response`] lines back
//! (tagged by `answer`), both through one codec ([`encode`], [`decode`]).
//! Requests about identities and the journal are answered here; those about
//! the service itself (status, reload, certificate, backup) by the
//! [`Service`] that `serve` hands in (`ops::Service`); the types of those
//! answers (reload report, store summary, backup manifest) are defined
//! here, with the protocol, and `ops` re-exports them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::auth::users::UserAnswer;
use crate::auth::{self, Authenticator, OpError, Principal, TokenRecord};
use crate::store::Store;
use crate::store::event::{Action, Event, Outcome};
use crate::tls::CertInfo;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    TokenCreate {
        principal: Principal,
        description: Option<String>,
    },
    TokenList,
    TokenRevoke {
        id: String,
    },
    /// `cube-adapter user …` (passwords arrive hashed).
    User {
        op: crate::auth::users::UserOp,
    },
    /// Register a client-certificate identity (the CLI issued the
    /// certificate from the appliance's CA).
    CertIdentityCreate {
        record: crate::auth::TokenRecord,
    },
    AuditVerify,
    AuditExport {
        since: u64,
    },
    /// `audit reconcile --operation OP` while the service runs: only an
    /// operation a lease is held by (an MCP call with no answer); the
    /// intents a crash left wait for a stopped service.
    AuditReconcileHeld {
        operation: String,
        note: String,
    },
    /// Health, backend, audit, leases, certificate, last reload.
    Status,
    /// As SIGHUP: re-read the configuration and the certificate.
    Reload,
    /// Issue a new server certificate now and serve it.
    CertRenew,
    /// A consistent copy of the store in `STATE/backup-…/state.redb`.
    Backup,
    /// `lease egress LEASE [--only DEST…|--none]`: a live lease's egress
    /// destinations, narrowed first to `only` when given.
    LeaseEgress {
        lease_ref: String,
        only: Option<Vec<String>>,
    },
    /// `recording list [--lease LEASE]`: the recordings, oldest first.
    RecordingList {
        lease_ref: Option<String>,
    },
    /// `recording hold|unhold REF --note NOTE`: set or lift a legal hold.
    RecordingHold {
        recording_ref: String,
        hold: bool,
        note: String,
    },
}

/// One answer line. Every request gets one answer, except `AuditExport`:
/// an `AuditEvent` per event, streamed as the journal is read, then
/// `AuditCount`. A refused or failed request gets one `Error` instead; an
/// export that fails part way ends with an `Error` in place of the count.
/// (No `Debug`: `Token` holds a secret.)
#[derive(Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Response {
    Error {
        message: String,
    },
    /// `TokenCreate`: the token, shown this once.
    Token {
        token: String,
    },
    /// `TokenList`.
    Tokens {
        tokens: Vec<TokenInfo>,
    },
    /// `User`: what the operation did (the listing for `UserOp::List`).
    User {
        user: UserAnswer,
    },
    /// `CertIdentityCreate`.
    Done,
    /// `TokenRevoke`: whether the token existed.
    Revoked {
        found: bool,
    },
    /// `AuditReconcileHeld`: the operations reconciled.
    Reconciled {
        operations: Vec<String>,
    },
    /// `AuditVerify`: the chain holds (`audit::Verified`, which is not
    /// `Deserialize`, as JSON).
    AuditVerify {
        result: serde_json::Value,
    },
    /// `AuditExport`: one event.
    AuditEvent {
        event: Box<Event>,
    },
    /// `AuditExport`: the last line, how many events came before it.
    AuditCount {
        count: u64,
    },
    /// `Status`: the status document (`status --json`).
    Status {
        status: serde_json::Value,
    },
    /// `Reload`: applied or refused (`report.ok`).
    Reload {
        report: ReloadReport,
    },
    /// `CertRenew`: the certificate now served.
    Certificate {
        info: CertInfo,
    },
    /// `Backup`: the copy's directory (in the state directory) and manifest.
    Backup {
        dir: PathBuf,
        manifest: Manifest,
    },
    /// `LeaseEgress`: the lease's destinations now.
    LeaseEgress {
        lease_ref: String,
        destinations: Vec<String>,
    },
    /// `RecordingList` and `RecordingHold`: recordings as stored.
    Recordings {
        recordings: Vec<crate::store::recordings::Recording>,
    },
}

impl Response {
    pub fn error(message: impl std::fmt::Display) -> Self {
        Self::Error {
            message: message.to_string(),
        }
    }
}

/// The running service's answers to the requests about itself.
pub trait Service: Send + Sync {
    /// Answer `Status`, `Reload`, `CertRenew` or `Backup`.
    fn handle(
        &self,
        req: Request,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send + '_>>;

    /// The audit journal the identity requests are recorded in (none: not
    /// recorded).
    fn journal(&self) -> Option<crate::audit::Journal> {
        None
    }
}

/// A token as listed: everything but the hash.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenInfo {
    pub id: String,
    pub principal: Principal,
    pub created_at: String,
    pub revoked_at: Option<String>,
    pub description: Option<String>,
    /// Set for a client-certificate identity: the certificate's SHA-256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_sha256: Option<String>,
}

impl From<TokenRecord> for TokenInfo {
    fn from(r: TokenRecord) -> Self {
        Self {
            id: r.id,
            principal: r.principal,
            created_at: r.created_at,
            revoked_at: r.revoked_at,
            description: r.description,
            cert_sha256: r.cert_sha256,
        }
    }
}

// ------------------------------------- what the service answers about itself

/// What one reload did.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReloadReport {
    /// False when the reload was refused: nothing changed.
    pub ok: bool,
    pub at: String,
    pub error: Option<String>,
    /// What was applied (`certificate`, reloadable keys that changed).
    pub applied: Vec<String>,
    /// Keys whose new value waits for a restart.
    pub restart_required: Vec<String>,
    /// Whether a new server certificate was issued.
    pub reissued: bool,
    pub certificate: Option<CertInfo>,
}

/// What the store holds, in one read transaction.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoreSummary {
    pub schema_version: u64,
    pub instance_id: String,
    /// Sequence number of the last audit event (events are numbered from 1
    /// without gaps; `audit verify` checks it).
    pub audit_last_seq: u64,
    pub pending_intents: u64,
    /// Of the pending intents, those held on purpose: an operation sent
    /// with no answer (an MCP call past its timeout), its lease blocked
    /// until an operator reconciles it (`Lease::held_by`).
    #[serde(default)]
    pub held_operations: u64,
    /// Leases by state (`running`, `paused`, …).
    pub leases: BTreeMap<String, u64>,
    pub active_leases: u64,
    pub tokens_active: u64,
    pub tokens_revoked: u64,
    /// Outcomes recorded `uncertain` (an effect that may or may not have
    /// happened: a timeout, an intent a crash left): for review.
    #[serde(default)]
    pub uncertain_outcomes: u64,
}

/// What a backup holds, written as `MANIFEST.json` in it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    pub format: u32,
    pub version: String,
    pub created_at: String,
    pub summary: StoreSummary,
    /// `audit verify` on the copy.
    pub audit_events: u64,
    pub audit_head: String,
    pub state_redb_bytes: u64,
    pub state_redb_sha256: String,
}

// ------------------------------------------------------------- the codec

/// The codec, both ways: a request or an answer as one JSON line.
pub fn encode(v: &impl Serialize) -> Vec<u8> {
    let mut b = serde_json::to_vec(v)
        .or_else(|e| serde_json::to_vec(&Response::error(format!("cannot encode: {e}"))))
        .unwrap_or_default();
    b.push(b'\n');
    b
}

/// The codec, both ways: one line back into a request or an answer.
pub fn decode<T: DeserializeOwned>(line: &str) -> Result<T, serde_json::Error> {
    serde_json::from_str(line)
}

// ------------------------------------------------------------ the two ends

/// Serve the socket until the task is dropped.
pub async fn serve(
    path: &Path,
    store: Store,
    authn: Authenticator,
    ops: std::sync::Arc<dyn Service>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let _ = std::fs::remove_file(path);
    let l = tokio::net::UnixListener::bind(path)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                // EMFILE and friends: back off instead of spinning.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let store = store.clone();
            let authn = authn.clone();
            let ops = ops.clone();
            tokio::spawn(async move {
                let (r, mut w) = s.into_split();
                let mut line = String::new();
                if BufReader::new(r).read_line(&mut line).await.is_err() {
                    return;
                }
                let out = match decode::<Request>(&line) {
                    Ok(
                        req @ (Request::Status
                        | Request::Reload
                        | Request::CertRenew
                        | Request::Backup
                        | Request::LeaseEgress { .. }
                        | Request::RecordingList { .. }
                        | Request::RecordingHold { .. }),
                    ) => ops.handle(req).await,
                    Ok(Request::AuditExport { since }) => {
                        return export(&store, since, &mut w).await;
                    }
                    Ok(req) => {
                        let journal = ops.journal();
                        identity(req, &store, &authn, journal.as_ref(), Actor::Operator)
                            .await
                            .unwrap_or_else(Response::error)
                    }
                    Err(e) => Response::error(format!("bad request: {e}")),
                };
                let _ = w.write_all(&encode(&out)).await;
            });
        }
    }))
}

/// Who asks for an identity operation: the audit event names them.
#[derive(Clone, Copy)]
pub enum Actor<'a> {
    /// The admin socket: the local operator (`cube-adapter token …`,
    /// `cube-adapter user …` on the appliance's host).
    Operator,
    /// A person signed in to the console (an admin), in a session (the
    /// session's store key).
    Console {
        principal: &'a Principal,
        session_key: &'a str,
    },
}

/// What an identity request changes, for its audit event: the action, the
/// affected identity (a token or certificate id, a user's name) and its
/// tenant when known.
fn what(req: &Request) -> Option<(Action, Option<String>, Option<String>)> {
    use crate::auth::users::UserOp;
    Some(match req {
        Request::TokenCreate { principal, .. } => {
            (Action::TokenCreate, None, Some(principal.tenant.clone()))
        }
        Request::TokenRevoke { id } => (
            Action::TokenRevoke,
            Some(auth::token_id(id).to_string()),
            None,
        ),
        Request::CertIdentityCreate { record } => (
            Action::CertIdentityCreate,
            Some(record.id.clone()),
            Some(record.principal.tenant.clone()),
        ),
        Request::User { op } => match op {
            UserOp::Add { principal, .. } => (
                Action::UserAdd,
                Some(principal.subject.clone()),
                Some(principal.tenant.clone()),
            ),
            UserOp::Passwd { name, .. } => (Action::UserPasswd, Some(name.clone()), None),
            UserOp::SetDisabled { name, disabled } => (
                if *disabled {
                    Action::UserDisable
                } else {
                    Action::UserEnable
                },
                Some(name.clone()),
                None,
            ),
            UserOp::Remove { name } => (Action::UserRemove, Some(name.clone()), None),
            UserOp::List => return None,
        },
        _ => return None,
    })
}

/// The audit event of an identity change: `action`, the actor's identity
/// digest (the operator's, or the console person's with their session),
/// the affected identity (`note_digest`) and its tenant, as digests. Never
/// a token, a password or its hash. Its outcome is set where it is
/// appended: in the change's own transaction (`auth::append_audit`), or
/// by [`identity`] for a change refused before any.
pub(crate) fn identity_event(
    j: &crate::audit::Journal,
    actor: Actor<'_>,
    action: Action,
    target: Option<&str>,
    tenant: Option<&str>,
) -> Event {
    let mut ev = j.event(action);
    match actor {
        Actor::Operator => {
            ev.identity_digest = Some(j.digest("identity", b"local\0admin-socket"));
        }
        Actor::Console {
            principal,
            session_key,
        } => {
            ev.identity_digest = Some(j.digest("identity", principal.identity_key().as_bytes()));
            ev.session_digest = Some(j.digest("console_session", session_key.as_bytes()));
        }
    }
    ev.tenant_digest = tenant.map(|t| j.digest("tenant", t.as_bytes()));
    ev.note_digest = target.map(|t| j.digest("identity_target", t.as_bytes()));
    ev
}

/// Codes of refusals found inside a change's transaction: their event is
/// in that transaction already.
const REFUSED_IN_TXN: &[&str] = &["user_exists", "user_not_found", "identity_exists"];

/// Answer a request about identities or the journal, and record what it
/// changes in `journal` (as `actor`), in the same transaction as the
/// change. The one path of the admin socket (the CLI) and the console: the
/// same records, validation, codes and audit events (`token_create`,
/// `token_revoke`, `cert_identity_create`, `user_add`, `user_passwd`,
/// `user_disable`, `user_enable`, `user_remove`).
pub async fn identity(
    req: Request,
    store: &Store,
    authn: &Authenticator,
    journal: Option<&crate::audit::Journal>,
    actor: Actor<'_>,
) -> Result<Response, OpError> {
    let what = what(&req);
    // A token's id is made with it: its event is completed there.
    let ev = match (journal, what) {
        (Some(j), Some((action, target, tenant))) => Some(identity_event(
            j,
            actor,
            action,
            target.as_deref(),
            tenant.as_deref(),
        )),
        _ => None,
    };
    let r = answer(req, store, authn, ev.clone(), journal).await;
    // Refused before the change's transaction (a bad hash or name, the
    // store failing): recorded on its own.
    if let (Err(e), Some(j), Some(mut ev)) = (&r, journal, ev)
        && !REFUSED_IN_TXN.contains(&e.code)
    {
        ev.outcome = Outcome::Rejected;
        ev.error_code = Some(e.code.to_string());
        if let Err(err) = j.record(ev).await {
            tracing::warn!(error = %err, "a refused identity change was not audited");
        }
    }
    r
}

/// The one answer to a request about identities or the journal; `ev`, a
/// change's audit event, is appended in the change's transaction.
async fn answer(
    req: Request,
    store: &Store,
    authn: &Authenticator,
    ev: auth::AuditEvent,
    journal: Option<&crate::audit::Journal>,
) -> Result<Response, OpError> {
    Ok(match req {
        Request::Status
        | Request::Reload
        | Request::CertRenew
        | Request::Backup
        | Request::LeaseEgress { .. }
        | Request::RecordingList { .. }
        | Request::RecordingHold { .. }
        | Request::AuditExport { .. } => {
            return Err(OpError::new(
                "invalid_request",
                "this request has no single answer from the identity handler",
            ));
        }
        Request::TokenCreate {
            principal,
            description,
        } => {
            let (token, rec) = auth::new_token(principal, description, authn.clock());
            let ev = match (ev, journal) {
                (Some(mut ev), Some(j)) => {
                    ev.note_digest = Some(j.digest("identity_target", rec.id().as_bytes()));
                    Some(ev)
                }
                (ev, _) => ev,
            };
            auth::store_token_audited(store, rec, ev)
                .await
                .map_err(OpError::failed)?;
            Response::Token { token }
        }
        Request::TokenList => Response::Tokens {
            tokens: auth::list_tokens(store)
                .map_err(OpError::failed)?
                .into_iter()
                .map(TokenInfo::from)
                .collect(),
        },
        Request::User { op } => {
            let user = auth::users::user_op_audited(store, op, authn.clock(), ev).await;
            // A changed password, a disabled or removed user: at once.
            authn.clear_cache();
            Response::User { user: user? }
        }
        Request::CertIdentityCreate { record } => {
            auth::store_cert_identity_audited(store, record, ev).await?;
            Response::Done
        }
        Request::TokenRevoke { id } => {
            let found = auth::revoke_token_audited(store, &id, authn.clock(), ev)
                .await
                .map_err(OpError::failed)?;
            authn.clear_cache();
            Response::Revoked { found }
        }
        Request::AuditReconcileHeld { operation, note } => {
            let Some(j) = journal else {
                return Err(OpError::new("audit_unavailable", "the journal is not open"));
            };
            let held = crate::audit::held(store).map_err(OpError::failed)?;
            if !held.contains(&operation) {
                return Err(OpError::new(
                    "invalid_request",
                    format!(
                        "no lease is held by operation {operation}: while the service runs only held operations (an MCP call with no answer) are reconciled; stop the service for the others"
                    ),
                ));
            }
            let operations = crate::audit::reconcile(j, Some(&operation), &note)
                .await
                .map_err(OpError::failed)?;
            Response::Reconciled { operations }
        }
        // Whole-journal reads run on the blocking pool.
        Request::AuditVerify => {
            let store = store.clone();
            let v = tokio::task::spawn_blocking(move || crate::audit::verify(&store))
                .await
                .map_err(OpError::failed)?
                .map_err(OpError::failed)?;
            Response::AuditVerify {
                result: serde_json::to_value(v).map_err(OpError::failed)?,
            }
        }
    })
}

/// Events an export reads in one read transaction and sends as one chunk
/// of answer lines (a few hundred KiB).
const EXPORT_BATCH: usize = 1024;
/// Chunks read ahead of the socket. With the one being read and the one
/// being written, an export never holds more than `EXPORT_AHEAD + 2`
/// chunks, however long the journal and however slow the reader.
const EXPORT_AHEAD: usize = 2;

/// `AuditExport`: every event from `since` up to the last one at the
/// start, then their count, written as they are read. One task of the
/// blocking pool reads the journal in batches, each in its own read
/// transaction (events never change once written, so batches by sequence
/// number up to a last one fixed first make one consistent export), and
/// sends them through a bounded channel to the writer: a slow reader holds
/// the export back instead of buffering it, and one that goes away stops
/// it. (One thread for the whole export also keeps its allocations in one
/// allocator arena.)
async fn export(store: &Store, since: u64, w: &mut (impl tokio::io::AsyncWrite + Unpin)) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(EXPORT_AHEAD);
    let store = store.clone();
    let reading = tokio::task::spawn_blocking(move || {
        if let Err(e) = read_export(&store, since, &tx) {
            // The stream ends with the error in place of the count.
            let _ = tx.blocking_send(encode(&Response::error(e)));
        }
    });
    while let Some(chunk) = rx.recv().await {
        if w.write_all(&chunk).await.is_err() {
            break;
        }
    }
    // A reader gone: the next send fails, which ends the reading side.
    drop(rx);
    let _ = reading.await;
    let _ = w.flush().await;
    // Its batches are freed now: hand their pages back (on the blocking
    // pool: trimming walks every arena).
    let _ = tokio::task::spawn_blocking(crate::embedded::sys::release_free_memory).await;
}

/// The reading side of [`export`] (on the blocking pool): chunks of
/// encoded `AuditEvent` lines, then the `AuditCount` line. `Ok` too when
/// the writer went away.
fn read_export(
    store: &Store,
    since: u64,
    tx: &tokio::sync::mpsc::Sender<Vec<u8>>,
) -> Result<(), crate::store::StoreError> {
    let to = store.read_now(crate::audit::last_seq)?;
    let mut from = since;
    let mut count = 0u64;
    let all = crate::audit::search::Query::default();
    loop {
        let mut chunk = Vec::with_capacity(EXPORT_BATCH * 512);
        let next = store.read_now(|txn| {
            crate::audit::search::forward(txn, &all, from, to, EXPORT_BATCH, |ev| {
                let line = Response::AuditEvent {
                    event: Box::new(ev),
                };
                serde_json::to_writer(&mut chunk, &line)
                    .map_err(|e| crate::store::StoreError::Corrupt(e.to_string()))?;
                chunk.push(b'\n');
                count += 1;
                Ok(())
            })
        })?;
        if !chunk.is_empty() && tx.blocking_send(chunk).is_err() {
            return Ok(());
        }
        match next {
            Some(n) => from = n,
            None => break,
        }
    }
    let _ = tx.blocking_send(encode(&Response::AuditCount { count }));
    Ok(())
}

/// Send one request to a running service and hand `each` its answers one
/// by one, as they arrive (an export is never held whole); the first error
/// `each` returns stops the call.
pub fn call_each(
    path: &Path,
    req: &Request,
    mut each: impl FnMut(Response) -> Result<(), String>,
) -> Result<(), String> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("cannot reach the service at {}: {e}", path.display()))?;
    s.write_all(&encode(req)).map_err(|e| e.to_string())?;
    let mut r = std::io::BufReader::new(s);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Ok(());
        }
        each(decode(&line).map_err(|e| format!("bad answer from the service: {e}"))?)?;
    }
}

/// Send one request to a running service; its answers (all of them: for
/// requests with one answer; an export goes through [`call_each`]).
pub fn call(path: &Path, req: &Request) -> Result<Vec<Response>, String> {
    let mut out = vec![];
    call_each(path, req, |r| {
        out.push(r);
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_tagged_lines_that_read_back() {
        let b = encode(&Response::Revoked { found: true });
        assert_eq!(b, b"{\"answer\":\"revoked\",\"found\":true}\n");
        let line = std::str::from_utf8(&b).unwrap();
        assert!(matches!(
            decode(line.trim_end()),
            Ok(Response::Revoked { found: true })
        ));
        assert!(matches!(
            decode(&String::from_utf8(encode(&Response::Done)).unwrap()),
            Ok(Response::Done)
        ));
        let e = Response::error("no such token");
        assert!(matches!(
            decode(std::str::from_utf8(&encode(&e)).unwrap()),
            Ok(Response::Error { message }) if message == "no such token"
        ));
        let r: Request = decode(std::str::from_utf8(&encode(&Request::Status)).unwrap()).unwrap();
        assert!(matches!(r, Request::Status));
    }

    async fn journal_of(n: u64) -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store
            .write(move |txn, chain| {
                for i in 0..n {
                    chain.append(
                        txn,
                        Event {
                            request_id: Some(format!("a{i}")),
                            ..Default::default()
                        },
                    )?;
                }
                Ok(())
            })
            .await
            .unwrap();
        (dir, store)
    }

    /// The export through a pipe far smaller than one batch: every event,
    /// in order, from `since` on, then the count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn export_streams_every_event_in_order_then_the_count() {
        use tokio::io::AsyncReadExt;
        let n = 3 * EXPORT_BATCH as u64 + 17;
        let (_dir, store) = journal_of(n).await;
        for since in [0, 1, 2, EXPORT_BATCH as u64 + 1, n, n + 1] {
            let (mut w, mut r) = tokio::io::duplex(1024);
            let st = store.clone();
            let server = tokio::spawn(async move { export(&st, since, &mut w).await });
            let mut text = String::new();
            r.read_to_string(&mut text).await.unwrap();
            server.await.unwrap();
            let lines: Vec<Response> = text.lines().map(|l| decode(l).unwrap()).collect();
            let first = since.max(1);
            let want = (n + 1).saturating_sub(first);
            assert_eq!(lines.len() as u64, want + 1, "since {since}");
            for (k, line) in lines.iter().enumerate() {
                let k = k as u64;
                match line {
                    Response::AuditEvent { event } if k < want => {
                        assert_eq!(event.seq, first + k);
                        assert_eq!(event.request_id, Some(format!("a{}", first + k - 1)));
                    }
                    Response::AuditCount { count } if k == want => assert_eq!(*count, want),
                    _ => panic!("line {k} of the export from {since}"),
                }
            }
        }
    }

    /// A reader that goes away part way ends the export (the service is not
    /// left reading the journal into a buffer nobody takes).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_export_whose_reader_goes_away_stops() {
        use tokio::io::AsyncBufReadExt;
        let (_dir, store) = journal_of(4 * EXPORT_BATCH as u64).await;
        let (mut w, r) = tokio::io::duplex(1024);
        let st = store.clone();
        let server = tokio::spawn(async move { export(&st, 1, &mut w).await });
        let mut r = tokio::io::BufReader::new(r);
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        assert!(matches!(decode(&line), Ok(Response::AuditEvent { .. })));
        drop(r);
        tokio::time::timeout(std::time::Duration::from_secs(30), server)
            .await
            .expect("the export stops when its reader goes away")
            .unwrap();
    }

    /// A journal that cannot be read: the export is one `Error` line.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_export_that_cannot_read_ends_with_an_error() {
        use tokio::io::AsyncReadExt;
        let (_dir, store) = journal_of(3).await;
        store.close().await;
        let (mut w, mut r) = tokio::io::duplex(1024);
        let server = tokio::spawn(async move { export(&store, 1, &mut w).await });
        let mut text = String::new();
        r.read_to_string(&mut text).await.unwrap();
        server.await.unwrap();
        let lines: Vec<Response> = text.lines().map(|l| decode(l).unwrap()).collect();
        assert!(
            matches!(lines.as_slice(), [Response::Error { .. }]),
            "{text}"
        );
    }
}
