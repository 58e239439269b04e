//! Client certificates from the company's CA (`[auth.client_ca]`): a
//! certificate the CA issued (verified after the handshake by
//! `tls::ClientTrust`) stands for the identity its subject (CN, a URI SAN
//! or an e-mail SAN, by config) is listed under, unless its fingerprint is
//! revoked. Beside it, the identity CA's certificates keep working
//! (`token create --client-cert`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use super::settings::{ClientCaIdentity, ClientCaSection};
use super::{OpError, Principal, TokenSpec};

/// The principal an identity entry stands for, or why it is not one.
pub fn principal(i: &ClientCaIdentity) -> Result<Principal, OpError> {
    TokenSpec {
        tenant: i.tenant.clone(),
        subject: Some(i.subject.clone()),
        roles: i.roles.clone(),
        runtimes: i.runtimes.clone(),
        profiles: i.profiles.clone(),
        actions: i.actions.clone(),
        no_actions: false,
        task_templates: i.task_templates.clone(),
    }
    .principal()
}

/// `[auth.client_ca]`, ready to map certificates.
#[derive(Debug)]
pub struct CompanyCa {
    subject: String,
    revoked: HashSet<String>,
    identities: HashMap<String, Arc<Principal>>,
}

/// An `[auth.client_ca]` identity that does not make a principal, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("auth.client_ca: {subject}: {source}")]
pub struct ClientCaError {
    pub subject: String,
    #[source]
    pub source: OpError,
}

impl CompanyCa {
    pub fn new(cfg: &ClientCaSection) -> Result<Self, ClientCaError> {
        let mut identities = HashMap::new();
        for i in &cfg.identities {
            let p = principal(i).map_err(|source| ClientCaError {
                subject: i.subject.clone(),
                source,
            })?;
            identities.insert(i.subject.clone(), Arc::new(p));
        }
        Ok(Self {
            subject: cfg.subject.clone(),
            revoked: cfg.revoked.iter().map(|r| r.to_ascii_lowercase()).collect(),
            identities,
        })
    }

    /// The identity a verified certificate of the company's CA stands for:
    /// the first of its subject's names (as configured) that is listed;
    /// none when its fingerprint (`sha256`, hex) is revoked.
    pub fn identity(&self, der: &[u8], sha256: &str) -> Option<Arc<Principal>> {
        if self.revoked.contains(sha256) {
            tracing::info!(fingerprint = %sha256, "a revoked client certificate was presented");
            return None;
        }
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let names: Vec<String> = match self.subject.as_str() {
            "cn" => cert
                .subject()
                .iter_common_name()
                .filter_map(|cn| cn.as_str().ok().map(str::to_string))
                .collect(),
            kind => cert
                .subject_alternative_name()
                .ok()
                .flatten()
                .map(|san| {
                    san.value
                        .general_names
                        .iter()
                        .filter_map(|n| match (kind, n) {
                            ("san_uri", GeneralName::URI(u)) => Some(u.to_string()),
                            ("san_email", GeneralName::RFC822Name(e)) => Some(e.to_string()),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default(),
        };
        names.iter().find_map(|n| self.identities.get(n).cloned())
    }
}
