//! Start-up, phase 2: who the appliance is (its CAs and served
//! certificate) and who may call it (client certificates, tokens, users,
//! OIDC).

use std::net::SocketAddr;
use std::sync::Arc;

use super::EnvSecrets;
use super::state::Opened;
use crate::auth::{Authenticator, Principal, Role};
use crate::config::Config;
use crate::tls::{LocalCa, SwappableCert};

/// The appliance's TLS: its own CA, the served certificate (swapped in
/// place on reload), the server configuration and the judge of client
/// certificates.
pub(super) struct Tls {
    pub ca: Arc<LocalCa>,
    /// The names the served certificate covers.
    pub names: Vec<String>,
    pub served: Arc<SwappableCert>,
    pub server: rustls::ServerConfig,
    pub judge: crate::server::PeerJudge,
}

/// The appliance's own CA (keys sealed under the store key), a server
/// certificate for `addr` and `[server_names]`, and the client
/// certificates that may stand for an identity: the identity CA's and the
/// company CA's (`[auth.client_ca]`). A certificate neither issued does not
/// fail the handshake (its bearer token may still count): it stands for
/// nothing.
pub(super) fn tls(cfg: &Config, o: &Opened, addr: SocketAddr) -> anyhow::Result<Tls> {
    let clock = &cfg.clock;
    let sealer = Some(o.store.sealer.clone());
    let ca = Arc::new(LocalCa::load_or_create_clocked(
        &o.state.join("tls"),
        sealer.clone(),
        clock.clone(),
    )?);
    let names = crate::tls::server_names(&cfg.server_names, addr);
    // Reissued when it no longer covers the names or expires soon.
    let (spem, skey, _) = ca.server_leaf("server", &names, clock.unix())?;
    let served = Arc::new(SwappableCert::new(crate::tls::certified_key(
        &spem,
        skey.as_bytes(),
    )?));
    // A CA of its own: the internal mTLS to the embedded backend trusts
    // only the main CA.
    let identity_ca = LocalCa::load_or_create_clocked(
        &o.state.join(crate::tls::IDENTITY_CA_DIR),
        sealer,
        clock.clone(),
    )?;
    let company = match &cfg.auth.client_ca {
        Some(c) => {
            let pem = std::fs::read(&c.ca_file).map_err(|e| {
                anyhow::anyhow!("auth.client_ca: ca_file {}: {e}", c.ca_file.display())
            })?;
            // As a message: its text already says its source, which
            // `{:#}` would print again.
            let map = crate::auth::client_ca::CompanyCa::new(c).map_err(anyhow::Error::msg)?;
            Some((pem, Arc::new(map)))
        }
        None => None,
    };
    let trust = Arc::new(crate::tls::ClientTrust::new(
        identity_ca.cert_pem.as_bytes(),
        company.as_ref().map(|(pem, _)| pem.as_slice()),
    )?);
    let server = crate::tls::server_config_trusting(served.clone(), trust.clone())?;
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
    Ok(Tls {
        ca,
        names,
        served,
        server,
        judge,
    })
}

/// Who may call: the authenticator and what comes with it.
pub(super) struct Callers {
    pub authn: Authenticator,
    /// Sign-in blocks, to be audited (`delivery`).
    pub blocks: tokio::sync::mpsc::Receiver<crate::auth::throttle::Blocked>,
    pub console_oidc: Option<Arc<crate::auth::oidc::CodeFlow>>,
    /// The first start's admin token file.
    pub admin_token_file: Option<std::path::PathBuf>,
}

/// The first start's admin token, the fixed principals (the shared token,
/// the reference principals file), stored tokens and users, OIDC.
pub(super) async fn callers(
    cfg: &Config,
    o: &Opened,
    secrets: &EnvSecrets,
) -> anyhow::Result<Callers> {
    let admin_token_file =
        super::state::bootstrap_admin(&o.store, &o.state.join("admin.token"), &cfg.clock).await?;
    let mut shared = vec![];
    if let Some(t) = &secrets.shared_token {
        anyhow::ensure!(
            t.expose().len() >= 24,
            "CUBE_ADAPTER_TOKEN must be at least 24 characters"
        );
        shared.push((
            t.expose().to_string(),
            Principal::unrestricted("default", "shared-bearer", Role::Agent),
        ));
    }
    // As a message: it names its cause already (no chain to repeat it).
    let file = crate::ops::tokens_file_principals(cfg).map_err(anyhow::Error::msg)?;
    // Sign-in blocks (repeated failures) are audited, one event per block.
    let (block_tx, blocks) = tokio::sync::mpsc::channel(256);
    let mut authn = Authenticator::new(o.store.clone(), shared, file, cfg.hashing_slots)
        .with_clock(cfg.clock.clone())
        .with_block_reports(block_tx);
    if !cfg.console.local_users {
        authn = authn.without_local_users();
    }
    if !cfg.auth.oidc.is_empty() {
        let v = Arc::new(
            // As a message: its text already says its source.
            crate::auth::oidc::Verifier::new(&cfg.auth.oidc).map_err(anyhow::Error::msg)?,
        );
        v.prefetch();
        authn = authn.with_oidc(v);
    }
    let console_oidc = match &cfg.console.oidc {
        Some(o) => Some(Arc::new(
            crate::auth::oidc::CodeFlow::new(o).map_err(anyhow::Error::msg)?,
        )),
        None => None,
    };
    Ok(Callers {
        authn,
        blocks,
        console_oidc,
        admin_token_file,
    })
}
