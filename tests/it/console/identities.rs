//! Console: identities and connecting an agent (issue 15). Shares the
//! helpers of `console/mod.rs`.

use super::*;

const NEW_PASSWORD: &str = "a brand new passphrase 42";

impl Browser {
    /// POST a form as session `session`.
    async fn id_post(
        &self,
        path: &str,
        session: Option<&str>,
        fields: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut r = self
            .http
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(fields));
        if let Some(id) = session {
            r = r.header("cookie", format!("{SESSION}={id}"));
        }
        r.send().await.unwrap()
    }
}

/// `user list --json` of the CLI.
fn user_list(s: &Server) -> Vec<Value> {
    let out = std::process::Command::new(BIN)
        .args(["user", "list", "--json", "--state-dir"])
        .arg(&s.state)
        .arg("--config")
        .arg(s.empty_config())
        .output()
        .unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The token shown in a creation page's read-only field.
fn shown_token(html: &str) -> String {
    let at = html.find("value=\"cat_").expect("a token in the page") + 7;
    html[at..].split('"').next().unwrap().to_string()
}

/// GET /v1/leases with a bearer token: its status.
async fn v1_status(s: &Server, token: &str) -> StatusCode {
    client(s)
        .get(format!("{}/v1/leases", s.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
}

/// The identity digest a person's console sign-in recorded.
fn signed_in_identity(j: &str) -> Vec<String> {
    events(j, "console_sign_in", "ok")
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["identity_digest"].as_str().unwrap().to_string()
        })
        .collect()
}

/// One field of a journal line.
fn field(line: &str, name: &str) -> Value {
    let v: Value = serde_json::from_str(line).unwrap();
    v[name].clone()
}

/// An admin creates a token in the console: it is shown once, works on
/// /v1, is listed by the CLI, and is refused once revoked there. People:
/// add (with the password policy), disable (their session ends), enable,
/// reset a password (old one refused, sessions ended). Every change is
/// audited with the admin's identity; bad input gets its code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_manages_tokens_and_people() {
    let s = Server::start().await;
    user(&s, &["add", "root", "--tenant", "ops", "--role", "admin"]);
    let b = Browser::new(&s);

    // Signed out: the page and its forms send to the sign-in form.
    let r = b.get("/console/identities", None).await;
    assert_to_sign_in(r.status(), r.headers(), "identities signed out");
    let r = b
        .id_post(
            "/console/identities/tokens",
            None,
            &[("csrf", "x"), ("tenant", "acme")],
        )
        .await;
    assert_to_sign_in(r.status(), r.headers(), "token form signed out");

    let root = b.sign_in("root").await;
    let (st, html) = b.page("/console/identities", &root).await;
    assert_eq!(st, StatusCode::OK);
    assert_clean(&html, &s, Some(&root));
    for part in [
        "<h2 id=\"tokens-heading\">Tokens</h2>",
        "Certificate identities",
        "<h2 id=\"people-heading\">People</h2>",
        "aria-current=\"page\">Identities",
        "<label for=\"token-tenant\">Tenant</label>",
        // The tenant is chosen among those there are (issue #36): a new
        // one only by choosing so.
        "<select id=\"token-tenant\" name=\"tenant\" required",
        "<option value=\"admin\">admin</option>",
        "<option value=\"(new)\">A new tenant…</option>",
        "name=\"new_tenant\"",
    ] {
        assert!(html.contains(part), "{part}");
    }
    // The bootstrap admin token is listed by id, never shown.
    let before = s.token_list();
    let admin_id = before[0]["id"].as_str().unwrap();
    assert!(html.contains(&format!("<code>{admin_id}</code>")));
    let csrf = csrf_field(&html);

    // A foreign form: 403, nothing made.
    let r = b
        .id_post(
            "/console/identities/tokens",
            Some(&root),
            &[("csrf", "forged"), ("tenant", "acme")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(s.token_list().len(), before.len());

    // Bad input: the validation and codes of `token create`.
    for (fields, code) in [
        (vec![("tenant", "not a tenant!")], "invalid_tenant"),
        // "A new tenant…" without its name.
        (vec![("tenant", "(new)")], "invalid_tenant"),
        (
            vec![("tenant", "(new)"), ("new_tenant", "bad tenant!")],
            "invalid_tenant",
        ),
        (vec![("tenant", "acme"), ("role", "wizard")], "invalid_role"),
        (
            vec![("tenant", "acme"), ("runtimes", "cobol")],
            "invalid_runtime",
        ),
    ] {
        let mut f = vec![("csrf", csrf.as_str())];
        f.extend(fields);
        let r = b
            .id_post("/console/identities/tokens", Some(&root), &f)
            .await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{code}");
        let html = r.text().await.unwrap();
        assert!(html.contains(&format!("({code})")), "{code}: {html}");
        assert_clean(&html, &s, Some(&root));
    }
    assert_eq!(s.token_list().len(), before.len());

    // Create: shown once, with a copy button for the script.
    let r = b
        .id_post(
            "/console/identities/tokens",
            Some(&root),
            &[
                ("csrf", &csrf),
                ("subject", "console-agent"),
                ("tenant", "(new)"),
                ("new_tenant", "acme"),
                ("role", "agent"),
                ("runtimes", "mcp"),
                ("description", "made in the console"),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_no_store(r.headers(), "token created");
    assert_security_headers(r.headers(), "token created");
    let html = r.text().await.unwrap();
    let token = shown_token(&html);
    assert_eq!(
        html.matches(&token).count(),
        1,
        "the token once in the page"
    );
    assert!(html.contains("data-copy=\"new-token\""));
    assert!(html.contains("readonly"));
    assert!(html.contains("<script src=\"/console/static/console.js?v="));
    // Nothing else secret, no inline script or style.
    assert_clean(&html, &s, Some(&root));
    let id = token.split('_').nth(1).unwrap().to_string();

    // It works on /v1 and the CLI lists it.
    assert_eq!(v1_status(&s, &token).await, StatusCode::OK);
    let listed = s.token_list();
    let mine = listed
        .iter()
        .find(|t| t["id"] == id.as_str())
        .expect("the CLI lists the console's token");
    assert_eq!(mine["principal"]["subject"], "console-agent");
    assert_eq!(mine["principal"]["tenant"], "acme");
    assert_eq!(mine["principal"]["runtimes"], json!(["mcp"]));
    assert_eq!(mine["description"], "made in the console");

    // Later pages list it, never show it.
    let (_, html) = b.page("/console/identities", &root).await;
    assert!(html.contains(&format!("<code>{id}</code>")));
    assert!(!html.contains(&token));
    assert_clean(&html, &s, Some(&root));

    // Revoke: asked first (nothing happens yet), then refused on /v1 at
    // once.
    let r = b
        .id_post(
            &format!("/console/identities/tokens/{id}/revoke"),
            Some(&root),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let html = r.text().await.unwrap();
    assert!(
        html.contains("Revoke this identity?")
            && html.contains(&format!(
                "action=\"/console/identities/tokens/{id}/revoke\""
            ))
            && html.contains("name=\"confirm\" value=\"yes\""),
        "{html}"
    );
    assert_clean(&html, &s, Some(&root));
    assert_eq!(v1_status(&s, &token).await, StatusCode::OK);
    let r = b
        .id_post(
            &format!("/console/identities/tokens/{id}/revoke"),
            Some(&root),
            &[("csrf", &csrf), ("confirm", "yes")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?done=token_revoked"
    );
    assert_eq!(v1_status(&s, &token).await, StatusCode::UNAUTHORIZED);
    let (_, html) = b
        .page("/console/identities?done=token_revoked", &root)
        .await;
    assert!(html.contains("Revoked."));
    assert!(!html.contains(&token));
    let r = b
        .id_post(
            "/console/identities/tokens/0123456789ab/revoke",
            Some(&root),
            &[("csrf", &csrf), ("confirm", "yes")],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?error=token_not_found"
    );

    // People: the password policy, typed twice.
    let add = |name: &'static str, pw: &'static str, again: &'static str| {
        let (b, root, csrf) = (&b, root.clone(), csrf.clone());
        async move {
            let r = b
                .id_post(
                    "/console/identities/people",
                    Some(&root),
                    &[
                        ("csrf", &csrf),
                        ("name", name),
                        ("tenant", "acme"),
                        ("role", "approver"),
                        ("password", pw),
                        ("password_again", again),
                    ],
                )
                .await;
            assert_eq!(r.status(), StatusCode::SEE_OTHER);
            r.headers()[LOCATION].to_str().unwrap().to_string()
        }
    };
    assert_eq!(
        add("bob", PASSWORD, "something else entirely").await,
        "/console/identities?error=password_mismatch"
    );
    assert_eq!(
        add("bob", "short", "short").await,
        "/console/identities?error=invalid_password"
    );
    assert_eq!(
        add("Bob!", PASSWORD, PASSWORD).await,
        "/console/identities?error=invalid_name"
    );
    assert!(user_list(&s).iter().all(|u| u["name"] != "bob"));
    assert_eq!(
        add("bob", PASSWORD, PASSWORD).await,
        "/console/identities?done=person_added"
    );
    assert_eq!(
        add("bob", PASSWORD, PASSWORD).await,
        "/console/identities?error=user_exists"
    );
    let bob_rec = user_list(&s)
        .into_iter()
        .find(|u| u["name"] == "bob")
        .unwrap();
    assert_eq!(bob_rec["principal"]["tenant"], "acme");
    assert_eq!(bob_rec["principal"]["roles"], json!(["approver"]));
    let bob = b.sign_in("bob").await;
    let (st, _, _) = b.overview(&bob).await;
    assert_eq!(st, StatusCode::OK);
    let (_, html) = b.page("/console/identities", &root).await;
    assert!(html.contains("id=\"person-bob\""));
    assert_clean(&html, &s, Some(&root));

    // Disable: asked first; then bob's session is out at his next
    // request; enable.
    let r = b
        .id_post(
            "/console/identities/people/bob/disable",
            Some(&root),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.text().await.unwrap().contains("Disable this person?"));
    let (st, _, _) = b.overview(&bob).await;
    assert_eq!(st, StatusCode::OK, "not disabled before confirming");
    let r = b
        .id_post(
            "/console/identities/people/bob/disable",
            Some(&root),
            &[("csrf", &csrf), ("confirm", "yes")],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?done=person_disabled"
    );
    let (st, h, _) = b.overview(&bob).await;
    assert_to_sign_in(st, &h, "a disabled person");
    let (c, cookie) = b.sign_in_form().await;
    let r = b.post_sign_in(&c, &cookie, "bob", PASSWORD).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = b
        .id_post(
            "/console/identities/people/bob/enable",
            Some(&root),
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?done=person_enabled"
    );
    let bob = b.sign_in("bob").await;
    // An admin cannot disable themselves.
    let r = b
        .id_post(
            "/console/identities/people/root/disable",
            Some(&root),
            &[("csrf", &csrf), ("confirm", "yes")],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?error=self_disable_denied"
    );

    // Reset the password: sessions end, the old password is refused.
    let r = b
        .id_post(
            "/console/identities/people/bob/password",
            Some(&root),
            &[
                ("csrf", &csrf),
                ("password", NEW_PASSWORD),
                ("password_again", NEW_PASSWORD),
            ],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?done=password_reset"
    );
    let (st, h, _) = b.overview(&bob).await;
    assert_to_sign_in(st, &h, "a reset password");
    let (c, cookie) = b.sign_in_form().await;
    let r = b.post_sign_in(&c, &cookie, "bob", PASSWORD).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let (c, cookie) = b.sign_in_form().await;
    let r = b.post_sign_in(&c, &cookie, "bob", NEW_PASSWORD).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let r = b
        .id_post(
            "/console/identities/people/nobody/password",
            Some(&root),
            &[
                ("csrf", &csrf),
                ("password", NEW_PASSWORD),
                ("password_again", NEW_PASSWORD),
            ],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?error=user_not_found"
    );

    // The journal: each change, as the admin; never a secret.
    let j = s.journal();
    let admin = signed_in_identity(&j)[0].clone();
    for (action, outcome, n) in [
        ("token_create", "ok", 1),
        ("token_create", "rejected", 5),
        ("token_revoke", "ok", 1),
        ("token_revoke", "rejected", 1),
        ("user_add", "ok", 1),
        ("user_add", "rejected", 4),
        ("user_disable", "ok", 1),
        ("user_disable", "rejected", 1),
        ("user_enable", "ok", 1),
        ("user_passwd", "ok", 1),
        ("user_passwd", "rejected", 1),
    ] {
        // The console's (the CLI's `user add root` is the operator's).
        let ev: Vec<&str> = events(&j, action, outcome)
            .into_iter()
            .filter(|e| e.contains("\"session_digest\""))
            .collect();
        assert_eq!(ev.len(), n, "{action} {outcome}: {j}");
        for e in ev {
            assert_eq!(field(e, "identity_digest"), admin.as_str(), "{e}");
            assert!(field(e, "session_digest").is_string(), "{e}");
        }
    }
    assert_eq!(
        field(events(&j, "user_add", "rejected")[3], "error_code"),
        "user_exists"
    );
    let by_cli = events(&j, "user_add", "ok");
    assert_eq!(by_cli.len(), 2);
    assert_ne!(field(by_cli[0], "identity_digest"), admin.as_str());
    for secret in [token.as_str(), PASSWORD, NEW_PASSWORD, "$argon2"] {
        assert!(!j.contains(secret), "a secret in the journal");
    }
    // The CLI's changes are audited too (as the local operator).
    s.token(&["--tenant", "acme", "--subject", "from-cli"]);
    let j = s.journal();
    let cli = events(&j, "token_create", "ok");
    assert_eq!(cli.len(), 2);
    assert_ne!(field(cli[1], "identity_digest"), admin.as_str());
}

/// Approvers and auditors get 403 on every identities and connect page;
/// their forged forms (with their own valid CSRF token) change nothing and
/// are recorded as refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_admins_manage_identities() {
    let s = Server::start().await;
    user(
        &s,
        &["add", "alice", "--tenant", "acme", "--role", "approver"],
    );
    user(&s, &["add", "ada", "--tenant", "acme", "--role", "auditor"]);
    let b = Browser::new(&s);
    let tokens = s.token_list().len();
    for name in ["alice", "ada"] {
        let id = b.sign_in(name).await;
        let (_, _, html) = b.overview(&id).await;
        assert!(!html.contains("/console/identities"), "no link for {name}");
        let csrf = csrf_field(&html);
        for path in [
            "/console/identities",
            "/console/connect",
            "/console/connect/ca.pem",
        ] {
            let (st, html) = b.page(path, &id).await;
            assert_eq!(st, StatusCode::FORBIDDEN, "{name} {path}");
            assert!(html.contains("admin_required"));
            assert_clean(&html, &s, Some(&id));
        }
        for (path, fields) in [
            (
                "/console/identities/tokens",
                vec![("tenant", "acme"), ("role", "admin")],
            ),
            ("/console/identities/certificates", vec![("tenant", "acme")]),
            (
                "/console/identities/people",
                vec![
                    ("name", "mallory"),
                    ("tenant", "acme"),
                    ("role", "admin"),
                    ("password", PASSWORD),
                    ("password_again", PASSWORD),
                ],
            ),
            ("/console/identities/people/alice/disable", vec![]),
            (
                "/console/identities/people/ada/password",
                vec![("password", PASSWORD), ("password_again", PASSWORD)],
            ),
            (
                "/console/connect",
                vec![("host", "codex"), ("transport", "http"), ("tenant", "acme")],
            ),
        ] {
            let mut f = vec![("csrf", csrf.as_str())];
            f.extend(fields);
            let r = b.id_post(path, Some(&id), &f).await;
            assert_eq!(r.status(), StatusCode::FORBIDDEN, "{name} {path}");
            let html = r.text().await.unwrap();
            assert!(!html.contains("cat_"), "{name} {path}");
        }
    }
    assert_eq!(s.token_list().len(), tokens, "no token was made");
    let users = user_list(&s);
    assert_eq!(users.len(), 2);
    assert!(users.iter().all(|u| u["disabled_at"].is_null()));
    let j = s.journal();
    for action in [
        "token_create",
        "cert_identity_create",
        "user_add",
        "user_disable",
        "user_passwd",
    ] {
        let ev = events(&j, action, "rejected");
        assert_eq!(
            ev.len(),
            2 + usize::from(action == "token_create") * 2,
            "{action}: {j}"
        );
        assert!(
            ev.iter()
                .all(|e| e.contains("\"error_code\":\"admin_required\""))
        );
    }
    assert!(events(&j, "token_create", "ok").is_empty());
}

/// A certificate identity issued in the console: the bundle downloads
/// (client.pem, client.key, ca.pem), works as a client certificate on
/// /v1, is listed, and is refused once revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_identities_download_and_revoke() {
    let s = Server::start().await;
    user(&s, &["add", "root", "--tenant", "ops", "--role", "admin"]);
    let b = Browser::new(&s);
    let root = b.sign_in("root").await;
    let (_, html) = b.page("/console/identities", &root).await;
    let csrf = csrf_field(&html);
    let r = b
        .id_post(
            "/console/identities/certificates",
            Some(&root),
            &[
                ("csrf", &csrf),
                ("subject", "ci-runner"),
                ("tenant", "acme"),
                ("role", "agent"),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_no_store(r.headers(), "bundle");
    assert_eq!(r.headers()["content-type"], "application/x-tar");
    let disposition = r.headers()["content-disposition"]
        .to_str()
        .unwrap()
        .to_string();
    let id = disposition
        .strip_prefix("attachment; filename=\"cube-identity-")
        .and_then(|x| x.strip_suffix(".tar\""))
        .expect("an attachment")
        .to_string();
    let body = r.bytes().await.unwrap();
    let mut files = std::collections::BTreeMap::new();
    let mut ar = tar::Archive::new(&body[..]);
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let path = e.path().unwrap().to_string_lossy().to_string();
        let mode = e.header().mode().unwrap();
        let mut data = vec![];
        std::io::Read::read_to_end(&mut e, &mut data).unwrap();
        files.insert(path, (mode, data));
    }
    let dir = format!("cube-identity-{id}");
    let get = |f: &str| files[&format!("{dir}/{f}")].clone();
    assert_eq!(get("client.key").0 & 0o777, 0o600);
    assert_eq!(
        get("ca.pem").1,
        std::fs::read(s.state.join("tls/ca.pem")).unwrap()
    );
    let (cert, key) = (get("client.pem").1, get("client.key").1);

    // Listed with its certificate's digest; never the key.
    let listed = s.token_list();
    let rec = listed.iter().find(|t| t["id"] == id.as_str()).unwrap();
    assert_eq!(rec["principal"]["subject"], "ci-runner");
    let (_, html) = b.page("/console/identities", &root).await;
    assert!(html.contains(&format!("id=\"cert-{id}\"")));
    assert!(html.contains(rec["cert_sha256"].as_str().unwrap()));
    assert!(!html.contains("PRIVATE KEY"));
    assert_clean(&html, &s, Some(&root));

    // It is an identity on /v1, until revoked.
    let ca = std::fs::read(s.state.join("tls/ca.pem")).unwrap();
    let with_cert = || {
        reqwest::Client::builder()
            .tls_backend_preconfigured(
                cube_adapter::tls::client_config(Some(&ca), Some((&cert, &key))).unwrap(),
            )
            .build()
            .unwrap()
    };
    let r = with_cert()
        .get(format!("{}/v1/leases", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = b
        .id_post(
            &format!("/console/identities/tokens/{id}/revoke"),
            Some(&root),
            &[("csrf", &csrf), ("confirm", "yes")],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/identities?done=token_revoked"
    );
    let r = with_cert()
        .get(format!("{}/v1/leases", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let j = s.journal();
    assert_eq!(events(&j, "cert_identity_create", "ok").len(), 1);
    assert_eq!(events(&j, "token_revoke", "ok").len(), 1);
    assert!(!j.contains("PRIVATE KEY"));
}

/// Connect an agent: for each host and transport, the configuration with
/// this appliance's URL and the chosen profile, and a new token scoped to
/// the tenant and profile that works on /v1, shown once; the CA to
/// download; bad choices get their codes; a foreign form makes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_an_agent_for_each_host() {
    let s = Server::start().await;
    user(&s, &["add", "root", "--tenant", "ops", "--role", "admin"]);
    let b = Browser::new(&s);
    let r = b.get("/console/connect", None).await;
    assert_to_sign_in(r.status(), r.headers(), "connect signed out");
    let root = b.sign_in("root").await;
    let (st, html) = b.page("/console/connect", &root).await;
    assert_eq!(st, StatusCode::OK);
    assert_clean(&html, &s, Some(&root));
    assert!(
        html.contains(&format!("<code>{}/mcp</code>", s.url)),
        "{html}"
    );
    let csrf = csrf_field(&html);
    let at = html.find("<option value=\"").unwrap() + 15;
    let profile = html[at..].split('"').next().unwrap().to_string();

    // A name the certificate does not cover is not used.
    let r = b
        .http
        .get(format!("{}/console/connect", s.url))
        .header("host", "evil.example")
        .header("cookie", format!("{SESSION}={root}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let html = r.text().await.unwrap();
    assert!(!html.contains("evil.example"), "{html}");

    // The one script (the copy buttons), served as JavaScript.
    let r = b.get("/console/static/console.js", None).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["content-type"],
        "text/javascript; charset=utf-8"
    );
    assert!(r.text().await.unwrap().contains("data-copy"));

    // The CA, to place on the agent's machine.
    let r = b.get("/console/connect/ca.pem", Some(&root)).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.bytes().await.unwrap(),
        std::fs::read(s.state.join("tls/ca.pem")).unwrap()
    );

    let before = s.token_list().len();
    let r = b
        .id_post(
            "/console/connect",
            Some(&root),
            &[
                ("csrf", "forged"),
                ("host", "codex"),
                ("transport", "http"),
                ("tenant", "acme"),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    for (host, transport, prof, home, code) in [
        ("vim", "http", profile.as_str(), "", "invalid_host"),
        ("codex", "pigeon", profile.as_str(), "", "invalid_transport"),
        ("codex", "http", "no-such-profile", "", "invalid_profile"),
        ("codex", "stdio", profile.as_str(), "../etc", "invalid_home"),
    ] {
        let r = b
            .id_post(
                "/console/connect",
                Some(&root),
                &[
                    ("csrf", &csrf),
                    ("host", host),
                    ("transport", transport),
                    ("tenant", "acme"),
                    ("profile", prof),
                    ("home", home),
                ],
            )
            .await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{code}");
        assert!(
            r.text().await.unwrap().contains(&format!("({code})")),
            "{code}"
        );
    }
    assert_eq!(s.token_list().len(), before);
    // Each refused choice is recorded as a refused token_create, with its
    // code (as the Identities page records its refusals).
    let j = s.journal();
    let rejected = events(&j, "token_create", "rejected");
    for code in [
        "invalid_host",
        "invalid_transport",
        "invalid_profile",
        "invalid_home",
    ] {
        assert_eq!(
            rejected
                .iter()
                .filter(|l| l.contains(&format!("\"error_code\":\"{code}\"")))
                .count(),
            1,
            "{code}: {j}"
        );
    }

    let mut made = vec![];
    for host in ["codex", "claude-code", "opencode", "openclaw", "hermes"] {
        for transport in ["stdio", "http"] {
            let r = b
                .id_post(
                    "/console/connect",
                    Some(&root),
                    &[
                        ("csrf", &csrf),
                        ("host", host),
                        ("transport", transport),
                        ("name", &format!("{host}-{transport}")),
                        ("tenant", "acme"),
                        ("profile", &profile),
                        ("home", "/home/bob"),
                    ],
                )
                .await;
            assert_eq!(r.status(), StatusCode::OK, "{host} {transport}");
            assert_no_store(r.headers(), "connect result");
            let html = r.text().await.unwrap();
            let token = shown_token(&html);
            assert_eq!(html.matches(&token).count(), 1, "{host} {transport}");
            assert!(html.contains("data-copy=\"snippet\""));
            let at = html.find("id=\"snippet\">").unwrap();
            let snippet = html[at..].split("</pre>").next().unwrap();
            // The live URL (an HTTP host: its /mcp with the profile).
            if transport == "http" {
                assert!(
                    snippet.contains(&format!("{}/mcp?profile={profile}", s.url)),
                    "{host} {transport}: {snippet}"
                );
            } else {
                assert!(snippet.contains(&s.url), "{host} {transport}: {snippet}");
                assert!(snippet.contains(&profile), "{host} {transport}");
            }
            assert!(!snippet.contains("example.internal"), "{host} {transport}");
            if profile != "offline-code" {
                assert!(!snippet.contains("offline-code"), "{host} {transport}");
            }
            assert!(!snippet.contains("/home/alice"), "{host} {transport}");
            assert!(!snippet.contains(&token));
            assert_clean(&html, &s, Some(&root));
            assert_eq!(
                v1_status(&s, &token).await,
                StatusCode::OK,
                "{host} {transport}"
            );
            made.push((token, format!("{host}-{transport}")));
        }
    }
    let listed = s.token_list();
    for (token, subject) in &made {
        let id = token.split('_').nth(1).unwrap();
        let t = listed.iter().find(|t| t["id"] == id).unwrap();
        assert_eq!(t["principal"]["subject"], subject.as_str());
        assert_eq!(t["principal"]["tenant"], "acme");
        assert_eq!(t["principal"]["roles"], json!(["agent"]));
        assert_eq!(t["principal"]["profiles"], json!([profile]));
    }
    // Later pages never show them.
    let (_, html) = b.page("/console/identities", &root).await;
    let (_, html2) = b.page("/console/connect", &root).await;
    for (token, _) in &made {
        assert!(!html.contains(token.as_str()) && !html2.contains(token.as_str()));
    }
    let j = s.journal();
    assert_eq!(events(&j, "token_create", "ok").len(), made.len());
}
