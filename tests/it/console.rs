//! The web console (`/console`, issue 15): sign-in, sessions, CSRF, the
//! security headers, the Overview and the static assets, over TLS against
//! the real server. Cookies are handled by hand (no cookie jar) so each
//! attribute can be checked.

use cube_adapter::clock::ManualClock;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};

use crate::kit::{BIN, Server};

const PASSWORD: &str = "correct horse battery staple";
const SESSION: &str = "__Host-cube_session";
const SIGN_IN: &str = "__Host-cube_signin";

/// A client trusting the server's CA that does not follow redirects.
fn client(s: &Server) -> reqwest::Client {
    let ca = std::fs::read(s.state.join("tls/ca.pem")).unwrap();
    let tls = cube_adapter::tls::client_config(Some(&ca), None).unwrap();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// `cube-adapter user ARGS…` against the running server; panics on failure.
fn user(s: &Server, args: &[&str]) {
    let pw = s.dir.path().join("console-pw");
    std::fs::write(&pw, format!("{PASSWORD}\n")).unwrap();
    let mut cmd = std::process::Command::new(BIN);
    cmd.arg("user").args(args);
    if matches!(args.first(), Some(&"add") | Some(&"passwd")) {
        cmd.arg("--password-file").arg(&pw);
    }
    let out = cmd
        .arg("--state-dir")
        .arg(&s.state)
        .arg("--config")
        .arg(s.empty_config())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "user {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A form body, URL-encoded.
fn form(fields: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(fields)
        .finish()
}

/// The value a response sets for cookie `name`, with the whole header.
fn set_cookie(h: &HeaderMap, name: &str) -> Option<(String, String)> {
    h.get_all(SET_COOKIE)
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .find(|v| v.starts_with(&format!("{name}=")))
        .map(|v| {
            let value = v
                .split(';')
                .next()
                .unwrap()
                .split_once('=')
                .unwrap()
                .1
                .to_string();
            (value, v)
        })
}

/// The value of hidden field `csrf` in a page.
fn csrf_field(html: &str) -> String {
    let at = html.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    html[at..].split('"').next().unwrap().to_string()
}

/// Every console answer carries these.
fn assert_security_headers(h: &HeaderMap, what: &str) {
    for (k, v) in [
        (
            "content-security-policy",
            "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ),
        ("referrer-policy", "no-referrer"),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
    ] {
        assert_eq!(
            h.get(k).and_then(|x| x.to_str().ok()),
            Some(v),
            "{what}: {k}"
        );
    }
}

fn assert_no_store(h: &HeaderMap, what: &str) {
    assert_eq!(
        h.get("cache-control").and_then(|x| x.to_str().ok()),
        Some("no-store"),
        "{what}"
    );
}

/// No secret of the test in a page.
fn assert_clean(html: &str, s: &Server, session: Option<&str>) {
    assert!(!html.contains(PASSWORD), "a password in the page");
    assert!(!html.contains(&s.admin), "the admin token in the page");
    if let Some(id) = session {
        assert!(!html.contains(id), "the session id in the page");
    }
    assert!(!html.contains("$argon2"), "a password hash in the page");
    // Strict CSP: nothing inline that it would block.
    assert!(!html.contains("<script"), "a script in the page");
    assert!(!html.contains("style="), "an inline style in the page");
    assert!(!html.contains("<style"), "a style element in the page");
}

struct Browser {
    http: reqwest::Client,
    url: String,
}

impl Browser {
    fn new(s: &Server) -> Self {
        Self {
            http: client(s),
            url: s.url.clone(),
        }
    }

    async fn get(&self, path: &str, session: Option<&str>) -> reqwest::Response {
        let mut r = self.http.get(format!("{}{path}", self.url));
        if let Some(id) = session {
            r = r.header("cookie", format!("{SESSION}={id}"));
        }
        r.send().await.unwrap()
    }

    /// The sign-in form: its token and the double-submit cookie's value.
    async fn sign_in_form(&self) -> (String, String) {
        let r = self.get("/console/sign-in", None).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_security_headers(r.headers(), "sign-in form");
        assert_no_store(r.headers(), "sign-in form");
        let (cookie, header) = set_cookie(r.headers(), SIGN_IN).expect("a sign-in cookie");
        for part in ["Secure", "HttpOnly", "SameSite=Strict", "Path=/"] {
            assert!(header.contains(part), "{header}");
        }
        let html = r.text().await.unwrap();
        assert!(html.contains("<label for=\"name\">") && html.contains("<label for=\"password\">"));
        (csrf_field(&html), cookie)
    }

    async fn post_sign_in(
        &self,
        csrf: &str,
        cookie: &str,
        name: &str,
        pw: &str,
    ) -> reqwest::Response {
        self.http
            .post(format!("{}/console/sign-in", self.url))
            .header("cookie", format!("{SIGN_IN}={cookie}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(&[("csrf", csrf), ("name", name), ("password", pw)]))
            .send()
            .await
            .unwrap()
    }

    /// Sign in; the session id.
    async fn sign_in(&self, name: &str) -> String {
        let (csrf, cookie) = self.sign_in_form().await;
        let r = self.post_sign_in(&csrf, &cookie, name, PASSWORD).await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER);
        assert_eq!(r.headers()[LOCATION], "/console");
        set_cookie(r.headers(), SESSION)
            .expect("a session cookie")
            .0
    }

    async fn sign_out(&self, session: &str, csrf: Option<&str>) -> reqwest::Response {
        let fields: Vec<(&str, &str)> = csrf.map(|c| ("csrf", c)).into_iter().collect();
        self.http
            .post(format!("{}/console/sign-out", self.url))
            .header("cookie", format!("{SESSION}={session}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(&fields))
            .send()
            .await
            .unwrap()
    }

    /// The Overview's status and HTML.
    async fn overview(&self, session: &str) -> (StatusCode, HeaderMap, String) {
        let r = self.get("/console", Some(session)).await;
        let (st, h) = (r.status(), r.headers().clone());
        (st, h, r.text().await.unwrap())
    }
}

fn assert_to_sign_in(st: StatusCode, h: &HeaderMap, what: &str) {
    assert_eq!(st, StatusCode::SEE_OTHER, "{what}");
    assert_eq!(h[LOCATION], "/console/sign-in", "{what}");
}

/// The audit journal as exported, one JSON event a line.
fn journal(s: &Server) -> String {
    let out = std::process::Command::new(BIN)
        .args(["audit", "export", "--state-dir"])
        .arg(&s.state)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

fn events<'a>(journal: &'a str, action: &str, outcome: &str) -> Vec<&'a str> {
    journal
        .lines()
        .filter(|l| {
            l.contains(&format!("\"action\":\"{action}\""))
                && l.contains(&format!("\"outcome\":\"{outcome}\""))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_overview_and_sign_out() {
    let s = Server::start().await;
    user(
        &s,
        &["add", "alice", "--tenant", "acme", "--role", "approver"],
    );
    let b = Browser::new(&s);

    // Signed out: every page sends to the sign-in form.
    let r = b.get("/console", None).await;
    assert_to_sign_in(r.status(), r.headers(), "no cookie");
    assert_security_headers(r.headers(), "redirect");
    assert_no_store(r.headers(), "redirect");
    let (st, h, _) = b
        .overview("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA")
        .await;
    assert_to_sign_in(st, &h, "an unknown session");

    // A wrong password: the form again, 401, audited as rejected.
    let (csrf, cookie) = b.sign_in_form().await;
    let r = b
        .post_sign_in(&csrf, &cookie, "alice", "not the password at all")
        .await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert_security_headers(r.headers(), "failed sign-in");
    assert!(set_cookie(r.headers(), SESSION).is_none());
    let html = r.text().await.unwrap();
    assert!(html.contains("Wrong user name or password."), "{html}");
    assert!(!html.contains("not the password at all"));
    assert_clean(&html, &s, None);
    let j = journal(&s);
    let rejected = events(&j, "console_sign_in", "rejected");
    assert_eq!(rejected.len(), 1, "{j}");
    assert!(rejected[0].contains("\"error_code\":\"unauthorized\""));
    assert!(!j.contains("not the password at all") && !j.contains(PASSWORD));

    // A form token that is not the cookie's: refused before any check.
    let (_, cookie) = b.sign_in_form().await;
    let r = b.post_sign_in("forged", &cookie, "alice", PASSWORD).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(set_cookie(r.headers(), SESSION).is_none());

    // The right password: a session cookie with every attribute.
    let (csrf, cookie) = b.sign_in_form().await;
    let r = b.post_sign_in(&csrf, &cookie, "alice", PASSWORD).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(r.headers()[LOCATION], "/console");
    assert_security_headers(r.headers(), "sign-in");
    let (id, header) = set_cookie(r.headers(), SESSION).expect("a session cookie");
    for part in [
        "Secure",
        "HttpOnly",
        "SameSite=Strict",
        "Path=/",
        "Max-Age=43200",
    ] {
        assert!(header.contains(part), "{header}");
    }
    assert!(!header.contains("Domain"), "__Host- cookies have no Domain");
    assert_eq!(id.len(), 43);
    assert_eq!(events(&journal(&s), "console_sign_in", "ok").len(), 1);
    // The store keeps a digest of the id, never the id.
    let raw = std::fs::read(s.state.join("state.redb")).unwrap();
    assert!(
        !raw.windows(id.len()).any(|w| w == id.as_bytes()),
        "the session id is stored"
    );

    // The Overview.
    let (st, h, html) = b.overview(&id).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert_security_headers(&h, "overview");
    assert_no_store(&h, "overview");
    assert_eq!(h["content-type"], "text/html; charset=utf-8");
    for want in [
        "<h1>Overview</h1>",
        "Plans pending approval",
        "Tasks running",
        "Live leases",
        "Counts for tenant acme.",
        "embedded",
        "days left",
        "alice",
        "approver",
        "action=\"/console/sign-out\"",
        "/console/static/console.css?v=",
    ] {
        assert!(html.contains(want), "the Overview lacks {want}: {html}");
    }
    assert_clean(&html, &s, Some(&id));
    let csrf = csrf_field(&html);

    // Sign-out needs this session's CSRF token.
    let r = b.sign_out(&id, None).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN, "no token");
    assert_security_headers(r.headers(), "refused sign-out");
    let r = b.sign_out(&id, Some("wrong-token")).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN, "a wrong token");
    let other = b.sign_in("alice").await;
    let (_, _, other_html) = b.overview(&other).await;
    let other_csrf = csrf_field(&other_html);
    assert_ne!(other_csrf, csrf, "one token per session");
    let r = b.sign_out(&id, Some(&other_csrf)).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN, "another session's token");
    assert_eq!(b.overview(&id).await.0, StatusCode::OK, "still signed in");

    // Sign-out ends this session only.
    let r = b.sign_out(&id, Some(&csrf)).await;
    assert_to_sign_in(r.status(), r.headers(), "sign-out");
    let (_, cleared) = set_cookie(r.headers(), SESSION).expect("the cookie is cleared");
    assert!(cleared.contains("Max-Age=0"), "{cleared}");
    let (st, h, _) = b.overview(&id).await;
    assert_to_sign_in(st, &h, "after sign-out");
    assert_eq!(b.overview(&other).await.0, StatusCode::OK);
    assert_eq!(events(&journal(&s), "console_sign_out", "ok").len(), 1);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_users_are_out_at_the_next_request() {
    let s = Server::start().await;
    for name in ["dora", "erin", "fred"] {
        user(&s, &["add", name, "--tenant", "acme", "--role", "auditor"]);
    }
    user(&s, &["add", "root", "--tenant", "ops", "--role", "admin"]);
    user(&s, &["add", "gail", "--tenant", "acme", "--role", "agent"]);
    let b = Browser::new(&s);
    let dora = b.sign_in("dora").await;
    let erin = b.sign_in("erin").await;
    let fred = b.sign_in("fred").await;
    let root = b.sign_in("root").await;
    for id in [&dora, &erin, &fred, &root] {
        assert_eq!(b.overview(id).await.0, StatusCode::OK);
    }
    let (_, _, html) = b.overview(&root).await;
    assert!(html.contains("Counts for all tenants."), "{html}");

    user(&s, &["disable", "dora"]);
    user(&s, &["passwd", "erin"]);
    user(&s, &["remove", "fred"]);
    for (id, who) in [
        (&dora, "disabled"),
        (&erin, "new password"),
        (&fred, "removed"),
    ] {
        let (st, h, _) = b.overview(id).await;
        assert_to_sign_in(st, &h, who);
    }
    // Ended for good: enabling again needs a new sign-in.
    user(&s, &["enable", "dora"]);
    let (st, h, _) = b.overview(&dora).await;
    assert_to_sign_in(st, &h, "enabled again");
    assert_eq!(b.overview(&root).await.0, StatusCode::OK, "others stay in");

    // A disabled user cannot sign in.
    user(&s, &["disable", "root"]);
    let (csrf, cookie) = b.sign_in_form().await;
    let r = b.post_sign_in(&csrf, &cookie, "root", PASSWORD).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    // An agent-role person is no console user.
    let (csrf, cookie) = b.sign_in_form().await;
    let r = b.post_sign_in(&csrf, &cookie, "gail", PASSWORD).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(set_cookie(r.headers(), SESSION).is_none());
    let j = journal(&s);
    assert!(
        events(&j, "console_sign_in", "rejected")
            .iter()
            .any(|l| l.contains("\"error_code\":\"forbidden\"")),
        "{j}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_end_when_idle_or_old() {
    let clock = ManualClock::starting_now();
    let s = Server::start_with(|c| {
        c.clock = clock.clone().into();
        c.console.idle_timeout_seconds = 600;
        c.console.absolute_timeout_seconds = 1800;
    })
    .await;
    user(&s, &["add", "hana", "--tenant", "acme"]);
    let b = Browser::new(&s);

    let id = b.sign_in("hana").await;
    clock.advance(time::Duration::seconds(590));
    assert_eq!(
        b.overview(&id).await.0,
        StatusCode::OK,
        "used within the idle time"
    );
    clock.advance(time::Duration::seconds(590));
    assert_eq!(
        b.overview(&id).await.0,
        StatusCode::OK,
        "idle time counts from the last use"
    );
    clock.advance(time::Duration::seconds(601));
    let (st, h, _) = b.overview(&id).await;
    assert_to_sign_in(st, &h, "idle");

    let id = b.sign_in("hana").await;
    for _ in 0..3 {
        clock.advance(time::Duration::seconds(500));
        assert_eq!(
            b.overview(&id).await.0,
            StatusCode::OK,
            "busy, within the absolute time"
        );
    }
    clock.advance(time::Duration::seconds(500));
    let (st, h, _) = b.overview(&id).await;
    assert_to_sign_in(st, &h, "past the absolute lifetime");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_assets_are_served_and_cached() {
    let s = Server::start().await;
    let b = Browser::new(&s);
    let r = b.get("/console/static/console.css", None).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "text/css; charset=utf-8");
    assert_eq!(
        r.headers()["cache-control"],
        "public, max-age=31536000, immutable"
    );
    assert!(r.headers().contains_key("etag"));
    assert_security_headers(r.headers(), "css");
    let css = r.text().await.unwrap();
    assert!(css.contains("prefers-color-scheme: dark"), "{css}");
    for missing in [
        "/console/static/nothing.css",
        "/console/static/../Cargo.toml",
    ] {
        let r = b.get(missing, None).await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "{missing}");
    }
    // An unknown console page: an HTML 404 with the console's headers.
    let r = b.get("/console/no-such-page", None).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_security_headers(r.headers(), "unknown page");
    assert_no_store(r.headers(), "unknown page");
    assert_eq!(r.headers()["content-type"], "text/html; charset=utf-8");
    s.stop().await;
}
