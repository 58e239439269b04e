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
    pub(crate) fn validate(&self) -> Result<(), String> {
        if !["cn", "san_uri", "san_email"].contains(&self.subject.as_str()) {
            return Err(format!(
                "auth.client_ca: subject must be cn, san_uri or san_email (got {:?})",
                self.subject
            ));
        }
        for r in &self.revoked {
            if r.len() != 64 || !r.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "auth.client_ca: revoked {r:?} is not a SHA-256 fingerprint (64 hex digits)"
                ));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for i in &self.identities {
            if !seen.insert(i.subject.as_str()) {
                return Err(format!(
                    "auth.client_ca: identity {:?} is listed twice",
                    i.subject
                ));
            }
            super::client_ca::principal(i)
                .map_err(|e| format!("auth.client_ca: identity {:?}: {e}", i.subject))?;
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
pub fn check_fetch_url(u: &str) -> Result<(), String> {
    let url = url::Url::parse(u).map_err(|e| format!("{u:?} is not a URL ({e})"))?;
    match url.scheme() {
        "https" => {}
        "http" if loopback_host(&url) => {}
        "http" => {
            return Err(format!(
                "{u} must be https:// (plain http:// only to a loopback address)"
            ));
        }
        other => return Err(format!("{u} must be https:// (got {other}://)")),
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{u} has no host"));
    }
    if !url.username().is_empty() || url.password().is_some() || url.fragment().is_some() {
        return Err(format!("{u} must not carry a user, password or fragment"));
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

    pub(crate) fn validate(&self) -> Result<(), String> {
        let at = |e: String| format!("console.oidc: {e}");
        self.id_token_issuer()
            .validate()
            .map_err(|e| at(e.replace("auth.oidc ", "")))?;
        check_fetch_url(&self.redirect_url).map_err(|e| at(format!("redirect_url: {e}")))?;
        if !self.redirect_url.ends_with("/console/oidc/callback") {
            return Err(at(
                "redirect_url must be the console's address + /console/oidc/callback".into(),
            ));
        }
        if self.client_id.trim().is_empty() {
            return Err(at("client_id is required".into()));
        }
        if self.approver.is_empty() && self.auditor.is_empty() && self.admin.is_empty() {
            return Err(at(
                "name the roles_claim values of approvers, auditors or admins (approver, auditor, admin)".into(),
            ));
        }
        check_tenants(self.tenant.as_deref(), &self.tenants).map_err(at)?;
        for n in [&self.name_claim, &self.tenant_claim, &self.roles_claim] {
            if n.trim().is_empty() {
                return Err(at("claim names must not be empty".into()));
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
    pub(crate) fn validate(&self) -> Result<(), String> {
        let at = |e: String| format!("auth.oidc {}: {e}", self.issuer);
        check_fetch_url(&self.issuer).map_err(at)?;
        if self.issuer.contains('?') {
            return Err(at("the issuer has no query".into()));
        }
        if self.audience.trim().is_empty() {
            return Err(at("audience is required".into()));
        }
        if self.algorithms.is_empty() {
            return Err(at("algorithms must name at least one".into()));
        }
        for a in &self.algorithms {
            if super::oidc::algorithm(a).is_none() {
                return Err(at(format!(
                    "algorithm {a:?} is not allowed (asymmetric only: {})",
                    super::oidc::ALGORITHMS
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        if let Some(j) = &self.jwks_url {
            check_fetch_url(j).map_err(|e| at(format!("jwks_url: {e}")))?;
        }
        if self.leeway_seconds > 300 {
            return Err(at("leeway_seconds must be at most 300".into()));
        }
        check_tenants(self.tenant.as_deref(), &self.tenants).map_err(at)?;
        if self.allowed_roles.is_empty() {
            return Err(at(
                "allowed_roles must name at least one role (agent, approver, auditor, admin)"
                    .into(),
            ));
        }
        for r in &self.allowed_roles {
            r.parse::<super::Role>()
                .map_err(|e| at(format!("allowed_roles: {e}")))?;
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
                return Err(at("claim names must not be empty".into()));
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
fn check_tenants(fixed: Option<&str>, list: &[String]) -> Result<(), String> {
    if fixed.is_none() && list.is_empty() {
        return Err(
            "name the tenants this issuer's tokens may act for: `tenant = \"…\"` (one, also for tokens without a tenant claim) or `tenants = [\"…\"]`; the tenant claim alone is not trusted"
                .into(),
        );
    }
    for t in fixed.into_iter().chain(list.iter().map(String::as_str)) {
        if !super::valid_tenant_name(t) {
            return Err(format!(
                "tenant {t:?} must be 1-128 characters of [A-Za-z0-9_.:-]"
            ));
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
