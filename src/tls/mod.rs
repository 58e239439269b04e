//! TLS: the appliance's local CA (rcgen), server and client leaf
//! certificates, and rustls configurations built on one crypto provider
//! (ring) for the whole process.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::Digest;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("certificate generation: {0}")]
    Gen(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("{0}")]
    Pem(String),
}

/// The one crypto provider of this process.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Install ring as the process default (first thing in `main`).
pub fn install_default_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TlsError {
    let w = what.into();
    move |e| TlsError::Io(w, e)
}

/// Write a file with the given mode, atomically (tmp + rename).
pub fn write_private(path: &Path, data: &[u8], mode: u32) -> Result<(), TlsError> {
    crate::secrets::write_private(path, data, mode).map_err(io(format!("write {}", path.display())))
}

/// The local certificate authority kept in a directory: `ca.pem` (public)
/// and `ca.key` (0600).
pub struct LocalCa {
    key: KeyPair,
    params: CertificateParams,
    pub cert_pem: String,
    pub dir: PathBuf,
    sealer: Option<crate::secrets::Sealer>,
    /// Validity dates and renewal come from here (the system clock unless
    /// `with_clock` says otherwise).
    clock: crate::clock::Clock,
}

const SEALED: &str = "sealed:";

impl LocalCa {
    fn write_key(&self, path: &Path, pem: &str) -> Result<(), TlsError> {
        write_key(self.sealer.as_ref(), path, pem)
    }

    /// Read a key written by this CA (sealed or plain PEM).
    pub fn read_key(&self, path: &Path) -> Result<String, TlsError> {
        read_key(self.sealer.as_ref(), path)
    }
}

fn write_key(
    sealer: Option<&crate::secrets::Sealer>,
    path: &Path,
    pem: &str,
) -> Result<(), TlsError> {
    let data = match sealer {
        Some(s) => format!(
            "{SEALED}{}\n",
            s.seal(pem.as_bytes())
                .map_err(|e| TlsError::Pem(e.to_string()))?
        ),
        None => pem.to_string(),
    };
    write_private(path, data.as_bytes(), 0o600)
}

fn read_key(sealer: Option<&crate::secrets::Sealer>, path: &Path) -> Result<String, TlsError> {
    let text = std::fs::read_to_string(path).map_err(io(format!("read {}", path.display())))?;
    match (text.trim().strip_prefix(SEALED), sealer) {
        (Some(b), Some(s)) => {
            let pem = s
                .open(b)
                .map_err(|e| TlsError::Pem(format!("{}: {e}", path.display())))?;
            String::from_utf8(pem)
                .map_err(|_| TlsError::Pem(format!("{}: not UTF-8", path.display())))
        }
        (Some(_), None) => Err(TlsError::Pem(format!(
            "{} is sealed and no key was given",
            path.display()
        ))),
        (None, _) => Ok(text),
    }
}

fn ca_params(now: time::OffsetDateTime) -> Result<CertificateParams, TlsError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "cube-adapter local CA");
    dn.push(DnType::OrganizationName, "cube-adapter");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(3650);
    Ok(p)
}

impl LocalCa {
    /// Load the CA from `dir`, or create it on first use.
    pub fn load_or_create(dir: &Path) -> Result<Self, TlsError> {
        Self::load_or_create_sealed(dir, None)
    }

    /// As `load_or_create`, with private keys sealed under the store key.
    pub fn load_or_create_sealed(
        dir: &Path,
        sealer: Option<crate::secrets::Sealer>,
    ) -> Result<Self, TlsError> {
        Self::load_or_create_clocked(dir, sealer, crate::clock::Clock::System)
    }

    /// As `load_or_create_sealed`, with validity dates (a new CA's, every
    /// leaf's) and renewal decided by `clock`.
    pub fn load_or_create_clocked(
        dir: &Path,
        sealer: Option<crate::secrets::Sealer>,
        clock: crate::clock::Clock,
    ) -> Result<Self, TlsError> {
        std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        if cert_path.exists() && key_path.exists() {
            let key_pem = read_key(sealer.as_ref(), &key_path)?;
            let cert_pem = std::fs::read_to_string(&cert_path)
                .map_err(io(format!("read {}", cert_path.display())))?;
            let key = KeyPair::from_pem(&key_pem)?;
            return Ok(Self {
                key,
                params: ca_params(clock.now())?,
                cert_pem,
                dir: dir.to_path_buf(),
                sealer,
                clock,
            });
        }
        let key = KeyPair::generate()?;
        let params = ca_params(clock.now())?;
        let cert = params.self_signed(&key)?;
        write_key(sealer.as_ref(), &key_path, &key.serialize_pem())?;
        write_private(&cert_path, cert.pem().as_bytes(), 0o644)?;
        Ok(Self {
            key,
            params,
            cert_pem: cert.pem(),
            dir: dir.to_path_buf(),
            sealer,
            clock,
        })
    }

    /// The clock that dates this CA's certificates.
    pub fn clock(&self) -> &crate::clock::Clock {
        &self.clock
    }

    /// SHA-256 fingerprint of the CA certificate (`AA:BB:…`).
    pub fn fingerprint(&self) -> String {
        let der = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .map(|d| d.to_vec())
            .unwrap_or_default();
        let d = sha2::Sha256::digest(&der);
        d.iter()
            .map(|b| format!("{b:02X}"))
            .collect::<Vec<_>>()
            .join(":")
    }

    fn issue(
        &self,
        cn: &str,
        sans: &[String],
        server: bool,
        days: i64,
    ) -> Result<(String, String), TlsError> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cn);
        p.distinguished_name = dn;
        for s in sans {
            p.subject_alt_names
                .push(match s.parse::<std::net::IpAddr>() {
                    Ok(ip) => SanType::IpAddress(ip),
                    Err(_) => SanType::DnsName(s.clone().try_into()?),
                });
        }
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        let now = self.clock.now();
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(days);
        let key = KeyPair::generate()?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = p.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A server certificate for `names` (DNS names and IP addresses).
    pub fn issue_server(&self, names: &[String]) -> Result<(String, String), TlsError> {
        let cn = names
            .first()
            .cloned()
            .unwrap_or_else(|| "cube-adapter".into());
        self.issue(&cn, names, true, 397)
    }

    /// A client certificate (for mTLS) with common name `cn`.
    pub fn issue_client(&self, cn: &str) -> Result<(String, String), TlsError> {
        self.issue(cn, &[], false, 397)
    }

    /// Issue (or reuse) `<name>.pem` / `<name>.key` in the CA's directory.
    /// A certificate with `RENEW_DAYS` or fewer left (or unreadable) is
    /// issued anew: the internal leaves (the embedded backend's server and
    /// the broker's client) renew themselves at every start.
    pub fn leaf_files(
        &self,
        name: &str,
        server_names: Option<&[String]>,
    ) -> Result<(PathBuf, PathBuf), TlsError> {
        let cert = self.dir.join(format!("{name}.pem"));
        let key = self.dir.join(format!("{name}.key"));
        let expiring = || {
            std::fs::read(&cert)
                .ok()
                .and_then(|pem| cert_info(&pem).ok())
                .is_none_or(|i| i.days_left(self.clock.unix()) <= RENEW_DAYS)
        };
        if !(cert.exists() && key.exists()) || expiring() {
            let (c, k) = match server_names {
                Some(n) => self.issue_server(n)?,
                None => self.issue_client(name)?,
            };
            self.write_key(&key, &k)?;
            write_private(&cert, c.as_bytes(), 0o644)?;
        }
        Ok((cert, key))
    }
}

pub fn parse_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|e| TlsError::Pem(format!("invalid certificate PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::Pem("no certificate found in PEM".into()));
    }
    Ok(certs)
}

pub fn parse_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| TlsError::Pem(format!("invalid private key PEM: {e}")))
}

fn roots(ca_pem: &[u8]) -> Result<rustls::RootCertStore, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for c in parse_certs(ca_pem)? {
        store.add(c)?;
    }
    Ok(store)
}

/// Server config: TLS 1.2+, HTTP/1.1; with `client_ca`, client
/// certificates signed by it are required (mTLS).
pub fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
    client_ca: Option<&[u8]>,
) -> Result<rustls::ServerConfig, TlsError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(ca)?),
                provider(),
            )
            .build()
            .map_err(|e| TlsError::Pem(format!("client verifier: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_single_cert(parse_certs(cert_pem)?, parse_key(key_pem)?)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Client config trusting `ca_pem` (or the public web PKI), optionally
/// presenting a client certificate.
pub fn client_config(
    ca_pem: Option<&[u8]>,
    identity: Option<(&[u8], &[u8])>,
) -> Result<rustls::ClientConfig, TlsError> {
    // Without a CA of its own, trust the public web PKI (Mozilla's roots).
    let store = match ca_pem {
        Some(ca) => roots(ca)?,
        None => rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        },
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(store);
    let mut cfg = match identity {
        Some((cert, key)) => builder.with_client_auth_cert(parse_certs(cert)?, parse_key(key)?)?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The server certificate a running listener presents, swapped in place on
/// reload (SIGHUP, `cert renew`): handshakes after the swap get the new
/// one, connections already open keep theirs.
#[derive(Debug)]
pub struct SwappableCert(std::sync::RwLock<Arc<rustls::sign::CertifiedKey>>);

impl SwappableCert {
    pub fn new(key: rustls::sign::CertifiedKey) -> Self {
        Self(std::sync::RwLock::new(Arc::new(key)))
    }

    pub fn swap(&self, key: rustls::sign::CertifiedKey) {
        let mut g = self.0.write().unwrap_or_else(|p| p.into_inner());
        *g = Arc::new(key);
    }

    fn current(&self) -> Arc<rustls::sign::CertifiedKey> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl rustls::server::ResolvesServerCert for SwappableCert {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.current())
    }
}

/// A certificate chain and its key, checked to belong together.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<rustls::sign::CertifiedKey, TlsError> {
    let signer = provider()
        .key_provider
        .load_private_key(parse_key(key_pem)?)?;
    let ck = rustls::sign::CertifiedKey::new(parse_certs(cert_pem)?, signer);
    ck.keys_match()?;
    Ok(ck)
}

/// Server config (as `server_config` without client certificates) whose
/// certificate comes from `cert`.
/// Under the state directory: the CA that issues client certificates for
/// identities. Kept apart from the main CA (`tls/`), whose certificates the
/// embedded backend accepts: an identity's certificate never reaches it.
pub const IDENTITY_CA_DIR: &str = "tls/identities";

/// Under the state directory: the CA whose certificates the egress proxy
/// presents to sandboxes for the HTTPS destinations it intercepts
/// (`ca.pem` is what a template or preset installs in the sandbox). A CA of
/// its own: a sandbox that trusts it trusts nothing else of the appliance.
pub const EGRESS_CA_DIR: &str = "egress";

/// Which CA vouches for a client certificate (`ClientTrust::classify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The appliance's identity CA (`token create --client-cert`).
    Own,
    /// The company's CA (`[auth.client_ca]`).
    Company,
    /// Neither: the certificate stands for nothing (a bearer token may).
    Untrusted,
}

/// The CAs whose client certificates may stand for identities: the
/// identity CA, and the company's where configured.
#[derive(Debug)]
pub struct ClientTrust {
    own: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    company: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    hints: Vec<rustls::DistinguishedName>,
}

impl ClientTrust {
    pub fn new(own_ca: &[u8], company_ca: Option<&[u8]>) -> Result<Self, TlsError> {
        let verifier =
            |pem: &[u8]| -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
                rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots(pem)?),
                    provider(),
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::Pem(format!("client verifier: {e}")))
            };
        let own = verifier(own_ca)?;
        let company = company_ca.map(verifier).transpose()?;
        let mut hints = own.root_hint_subjects().to_vec();
        if let Some(c) = &company {
            hints.extend_from_slice(c.root_hint_subjects());
        }
        Ok(Self {
            own,
            company,
            hints,
        })
    }

    /// Which CA issued the certificate chain a client presented (its key
    /// already proven by the handshake).
    pub fn classify(&self, chain: &[CertificateDer<'_>]) -> Verdict {
        let Some((ee, intermediates)) = chain.split_first() else {
            return Verdict::Untrusted;
        };
        let now = rustls_pki_types::UnixTime::now();
        if self.own.verify_client_cert(ee, intermediates, now).is_ok() {
            return Verdict::Own;
        }
        if self
            .company
            .as_ref()
            .is_some_and(|c| c.verify_client_cert(ee, intermediates, now).is_ok())
        {
            return Verdict::Company;
        }
        Verdict::Untrusted
    }
}

/// The handshake's side of [`ClientTrust`]: it asks for a certificate
/// (naming both CAs), needs none, and lets a client whose certificate no CA
/// vouches for finish the handshake, so that its bearer token still counts;
/// the holder must still prove its key. Which CA vouches is judged after
/// the handshake (`classify`), and an untrusted certificate stands for no
/// identity.
#[derive(Debug)]
struct Tolerant(Arc<ClientTrust>);

impl rustls::server::danger::ClientCertVerifier for Tolerant {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &self.0.hints
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        Ok(rustls::server::danger::ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.own.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.own.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.own.supported_verify_schemes()
    }
}

/// The listener's config: the served certificate, and client certificates
/// judged by `trust` after the handshake (none required, an untrusted one
/// no reason to fail it).
pub fn server_config_trusting(
    cert: Arc<SwappableCert>,
    trust: Arc<ClientTrust>,
) -> Result<rustls::ServerConfig, TlsError> {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(Arc::new(Tolerant(trust)))
        .with_cert_resolver(cert);
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// What `cert show` prints about a certificate.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct CertInfo {
    pub subject: String,
    /// DNS names and IP addresses.
    pub names: Vec<String>,
    /// RFC 3339.
    pub not_before: String,
    pub not_after: String,
    pub not_after_unix: i64,
    /// SHA-256 of the DER (`AA:BB:…`).
    pub sha256: String,
}

impl CertInfo {
    /// Whole days left at `now_unix` (negative once expired).
    pub fn days_left(&self, now_unix: i64) -> i64 {
        (self.not_after_unix - now_unix).div_euclid(86_400)
    }

    /// Whether every name in `names` is in the certificate.
    pub fn covers(&self, names: &[String]) -> bool {
        names.iter().all(|n| self.names.contains(n))
    }
}

/// Parse the first certificate of a PEM file.
pub fn cert_info(pem: &[u8]) -> Result<CertInfo, TlsError> {
    use x509_parser::extensions::GeneralName;
    let der = parse_certs(pem)?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::Pem("no certificate found in PEM".into()))?;
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
        .map_err(|e| TlsError::Pem(format!("invalid certificate: {e}")))?;
    let mut names = vec![];
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) => names.push(d.to_string()),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => {
                        let a: [u8; 4] = (*b).try_into().unwrap_or_default();
                        names.push(std::net::Ipv4Addr::from(a).to_string());
                    }
                    16 => {
                        let a: [u8; 16] = (*b).try_into().unwrap_or_default();
                        names.push(std::net::Ipv6Addr::from(a).to_string());
                    }
                    _ => {}
                },
                _ => {}
            }
        }
    }
    let rfc3339 = |t: &x509_parser::time::ASN1Time| {
        t.to_datetime()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default()
    };
    let v = cert.validity();
    Ok(CertInfo {
        subject: cert.subject().to_string(),
        names,
        not_before: rfc3339(&v.not_before),
        not_after: rfc3339(&v.not_after),
        not_after_unix: v.not_after.timestamp(),
        sha256: sha2::Sha256::digest(der.as_ref())
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect::<Vec<_>>()
            .join(":"),
    })
}

/// A server leaf is reissued when it has fewer days left than this.
pub const RENEW_DAYS: i64 = 30;

impl LocalCa {
    /// Issue `<name>.pem` / `<name>.key` anew, replacing the files (key
    /// first, each written atomically).
    pub fn reissue_server(
        &self,
        name: &str,
        server_names: &[String],
    ) -> Result<(PathBuf, PathBuf), TlsError> {
        let cert = self.dir.join(format!("{name}.pem"));
        let key = self.dir.join(format!("{name}.key"));
        let (c, k) = self.issue_server(server_names)?;
        self.write_key(&key, &k)?;
        write_private(&cert, c.as_bytes(), 0o644)?;
        Ok((cert, key))
    }

    /// The server leaf for `names`: the files as they are when they cover
    /// every name and have more than `RENEW_DAYS` left, else reissued.
    /// Returns the certificate and its key (PEM) and whether it was reissued.
    pub fn server_leaf(
        &self,
        name: &str,
        names: &[String],
        now_unix: i64,
    ) -> Result<(Vec<u8>, String, bool), TlsError> {
        let (cert, key) = self.leaf_files(name, Some(names))?;
        let pem = std::fs::read(&cert).map_err(io(format!("read {}", cert.display())))?;
        let fresh = cert_info(&pem)
            .map(|i| i.covers(names) && i.days_left(now_unix) > RENEW_DAYS)
            .unwrap_or(false);
        if fresh
            && let Ok(k) = self.read_key(&key)
            && certified_key(&pem, k.as_bytes()).is_ok()
        {
            return Ok((pem, k, false));
        }
        let (cert, key) = self.reissue_server(name, names)?;
        let pem = std::fs::read(&cert).map_err(io(format!("read {}", cert.display())))?;
        Ok((pem, self.read_key(&key)?, true))
    }
}

/// This host's name (empty when it has none).
fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default()
}

/// A client certificate that stands for an identity, as handed to its
/// holder: `client.pem`, `client.key` and `ca.pem` (the CA of the
/// appliance's server certificate, for the holder's trust). No `Debug`:
/// it holds the private key.
pub struct ClientBundle {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
    /// SHA-256 of the certificate (DER): what the identity record keeps.
    pub sha256: [u8; 32],
}

/// Issue a client certificate (common name `subject`) from the identity CA
/// of the state directory `state` (`IDENTITY_CA_DIR`, keys sealed by
/// `sealer`), dated by `clock`. `token create --client-cert` and the
/// console's certificate form both issue through here.
pub fn issue_identity_cert(
    state: &Path,
    sealer: crate::secrets::Sealer,
    clock: crate::clock::Clock,
    subject: &str,
) -> Result<ClientBundle, TlsError> {
    let ca = LocalCa::load_or_create_clocked(&state.join(IDENTITY_CA_DIR), Some(sealer), clock)?;
    let (cert_pem, key_pem) = ca.issue_client(subject)?;
    let p = state.join("tls/ca.pem");
    let ca_pem = std::fs::read_to_string(&p).map_err(io(format!("read {}", p.display())))?;
    let der = parse_certs(cert_pem.as_bytes())?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::Pem("no certificate was issued".into()))?;
    Ok(ClientBundle {
        sha256: sha2::Sha256::digest(der.as_ref()).into(),
        cert_pem,
        key_pem,
        ca_pem,
    })
}

/// The names the server certificate carries: localhost, the loopback
/// addresses, the host's name and addresses, the listen address and the
/// configured `server_names` (`extra`).
pub fn server_names(extra: &[String], addr: std::net::SocketAddr) -> Vec<String> {
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    let host = hostname();
    if !host.is_empty() {
        names.push(host);
    }
    if !addr.ip().is_unspecified() {
        names.push(addr.ip().to_string());
    }
    // The host's own addresses, so agents may use any of them.
    if let Ok(ifs) = nix::ifaddrs::getifaddrs() {
        for i in ifs {
            let Some(a) = i.address else { continue };
            if let Some(v4) = a.as_sockaddr_in() {
                names.push(v4.ip().to_string());
            } else if let Some(v6) = a.as_sockaddr_in6() {
                let ip = v6.ip();
                // Link-local addresses need a zone and cannot be in a SAN.
                if (ip.segments()[0] & 0xffc0) != 0xfe80 {
                    names.push(ip.to_string());
                }
            }
        }
    }
    names.extend(extra.iter().cloned());
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA given a manual clock dates its leaves by it and renews them
    /// when that clock, not the real one, says they expire.
    #[test]
    fn a_manual_clock_dates_and_renews_leaves() {
        install_default_provider();
        let dir = tempfile::tempdir().unwrap();
        let start = time::OffsetDateTime::from_unix_timestamp(1_900_000_000).unwrap();
        let m = crate::clock::ManualClock::new(start);
        let ca = LocalCa::load_or_create_clocked(dir.path(), None, m.clone().into()).unwrap();
        let (cert, _) = ca.leaf_files("client", None).unwrap();
        let first = std::fs::read(&cert).unwrap();
        let info = cert_info(&first).unwrap();
        assert_eq!(info.not_after_unix, 1_900_000_000 + 397 * 86_400);
        m.advance(time::Duration::days(397 - RENEW_DAYS - 1));
        ca.leaf_files("client", None).unwrap();
        assert_eq!(std::fs::read(&cert).unwrap(), first, "fresh: kept");
        m.advance(time::Duration::days(2));
        ca.leaf_files("client", None).unwrap();
        let renewed = cert_info(&std::fs::read(&cert).unwrap()).unwrap();
        assert_eq!(
            renewed.not_after_unix,
            m.now().unix_timestamp() + 397 * 86_400
        );
    }

    /// A leaf with `RENEW_DAYS` or fewer left is reissued by `leaf_files`;
    /// a fresh one is kept; `server_leaf` also reissues for new names.
    #[test]
    fn leaves_renew_themselves() {
        install_default_provider();
        let dir = tempfile::tempdir().unwrap();
        let ca = LocalCa::load_or_create(dir.path()).unwrap();
        let (cert, _) = ca.leaf_files("client", None).unwrap();
        let first = std::fs::read(&cert).unwrap();
        ca.leaf_files("client", None).unwrap();
        assert_eq!(std::fs::read(&cert).unwrap(), first, "fresh: kept");
        // An expiring one in its place.
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.not_after = crate::clock::system_now() + time::Duration::days(RENEW_DAYS - 1);
        let key = KeyPair::generate().unwrap();
        let old = p
            .signed_by(&key, &Issuer::from_params(&ca.params, &ca.key))
            .unwrap();
        write_private(&cert, old.pem().as_bytes(), 0o644).unwrap();
        ca.leaf_files("client", None).unwrap();
        let renewed = cert_info(&std::fs::read(&cert).unwrap()).unwrap();
        assert!(
            renewed.days_left(crate::clock::now().1) > 390,
            "{renewed:?}"
        );

        let names = vec!["localhost".to_string()];
        let now = crate::clock::now().1;
        let (a, _, _) = ca.server_leaf("server", &names, now).unwrap();
        let (b, _, reissued) = ca.server_leaf("server", &names, now).unwrap();
        assert!(!reissued);
        assert_eq!(a, b);
        let more = vec!["localhost".to_string(), "cube.example".to_string()];
        let (c, _, reissued) = ca.server_leaf("server", &more, now).unwrap();
        assert!(reissued);
        assert!(cert_info(&c).unwrap().covers(&more));
    }
}
