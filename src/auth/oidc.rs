//! OIDC JWT bearers: tokens an enterprise identity provider issues,
//! accepted on `/v1`, `/mcp` and the event streams beside our own tokens.
//!
//! Each `[[auth.oidc]]` issuer is trusted for its own keys only: a token
//! names its issuer (`iss`), and is checked against that issuer's JWKS
//! (discovered from `issuer` + `/.well-known/openid-configuration`, or
//! `jwks_url`), its audience, its pinned asymmetric algorithms and its
//! clock skew (`leeway_seconds`). `alg: none` and symmetric algorithms are
//! never accepted (no HMAC key is ever taken from a JWKS, so a token signed
//! with the public key as an HMAC secret finds nothing to verify it).
//!
//! Keys are fetched in the background at start and kept; a token whose
//! `kid` is unknown makes one refetch, at most once a minute per issuer. A
//! JWKS that is down leaves the keys already fetched working; a new `kid`
//! is then 401 `invalid_token`, never a 503. Claims map to a principal as
//! the reference adapter maps them (docs/operations.md, "OIDC").

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use base64::Engine;
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};

use super::settings::OidcIssuer;
use super::{Principal, Role, all, valid_tenant, valid_word};

/// The algorithms an issuer may be pinned to: asymmetric ones only.
pub const ALGORITHMS: &[(&str, Algorithm)] = &[
    ("RS256", Algorithm::RS256),
    ("RS384", Algorithm::RS384),
    ("RS512", Algorithm::RS512),
    ("PS256", Algorithm::PS256),
    ("PS384", Algorithm::PS384),
    ("PS512", Algorithm::PS512),
    ("ES256", Algorithm::ES256),
    ("ES384", Algorithm::ES384),
    ("EdDSA", Algorithm::EdDSA),
];

/// A JWT is longer than our own tokens; none is longer than this.
pub const MAX_TOKEN: usize = 16 * 1024;
/// An unknown `kid` refetches an issuer's keys at most this often.
const REFETCH_EVERY: Duration = Duration::from_secs(60);
/// One discovery or JWKS request may take this long.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// A JWKS document larger than this is refused.
const MAX_JWKS: usize = 1024 * 1024;

/// The algorithm named `name`, if an issuer may be pinned to it.
pub fn algorithm(name: &str) -> Option<Algorithm> {
    ALGORITHMS.iter().find(|(n, _)| *n == name).map(|(_, a)| *a)
}

/// Whether `s` looks like a JWT (three base64url parts, the last possibly
/// empty: an `alg: none` token is a JWT too, and refused as one with 401
/// `invalid_token`), not one of our tokens or a reference principal's.
pub fn looks_like_jwt(s: &str) -> bool {
    let mut parts = s.split('.');
    let ok = |p: Option<&str>, may_be_empty: bool| {
        p.is_some_and(|p| {
            (may_be_empty || !p.is_empty())
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
    };
    s.starts_with("eyJ")
        && ok(parts.next(), false)
        && ok(parts.next(), false)
        && ok(parts.next(), true)
        && parts.next().is_none()
}

/// Why a token was refused: said to the caller (401 `invalid_token`) and
/// logged, never with the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

fn refused(why: impl Into<String>) -> Refused {
    Refused(why.into())
}

/// Why an issuer (`[[auth.oidc]]`) or the console's sign-in
/// (`[console.oidc]`) cannot be set up: a start or reload refuses it.
#[derive(Debug, thiserror::Error)]
pub enum OidcError {
    #[error("auth.oidc {issuer}: ca_file {}: {source}", path.display())]
    CaFile {
        issuer: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("auth.oidc {issuer}: TLS: {source}")]
    Tls {
        issuer: String,
        #[source]
        source: crate::tls::TlsError,
    },
    #[error("auth.oidc {issuer}: HTTP client: {source}")]
    Client {
        issuer: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("console.oidc: client_secret_file {}: {source}", path.display())]
    SecretFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("console.oidc: client_secret_file is empty")]
    EmptySecret,
}

/// Why an issuer's discovery document or keys could not be had: logged
/// (the keys fetched before stay in use), or said to a person whose
/// sign-in cannot start or finish.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The request or its body failed.
    #[error("GET {url}: {source}")]
    Fetch {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("GET {url}: HTTP {status}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
    },
    #[error("GET {url}: more than {MAX_JWKS} bytes")]
    TooLarge { url: String },
    #[error("GET {url}: not JSON: {source}")]
    NotJson {
        url: String,
        #[source]
        source: serde_json::Error,
    },
    /// The discovery document's `issuer` is not the one configured.
    #[error("{url} names another issuer")]
    OtherIssuer { url: String },
    #[error("the provider's discovery document has no {name}")]
    NoEndpoint { name: &'static str },
    /// An endpoint the discovery document names is not one we fetch
    /// (`settings::check_fetch_url`'s words).
    #[error("{name}: {why}")]
    BadEndpoint { name: &'static str, why: String },
    #[error("the discovery document has no jwks_uri")]
    NoJwksUri,
    /// `jwks_uri` is not one we fetch (`settings::check_fetch_url`'s words).
    #[error("the discovery document: jwks_uri: {why}")]
    BadJwksUri { why: String },
    #[error("{url}: no keys")]
    NoKeys { url: String },
    #[error("{url}: no signing key for the allowed algorithms")]
    NoSigningKey { url: String },
}

/// A verified token: its principal and when it expires (unix seconds).
pub struct Verified {
    pub principal: Principal,
    pub expires: u64,
}

/// The configured issuers. Cheap to share (`Arc`).
pub struct Verifier {
    issuers: Vec<Arc<Issuer>>,
}

struct Issuer {
    cfg: OidcIssuer,
    algorithms: Vec<Algorithm>,
    http: reqwest::Client,
    /// Keys by `kid` ("" for a key without one).
    keys: RwLock<Arc<HashMap<String, DecodingKey>>>,
    /// One fetch at a time; when an unknown `kid` last made one.
    fetching: tokio::sync::Mutex<Option<Instant>>,
    /// The discovery document, once fetched.
    discovery: tokio::sync::OnceCell<Value>,
}

impl Verifier {
    /// The verifier for `issuers` (already validated by `config check`),
    /// or why it cannot be built (an unreadable CA file).
    pub fn new(issuers: &[OidcIssuer]) -> Result<Self, OidcError> {
        let mut out = vec![];
        for cfg in issuers {
            let ca = match &cfg.ca_file {
                Some(f) => Some(std::fs::read(f).map_err(|source| OidcError::CaFile {
                    issuer: cfg.issuer.clone(),
                    path: f.clone(),
                    source,
                })?),
                None => None,
            };
            let tls = crate::tls::client_config(ca.as_deref(), None).map_err(|source| {
                OidcError::Tls {
                    issuer: cfg.issuer.clone(),
                    source,
                }
            })?;
            let http = reqwest::Client::builder()
                .tls_backend_preconfigured(tls)
                .http1_only()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(FETCH_TIMEOUT)
                .timeout(FETCH_TIMEOUT)
                .user_agent(concat!("cube-adapter/", env!("CARGO_PKG_VERSION")))
                .build()
                .map_err(|source| OidcError::Client {
                    issuer: cfg.issuer.clone(),
                    source,
                })?;
            out.push(Arc::new(Issuer {
                algorithms: cfg.algorithms.iter().filter_map(|a| algorithm(a)).collect(),
                cfg: cfg.clone(),
                http,
                keys: RwLock::default(),
                fetching: tokio::sync::Mutex::new(None),
                discovery: tokio::sync::OnceCell::new(),
            }));
        }
        Ok(Self { issuers: out })
    }

    /// Fetch every issuer's keys in the background (at start: the first
    /// tokens then find them). A failure is logged; the first token with
    /// an unknown `kid` tries again.
    pub fn prefetch(self: &Arc<Self>) {
        for i in &self.issuers {
            let i = i.clone();
            tokio::spawn(async move {
                let _ = i.refetch(true).await;
            });
        }
    }

    /// Verify `token` and map its claims: `wall` is the time now (unix
    /// seconds).
    pub async fn verify(&self, token: &str, wall: u64) -> Result<Verified, Refused> {
        let (issuer, claims) = self.verify_claims(token).await?;
        let exp = claims.get("exp").and_then(Value::as_u64).unwrap_or(wall);
        let principal = issuer.principal(&claims)?;
        Ok(Verified {
            principal,
            expires: exp,
        })
    }

    /// Verify `token` (signature, algorithm, `iss`, `aud`, `exp`, `nbf`,
    /// the claims every token must have): its issuer and claims.
    async fn verify_claims(&self, token: &str) -> Result<(&Issuer, Map<String, Value>), Refused> {
        if token.len() > MAX_TOKEN {
            return Err(refused("the token is too long"));
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| {
            refused("the token's header is not a JWT header with an allowed algorithm")
        })?;
        let claims = unverified_claims(token)?;
        let iss = claims
            .get("iss")
            .and_then(Value::as_str)
            .ok_or_else(|| refused("the token has no issuer (iss)"))?;
        let issuer = self
            .issuers
            .iter()
            .find(|i| i.cfg.issuer == iss)
            .ok_or_else(|| refused("the token's issuer is not trusted here"))?;
        if !issuer.algorithms.contains(&header.alg) {
            return Err(refused(format!(
                "algorithm {:?} is not allowed for this issuer",
                header.alg
            )));
        }
        let key = issuer.key(header.kid.as_deref(), header.alg).await?;
        let mut v = Validation::new(header.alg);
        v.algorithms = vec![header.alg];
        v.set_issuer(&[&issuer.cfg.issuer]);
        v.set_audience(&[&issuer.cfg.audience]);
        v.leeway = issuer.cfg.leeway_seconds;
        v.validate_exp = true;
        v.validate_nbf = true;
        v.set_required_spec_claims(&["exp", "sub", "iss", "aud"]);
        let data = jsonwebtoken::decode::<Map<String, Value>>(token, &key, &v).map_err(|e| {
            use jsonwebtoken::errors::ErrorKind as K;
            refused(match e.kind() {
                K::ExpiredSignature => "the token has expired",
                K::ImmatureSignature => "the token is not valid yet (nbf)",
                K::InvalidAudience => "the token is not for this audience",
                K::InvalidIssuer => "the token's issuer is not trusted here",
                K::InvalidSignature => "the token's signature does not verify",
                K::MissingRequiredClaim(_) => {
                    "the token lacks a required claim (exp, sub, iss, aud)"
                }
                K::InvalidAlgorithm => "the token's algorithm does not match its key",
                _ => "the token is not valid",
            })
        })?;
        Ok((issuer, data.claims))
    }
}

/// The payload, before any check: only to find the issuer whose key checks
/// it.
fn unverified_claims(token: &str) -> Result<Map<String, Value>, Refused> {
    let payload = token
        .split('.')
        .nth(1)
        .ok_or_else(|| refused("the token is not a JWT"))?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| refused("the token's payload is not base64url"))?;
    serde_json::from_slice(&bytes).map_err(|_| refused("the token's payload is not a JSON object"))
}

impl Issuer {
    /// The key for `kid` (or the only key, when the token names none),
    /// fetching the keys again (at most once a minute) when it is unknown.
    async fn key(&self, kid: Option<&str>, alg: Algorithm) -> Result<DecodingKey, Refused> {
        if let Some(k) = self.lookup(kid) {
            return Ok(k);
        }
        self.refetch(false).await;
        self.lookup(kid).ok_or_else(|| {
            refused(match kid {
                Some(_) => format!("no key of this issuer has the token's kid ({alg:?})"),
                None => "the token names no kid and the issuer has several keys".to_string(),
            })
        })
    }

    fn lookup(&self, kid: Option<&str>) -> Option<DecodingKey> {
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner()).clone();
        match kid {
            Some(k) => keys.get(k).cloned(),
            None if keys.len() == 1 => keys.values().next().cloned(),
            None => None,
        }
    }

    /// Fetch the keys again, unless an unknown `kid` made one less than a
    /// minute ago (`force`: at start, which does not count). Keeps the keys
    /// it had when the fetch fails.
    async fn refetch(&self, force: bool) {
        let mut last = self.fetching.lock().await;
        if !force {
            if last.is_some_and(|t| t.elapsed() < REFETCH_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        match self.fetch().await {
            Ok(keys) => {
                tracing::info!(issuer = %self.cfg.issuer, keys = keys.len(), "OIDC keys fetched");
                *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
            }
            Err(e) => {
                tracing::warn!(issuer = %self.cfg.issuer, error = %e, "cannot fetch the OIDC keys; the ones fetched before stay in use")
            }
        }
    }

    async fn get_json(&self, url: &str) -> Result<Value, ProviderError> {
        let fetch = |source| ProviderError::Fetch {
            url: url.to_string(),
            source,
        };
        let r = self
            .http
            .get(url)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(fetch)?;
        if !r.status().is_success() {
            return Err(ProviderError::Status {
                url: url.to_string(),
                status: r.status(),
            });
        }
        let body = r.bytes().await.map_err(fetch)?;
        if body.len() > MAX_JWKS {
            return Err(ProviderError::TooLarge {
                url: url.to_string(),
            });
        }
        serde_json::from_slice(&body).map_err(|source| ProviderError::NotJson {
            url: url.to_string(),
            source,
        })
    }

    /// The issuer's discovery document (fetched once, when it is right).
    async fn discovery(&self) -> Result<&Value, ProviderError> {
        self.discovery
            .get_or_try_init(|| async {
                let url = format!(
                    "{}/.well-known/openid-configuration",
                    self.cfg.issuer.trim_end_matches('/')
                );
                let doc = self.get_json(&url).await?;
                if doc.get("issuer").and_then(Value::as_str) != Some(self.cfg.issuer.as_str()) {
                    return Err(ProviderError::OtherIssuer { url });
                }
                Ok(doc)
            })
            .await
    }

    /// An endpoint the discovery document names (`https://`, or `http://`
    /// on loopback).
    async fn endpoint(&self, name: &'static str) -> Result<String, ProviderError> {
        let doc = self.discovery().await?;
        let u = doc
            .get(name)
            .and_then(Value::as_str)
            .ok_or(ProviderError::NoEndpoint { name })?;
        // `check_fetch_url` (settings) says why in words.
        super::settings::check_fetch_url(u).map_err(|e| ProviderError::BadEndpoint {
            name,
            why: e.to_string(),
        })?;
        Ok(u.to_string())
    }

    async fn jwks_url(&self) -> Result<String, ProviderError> {
        if let Some(u) = &self.cfg.jwks_url {
            return Ok(u.clone());
        }
        let doc = self.discovery().await?;
        let jwks = doc
            .get("jwks_uri")
            .and_then(Value::as_str)
            .ok_or(ProviderError::NoJwksUri)?;
        super::settings::check_fetch_url(jwks)
            .map_err(|e| ProviderError::BadJwksUri { why: e.to_string() })?;
        Ok(jwks.to_string())
    }

    async fn fetch(&self) -> Result<HashMap<String, DecodingKey>, ProviderError> {
        let url = self.jwks_url().await?;
        let doc = self.get_json(&url).await?;
        let Some(listed) = doc.get("keys").and_then(Value::as_array) else {
            return Err(ProviderError::NoKeys { url });
        };
        let mut keys = HashMap::new();
        for k in listed {
            // A key of a kind this build does not know is skipped, not fatal.
            let Ok(jwk) = serde_json::from_value::<Jwk>(k.clone()) else {
                continue;
            };
            if let Some(key) = self.usable(&jwk) {
                keys.insert(jwk.common.key_id.clone().unwrap_or_default(), key);
            }
        }
        if keys.is_empty() {
            return Err(ProviderError::NoSigningKey { url });
        }
        Ok(keys)
    }

    /// A JWKS entry as a verification key: an asymmetric signing key of a
    /// family the issuer's algorithms use (never `oct`: no HMAC secret
    /// comes from a JWKS).
    fn usable(&self, jwk: &Jwk) -> Option<DecodingKey> {
        if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
            return None;
        }
        let family_ok = |names: &[&str]| {
            self.cfg
                .algorithms
                .iter()
                .any(|a| names.iter().any(|n| a.starts_with(n)))
        };
        let ok = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => family_ok(&["RS", "PS"]),
            AlgorithmParameters::EllipticCurve(_) => family_ok(&["ES"]),
            AlgorithmParameters::OctetKeyPair(_) => family_ok(&["EdDSA"]),
            AlgorithmParameters::OctetKey(_) => false,
        };
        ok.then(|| DecodingKey::from_jwk(jwk).ok()).flatten()
    }

    /// The principal a verified token's claims stand for.
    fn principal(&self, c: &Map<String, Value>) -> Result<Principal, Refused> {
        let names = &self.cfg.claims;
        let sub = c
            .get("sub")
            .and_then(Value::as_str)
            .filter(|s| valid_word(s))
            .ok_or_else(|| refused("the token's sub is not 1-256 bytes of text"))?;
        // The tenant: the claim, else the issuer's fixed `tenant`; never
        // `sub`, and only one the issuer may name (`tenant`, `tenants`).
        let tenant = match c.get(&names.tenant) {
            Some(Value::String(t)) => t.as_str(),
            Some(_) => return Err(refused(format!("claim {} is not a string", names.tenant))),
            None => self.cfg.tenant.as_deref().ok_or_else(|| {
                refused(format!(
                    "the token has no {} claim and this issuer names no fixed tenant",
                    names.tenant
                ))
            })?,
        };
        if !valid_tenant(tenant) {
            return Err(refused(format!(
                "the tenant ({} claim) must be 1-128 characters of [A-Za-z0-9_.:-]",
                names.tenant
            )));
        }
        if !self.cfg.allows_tenant(tenant) {
            return Err(self.beyond_ceiling(format!(
                "tenant {tenant:?} is not one this issuer may name (auth.oidc tenants)"
            )));
        }
        let list = |name: &str| -> Result<Option<Vec<String>>, Refused> {
            match c.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => {
                    let items = claim_list(v).ok_or_else(|| {
                        refused(format!("claim {name} is not a list or a string"))
                    })?;
                    if let Some(w) = items.iter().find(|w| !valid_word(w)) {
                        return Err(refused(format!("claim {name} holds {w:?}, not a name")));
                    }
                    Ok(Some(items))
                }
            }
        };
        // Absent claims grant nothing: no roles claim refuses the token.
        let named = list(&names.roles)?.ok_or_else(|| {
            refused(format!(
                "the token has no {} claim (absent roles grant nothing)",
                names.roles
            ))
        })?;
        // Providers put roles of their own in the same claim (Keycloak's
        // offline_access): those are not ours.
        let mut roles: Vec<Role> = named.iter().filter_map(|n| n.parse().ok()).collect();
        roles.sort();
        roles.dedup();
        if roles.is_empty() {
            return Err(refused(format!(
                "claim {} names no role of this appliance (agent or runtime, approver, auditor, admin)",
                names.roles
            )));
        }
        if let Some(r) = roles.iter().find(|r| !self.cfg.allows_role(**r)) {
            return Err(self.beyond_ceiling(format!(
                "role {} is above what this issuer may grant (auth.oidc allowed_roles)",
                r.as_str()
            )));
        }
        // An empty profile or runtime list means all (as the reference):
        // they narrow what the actions grant. Actions and task templates
        // absent grant nothing (the reference took `*`).
        let nonempty = |v: Option<Vec<String>>| v.filter(|v| !v.is_empty());
        Ok(Principal {
            label: None,
            tenant: tenant.to_string(),
            subject: sub.to_string(),
            runtimes: nonempty(list(&names.runtimes)?),
            profiles: nonempty(list(&names.profiles)?),
            actions: list(&names.actions)?.unwrap_or_default(),
            task_templates: list(&names.task_templates)?.unwrap_or_default(),
            roles,
            task: None,
            issuer: Some(self.cfg.issuer.clone()),
        })
    }

    /// A genuine token that claims more than its issuer may grant: refused
    /// as any bad token is, and logged at WARN (a provider minting such
    /// tokens is misconfigured or compromised); never with the token.
    fn beyond_ceiling(&self, why: String) -> Refused {
        tracing::warn!(issuer = %self.cfg.issuer, reason = %why, "OIDC token beyond its issuer's ceiling refused");
        refused(why)
    }
}

/// How long a started sign-in may take to come back.
const SIGN_IN_SECONDS: u64 = 600;

/// The console's sign-in with an OIDC provider: the authorization code
/// flow with PKCE (S256), `state` and `nonce`, the ID token checked as a
/// bearer is (signature, algorithm, issuer, audience = the client, time)
/// and its nonce.
///
/// Nothing is kept per started sign-in (#34 L9: `/console/oidc/start`
/// could be flooded): the `state` carries when it was made and a MAC
/// under a key made at start, and the nonce and PKCE verifier are derived
/// from it with that key. A flood of starts costs a MAC each and evicts
/// no one's sign-in; a state is good for [`SIGN_IN_SECONDS`], in the
/// browser whose cookie holds it, and its code is exchanged once (the
/// provider's rule).
pub struct CodeFlow {
    cfg: super::settings::ConsoleOidc,
    /// The client's secret (never shown: this type has no `Debug`).
    secret: String,
    verifier: Verifier,
    /// Keys the states' MACs and the values derived from them.
    key: [u8; 32],
}

/// A person the provider vouched for.
pub struct Person {
    /// What the console shows and the journal digests.
    pub name: String,
    pub principal: Principal,
}

/// Base64url without padding of SHA-256 (PKCE's S256).
fn s256(v: &str) -> String {
    use sha2::Digest;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sha2::Sha256::digest(v.as_bytes()))
}

impl CodeFlow {
    /// The flow of `[console.oidc]`, its client secret read from its file.
    pub fn new(cfg: &super::settings::ConsoleOidc) -> Result<Self, OidcError> {
        let secret = std::fs::read_to_string(&cfg.client_secret_file)
            .map_err(|source| OidcError::SecretFile {
                path: cfg.client_secret_file.clone(),
                source,
            })?
            .trim()
            .to_string();
        if secret.is_empty() {
            return Err(OidcError::EmptySecret);
        }
        let mut key = [0u8; 32];
        for (k, r) in key.iter_mut().zip(crate::ids::random_bytes(32)) {
            *k = r;
        }
        Ok(Self {
            verifier: Verifier::new(&[cfg.id_token_issuer()])?,
            cfg: cfg.clone(),
            secret,
            key,
        })
    }

    /// HMAC-SHA256 under this flow's key of `label` and `parts`.
    fn mac(&self, label: &str, parts: &[&[u8]]) -> Result<[u8; 32], Refused> {
        use hmac::Mac;
        let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.key)
            .map_err(|_| refused("no key for the sign-in's state"))?;
        m.update(label.as_bytes());
        for p in parts {
            m.update(&(p.len() as u64).to_be_bytes());
            m.update(p);
        }
        Ok(m.finalize().into_bytes().into())
    }

    /// A new state made at `now`: base64url of when (8 bytes), 16 random
    /// bytes and 16 bytes of their MAC.
    fn new_state(&self, now: u64) -> Result<String, Refused> {
        let when = now.to_be_bytes();
        let random = crate::ids::random_bytes(16);
        let mac = self.mac("state", &[&when, &random])?;
        let mut raw = Vec::with_capacity(40);
        raw.extend_from_slice(&when);
        raw.extend_from_slice(&random);
        raw.extend_from_slice(mac.get(..16).unwrap_or_default());
        Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw))
    }

    /// Whether `state` is one this flow made less than
    /// [`SIGN_IN_SECONDS`] before `now`.
    fn state_holds(&self, state: &str, now: u64) -> bool {
        let Ok(raw) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(state) else {
            return false;
        };
        let (Some(when), Some(random), Some(tag)) = (raw.get(..8), raw.get(8..24), raw.get(24..))
        else {
            return false;
        };
        if tag.len() != 16 {
            return false;
        }
        let Ok(want) = self.mac("state", &[when, random]) else {
            return false;
        };
        let ok = want
            .get(..16)
            .is_some_and(|w| bool::from(subtle::ConstantTimeEq::ct_eq(w, tag)));
        let made = <[u8; 8]>::try_from(when)
            .map(u64::from_be_bytes)
            .unwrap_or(0);
        ok && made <= now.saturating_add(60) && now.saturating_sub(made) < SIGN_IN_SECONDS
    }

    /// The nonce and the PKCE verifier of a sign-in (43 base64url
    /// characters each), derived from its state.
    fn derived(&self, state: &str) -> Result<(String, String), Refused> {
        let b64 = |b: [u8; 32]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        Ok((
            b64(self.mac("nonce", &[state.as_bytes()])?),
            b64(self.mac("pkce", &[state.as_bytes()])?),
        ))
    }

    /// What the sign-in button says.
    pub fn label(&self) -> &str {
        &self.cfg.label
    }

    fn issuer(&self) -> Result<&Issuer, Refused> {
        self.verifier
            .issuers
            .first()
            .map(|i| &**i)
            .ok_or_else(|| refused("no issuer"))
    }

    /// Start a sign-in: the provider's URL to send the browser to, and the
    /// `state` the browser must bring back (the caller binds it to the
    /// browser with a cookie).
    pub async fn start(&self, now: u64) -> Result<(String, String), Refused> {
        let issuer = self.issuer()?;
        let auth = issuer
            .endpoint("authorization_endpoint")
            .await
            .map_err(|e| refused(format!("the identity provider cannot be reached: {e}")))?;
        let state = self.new_state(now)?;
        let (nonce, verifier) = self.derived(&state)?;
        let mut scopes = vec!["openid".to_string()];
        scopes.extend(self.cfg.scopes.iter().filter(|s| *s != "openid").cloned());
        let mut url =
            url::Url::parse(&auth).map_err(|e| refused(format!("authorization_endpoint: {e}")))?;
        url.query_pairs_mut()
            .append_pair("response_type", "code")
            .append_pair("client_id", &self.cfg.client_id)
            .append_pair("redirect_uri", &self.cfg.redirect_url)
            .append_pair("scope", &scopes.join(" "))
            .append_pair("state", &state)
            .append_pair("nonce", &nonce)
            .append_pair("code_challenge", &s256(&verifier))
            .append_pair("code_challenge_method", "S256");
        Ok((url.into(), state))
    }

    /// Finish a sign-in the provider sent back with `code` for `state`
    /// (already matched to the browser's cookie): the code is exchanged
    /// once, the ID token checked, the person mapped.
    pub async fn finish(&self, state: &str, code: &str, now: u64) -> Result<Person, Refused> {
        if !self.state_holds(state, now) {
            return Err(refused("this sign-in has expired or was not started here"));
        }
        let (nonce, verifier) = self.derived(state)?;
        let issuer = self.issuer()?;
        let token_url = issuer
            .endpoint("token_endpoint")
            .await
            .map_err(|e| refused(format!("the identity provider cannot be reached: {e}")))?;
        let body = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("grant_type", "authorization_code")
            .append_pair("code", code)
            .append_pair("redirect_uri", &self.cfg.redirect_url)
            .append_pair("code_verifier", &verifier)
            .finish();
        let enc = |s: &str| url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
        let r = issuer
            .http
            .post(&token_url)
            .basic_auth(enc(&self.cfg.client_id), Some(enc(&self.secret)))
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .header(reqwest::header::ACCEPT, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| refused(format!("the identity provider cannot be reached: {e}")))?;
        let status = r.status();
        let answer: Value = r
            .json()
            .await
            .map_err(|_| refused(format!("the token endpoint answered {status} without JSON")))?;
        if !status.is_success() {
            let err = answer
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("error");
            return Err(refused(format!(
                "the provider refused the code ({status} {err})"
            )));
        }
        let id_token = answer
            .get("id_token")
            .and_then(Value::as_str)
            .ok_or_else(|| refused("the provider sent no ID token"))?;
        let (_, claims) = self.verifier.verify_claims(id_token).await?;
        let got = claims.get("nonce").and_then(Value::as_str).unwrap_or("");
        if !super::same_secret(&nonce, got) {
            return Err(refused("the ID token's nonce is not this sign-in's"));
        }
        self.person(&claims)
    }

    /// The person an ID token's claims stand for, with the console roles
    /// `[console.oidc]` maps their `roles_claim` values to.
    fn person(&self, c: &Map<String, Value>) -> Result<Person, Refused> {
        let cfg = &self.cfg;
        let sub = c
            .get("sub")
            .and_then(Value::as_str)
            .filter(|s| valid_word(s))
            .ok_or_else(|| refused("the ID token's sub is not 1-256 bytes of text"))?;
        let name = [cfg.name_claim.as_str(), "email"]
            .iter()
            .find_map(|n| c.get(*n).and_then(Value::as_str))
            .filter(|n| valid_word(n))
            .unwrap_or(sub);
        let tenant = match c.get(&cfg.tenant_claim).and_then(Value::as_str) {
            Some(t) => t.to_string(),
            None => cfg.tenant.clone().ok_or_else(|| {
                refused(format!(
                    "the ID token has no {} claim and [console.oidc] names no tenant",
                    cfg.tenant_claim
                ))
            })?,
        };
        if !valid_tenant(&tenant) {
            return Err(refused(format!(
                "the tenant ({}) must be 1-128 characters of [A-Za-z0-9_.:-]",
                cfg.tenant_claim
            )));
        }
        // The same ceiling as a bearer's: only a tenant `[console.oidc]`
        // names (`tenant`, `tenants`).
        if !cfg.allows_tenant(&tenant) {
            tracing::warn!(issuer = %cfg.issuer, tenant = %tenant, "console sign-in for a tenant [console.oidc] does not name refused");
            return Err(refused(format!(
                "tenant {tenant:?} is not one [console.oidc] names (tenants)"
            )));
        }
        let values = c
            .get(&cfg.roles_claim)
            .and_then(claim_list)
            .unwrap_or_default();
        let has = |names: &[String]| values.iter().any(|v| names.contains(v));
        let mut roles = vec![];
        for (names, role) in [
            (&cfg.approver, Role::Approver),
            (&cfg.auditor, Role::Auditor),
            (&cfg.admin, Role::Admin),
        ] {
            if has(names) {
                roles.push(role);
            }
        }
        Ok(Person {
            name: name.to_string(),
            principal: Principal {
                label: None,
                tenant,
                subject: sub.to_string(),
                actions: super::default_actions(&roles),
                roles,
                runtimes: None,
                profiles: None,
                task_templates: all(),
                task: None,
                issuer: Some(cfg.issuer.clone()),
            },
        })
    }
}

/// A claim that is a list of strings, or one string of names separated by
/// spaces or commas.
fn claim_list(v: &Value) -> Option<Vec<String>> {
    match v {
        Value::String(s) => Some(
            s.split([',', ' '])
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        ),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map(|s| s.trim().to_string()))
            .collect::<Option<Vec<String>>>()
            .map(|v| v.into_iter().filter(|s| !s.is_empty()).collect()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwts_are_told_from_other_tokens() {
        assert!(looks_like_jwt("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"));
        assert!(!looks_like_jwt("cat_abc.def"));
        // `alg: none` with no signature is a JWT (and refused as one).
        assert!(looks_like_jwt("eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0."));
        assert!(!looks_like_jwt("eyJhbGciOiJub25lIn0..c2ln"));
        assert!(!looks_like_jwt("eyJ.a.b.c"));
    }

    fn flow(dir: &std::path::Path) -> CodeFlow {
        let secret = dir.join("secret");
        std::fs::write(&secret, "console-secret-0123456789\n").unwrap();
        let cfg: crate::auth::settings::ConsoleOidc = toml::from_str(&format!(
            "issuer = \"http://127.0.0.1:9\"\nclient_id = \"c\"\nclient_secret_file = \"{}\"\nredirect_url = \"https://127.0.0.1:1/console/oidc/callback\"\napprover = [\"a\"]\ntenant = \"acme\"\n",
            secret.display()
        ))
        .unwrap();
        CodeFlow::new(&cfg).unwrap()
    }

    /// #34 L9: a sign-in's state is stateless: it holds, in time, for the
    /// flow that made it only, and its nonce and verifier are its own.
    #[test]
    fn sign_in_states_are_macs_not_server_state() {
        let dir = tempfile::tempdir().unwrap();
        let (f, other) = (flow(dir.path()), flow(dir.path()));
        let now = 1_700_000_000;
        let s = f.new_state(now).unwrap();
        assert!(f.state_holds(&s, now));
        assert!(f.state_holds(&s, now + SIGN_IN_SECONDS - 1));
        assert!(!f.state_holds(&s, now + SIGN_IN_SECONDS), "expired");
        assert!(!f.state_holds(&s, now - 3600), "from the future");
        assert!(!other.state_holds(&s, now), "another key");
        let mut tampered = s.clone().into_bytes();
        tampered[2] = if tampered[2] == b'A' { b'B' } else { b'A' };
        assert!(!f.state_holds(&String::from_utf8(tampered).unwrap(), now));
        assert!(!f.state_holds("", now) && !f.state_holds("x", now));
        let (nonce, verifier) = f.derived(&s).unwrap();
        assert_eq!((nonce.len(), verifier.len()), (43, 43));
        assert_ne!(nonce, verifier);
        let s2 = f.new_state(now).unwrap();
        assert_ne!(s, s2);
        assert_ne!(f.derived(&s2).unwrap().0, nonce);
    }

    /// #34 M3: the console's sign-in has the same tenant ceiling as a
    /// bearer: only `[console.oidc] tenant`/`tenants`.
    #[test]
    fn console_sign_ins_keep_to_the_configured_tenants() {
        let dir = tempfile::tempdir().unwrap();
        let f = flow(dir.path());
        let person = |c: serde_json::Value| f.person(c.as_object().unwrap());
        let p = person(serde_json::json!({"sub": "u1", "groups": ["a"]})).unwrap();
        assert_eq!(p.principal.tenant, "acme", "the fixed tenant");
        let p =
            person(serde_json::json!({"sub": "u1", "tenant_id": "acme", "groups": "a"})).unwrap();
        assert_eq!(p.principal.roles, [Role::Approver]);
        let e = person(serde_json::json!({"sub": "u1", "tenant_id": "globex", "groups": "a"}))
            .err()
            .unwrap();
        assert!(e.0.contains("\"globex\" is not one"), "{e}");
    }

    /// The words a fetch failure is logged and shown with.
    #[test]
    fn provider_errors_say_what_failed() {
        let url = "https://idp.example/jwks".to_string();
        assert_eq!(
            ProviderError::TooLarge { url: url.clone() }.to_string(),
            "GET https://idp.example/jwks: more than 1048576 bytes"
        );
        assert_eq!(
            ProviderError::NoSigningKey { url }.to_string(),
            "https://idp.example/jwks: no signing key for the allowed algorithms"
        );
        assert_eq!(
            ProviderError::BadJwksUri { why: "x".into() }.to_string(),
            "the discovery document: jwks_uri: x"
        );
    }

    #[test]
    fn claim_lists_take_lists_and_separated_strings() {
        assert_eq!(
            claim_list(&serde_json::json!("a, b c")).unwrap(),
            vec!["a", "b", "c"]
        );
        assert_eq!(
            claim_list(&serde_json::json!(["x", " y "])).unwrap(),
            vec!["x", "y"]
        );
        assert!(claim_list(&serde_json::json!([1])).is_none());
        assert!(claim_list(&serde_json::json!({})).is_none());
    }
}
