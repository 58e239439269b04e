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
use crate::auth::{self, Authenticator, Principal, TokenRecord};
use crate::store::Store;
use crate::store::event::Event;
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
    /// Health, backend, audit, leases, certificate, last reload.
    Status,
    /// As SIGHUP: re-read the configuration and the certificate.
    Reload,
    /// Issue a new server certificate now and serve it.
    CertRenew,
    /// A consistent copy of the store in `STATE/backup-…/state.redb`.
    Backup,
}

/// One answer line. Every request gets one answer, except `AuditExport`:
/// an `AuditEvent` per event, then `AuditCount`. A refused or failed
/// request gets one `Error` instead. (No `Debug`: `Token` holds a secret.)
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
    /// Leases by state (`running`, `paused`, …).
    pub leases: BTreeMap<String, u64>,
    pub active_leases: u64,
    pub tokens_active: u64,
    pub tokens_revoked: u64,
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
                        | Request::Backup),
                    ) => vec![ops.handle(req).await],
                    Ok(req) => handle(req, &store, &authn).await,
                    Err(e) => vec![Response::error(format!("bad request: {e}"))],
                };
                for r in out {
                    if w.write_all(&encode(&r)).await.is_err() {
                        return;
                    }
                }
            });
        }
    }))
}

async fn handle(req: Request, store: &Store, authn: &Authenticator) -> Vec<Response> {
    match req {
        Request::AuditExport { since } => export(store, since)
            .await
            .unwrap_or_else(|e| vec![Response::error(e)]),
        req => vec![
            answer(req, store, authn)
                .await
                .unwrap_or_else(Response::error),
        ],
    }
}

/// The one answer to a request about identities or the journal.
async fn answer(req: Request, store: &Store, authn: &Authenticator) -> Result<Response, String> {
    Ok(match req {
        Request::Status
        | Request::Reload
        | Request::CertRenew
        | Request::Backup
        | Request::AuditExport { .. } => {
            return Err("this request has no single answer from the identity handler".into());
        }
        Request::TokenCreate {
            principal,
            description,
        } => {
            let (token, rec) = auth::new_token(principal, description, authn.clock())?;
            auth::store_token(store, rec)
                .await
                .map_err(|e| e.to_string())?;
            Response::Token { token }
        }
        Request::TokenList => Response::Tokens {
            tokens: auth::list_tokens(store)
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(TokenInfo::from)
                .collect(),
        },
        Request::User { op } => {
            let user = auth::users::user_op(store, op, authn.clock()).await?;
            // A changed password, a disabled or removed user: at once.
            authn.clear_cache();
            Response::User { user }
        }
        Request::CertIdentityCreate { record } => {
            auth::store_cert_identity(store, record).await?;
            Response::Done
        }
        Request::TokenRevoke { id } => {
            let found = auth::revoke_token(store, &id, authn.clock())
                .await
                .map_err(|e| e.to_string())?;
            authn.clear_cache();
            Response::Revoked { found }
        }
        // Whole-journal reads run on the blocking pool.
        Request::AuditVerify => {
            let store = store.clone();
            let v = tokio::task::spawn_blocking(move || crate::audit::verify(&store))
                .await
                .map_err(|e| e.to_string())??;
            Response::AuditVerify {
                result: serde_json::to_value(v).map_err(|e| e.to_string())?,
            }
        }
    })
}

/// `AuditExport`: every event from `since` on, then their count.
async fn export(store: &Store, since: u64) -> Result<Vec<Response>, String> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || {
        let mut out = vec![];
        let count = crate::audit::export(&store, since, |e| {
            out.push(Response::AuditEvent {
                event: Box::new(e.clone()),
            });
            Ok(())
        })?;
        out.push(Response::AuditCount { count });
        Ok(out)
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Send one request to a running service; its answers.
pub fn call(path: &Path, req: &Request) -> Result<Vec<Response>, String> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("cannot reach the service at {}: {e}", path.display()))?;
    s.write_all(&encode(req)).map_err(|e| e.to_string())?;
    let mut out = vec![];
    for line in std::io::BufReader::new(s).lines() {
        let line = line.map_err(|e| e.to_string())?;
        out.push(decode(&line).map_err(|e| format!("bad answer from the service: {e}"))?);
    }
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
}
