//! The company's client CA (issue 19): certificates it issued stand for
//! the identities `[auth.client_ca]` lists by subject, a revoked one is
//! refused, and a certificate from a CA nobody trusts does not break the
//! handshake for a client that also sends a bearer token.

use cube_adapter::config::{ClientCaIdentity, ClientCaSection};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};
use reqwest::StatusCode;
use serde_json::json;

use crate::kit::{Server, code};

/// A CA made here.
struct Ca {
    params: CertificateParams,
    key: KeyPair,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![]).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let pem = params.self_signed(&key).unwrap().pem();
        Self { params, key, pem }
    }

    /// A client certificate with `uri` as its URI SAN: (cert PEM, key PEM,
    /// SHA-256 hex).
    fn client(&self, uri: &str) -> (String, String, String) {
        use sha2::Digest;
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec![]).unwrap();
        p.distinguished_name.push(DnType::CommonName, "an agent");
        p.subject_alt_names = vec![SanType::URI(uri.try_into().unwrap())];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p
            .signed_by(&key, &Issuer::from_params(&self.params, &self.key))
            .unwrap();
        let sha = hex::encode(sha2::Sha256::digest(cert.der()));
        (cert.pem(), key.serialize_pem(), sha)
    }
}

/// A client of `s` presenting `cert`.
fn client_with(s: &Server, cert: &(String, String, String)) -> reqwest::Client {
    let ca = std::fs::read(s.state.join("tls/ca.pem")).unwrap();
    let tls =
        cube_adapter::tls::client_config(Some(&ca), Some((cert.0.as_bytes(), cert.1.as_bytes())))
            .unwrap();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_companys_certificates_stand_for_their_identities() {
    let company = Ca::new("Example Corp Issuing CA");
    let stranger = Ca::new("Nobody We Know");
    let agent = company.client("spiffe://acme/agent-1");
    let revoked = company.client("spiffe://acme/agent-2");
    let unlisted = company.client("spiffe://acme/agent-3");
    let foreign = stranger.client("spiffe://acme/agent-1");
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("company-ca.pem");
    std::fs::write(&ca_file, &company.pem).unwrap();
    let identity = |subject: &str| ClientCaIdentity {
        subject: subject.into(),
        tenant: "acme".into(),
        roles: vec![],
        runtimes: vec![],
        profiles: vec![],
        actions: vec!["lease:*".into()],
        task_templates: vec![],
    };
    let section = ClientCaSection {
        ca_file,
        subject: "san_uri".into(),
        revoked: vec![revoked.2.clone()],
        identities: vec![
            identity("spiffe://acme/agent-1"),
            identity("spiffe://acme/agent-2"),
        ],
    };
    let s = Server::start_with(|c| c.auth.client_ca = Some(section)).await;
    let get = |http: reqwest::Client, bearer: Option<String>| {
        let url = format!("{}/v1/leases", s.url);
        async move {
            let mut r = http.get(url);
            if let Some(b) = bearer {
                r = r.bearer_auth(b);
            }
            let r = r.send().await.expect("the handshake completes");
            let st = r.status();
            (st, r.json::<serde_json::Value>().await.unwrap())
        }
    };

    // Listed: its identity, with its scopes.
    let http = client_with(&s, &agent);
    assert_eq!(get(http.clone(), None).await.0, StatusCode::OK);
    let r = http
        .post(format!("{}/v1/leases/acquire", s.url))
        .json(&json!({"runtime": "mcp", "session_key": "cert-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let lease: serde_json::Value = r.json().await.unwrap();
    let r = http
        .post(format!(
            "{}/v1/leases/{}/exec",
            s.url,
            lease["lease_ref"].as_str().unwrap()
        ))
        .json(&json!({"command": "true"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        StatusCode::FORBIDDEN,
        "exec is not in its scopes"
    );

    // Revoked by fingerprint; issued but not listed.
    for who in [&revoked, &unlisted] {
        let (st, v) = get(client_with(&s, who), None).await;
        assert_eq!((st, code(&v)), (StatusCode::UNAUTHORIZED, "unauthorized"));
    }
    // A CA nobody trusts: the handshake completes; its bearer token counts,
    // the certificate alone stands for nothing.
    let (st, _) = get(client_with(&s, &foreign), Some(s.admin.clone())).await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = get(client_with(&s, &foreign), None).await;
    assert_eq!((st, code(&v)), (StatusCode::UNAUTHORIZED, "unauthorized"));
    s.stop().await;
}
