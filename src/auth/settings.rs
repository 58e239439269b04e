//! The settings of identities from elsewhere, as the configuration holds
//! them (`[auth]`, `[console.oidc]`; re-exported by `config`): OIDC
//! issuers, the console's OIDC client, the company's client CA.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Client certificates from the company's CA (`[auth.client_ca]`;
/// `auth::client_ca`): a verified certificate's subject maps to an
/// identity listed here. A change needs a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClientCaSection {
    /// PEM CA certificates (roots) whose client certificates are trusted.
    pub ca_file: PathBuf,
    /// What names the holder: `cn` (the subject's common name), `san_uri`
    /// (a URI subject alternative name, e.g. SPIFFE) or `san_email`.
    #[serde(default = "client_ca_subject")]
    pub subject: String,
    /// SHA-256 fingerprints (hex) of certificates refused although valid.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revoked: Vec<String>,
    /// The identities certificates stand for, by subject.
    #[serde(default)]
    pub identities: Vec<ClientCaIdentity>,
}

fn client_ca_subject() -> String {
    "cn".into()
}

/// One identity of `[[auth.client_ca.identities]]`: as `token create`
/// takes them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClientCaIdentity {
    /// The certificate's subject, as `subject` picks it.
    pub subject: String,
    pub tenant: String,
    /// agent (default), approver, auditor, admin.
    #[serde(default)]
    pub roles: Vec<String>,
    /// Empty: any.
    #[serde(default)]
    pub runtimes: Vec<String>,
    /// Empty: any.
    #[serde(default)]
    pub profiles: Vec<String>,
    /// Empty: the roles' defaults.
    #[serde(default)]
    pub actions: Vec<String>,
    /// Empty: `*`.
    #[serde(default)]
    pub task_templates: Vec<String>,
}

impl ClientCaSection {
    pub(crate) fn validate(&self) -> Result<(), SettingsError> {
        let err = |e| Err(SettingsError::ClientCa(e));
        if !["cn", "san_uri", "san_email"].contains(&self.subject.as_str()) {
            return err(ClientCaError::Subject(self.subject.clone()));
        }
        for r in &self.revoked {
            if r.len() != 64 || !r.bytes().all(|b| b.is_ascii_hexdigit()) {
                return err(ClientCaError::Revoked(r.clone()));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for i in &self.identities {
            if !seen.insert(i.subject.as_str()) {
                return err(ClientCaError::Twice(i.subject.clone()));
            }
            if let Err(why) = super::client_ca::principal(i) {
                return err(ClientCaError::Identity {
                    subject: i.subject.clone(),
                    why,
                });
            }
        }
        Ok(())
    }
}

/// One trusted OIDC issuer (`[[auth.oidc]]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct OidcIssuer {
    /// The issuer exactly as its tokens' `iss` says (`https://…`, or
    /// `http://` to a loopback address only). Its keys are discovered at
    /// `<issuer>/.well-known/openid-configuration` unless `jwks_url` is
    /// given.
    pub issuer: String,
    /// The audience tokens must carry in `aud` (required).
    pub audience: String,
    /// The algorithms its tokens may be signed with: asymmetric only (RS256,
    /// RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA).
    #[serde(default = "oidc_algorithms")]
    pub algorithms: Vec<String>,
    /// Where its keys are, instead of discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwks_url: Option<String>,
    /// PEM CA certificates to trust for the issuer's URLs instead of the
    /// public web PKI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Clock skew allowed on `exp` and `nbf` (0..=300 s).
    #[serde(default = "oidc_leeway")]
    pub leeway_seconds: u64,
    /// Which claims hold what (`[auth.oidc.claims]`).
    #[serde(default)]
    pub claims: ClaimNames,
    /// The tenant of tokens without a tenant claim; with no `tenants`, the
    /// only tenant this issuer's tokens may act for (a token naming
    /// another is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The tenants this issuer's tokens may name (with `tenant`, if set).
    /// One of `tenant` and `tenants` is required: an issuer never chooses
    /// an arbitrary tenant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// The roles this issuer's tokens may carry (a ceiling, not a grant:
    /// the token still names its roles). A token naming a role outside it
    /// is refused. Default: `agent` only.
    #[serde(default = "oidc_allowed_roles")]
    pub allowed_roles: Vec<String>,
}

fn oidc_allowed_roles() -> Vec<String> {
    vec!["agent".into()]
}

fn oidc_algorithms() -> Vec<String> {
    vec!["RS256".into()]
}
pub(crate) fn oidc_leeway() -> u64 {
    60
}

/// The claims an OIDC token's principal is read from; the reference
/// adapter's names by default.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ClaimNames {
    /// The tenant (absent: the issuer's `tenant`, else the token is
    /// refused).
    pub tenant: String,
    /// Roles: agent (or runtime), approver, auditor, admin; absent: the
    /// token is refused. Other names in the claim are ignored.
    pub roles: String,
    /// Profiles it may use; absent or empty: all.
    pub profiles: String,
    /// Runtimes it may be; absent or empty: all.
    pub runtimes: String,
    /// Action scopes; absent or empty: none.
    pub actions: String,
    /// Task templates it may plan; absent or empty: none.
    pub task_templates: String,
}

impl Default for ClaimNames {
    fn default() -> Self {
        Self {
            tenant: "tenant_id".into(),
            roles: "roles".into(),
            profiles: "cube_profiles".into(),
            runtimes: "cube_runtimes".into(),
            actions: "cube_actions".into(),
            task_templates: "cube_task_templates".into(),
        }
    }
}

/// A URL the appliance fetches from: `https://`, or `http://` to a
/// loopback address only; with a host, without a user or fragment.
pub fn check_fetch_url(u: &str) -> Result<(), FetchUrlError> {
    let url = url::Url::parse(u).map_err(|source| FetchUrlError::NotUrl {
        url: u.to_string(),
        source,
    })?;
    match url.scheme() {
        "https" => {}
        "http" if loopback_host(&url) => {}
        "http" => return Err(FetchUrlError::PlainHttp(u.to_string())),
        other => {
            return Err(FetchUrlError::Scheme {
                url: u.to_string(),
                scheme: other.to_string(),
            });
        }
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(FetchUrlError::NoHost(u.to_string()));
    }
    if !url.username().is_empty() || url.password().is_some() || url.fragment().is_some() {
        return Err(FetchUrlError::Credentials(u.to_string()));
    }
    Ok(())
}

/// People sign in to the console with an OIDC provider (`[console.oidc]`;
/// the authorization code flow with PKCE, `state` and `nonce`). A change
/// needs a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ConsoleOidc {
    /// The issuer (`https://…`, or `http://` to a loopback address), its
    /// endpoints discovered at `<issuer>/.well-known/openid-configuration`.
    pub issuer: String,
    /// The console's client at the provider.
    pub client_id: String,
    /// A file holding the client's secret (surrounding whitespace ignored).
    pub client_secret_file: PathBuf,
    /// The redirect URI registered at the provider: the console's own
    /// address + `/console/oidc/callback`.
    pub redirect_url: String,
    /// The sign-in button says "Sign in with LABEL".
    #[serde(default = "oidc_label")]
    pub label: String,
    /// Scopes asked for (`openid` is always asked).
    #[serde(default = "oidc_scopes")]
    pub scopes: Vec<String>,
    /// Algorithms the ID token may be signed with (asymmetric only).
    #[serde(default = "oidc_algorithms")]
    pub algorithms: Vec<String>,
    /// PEM CA certificates to trust for the provider instead of the public
    /// web PKI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Clock skew allowed on the ID token's `exp` and `nbf` (0..=300 s).
    #[serde(default = "oidc_leeway")]
    pub leeway_seconds: u64,
    /// The claim that names the person in the console and the journal's
    /// digests (else `email`, else `sub`).
    #[serde(default = "oidc_name_claim")]
    pub name_claim: String,
    /// The claim that holds the tenant.
    #[serde(default = "oidc_tenant_claim")]
    pub tenant_claim: String,
    /// The tenant of people whose token has no tenant claim; absent: such a
    /// sign-in is refused. With no `tenants`, the only tenant people may
    /// sign in to (a token naming another is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The tenants people may sign in to (with `tenant`, if set). One of
    /// `tenant` and `tenants` is required.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// The claim (a list, or names separated by spaces or commas) whose
    /// values map to console roles.
    #[serde(default = "oidc_groups_claim")]
    pub roles_claim: String,
    /// Values of `roles_claim` that make an approver.
    #[serde(default)]
    pub approver: Vec<String>,
    /// Values that make an auditor.
    #[serde(default)]
    pub auditor: Vec<String>,
    /// Values that make an admin.
    #[serde(default)]
    pub admin: Vec<String>,
}

fn oidc_label() -> String {
    "single sign-on".into()
}
fn oidc_scopes() -> Vec<String> {
    vec!["openid".into(), "profile".into(), "email".into()]
}
fn oidc_name_claim() -> String {
    "preferred_username".into()
}
fn oidc_tenant_claim() -> String {
    "tenant_id".into()
}
fn oidc_groups_claim() -> String {
    "groups".into()
}

impl ConsoleOidc {
    /// The issuer as `[[auth.oidc]]` would trust it, for the ID token: the
    /// audience is the client.
    pub fn id_token_issuer(&self) -> OidcIssuer {
        OidcIssuer {
            issuer: self.issuer.clone(),
            audience: self.client_id.clone(),
            algorithms: self.algorithms.clone(),
            jwks_url: None,
            ca_file: self.ca_file.clone(),
            leeway_seconds: self.leeway_seconds,
            claims: ClaimNames::default(),
            tenant: self.tenant.clone(),
            tenants: self.tenants.clone(),
            // The console maps roles itself (`approver`, `auditor`, `admin`).
            allowed_roles: ["approver", "auditor", "admin"].map(String::from).to_vec(),
        }
    }

    /// Whether people may sign in to `tenant` (`tenant` or `tenants`).
    pub fn allows_tenant(&self, tenant: &str) -> bool {
        allows_tenant(self.tenant.as_deref(), &self.tenants, tenant)
    }

    pub(crate) fn validate(&self) -> Result<(), SettingsError> {
        let err = |e| Err(SettingsError::ConsoleOidc(e));
        if let Err(source) = self.id_token_issuer().check() {
            return err(ConsoleOidcError::Issuer {
                issuer: self.issuer.clone(),
                source,
            });
        }
        if let Err(e) = check_fetch_url(&self.redirect_url) {
            return err(ConsoleOidcError::RedirectUrl(e));
        }
        if !self.redirect_url.ends_with("/console/oidc/callback") {
            return err(ConsoleOidcError::Callback);
        }
        if self.client_id.trim().is_empty() {
            return err(ConsoleOidcError::NoClientId);
        }
        if self.approver.is_empty() && self.auditor.is_empty() && self.admin.is_empty() {
            return err(ConsoleOidcError::NoRoles);
        }
        if let Err(e) = check_tenants(self.tenant.as_deref(), &self.tenants) {
            return err(ConsoleOidcError::Tenants(e));
        }
        for n in [&self.name_claim, &self.tenant_claim, &self.roles_claim] {
            if n.trim().is_empty() {
                return err(ConsoleOidcError::EmptyClaim);
            }
        }
        Ok(())
    }
}

impl OidcIssuer {
    /// Whether this issuer's tokens may act for `tenant`.
    pub fn allows_tenant(&self, tenant: &str) -> bool {
        allows_tenant(self.tenant.as_deref(), &self.tenants, tenant)
    }

    /// Whether this issuer's tokens may carry `role`.
    pub fn allows_role(&self, role: super::Role) -> bool {
        self.allowed_roles
            .iter()
            .any(|r| r.parse::<super::Role>().is_ok_and(|a| a == role))
    }

    /// The issuer's own settings (not whether another has its name).
    pub(crate) fn validate(&self) -> Result<(), SettingsError> {
        self.check().map_err(|source| SettingsError::Oidc {
            issuer: self.issuer.clone(),
            source,
        })
    }

    /// [`Self::validate`], without naming the issuer (`[console.oidc]`
    /// names it its own way).
    fn check(&self) -> Result<(), IssuerError> {
        check_fetch_url(&self.issuer)?;
        if self.issuer.contains('?') {
            return Err(IssuerError::Query);
        }
        if self.audience.trim().is_empty() {
            return Err(IssuerError::NoAudience);
        }
        if self.algorithms.is_empty() {
            return Err(IssuerError::NoAlgorithm);
        }
        if let Some(a) = self
            .algorithms
            .iter()
            .find(|a| super::oidc::algorithm(a).is_none())
        {
            return Err(IssuerError::Algorithm(a.clone()));
        }
        if let Some(j) = &self.jwks_url {
            check_fetch_url(j).map_err(IssuerError::JwksUrl)?;
        }
        if self.leeway_seconds > 300 {
            return Err(IssuerError::Leeway);
        }
        check_tenants(self.tenant.as_deref(), &self.tenants)?;
        if self.allowed_roles.is_empty() {
            return Err(IssuerError::NoRole);
        }
        for r in &self.allowed_roles {
            r.parse::<super::Role>().map_err(IssuerError::Role)?;
        }
        let c = &self.claims;
        for n in [
            &c.tenant,
            &c.roles,
            &c.profiles,
            &c.runtimes,
            &c.actions,
            &c.task_templates,
        ] {
            if n.trim().is_empty() {
                return Err(IssuerError::EmptyClaim);
            }
        }
        Ok(())
    }
}

/// `tenant` or one of `tenants`.
fn allows_tenant(fixed: Option<&str>, list: &[String], tenant: &str) -> bool {
    fixed == Some(tenant) || list.iter().any(|t| t == tenant)
}

/// One of `tenant` and `tenants` is set, and each names a valid tenant.
fn check_tenants(fixed: Option<&str>, list: &[String]) -> Result<(), TenantsError> {
    if fixed.is_none() && list.is_empty() {
        return Err(TenantsError::Unnamed);
    }
    for t in fixed.into_iter().chain(list.iter().map(String::as_str)) {
        if !super::valid_tenant_name(t) {
            return Err(TenantsError::Invalid(t.to_string()));
        }
    }
    Ok(())
}

/// Whether `u`'s host is a loopback name or address.
pub(crate) fn loopback_host(u: &url::Url) -> bool {
    match u.host() {
        Some(url::Host::Ipv4(a)) => a.is_loopback(),
        Some(url::Host::Ipv6(a)) => a.is_loopback(),
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        None => false,
    }
}

/// Why `[auth]` or `[console.oidc]` settings are refused (config
/// validation says it as it is).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// `[auth.client_ca]`.
    #[error("auth.client_ca: {0}")]
    ClientCa(#[source] ClientCaError),
    /// One `[[auth.oidc]]` issuer.
    #[error("auth.oidc {issuer}: {source}")]
    Oidc { issuer: String, source: IssuerError },
    /// `[console.oidc]`.
    #[error("console.oidc: {0}")]
    ConsoleOidc(#[source] ConsoleOidcError),
}

/// What is wrong in `[auth.client_ca]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientCaError {
    /// `subject` names no field a certificate is mapped by.
    #[error("subject must be cn, san_uri or san_email (got {0:?})")]
    Subject(String),
    /// An entry of `revoked` is not a fingerprint.
    #[error("revoked {0:?} is not a SHA-256 fingerprint (64 hex digits)")]
    Revoked(String),
    /// Two identities for one subject.
    #[error("identity {0:?} is listed twice")]
    Twice(String),
    /// An identity that is no principal, and why (`auth::client_ca`).
    #[error("identity {subject:?}: {why}")]
    Identity {
        subject: String,
        why: super::OpError,
    },
}

/// What is wrong in an OIDC issuer's settings (`[[auth.oidc]]`, and the
/// issuer `[console.oidc]` trusts for its ID tokens).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IssuerError {
    /// The issuer is not a URL the appliance fetches from.
    #[error(transparent)]
    Url(#[from] FetchUrlError),
    #[error("the issuer has no query")]
    Query,
    #[error("audience is required")]
    NoAudience,
    #[error("algorithms must name at least one")]
    NoAlgorithm,
    /// A symmetric or unknown algorithm.
    #[error(
        "algorithm {0:?} is not allowed (asymmetric only: {list})",
        list = allowed_algorithms()
    )]
    Algorithm(String),
    #[error("jwks_url: {0}")]
    JwksUrl(#[source] FetchUrlError),
    #[error("leeway_seconds must be at most 300")]
    Leeway,
    #[error(transparent)]
    Tenants(#[from] TenantsError),
    #[error("allowed_roles must name at least one role (agent, approver, auditor, admin)")]
    NoRole,
    /// An entry of `allowed_roles` that is no role.
    #[error("allowed_roles: {0}")]
    Role(#[source] super::UnknownRole),
    #[error("claim names must not be empty")]
    EmptyClaim,
}

/// The algorithms an issuer may use, for messages.
fn allowed_algorithms() -> String {
    super::oidc::ALGORITHMS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// What is wrong in `[console.oidc]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConsoleOidcError {
    /// The provider as an issuer of ID tokens.
    #[error("{issuer}: {source}")]
    Issuer { issuer: String, source: IssuerError },
    #[error("redirect_url: {0}")]
    RedirectUrl(#[source] FetchUrlError),
    #[error("redirect_url must be the console's address + /console/oidc/callback")]
    Callback,
    #[error("client_id is required")]
    NoClientId,
    #[error(
        "name the roles_claim values of approvers, auditors or admins (approver, auditor, admin)"
    )]
    NoRoles,
    #[error(transparent)]
    Tenants(#[from] TenantsError),
    #[error("claim names must not be empty")]
    EmptyClaim,
}

/// Why a URL the appliance would fetch from is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchUrlError {
    #[error("{url:?} is not a URL ({source})")]
    NotUrl {
        url: String,
        source: url::ParseError,
    },
    /// `http://` to a host that is not loopback.
    #[error("{0} must be https:// (plain http:// only to a loopback address)")]
    PlainHttp(String),
    #[error("{url} must be https:// (got {scheme}://)")]
    Scheme { url: String, scheme: String },
    #[error("{0} has no host")]
    NoHost(String),
    #[error("{0} must not carry a user, password or fragment")]
    Credentials(String),
}

/// Why the tenants an issuer's tokens may act for are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantsError {
    /// Neither `tenant` nor `tenants`: the token would choose.
    #[error(
        "name the tenants this issuer's tokens may act for: `tenant = \"…\"` (one, also for tokens without a tenant claim) or `tenants = [\"…\"]`; the tenant claim alone is not trusted"
    )]
    Unnamed,
    #[error("tenant {0:?} must be 1-128 characters of [A-Za-z0-9_.:-]")]
    Invalid(String),
}
