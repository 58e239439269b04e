//! The local admin socket (`STATE/admin.sock`, 0600): while `serve` holds
//! the store, operator commands reach it here. One protocol: one JSON
//! [`Request`] per connection (tagged by `cmd`), JSON lines back. Requests
//! about identities and the journal are answered here; those about the
//! service itself (status, reload, certificate, backup) by the [`Service`]
//! that `serve` hands in (`ops::Service`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::auth::{self, Authenticator, Principal, TokenRecord};
use crate::store::Store;

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

/// The running service's answers to the requests about itself.
pub trait Service: Send + Sync {
    /// Answer `Status`, `Reload`, `CertRenew` or `Backup`.
    fn handle(
        &self,
        req: Request,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<serde_json::Value>> + Send + '_>>;
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
                let out = match serde_json::from_str::<Request>(&line) {
                    Ok(
                        req @ (Request::Status
                        | Request::Reload
                        | Request::CertRenew
                        | Request::Backup),
                    ) => ops.handle(req).await,
                    Ok(req) => handle(req, &store, &authn).await,
                    Err(e) => {
                        vec![serde_json::json!({"ok": false, "error": format!("bad request: {e}")})]
                    }
                };
                for v in out {
                    let mut b = serde_json::to_vec(&v).unwrap_or_default();
                    b.push(b'\n');
                    if w.write_all(&b).await.is_err() {
                        return;
                    }
                }
            });
        }
    }))
}

async fn handle(req: Request, store: &Store, authn: &Authenticator) -> Vec<serde_json::Value> {
    use serde_json::json;
    let err = |e: String| vec![json!({"ok": false, "error": e})];
    match req {
        Request::Status | Request::Reload | Request::CertRenew | Request::Backup => {
            err("a request about the service reached the identity handler".into())
        }
        Request::TokenCreate {
            principal,
            description,
        } => match auth::new_token(principal, description, authn.clock()) {
            Ok((token, rec)) => match auth::store_token(store, rec).await {
                Ok(()) => vec![json!({"ok": true, "token": token})],
                Err(e) => err(e.to_string()),
            },
            Err(e) => err(e),
        },
        Request::TokenList => match auth::list_tokens(store) {
            Ok(v) => vec![
                json!({"ok": true, "tokens": v.into_iter().map(TokenInfo::from).collect::<Vec<_>>()}),
            ],
            Err(e) => err(e.to_string()),
        },
        Request::User { op } => match crate::auth::users::user_op(store, op, authn.clock()).await {
            Ok(v) => {
                // A changed password, a disabled or removed user: at once.
                authn.clear_cache();
                let mut m = json!({"ok": true});
                if let (Some(m), serde_json::Value::Object(v)) = (m.as_object_mut(), v) {
                    m.extend(v);
                }
                vec![m]
            }
            Err(e) => err(e),
        },
        Request::CertIdentityCreate { record } => {
            match auth::store_cert_identity(store, record).await {
                Ok(()) => vec![json!({"ok": true})],
                Err(e) => err(e),
            }
        }
        Request::TokenRevoke { id } => match auth::revoke_token(store, &id, authn.clock()).await {
            Ok(found) => {
                authn.clear_cache();
                vec![json!({"ok": true, "revoked": found})]
            }
            Err(e) => err(e.to_string()),
        },
        // Whole-journal reads run on the blocking pool.
        Request::AuditVerify => {
            let store = store.clone();
            match tokio::task::spawn_blocking(move || crate::audit::verify(&store)).await {
                Ok(Ok(v)) => vec![json!({"ok": true, "result": v})],
                Ok(Err(e)) => err(e),
                Err(e) => err(e.to_string()),
            }
        }
        Request::AuditExport { since } => {
            let store = store.clone();
            let r = tokio::task::spawn_blocking(move || {
                let mut out = vec![];
                crate::audit::export(&store, since, |e| {
                    out.push(json!({"event": e}));
                    Ok(())
                })
                .map(|n| {
                    out.push(json!({"ok": true, "count": n}));
                    out
                })
            })
            .await;
            match r {
                Ok(Ok(out)) => out,
                Ok(Err(e)) => err(e),
                Err(e) => err(e.to_string()),
            }
        }
    }
}

/// Send one request to a running service.
pub fn call(path: &Path, req: &impl Serialize) -> Result<Vec<serde_json::Value>, String> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("cannot reach the service at {}: {e}", path.display()))?;
    let mut b = serde_json::to_vec(req).map_err(|e| e.to_string())?;
    b.push(b'\n');
    s.write_all(&b).map_err(|e| e.to_string())?;
    let mut out = vec![];
    for line in std::io::BufReader::new(s).lines() {
        let line = line.map_err(|e| e.to_string())?;
        out.push(
            serde_json::from_str(&line).map_err(|e| format!("bad answer from the service: {e}"))?,
        );
    }
    Ok(out)
}
