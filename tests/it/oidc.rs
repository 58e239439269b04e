//! Identity from the enterprise (issue 19): OIDC JWT bearers, from a real
//! provider (`oidc-provider` from npm, `tests/oidc/provider.mjs`) and from
//! keys the test makes, served by a JWKS the test can rotate and take
//! down.

use std::sync::{Arc, Mutex};

use cube_adapter::config::{ClaimNames, ConsoleOidc, OidcIssuer};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::{Server, code};

fn now() -> u64 {
    cube_adapter::clock::system_time()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// An ES256 key made here, and its JWK.
struct TestKey {
    kid: String,
    enc: EncodingKey,
    jwk: Value,
    /// The public key's bytes (for a token "signed" with them as an HMAC
    /// secret).
    public: Vec<u8>,
}

impl TestKey {
    fn new(kid: &str) -> Self {
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let raw = kp.public_key_raw().to_vec();
        // Uncompressed point: 0x04, x (32 bytes), y (32 bytes).
        let jwk = json!({
            "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
            "x": b64(&raw[1..33]), "y": b64(&raw[33..65]),
        });
        Self {
            kid: kid.into(),
            enc: EncodingKey::from_ec_der(&kp.serialize_der()),
            jwk,
            public: kp.public_key_pem().into_bytes(),
        }
    }

    fn sign(&self, claims: &Value) -> String {
        let mut h = Header::new(Algorithm::ES256);
        h.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&h, claims, &self.enc).unwrap()
    }
}

#[derive(Default)]
struct JwksState {
    keys: Vec<Value>,
    down: bool,
    fetches: usize,
    /// Requests answered 503 while down.
    refused: usize,
}

/// A provider's discovery document and JWKS on 127.0.0.1, as the test
/// sets them.
struct Jwks {
    issuer: String,
    state: Arc<Mutex<JwksState>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Jwks {
    async fn start() -> Self {
        use axum::routing::get;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let issuer = format!("http://{}", listener.local_addr().unwrap());
        let state: Arc<Mutex<JwksState>> = Arc::default();
        let (s1, s2, iss) = (state.clone(), state.clone(), issuer.clone());
        let app = axum::Router::new()
            .route(
                "/.well-known/openid-configuration",
                get(move || {
                    let (s, iss) = (s1.clone(), iss.clone());
                    async move {
                        let mut s = s.lock().unwrap();
                        if s.down {
                            s.refused += 1;
                            return Err(StatusCode::SERVICE_UNAVAILABLE);
                        }
                        Ok(axum::Json(
                            json!({"issuer": iss, "jwks_uri": format!("{iss}/jwks")}),
                        ))
                    }
                }),
            )
            .route(
                "/jwks",
                get(move || {
                    let s = s2.clone();
                    async move {
                        let mut s = s.lock().unwrap();
                        if s.down {
                            s.refused += 1;
                            return Err(StatusCode::SERVICE_UNAVAILABLE);
                        }
                        s.fetches += 1;
                        Ok(axum::Json(json!({"keys": s.keys})))
                    }
                }),
            );
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            issuer,
            state,
            _task: task,
        }
    }

    fn publish(&self, k: &TestKey) {
        self.state.lock().unwrap().keys.push(k.jwk.clone());
    }

    fn fetches(&self) -> usize {
        self.state.lock().unwrap().fetches
    }
}

fn issuer(iss: &str, audience: &str, algorithms: &[&str]) -> OidcIssuer {
    OidcIssuer {
        issuer: iss.into(),
        audience: audience.into(),
        algorithms: algorithms.iter().map(|a| a.to_string()).collect(),
        jwks_url: None,
        ca_file: None,
        leeway_seconds: 30,
        claims: ClaimNames::default(),
        tenant: None,
        tenants: vec!["acme".into()],
        allowed_roles: vec!["agent".into()],
    }
}

/// GET /v1/leases with `token`: the status and the error code, if any.
async fn list_with(s: &Server, token: &str) -> (StatusCode, String) {
    let (st, v) = s.get(token, "/v1/leases").await;
    (st, code(&v).to_string())
}

/// Keys made here: what holds is accepted, what does not is 401
/// `invalid_token`; keys are fetched again for a new `kid` (at most once a
/// minute); a JWKS that is down leaves the keys already fetched working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_that_do_not_hold_are_refused() {
    let jwks = Jwks::start().await;
    let a = TestKey::new("key-a");
    jwks.publish(&a);
    // A second issuer, whose JWKS goes down.
    let jwks2 = Jwks::start().await;
    let e = TestKey::new("key-e");
    jwks2.publish(&e);
    let iss = jwks.issuer.clone();
    let iss2 = jwks2.issuer.clone();
    let s = Server::start_with(|c| {
        c.auth.oidc = vec![issuer(&iss, "cube-adapter", &["ES256"]), {
            // A fixed tenant: its tokens carry none.
            let mut i = issuer(&iss2, "cube-adapter", &["ES256"]);
            i.tenant = Some("globex".into());
            i.tenants = vec![];
            i
        }]
    })
    .await;
    let t = now();
    let claims = |over: Value| {
        let mut c = json!({
            "iss": iss, "aud": "cube-adapter", "sub": "agent-7", "tenant_id": "acme",
            "roles": "agent", "cube_actions": ["lease:list"], "iat": t, "exp": t + 300, "jti": rand::random::<u64>().to_string(),
        });
        for (k, v) in over.as_object().unwrap() {
            if v.is_null() {
                c.as_object_mut().unwrap().remove(k);
            } else {
                c[k] = v.clone();
            }
        }
        c
    };
    let ok = a.sign(&claims(json!({})));
    assert_eq!(list_with(&s, &ok).await.0, StatusCode::OK);

    let refused = [
        ("expired", a.sign(&claims(json!({"exp": t - 120})))),
        ("not yet valid", a.sign(&claims(json!({"nbf": t + 3600})))),
        (
            "another issuer",
            a.sign(&claims(json!({"iss": "http://127.0.0.1:9/other"}))),
        ),
        (
            "another audience",
            a.sign(&claims(json!({"aud": "someone-else"}))),
        ),
        ("no subject", a.sign(&claims(json!({"sub": null})))),
        ("no expiry", a.sign(&claims(json!({"exp": null})))),
        ("a bad tenant", a.sign(&claims(json!({"tenant_id": "a b"})))),
        (
            "roles none of ours",
            a.sign(&claims(json!({"roles": ["offline_access"]}))),
        ),
        // The issuer's ceilings (#34 M3): a tenant it may not name, a
        // role above its allowed_roles, no roles claim, no tenant claim
        // (never `sub` instead).
        (
            "a tenant outside the issuer's",
            a.sign(&claims(json!({"tenant_id": "globex"}))),
        ),
        (
            "a role above allowed_roles",
            a.sign(&claims(json!({"roles": ["agent", "admin"]}))),
        ),
        ("no roles claim", a.sign(&claims(json!({"roles": null})))),
        (
            "no tenant claim",
            a.sign(&claims(json!({"tenant_id": null, "sub": "acme"}))),
        ),
        ("alg none", {
            let h = b64(br#"{"alg":"none","typ":"JWT"}"#);
            let p = b64(claims(json!({})).to_string().as_bytes());
            format!("{h}.{p}.c2ln")
        }),
        ("HS256 with the public key as secret", {
            let mut h = Header::new(Algorithm::HS256);
            h.kid = Some(a.kid.clone());
            jsonwebtoken::encode(&h, &claims(json!({})), &EncodingKey::from_secret(&a.public))
                .unwrap()
        }),
        ("a forged signature", {
            let other = TestKey::new("key-a");
            other.sign(&claims(json!({})))
        }),
    ];
    for (what, token) in &refused {
        let (st, c) = list_with(&s, token).await;
        assert_eq!(
            (st, c.as_str()),
            (StatusCode::UNAUTHORIZED, "invalid_token"),
            "{what}"
        );
    }
    // `alg: none` without a signature (`header.payload.`) is a JWT too,
    // refused as any bad one is (docs/operations.md: 401 `invalid_token`).
    let bare = {
        let h = b64(br#"{"alg":"none","typ":"JWT"}"#);
        let p = b64(claims(json!({})).to_string().as_bytes());
        format!("{h}.{p}.")
    };
    let (st, c) = list_with(&s, &bare).await;
    assert_eq!(
        (st, c.as_str()),
        (StatusCode::UNAUTHORIZED, "invalid_token")
    );
    // Within the allowed clock skew (30 s).
    let late = a.sign(&claims(json!({"exp": t - 5})));
    assert_eq!(list_with(&s, &late).await.0, StatusCode::OK);

    // A new key: one fetch finds it.
    let b = TestKey::new("key-b");
    jwks.publish(&b);
    let before = jwks.fetches();
    assert_eq!(
        list_with(&s, &b.sign(&claims(json!({})))).await.0,
        StatusCode::OK
    );
    assert_eq!(jwks.fetches(), before + 1);
    // Another unknown kid within the minute: no fetch, refused.
    let c = TestKey::new("key-c");
    jwks.publish(&c);
    let (st, code) = list_with(&s, &c.sign(&claims(json!({})))).await;
    assert_eq!(
        (st, code.as_str()),
        (StatusCode::UNAUTHORIZED, "invalid_token")
    );
    assert_eq!(jwks.fetches(), before + 1, "at most one fetch a minute");

    // The second issuer's JWKS goes down: its known keys keep working, a
    // new kid is a 401 (never a 503) after one failed fetch.
    let claims2 = |exp: u64| {
        json!({
            "iss": iss2, "aud": "cube-adapter", "sub": "agent-9", "exp": exp,
            "roles": ["agent"], "cube_actions": "lease:list",
            "jti": rand::random::<u64>().to_string(),
        })
    };
    assert_eq!(
        list_with(&s, &e.sign(&claims2(t + 300))).await.0,
        StatusCode::OK
    );
    jwks2.state.lock().unwrap().down = true;
    let f = TestKey::new("key-f");
    let (st, code) = list_with(&s, &f.sign(&claims2(t + 300))).await;
    assert_eq!(
        (st, code.as_str()),
        (StatusCode::UNAUTHORIZED, "invalid_token")
    );
    assert!(jwks2.state.lock().unwrap().refused >= 1, "it tried");
    assert_eq!(
        list_with(&s, &e.sign(&claims2(t + 301))).await.0,
        StatusCode::OK
    );
    // One issuer's key does not vouch for the other's tokens.
    let (st, code) = list_with(&s, &a.sign(&claims2(t + 300))).await;
    assert_eq!(
        (st, code.as_str()),
        (StatusCode::UNAUTHORIZED, "invalid_token")
    );
    // The fixed-tenant issuer: its own tenant named is fine, another
    // tenant (the first issuer's) is refused.
    let mut named = claims2(t + 302);
    named["tenant_id"] = json!("globex");
    assert_eq!(list_with(&s, &e.sign(&named)).await.0, StatusCode::OK);
    named["tenant_id"] = json!("acme");
    let (st, code) = list_with(&s, &e.sign(&named)).await;
    assert_eq!(
        (st, code.as_str()),
        (StatusCode::UNAUTHORIZED, "invalid_token")
    );
    // Absent actions grant none (the reference took `*`).
    let (st, code) = list_with(&s, &a.sign(&claims(json!({"cube_actions": null})))).await;
    assert_eq!(
        (st, code.as_str()),
        (StatusCode::FORBIDDEN, "action_denied")
    );
    s.stop().await;
}

/// The certified `oidc-provider` on 127.0.0.1 (tests/oidc/provider.mjs).
pub struct Provider {
    pub issuer: String,
    child: std::process::Child,
}

impl Provider {
    pub fn start(env: &[(&str, &str)]) -> Self {
        use std::io::BufRead;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oidc");
        assert!(
            dir.join("node_modules/oidc-provider").exists(),
            "oidc-provider is not installed: npm ci --prefix tests/oidc (.ci/run does it)"
        );
        let mut cmd = std::process::Command::new("node");
        cmd.arg(dir.join("provider.mjs"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .expect("node (Debian's nodejs; .ci/run installs it)");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        Self {
            issuer: v["issuer"].as_str().unwrap().to_string(),
            child,
        }
    }

    /// A machine token by client_credentials, for `resource` (its `aud`).
    pub async fn agent_token(&self, client: &str, secret: &str, resource: &str) -> String {
        let r = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .post(format!("{}/token", self.issuer))
            .basic_auth(client, Some(secret))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(
                url::form_urlencoded::Serializer::new(String::new())
                    .append_pair("grant_type", "client_credentials")
                    .append_pair("resource", resource)
                    .finish(),
            )
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "token: {}", r.status());
        let v: Value = r.json().await.unwrap();
        v["access_token"].as_str().unwrap().to_string()
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const AUDIENCE: &str = "https://cube-adapter.test";
const AGENT: (&str, &str) = ("cube-agent", "agent-secret-0123456789abcdef");

/// A real provider's machine tokens are bearers on /v1 with the principal
/// their claims say (tenant, profiles, actions); the audit names the
/// issuer by digest; a token for another audience is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_providers_tokens_are_bearers_with_their_claims() {
    let idp = Provider::start(&[(
        "OIDC_AGENT_CLAIMS",
        r#"{"tenant_id":"acme","roles":"runtime offline_access","cube_profiles":["offline-code"],"cube_actions":["lease:*","exec:run","job:*"]}"#,
    )]);
    let iss = idp.issuer.clone();
    let s = Server::start_with(|c| c.auth.oidc = vec![issuer(&iss, AUDIENCE, &["RS256"])]).await;
    let token = idp.agent_token(AGENT.0, AGENT.1, AUDIENCE).await;
    assert!(token.len() > 512, "longer than any token of ours");

    let (st, lease) = s
        .post(
            &token,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "oidc-1"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{lease}");
    let lease_ref = lease["lease_ref"].as_str().unwrap().to_string();
    let (st, out) = s
        .post(
            &token,
            &format!("/v1/leases/{lease_ref}/exec"),
            json!({"command": "echo via-oidc"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{out}");
    assert_eq!(out["stdout"], "via-oidc\n");
    // Not in its cube_actions.
    let (st, v) = s
        .post(
            &token,
            &format!("/v1/leases/{lease_ref}/write"),
            json!({"path": "/workspace/x", "content": "x"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    // Not in its cube_profiles.
    let (st, v) = s
        .post(
            &token,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "oidc-2", "profile": "persistent-code"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    // Its tenant's listing (the token's) holds the lease.
    let (st, mine) = s.get(&token, "/v1/leases").await;
    assert_eq!(st, StatusCode::OK);
    assert!(mine.to_string().contains(&lease_ref), "{mine}");

    // The same token on /mcp and on an event stream.
    let mcp = |token: String| {
        let (http, url) = (s.http.clone(), format!("{}/mcp", s.url));
        async move {
            http.post(url)
                .bearer_auth(token)
                .header("accept", "application/json, text/event-stream")
                .json(
                    &json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "oidc-test", "version": "1"}}}),
                )
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(mcp(token.clone()).await, StatusCode::OK);
    let (st, job) = s
        .post(
            &token,
            &format!("/v1/leases/{lease_ref}/jobs"),
            json!({"command": "echo job-out"}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{job}");
    let job_ref = job["job_ref"].as_str().unwrap();
    let events = s
        .http
        .get(format!("{}/v1/jobs/{job_ref}/events", s.url))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), StatusCode::OK);
    assert!(
        events.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"),
        "an event stream"
    );
    drop(events);

    let wrong = idp
        .agent_token(AGENT.0, AGENT.1, "https://other.test")
        .await;
    assert_eq!(mcp(wrong.clone()).await, StatusCode::UNAUTHORIZED);
    let (st, v) = s.get(&wrong, "/v1/leases").await;
    assert_eq!((st, code(&v)), (StatusCode::UNAUTHORIZED, "invalid_token"));

    let journal = s.journal();
    let exec = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["action"] == "exec" && e["phase"] == "intent")
        .expect("an exec intent");
    assert!(exec["issuer_digest"].is_string(), "{exec}");
    assert!(!journal.contains(&iss), "the issuer only as a digest");
    assert!(
        !journal.contains("cube-agent"),
        "the subject only as a digest"
    );
    s.stop().await;
}

/// Each issuer has a ceiling (#34 M3), with tokens from real providers:
/// a tenant the issuer may not name, a role above its `allowed_roles`,
/// and no roles claim are refused (401 `invalid_token`, logged without
/// the token); no actions claim grants no action. A second provider (a
/// contractor's, fixed to its own tenant) cannot mint the first one's
/// tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_issuer_has_a_ceiling_of_tenants_and_roles() {
    let agent =
        |claims: Value| json!({"secret": "agent-secret-0123456789abcdef", "claims": claims});
    let extra = json!({
        "other-tenant": agent(json!({"tenant_id": "globex", "roles": ["agent"], "cube_actions": ["lease:*"]})),
        "wants-admin": agent(json!({"tenant_id": "acme", "roles": ["agent", "admin"], "cube_actions": ["lease:*"]})),
        "no-roles": agent(json!({"tenant_id": "acme", "cube_actions": ["lease:*"]})),
        "no-actions": agent(json!({"tenant_id": "acme", "roles": "agent"})),
        "approver": agent(json!({"tenant_id": "acme", "roles": "approver", "cube_actions": ["lease:list"]})),
    })
    .to_string();
    let idp = Provider::start(&[
        (
            "OIDC_AGENT_CLAIMS",
            r#"{"tenant_id":"acme","roles":"agent","cube_actions":["lease:*"]}"#,
        ),
        ("OIDC_EXTRA_AGENTS", &extra),
    ]);
    // The contractor's provider: its agents say they are acme's.
    let contractor = Provider::start(&[(
        "OIDC_AGENT_CLAIMS",
        r#"{"tenant_id":"acme","roles":"agent","cube_actions":["lease:*"]}"#,
    )]);
    let (iss, iss2) = (idp.issuer.clone(), contractor.issuer.clone());
    let s = Server::start_with(|c| {
        let mut main = issuer(&iss, AUDIENCE, &["RS256"]);
        main.allowed_roles = vec!["agent".into(), "approver".into()];
        let mut other = issuer(&iss2, AUDIENCE, &["RS256"]);
        other.tenant = Some("contractor".into());
        other.tenants = vec![];
        c.auth.oidc = vec![main, other];
    })
    .await;
    async fn token(p: &Provider, client: &str) -> String {
        p.agent_token(client, AGENT.1, AUDIENCE).await
    }

    // Within the ceilings: the agent, and an approver (allowed here).
    let ok = token(&idp, AGENT.0).await;
    assert_eq!(list_with(&s, &ok).await.0, StatusCode::OK);
    let approver = token(&idp, "approver").await;
    assert_eq!(list_with(&s, &approver).await.0, StatusCode::OK);

    for (client, what) in [
        ("other-tenant", "is not one this issuer may name"),
        ("wants-admin", "role admin is above"),
        ("no-roles", "has no roles claim"),
    ] {
        let t = token(&idp, client).await;
        let (st, v) = s.get(&t, "/v1/leases").await;
        assert_eq!(
            (st, code(&v)),
            (StatusCode::UNAUTHORIZED, "invalid_token"),
            "{client}: {v}"
        );
        assert!(
            v["error"]["message"].as_str().unwrap().contains(what),
            "{client}: {v}"
        );
        // Not an acquire either (nothing was granted).
        let (st, _) = s
            .post(
                &t,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": client}),
            )
            .await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{client}");
    }
    // No actions claim: authenticated, and allowed nothing.
    let none = token(&idp, "no-actions").await;
    let (st, v) = s.get(&none, "/v1/leases").await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::FORBIDDEN, "action_denied"),
        "{v}"
    );
    let (st, v) = s
        .post(
            &none,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "none"}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");

    // The contractor's token naming acme is refused; the same issuer's
    // fixed tenant is the contractor's own.
    let forged = token(&contractor, AGENT.0).await;
    let (st, v) = s.get(&forged, "/v1/leases").await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::UNAUTHORIZED, "invalid_token"),
        "{v}"
    );
    let why = v["error"]["message"].as_str().unwrap();
    assert!(why.contains("tenant \"acme\" is not one"), "{v}");
    s.stop().await;
}

/// `[console.oidc]` for a provider on 127.0.0.1 and a console at `console`
/// (`https://127.0.0.1:PORT`); the client secret in `dir`.
fn console_oidc(issuer: &str, console: &str, dir: &std::path::Path) -> ConsoleOidc {
    let secret = dir.join("console-secret");
    std::fs::write(&secret, format!("{CONSOLE_SECRET}\n")).unwrap();
    toml::from_str(&format!(
        r#"
        issuer = "{issuer}"
        client_id = "cube-console"
        client_secret_file = "{}"
        redirect_url = "{console}/console/oidc/callback"
        label = "Test IdP"
        approver = ["cube-approvers"]
        auditor = ["cube-auditors"]
        tenants = ["acme"]
        "#,
        secret.display()
    ))
    .unwrap()
}

const CONSOLE_SECRET: &str = "console-secret-0123456789abcdef";
const ACCOUNTS: &str = r#"{
  "alice": {"email": "alice@example.test", "tenant_id": "acme", "groups": ["cube-approvers", "staff"]},
  "bob": {"email": "bob@example.test", "tenant_id": "acme", "groups": "cube-auditors"},
  "carol": {"email": "carol@example.test", "tenant_id": "acme", "groups": ["staff"]}
}"#;

/// People sign in to the console through a real provider in headless
/// Chromium (`tests/browser/oidc.mjs`): an approver and an auditor get their
/// roles from their groups, sign-out ends the session, a person with no
/// console role and a forged callback are refused; every sign-in is in
/// the journal with the issuer's digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn people_sign_in_to_the_console_with_the_provider_in_chromium() {
    let browser = crate::console::browser::preflight();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let console = format!("https://{}", listener.local_addr().unwrap());
    let idp = Provider::start(&[
        (
            "OIDC_REDIRECT_URIS",
            &format!("{console}/console/oidc/callback"),
        ),
        ("OIDC_ACCOUNTS", ACCOUNTS),
    ]);
    let keep = tempfile::tempdir().unwrap();
    let oidc = console_oidc(&idp.issuer, &console, keep.path());
    let s = Server::start_on(
        listener,
        |c| c.console.oidc = Some(oidc),
        Default::default(),
    )
    .await;
    assert_eq!(s.url, console);

    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-oidc");
    let _ = std::fs::remove_dir_all(&out);
    let spki = crate::console::browser::spki_sha256(
        &std::fs::read(s.state.join("tls/server.pem")).unwrap(),
    );
    let run = tokio::time::timeout(
        std::time::Duration::from_secs(180),
        tokio::process::Command::new("node")
            .arg(browser.join("oidc.mjs"))
            .current_dir(&browser)
            .env("CUBE_URL", &s.url)
            .env("CUBE_SPKI", &spki)
            .env("CUBE_OUT", &out)
            .env("CUBE_SCREENS", out.join("screens"))
            .env("OIDC_ISSUER", &idp.issuer)
            .env("OIDC_APPROVER", "alice")
            .env("OIDC_AUDITOR", "bob")
            .env("OIDC_NOBODY", "carol")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the browser script ends within 3 minutes")
    .expect("node runs");
    let log = String::from_utf8_lossy(&run.stderr).into_owned();
    let report: Value = serde_json::from_slice(
        &std::fs::read(out.join("report.json"))
            .unwrap_or_else(|e| panic!("no report from the browser script ({e}):\n{log}")),
    )
    .unwrap();
    assert!(
        run.status.success() && report["ok"] == true,
        "the browser sign-in failed (target/console-oidc/ has the report and pages):\n{log}\n{report:#}"
    );

    let events: Vec<Value> = s
        .journal()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|e: &Value| e["action"] == "console_sign_in")
        .collect();
    let ok: Vec<&Value> = events.iter().filter(|e| e["outcome"] == "ok").collect();
    assert_eq!(ok.len(), 2, "alice and bob: {events:#?}");
    assert!(ok.iter().all(|e| e["issuer_digest"].is_string()));
    let refused: Vec<&str> = events
        .iter()
        .filter(|e| e["outcome"] == "rejected")
        .filter_map(|e| e["error_code"].as_str())
        .collect();
    assert!(refused.contains(&"forbidden"), "carol: {refused:?}");
    assert!(
        refused.contains(&"invalid_state"),
        "the forged callback: {refused:?}"
    );
    let journal = s.journal();
    assert!(!journal.contains("alice"), "names only as digests");
    s.stop().await;
}

/// With `local_users = false`, people sign in only with the provider:
/// the password form is gone, posting it is refused, and HTTP Basic is
/// refused on /v1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_users_can_be_turned_off() {
    let keep = tempfile::tempdir().unwrap();
    let oidc = console_oidc("http://127.0.0.1:9", "https://127.0.0.1:1", keep.path());
    let s = Server::start_with(|c| {
        c.console.oidc = Some(oidc);
        c.console.local_users = false;
    })
    .await;
    let pw = keep.path().join("pw");
    std::fs::write(&pw, "long-enough-password\n").unwrap();
    let out = s.cli(&[
        "user",
        "add",
        "dora",
        "--tenant",
        "acme",
        "--role",
        "auditor",
        "--password-file",
        pw.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = s
        .http
        .get(format!("{}/console/sign-in", s.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("id=\"oidc-sign-in\"") && page.contains("Sign in with Test IdP"));
    assert!(!page.contains("type=\"password\""), "no password form");
    let r = s
        .http
        .post(format!("{}/console/sign-in", s.url))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("csrf=x&name=dora&password=long-enough-password")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = s
        .http
        .get(format!("{}/v1/leases", s.url))
        .basic_auth("dora", Some("long-enough-password"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    s.stop().await;
}
