//! `token create|list|revoke`: bearer tokens, and client certificates that
//! stand for an identity like a token (`token create --client-cert DIR`).
//! Through the running service's admin socket, or the store when stopped.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::common::{Access, Common, access, ask, runtime, unexpected};
use super::{EXIT_CODES, Exit};
use crate::admin::{Request, Response, TokenInfo};
use crate::auth::{self, Principal};

#[derive(Subcommand)]
pub enum TokenCommand {
    /// Issue a bearer token; prints the token alone on stdout.
    ///
    /// The token is shown once (only a keyed hash of it is kept). Without
    /// --action, the roles give the scopes: an agent its lease, exec, file,
    /// job, PTY, checkpoint, MCP (mcp:*) and task-planning actions and reads; an approver
    /// task decisions (task:approve) and reads; an auditor reads only; an
    /// admin everything. Works while
    /// the service runs (through its admin socket) and while it is
    /// stopped. Exit 2 for an invalid tenant, role or runtime.
    #[command(after_help = EXIT_CODES)]
    Create(TokenCreateArgs),
    /// List tokens (ids and scopes, never secrets).
    #[command(after_help = EXIT_CODES)]
    List(TokenListArgs),
    /// Revoke a token by id (or by the token itself).
    ///
    /// Takes effect at once on a running service. Exit 1 when no token has
    /// that id.
    #[command(after_help = EXIT_CODES)]
    Revoke(TokenRevokeArgs),
}

#[derive(Args)]
pub struct TokenCreateArgs {
    #[command(flatten)]
    pub common: Common,
    /// Tenant the token acts for.
    #[arg(long)]
    pub tenant: String,
    /// Subject (who holds it); defaults to the tenant.
    #[arg(long)]
    pub subject: Option<String>,
    /// Allowed runtime (repeatable; default: any).
    #[arg(long = "runtime")]
    pub runtimes: Vec<String>,
    /// Allowed profile (repeatable; default: any).
    #[arg(long = "profile")]
    pub profiles: Vec<String>,
    /// Allowed action scope, e.g. exec:run, file:*, task:* (repeatable;
    /// default: the roles' scopes, see above).
    #[arg(long = "action")]
    pub actions: Vec<String>,
    /// Deny every action (an explicit empty scope list).
    #[arg(long, conflicts_with = "actions")]
    pub no_actions: bool,
    /// Role: agent, approver, auditor or admin (repeatable; default agent).
    #[arg(long = "role")]
    pub roles: Vec<String>,
    /// Task template this token may plan (repeatable; default: *).
    #[arg(long = "task-template")]
    pub task_templates: Vec<String>,
    /// Instead of a token, issue a client certificate for this identity
    /// from the appliance's CA into DIR (client.pem, client.key, ca.pem)
    /// and print its id. Callers present it over TLS (no token needed);
    /// `token revoke ID` ends it like a token.
    #[arg(long, value_name = "DIR")]
    pub client_cert: Option<PathBuf>,
    /// Free text kept with the token.
    #[arg(long)]
    pub description: Option<String>,
}

#[derive(Args)]
pub struct TokenListArgs {
    #[command(flatten)]
    pub common: Common,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct TokenRevokeArgs {
    #[command(flatten)]
    pub common: Common,
    pub id: String,
}

pub fn create(req: TokenCreateArgs) -> Exit {
    let spec = auth::TokenSpec {
        tenant: req.tenant,
        subject: req.subject,
        roles: req.roles,
        runtimes: req.runtimes,
        profiles: req.profiles,
        actions: req.actions,
        no_actions: req.no_actions,
        task_templates: req.task_templates,
    };
    let principal = match spec.principal() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::Usage;
        }
    };
    let state = match req.common.state_dir() {
        Ok(s) => s,
        Err(c) => return c,
    };
    if let Some(dir) = req.client_cert {
        return cert_identity_create(&state, &dir, principal, req.description);
    }
    let token = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match ask(
            &p,
            &Request::TokenCreate {
                principal,
                description: req.description,
            },
        ) {
            Ok(Response::Token { token }) => token,
            Ok(r) => return unexpected(r),
            Err(c) => return c,
        },
        Ok(Access::Store(store)) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            let r = rt.block_on(async {
                let (token, rec) =
                    auth::new_token(principal, req.description, &crate::clock::Clock::System);
                auth::store_token(&store, rec)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(token)
            });
            match r {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {e}");
                    return Exit::Store;
                }
            }
        }
    };
    if token.is_empty() {
        eprintln!("error: no token was issued");
        return Exit::Failed;
    }
    println!("{token}");
    Exit::Ok
}

pub fn list(args: TokenListArgs) -> Exit {
    let state = match args.common.state_dir() {
        Ok(s) => s,
        Err(c) => return c,
    };
    let tokens: Vec<TokenInfo> = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match ask(&p, &Request::TokenList) {
            Ok(Response::Tokens { tokens }) => tokens,
            Ok(r) => return unexpected(r),
            Err(c) => return c,
        },
        Ok(Access::Store(store)) => match auth::list_tokens(&store) {
            Ok(v) => v.into_iter().map(TokenInfo::from).collect(),
            Err(e) => {
                eprintln!("error: {e}");
                return Exit::Store;
            }
        },
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&tokens).unwrap_or_default()
        );
        return Exit::Ok;
    }
    println!(
        "{:<14} {:<16} {:<20} {:<24} {:<10} {:<20} SCOPES",
        "ID", "TENANT", "SUBJECT", "ROLES", "STATE", "CREATED"
    );
    for t in tokens {
        let roles: Vec<String> = t
            .principal
            .roles
            .iter()
            .map(|r| format!("{r:?}").to_lowercase())
            .collect();
        println!(
            "{:<14} {:<16} {:<20} {:<24} {:<10} {:<20} {}",
            t.id,
            t.principal.tenant,
            t.principal.subject,
            roles.join(","),
            if t.revoked_at.is_some() {
                "revoked"
            } else {
                "active"
            },
            t.created_at,
            t.principal.scopes_text(",")
        );
    }
    Exit::Ok
}

pub fn revoke(args: TokenRevokeArgs) -> Exit {
    let id = args.id.as_str();
    let state = match args.common.state_dir() {
        Ok(s) => s,
        Err(c) => return c,
    };
    let found = match access(&state) {
        Err(c) => return c,
        Ok(Access::Socket(p)) => match ask(&p, &Request::TokenRevoke { id: id.to_string() }) {
            Ok(Response::Revoked { found }) => found,
            Ok(r) => return unexpected(r),
            Err(c) => return c,
        },
        Ok(Access::Store(store)) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            match rt.block_on(auth::revoke_token(&store, id, &crate::clock::Clock::System)) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("error: {e}");
                    return Exit::Store;
                }
            }
        }
    };
    if found {
        println!("revoked");
        Exit::Ok
    } else {
        eprintln!("error: no token with id {id}");
        Exit::Failed
    }
}

/// `token create --client-cert DIR`: a client certificate from the
/// appliance's CA (common name: the subject) that stands for `principal`.
/// Writes `DIR/client.pem`, `DIR/client.key` (0600) and `DIR/ca.pem`;
/// prints the identity's id.
fn cert_identity_create(
    state: &Path,
    dir: &Path,
    principal: Principal,
    description: Option<String>,
) -> Exit {
    let files = ["client.pem", "client.key", "ca.pem"].map(|f| dir.join(f));
    if let Some(f) = files.iter().find(|f| f.exists()) {
        eprintln!(
            "error: {} exists already (nothing was changed)",
            f.display()
        );
        return Exit::Usage;
    }
    let access = match access(state) {
        Ok(a) => a,
        Err(c) => return c,
    };
    let issued = crate::store::Sealer::load_or_create(&state.join("secret.key"))
        .map_err(|e| e.to_string())
        .and_then(|sealer| {
            crate::tls::issue_identity_cert(
                state,
                sealer,
                crate::clock::Clock::System,
                &principal.subject,
            )
            .map_err(|e| e.to_string())
        });
    let bundle = match issued {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: cannot issue a client certificate: {e}");
            return Exit::State;
        }
    };
    let (ca, cert, key, fp) = (
        bundle.ca_pem,
        bundle.cert_pem,
        bundle.key_pem,
        auth::PeerCert::own(bundle.sha256),
    );
    let rec = auth::cert_record(principal, description, &fp, &crate::clock::Clock::System);
    let id = rec.id.clone();
    let stored = match access {
        Access::Socket(p) => match ask(&p, &Request::CertIdentityCreate { record: rec }) {
            Ok(Response::Done) => Ok(()),
            Ok(r) => Err(unexpected(r)),
            Err(c) => Err(c),
        },
        Access::Store(store) => {
            let rt = match runtime() {
                Ok(r) => r,
                Err(c) => return c,
            };
            rt.block_on(auth::store_cert_identity(&store, rec))
                .map_err(|e| {
                    eprintln!("error: {e}");
                    Exit::Store
                })
        }
    };
    if let Err(c) = stored {
        return c;
    }
    if let Err(e) = std::fs::create_dir_all(dir)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            crate::tls::write_private(&files[0], cert.as_bytes(), 0o644).map_err(|e| e.to_string())
        })
        .and_then(|()| {
            crate::tls::write_private(&files[1], key.as_bytes(), 0o600).map_err(|e| e.to_string())
        })
        .and_then(|()| {
            crate::tls::write_private(&files[2], ca.as_bytes(), 0o644).map_err(|e| e.to_string())
        })
    {
        eprintln!(
            "error: the identity {id} is registered but its files could not be written ({e}); revoke it: cube-adapter token revoke {id}"
        );
        return Exit::Failed;
    }
    eprintln!(
        "wrote {}, {} and {} (the appliance's CA)",
        files[0].display(),
        files[1].display(),
        files[2].display()
    );
    println!("{id}");
    Exit::Ok
}
