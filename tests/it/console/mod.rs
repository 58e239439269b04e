//! The web console (`/console`, issue 15): sign-in, sessions, CSRF, the
//! security headers, the Overview, Approvals and the static assets, over TLS against
//! the real server. Cookies are handled by hand (no cookie jar) so each
//! attribute can be checked.

mod audit;
pub mod browser;
mod identities;
mod live;
mod tasks;

use cube_adapter::clock::ManualClock;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};

use serde_json::{Value, json};

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
        ("strict-transport-security", "max-age=31536000"),
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
    // Scripts only from the console's own static files (no inline script).
    for (i, _) in html.match_indices("<script") {
        let rest = html.get(i..).unwrap_or_default();
        assert!(
            rest.starts_with("<script src=\"/console/static/"),
            "an inline script in the page"
        );
    }
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
    let j = s.journal();
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
    assert_eq!(events(&s.journal(), "console_sign_in", "ok").len(), 1);
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
    assert_eq!(events(&s.journal(), "console_sign_out", "ok").len(), 1);
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
    let j = s.journal();
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

impl Browser {
    async fn page(&self, path: &str, session: &str) -> (StatusCode, String) {
        let r = self.get(path, Some(session)).await;
        let st = r.status();
        assert_security_headers(r.headers(), path);
        assert_no_store(r.headers(), path);
        (st, r.text().await.unwrap())
    }

    /// POST a decision on a plan: the answer (not followed).
    async fn decide(
        &self,
        session: &str,
        plan: &str,
        csrf: Option<&str>,
        decision: &str,
        reason: &str,
    ) -> reqwest::Response {
        let mut fields = vec![("decision", decision), ("reason", reason)];
        if let Some(c) = csrf {
            fields.push(("csrf", c));
        }
        self.http
            .post(format!("{}/console/plans/{plan}/decide", self.url))
            .header("cookie", format!("{SESSION}={session}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(&fields))
            .send()
            .await
            .unwrap()
    }

    /// Decide, expect the 303 back to the review page, and follow it.
    async fn decide_and_follow(
        &self,
        session: &str,
        plan: &str,
        csrf: &str,
        decision: &str,
        want: &str,
    ) -> String {
        let r = self
            .decide(session, plan, Some(csrf), decision, "looked fine")
            .await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER, "{decision} {plan}");
        let to = r.headers()[LOCATION].to_str().unwrap().to_string();
        assert_eq!(to, format!("/console/plans/{plan}?{want}"));
        let (st, html) = self.page(&to, session).await;
        assert_eq!(st, StatusCode::OK, "{html}");
        html
    }
}

/// The appliance with the trusted-task templates, an agent of tenant
/// `acme` that may plan (`agent-a`) and alice, an approver of `acme`.
async fn approvals_rig() -> (Server, String) {
    let s = Server::start_with(crate::tasks::configure).await;
    let agent = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "agent-a",
        "--action",
        "task:*",
    ]);
    user(
        &s,
        &["add", "alice", "--tenant", "acme", "--role", "approver"],
    );
    (s, agent)
}

/// A plan's state as /v1 answers it to `token`.
async fn plan_state(s: &Server, token: &str, plan: &str) -> String {
    let (st, v) = s.get(token, &format!("/v1/task-plans/{plan}")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v["state"].as_str().unwrap().to_string()
}

async fn plan_word_count(s: &Server, token: &str, text: &str) -> Value {
    let (st, v) = s
        .post(
            token,
            "/v1/tasks/plan",
            json!({"template": "word-count", "parameters": {"text": text, "repeat": 2}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["state"], "pending_approval");
    v
}

/// The audit events of one action with one error code.
fn refusals<'a>(journal: &'a str, action: &str, code: &str) -> Vec<&'a str> {
    journal
        .lines()
        .filter(|l| {
            l.contains(&format!("\"action\":\"{action}\""))
                && l.contains("\"outcome\":\"rejected\"")
                && l.contains(&format!("\"error_code\":\"{code}\""))
        })
        .collect()
}

/// An agent plans; an approver of its tenant sees the plan in the queue,
/// reviews it with its parameters and the rendered command, and approves
/// it (CSRF required); an auditor sees the queue and the digests but no
/// parameters and no form, and a forged decision is refused with the
/// broker's code and audited; another tenant's approver sees nothing; a
/// person cannot approve their own plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_queue_review_and_decisions() {
    let (s, agent) = approvals_rig().await;
    user(
        &s,
        &["add", "dora", "--tenant", "acme", "--role", "auditor"],
    );
    user(
        &s,
        &["add", "eve", "--tenant", "other", "--role", "approver"],
    );
    user(
        &s,
        &[
            "add", "sam", "--tenant", "acme", "--role", "approver", "--action", "task:*",
        ],
    );
    let b = Browser::new(&s);
    let secret1 = "first secret parameter";
    let secret2 = "second hidden parameter";
    let p1 = plan_word_count(&s, &agent, secret1).await;
    let plan1 = p1["plan_ref"].as_str().unwrap().to_string();
    let clean = |html: &str, id: &str| {
        assert_clean(html, &s, Some(id));
        assert!(!html.contains(&agent), "the agent's token in the page");
    };

    // The approver's queue: the plan, linked, refreshing itself.
    let alice = b.sign_in("alice").await;
    let (st, html) = b.page("/console/approvals", &alice).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        "<h1>Approvals</h1>",
        // No reload of its own: a script says when the queue changed.
        &format!("data-pending=\"{plan1}\""),
        "id=\"queue-reload\"",
        &format!("<a href=\"/console/plans/{plan1}\">{plan1}</a>"),
        "word-count",
        "<td>acme</td>",
        "<td>word-count<br><span class=\"hint\">trusted</span></td>",
        // Who asked, by name; no reason given.
        "<td>agent-a (token ",
        "none given",
        "href=\"/console/approvals\" aria-current=\"page\"",
        "Time left",
    ] {
        assert!(html.contains(want), "the queue lacks {want}: {html}");
    }
    assert!(!html.contains(secret1), "parameters in the queue");
    clean(&html, &alice);
    // The Overview links to it too.
    let (_, _, html) = b.overview(&alice).await;
    assert!(html.contains("href=\"/console/approvals\""), "{html}");

    // The review: parameters, the command as it will run, the digests.
    let (st, html) = b.page(&format!("/console/plans/{plan1}"), &alice).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        secret1,
        "The command exactly as it will run",
        "/bin/sh -c",
        &format!("&#39;{secret1}&#39;"),
        p1["command_sha256"].as_str().unwrap(),
        p1["parameters_sha256"].as_str().unwrap(),
        p1["template_sha256"].as_str().unwrap(),
        "pending_approval",
        "Outputs policy",
        "<td>summary</td><td>json</td>",
        "<td>echo</td><td>text</td><td>digest</td>",
        &format!("action=\"/console/plans/{plan1}/decide\""),
        "value=\"approve\"",
        "value=\"deny\"",
        "The agent gave no reason.",
        "approvals <span id=\"approvals\">0 of 1</span>",
    ] {
        assert!(html.contains(want), "the review lacks {want}: {html}");
    }
    assert!(
        html.contains("<dd id=\"asked-by\">agent-a (token "),
        "{html}"
    );
    // Nothing is hidden in these parameters: no banner.
    assert!(!html.contains("hidden-banner"), "{html}");
    assert!(!html.contains("You asked for this plan"), "{html}");
    clean(&html, &alice);
    let csrf = csrf_field(&html);

    // No CSRF token, or another's: refused, nothing decided.
    let r = b.decide(&alice, &plan1, None, "approve", "").await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_security_headers(r.headers(), "refused decision");
    let r = b
        .decide(&alice, &plan1, Some("forged-token"), "approve", "")
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(plan_state(&s, &agent, &plan1).await, "pending_approval");

    // Approve: 303 back to the review, which says so; /v1 agrees.
    let html = b
        .decide_and_follow(&alice, &plan1, &csrf, "approve", "done=approved")
        .await;
    assert!(html.contains("Approved."), "{html}");
    assert!(html.contains(">approved</span>"), "{html}");
    assert!(!html.contains("value=\"approve\""), "no form once decided");
    clean(&html, &alice);
    assert_eq!(plan_state(&s, &agent, &plan1).await, "approved");
    // The approver's words are kept as written, with who and through what.
    assert!(
        html.contains("1 of 1: alice (acme, ") && html.contains(", console)"),
        "{html}"
    );
    assert!(
        html.contains("alice: <span class=\"words\">looked fine</span>"),
        "{html}"
    );
    let j = s.journal();
    let approved = events(&j, "task_approve", "ok");
    assert_eq!(approved.len(), 1, "{j}");
    // A person in the console, recorded as such (runtime and session).
    assert!(
        approved[0].contains("\"runtime\":\"console\"")
            && approved[0].contains("\"session_digest\":"),
        "{}",
        approved[0]
    );
    // The parameters never; the approver's words in clear (issue #36).
    assert!(!j.contains(secret1));
    assert!(
        approved[0].contains("\"reason\":\"looked fine\""),
        "{}",
        approved[0]
    );
    // Gone from the queue, listed among the decided with who decided.
    let (_, html) = b.page("/console/approvals", &alice).await;
    assert!(!html.contains("http-equiv=\"refresh\""), "{html}");
    let (queue, recent) = html.split_once("id=\"recent-heading\"").unwrap();
    assert!(!queue.contains(&plan1), "{html}");
    assert!(queue.contains("No plan is waiting for approval."), "{html}");
    assert!(
        recent.contains(&plan1) && recent.contains("approved by alice"),
        "{html}"
    );
    // What the queue's script reads.
    let r = b.get("/console/approvals/pending", Some(&alice)).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"pending": []}));
    // Deciding again: the broker's code, shown on the page.
    let html = b
        .decide_and_follow(&alice, &plan1, &csrf, "deny", "error=plan_not_pending")
        .await;
    assert!(
        html.contains("no longer pending approval") && html.contains("(plan_not_pending)"),
        "{html}"
    );

    // The same parameters again: marked identical to the approved plan;
    // other ones: what changed (issue #36).
    let again = plan_word_count(&s, &agent, secret1).await;
    let again = again["plan_ref"].as_str().unwrap().to_string();
    let (_, html) = b.page(&format!("/console/plans/{again}"), &alice).await;
    assert!(
        html.contains(&format!(
            "<strong>Identical</strong> to <a href=\"/console/plans/{plan1}\">{plan1}</a>"
        )),
        "{html}"
    );
    assert!(!html.contains("id=\"diff\""), "{html}");

    // The auditor: the queue and the digests, no parameters, no form.
    let p2 = plan_word_count(&s, &agent, secret2).await;
    let plan2 = p2["plan_ref"].as_str().unwrap().to_string();
    let dora = b.sign_in("dora").await;
    let (st, html) = b.page("/console/approvals", &dora).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(html.contains(&plan2), "{html}");
    clean(&html, &dora);
    let (st, html) = b.page(&format!("/console/plans/{plan2}"), &dora).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(
        html.contains(p2["command_sha256"].as_str().unwrap()),
        "{html}"
    );
    assert!(html.contains(p2["parameters_sha256"].as_str().unwrap()));
    assert!(!html.contains(secret2), "parameters shown to an auditor");
    assert!(!html.contains("The command exactly as it will run"));
    assert!(!html.contains("/decide\""), "a decide form for an auditor");
    assert!(
        html.contains("shown only to people who may decide"),
        "{html}"
    );
    clean(&html, &dora);
    // /v1 answers the auditor the same: the review without parameters.
    let r = client(&s)
        .get(format!("{}/v1/task-plans/{plan2}", s.url))
        .basic_auth("dora", Some(PASSWORD))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = r.json().await.unwrap();
    assert!(
        v.get("parameters").is_none() && v["state"] == "pending_approval",
        "{v}"
    );
    // A forged decision: the broker's 403 code, audited as /v1 would.
    let dora_csrf = csrf_field(&html);
    let html = b
        .decide_and_follow(&dora, &plan2, &dora_csrf, "approve", "error=action_denied")
        .await;
    assert!(
        html.contains("(action_denied)") && html.contains("look, not decide"),
        "{html}"
    );
    assert_eq!(plan_state(&s, &agent, &plan2).await, "pending_approval");
    assert_eq!(
        refusals(&s.journal(), "task_approve", "action_denied").len(),
        1
    );

    // Another tenant's approver: not in the queue, no such plan.
    let eve = b.sign_in("eve").await;
    let (st, html) = b.page("/console/approvals", &eve).await;
    assert_eq!(st, StatusCode::OK);
    assert!(!html.contains(&plan2) && !html.contains(&plan1), "{html}");
    assert!(html.contains("for tenant other"), "{html}");
    let (st, html) = b.page(&format!("/console/plans/{plan2}"), &eve).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{html}");
    assert!(html.contains("task_plan_not_found") && !html.contains(secret2));
    let eve_csrf = csrf_field(&html);
    let r = b.decide(&eve, &plan2, Some(&eve_csrf), "approve", "").await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        r.headers()[LOCATION],
        format!("/console/plans/{plan2}?error=task_plan_not_found").as_str()
    );
    assert_eq!(plan_state(&s, &agent, &plan2).await, "pending_approval");

    // Deny with a reason.
    let html = b
        .decide_and_follow(&alice, &plan2, &csrf, "deny", "done=denied")
        .await;
    assert!(html.contains("Denied."), "{html}");
    assert_eq!(plan_state(&s, &agent, &plan2).await, "denied");

    // Self-approval: sam plans with his password, then cannot approve.
    let r = client(&s)
        .post(format!("{}/v1/tasks/plan", s.url))
        .basic_auth("sam", Some(PASSWORD))
        .json(&json!({"template": "word-count", "parameters": {"text": "mine", "repeat": 1}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let v: Value = r.json().await.unwrap();
    let plan3 = v["plan_ref"].as_str().unwrap().to_string();
    let sam = b.sign_in("sam").await;
    let (_, html) = b.page("/console/approvals", &sam).await;
    assert!(html.contains(&plan3) && html.contains("(you)"), "{html}");
    let (st, html) = b.page(&format!("/console/plans/{plan3}"), &sam).await;
    assert_eq!(st, StatusCode::OK);
    assert!(html.contains("You asked for this plan"), "{html}");
    let sam_csrf = csrf_field(&html);
    let html = b
        .decide_and_follow(
            &sam,
            &plan3,
            &sam_csrf,
            "approve",
            "error=self_approval_denied",
        )
        .await;
    assert!(
        html.contains("(self_approval_denied)")
            && html.contains("someone other than its requester must approve it"),
        "{html}"
    );
    clean(&html, &sam);
    let (_, html) = b.page(&format!("/console/plans/{plan3}"), &alice).await;
    assert!(html.contains("pending_approval"), "{html}");
    assert_eq!(
        refusals(&s.journal(), "task_approve", "self_approval_denied").len(),
        1
    );

    // Signed out: the queue and the review send to sign-in; a bad code in
    // the query is not echoed.
    let r = b.get("/console/approvals", None).await;
    assert_to_sign_in(r.status(), r.headers(), "queue, signed out");
    let (st, html) = b
        .page(
            &format!("/console/plans/{plan3}?error=%3Cscript%3Ex"),
            &alice,
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert!(!html.contains("<script") && !html.contains("role=\"alert\""));
    s.stop().await;
}

/// The Overview shows auditors and admins each audit sink's state and lag
/// (a collector that refuses connections: failing, with the reason) and
/// the uncertain outcomes to review; an approver sees neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_audit_delivery_to_auditors() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let sinks: Vec<cube_adapter::config::sinks::SinkDef> = vec![
        toml::from_str(&format!(
            "kind = \"http\"\nname = \"siem\"\nurl = \"http://127.0.0.1:{port}/\"\nmax_backoff_seconds = 1\n"
        ))
        .unwrap(),
    ];
    let s = Server::start_with(move |c| c.audit.sinks = sinks).await;
    user(
        &s,
        &["add", "olga", "--tenant", "acme", "--role", "auditor"],
    );
    user(
        &s,
        &["add", "alice", "--tenant", "acme", "--role", "approver"],
    );
    let b = Browser::new(&s);
    let olga = b.sign_in("olga").await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let html = loop {
        let (st, _, html) = b.overview(&olga).await;
        assert_eq!(st, StatusCode::OK);
        if html.contains("failing (") {
            break html;
        }
        assert!(std::time::Instant::now() < deadline, "{html}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(
        html.contains("Audit delivery") && html.contains("<td>siem</td>"),
        "{html}"
    );
    assert!(html.contains("cannot connect"), "{html}");
    assert!(html.contains("Uncertain outcomes"), "{html}");
    assert_clean(&html, &s, Some(&olga));
    let alice = b.sign_in("alice").await;
    let (_, _, html) = b.overview(&alice).await;
    assert!(
        !html.contains("Audit delivery") && !html.contains("Uncertain outcomes"),
        "{html}"
    );
    s.stop().await;
}

/// A reason typed while the session ended is not lost (issue #36): the
/// decision is not made, the person signs in again and lands on the plan
/// with their words in the form; the draft is used once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_reason_survives_a_session_that_ended() {
    let (s, agent) = approvals_rig().await;
    let b = Browser::new(&s);
    let plan = plan_word_count(&s, &agent, "draft test").await["plan_ref"]
        .as_str()
        .unwrap()
        .to_string();
    let alice = b.sign_in("alice").await;
    let (_, html) = b.page(&format!("/console/plans/{plan}"), &alice).await;
    let csrf = csrf_field(&html);
    let r = b.sign_out(&alice, Some(&csrf)).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let words = "checked the diff with Bob; ok to run";
    let r = b.decide(&alice, &plan, Some(&csrf), "approve", words).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        r.headers()[LOCATION],
        format!("/console/sign-in?next=/console/plans/{plan}").as_str()
    );
    let (draft, header) = set_cookie(r.headers(), "__Host-cube-draft").expect("the draft is kept");
    for part in [
        "Secure",
        "HttpOnly",
        "SameSite=Strict",
        "Path=/",
        "Max-Age=1800",
    ] {
        assert!(header.contains(part), "{header}");
    }
    assert_eq!(plan_state(&s, &agent, &plan).await, "pending_approval");
    // Signing in again from the link's form goes back to the plan.
    let (c, cookie) = b.sign_in_form().await;
    let r = b
        .http
        .post(format!("{}/console/sign-in", b.url))
        .header("cookie", format!("{SIGN_IN}={cookie}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(&[
            ("csrf", &c),
            ("name", "alice"),
            ("password", PASSWORD),
            ("next", &format!("/console/plans/{plan}")),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        r.headers()[LOCATION],
        format!("/console/plans/{plan}").as_str()
    );
    let (session, _) = set_cookie(r.headers(), SESSION).unwrap();
    let r = b
        .http
        .get(format!("{}/console/plans/{plan}", b.url))
        .header(
            "cookie",
            format!("{SESSION}={session}; __Host-cube-draft={draft}"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let cleared = r
        .headers()
        .get_all(SET_COOKIE)
        .iter()
        .any(|v| v.to_str().unwrap().starts_with("__Host-cube-draft=;"));
    assert!(cleared, "the draft is used once");
    let html = r.text().await.unwrap();
    assert!(
        html.contains(&format!(">{words}</textarea>")) && html.contains("id=\"draft-kept\""),
        "{html}"
    );
    // Another plan's review does not take it.
    let other = plan_word_count(&s, &agent, "other").await["plan_ref"]
        .as_str()
        .unwrap()
        .to_string();
    let r = b
        .http
        .get(format!("{}/console/plans/{other}", b.url))
        .header(
            "cookie",
            format!("{SESSION}={session}; __Host-cube-draft={draft}"),
        )
        .send()
        .await
        .unwrap();
    assert!(!r.text().await.unwrap().contains(words));
    s.stop().await;
}
