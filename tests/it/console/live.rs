//! The console's Leases, jobs and PTYs pages (issue 15, item 4) and the
//! approval notifications (item 5), against the real server.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::Mac;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// `/v1` POST as the agent, expecting `want`.
async fn v1(s: &Server, token: &str, path: &str, body: Value, want: StatusCode) -> Value {
    let (st, v) = s.post(token, path, body).await;
    assert_eq!(st, want, "{path}: {v}");
    v
}

impl Browser {
    /// POST a form as `session`: the answer (not followed).
    async fn live_post(
        &self,
        session: Option<&str>,
        path: &str,
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

    /// POST, expect a 303 to `want`, follow it; the page.
    async fn live_post_follow(
        &self,
        session: &str,
        path: &str,
        fields: &[(&str, &str)],
        want: &str,
    ) -> String {
        let r = self.live_post(Some(session), path, fields).await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER, "{path}");
        assert_security_headers(r.headers(), path);
        let to = r.headers()[LOCATION].to_str().unwrap().to_string();
        assert_eq!(to, want, "{path}");
        let (st, html) = self.page(&to, session).await;
        assert_eq!(st, StatusCode::OK, "{html}");
        html
    }
}

/// The people of these tests. The auditors get their role's default
/// scopes (the reads: leases, jobs, PTYs, job output); alice, an approver,
/// is narrowed by `--action` to the lease list and approving.
fn people(s: &Server) {
    user(s, &["add", "root", "--tenant", "ops", "--role", "admin"]);
    user(s, &["add", "dora", "--tenant", "acme", "--role", "auditor"]);
    user(s, &["add", "eve", "--tenant", "other", "--role", "auditor"]);
    user(
        s,
        &[
            "add",
            "alice",
            "--tenant",
            "acme",
            "--role",
            "approver",
            "--action",
            "lease:list",
            "--action",
            "task:approve",
        ],
    );
}

/// A page, polled until it contains `want` (job output arrives as it runs).
async fn page_until(b: &Browser, path: &str, session: &str, want: &str) -> String {
    let mut last = String::new();
    for _ in 0..100 {
        let (st, html) = b.page(path, session).await;
        assert_eq!(st, StatusCode::OK, "{html}");
        if html.contains(want) {
            return html;
        }
        last = html;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    panic!("{path} never showed {want}: {last}");
}

/// An agent's lease, its jobs and PTY on the list; a job's output tail
/// (escaped, the end only, no command); an auditor looks but has no forms
/// and a forged POST is refused with the broker's code and audited; an
/// approver without job scopes sees the lease but not the jobs; another
/// tenant sees nothing; an admin cancels a job, kills a PTY and kills the
/// lease, audited as on /v1; sign-in and CSRF are required.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_jobs_ptys_tail_and_admin_actions() {
    let s = Server::start().await;
    let agent = s.token(&["--tenant", "acme", "--subject", "agent-live"]);
    people(&s);
    let b = Browser::new(&s);
    let clean = |html: &str, id: &str| {
        assert_clean(html, &s, Some(id));
        assert!(!html.contains(&agent), "the agent's token in the page");
    };

    let lease = s.acquire(&agent, "live-console").await;
    let (_, status) = s.get(&agent, &format!("/v1/leases/{lease}/status")).await;
    let sandbox_ref = status["sandbox_ref"].as_str().unwrap().to_string();
    let profile = status["profile"].as_str().unwrap().to_string();
    // One job that ends with a lot of output, one that keeps running.
    let v = v1(
        &s,
        &agent,
        &format!("/v1/leases/{lease}/jobs"),
        json!({"command": "for i in $(seq 1 4000); do echo \"line $i\"; done; echo '<b>done</b> & out'; echo err-marker >&2"}),
        StatusCode::ACCEPTED,
    )
    .await;
    let long = v["job_ref"].as_str().unwrap().to_string();
    let v = v1(
        &s,
        &agent,
        &format!("/v1/leases/{lease}/jobs"),
        json!({"command": "echo still-running; sleep 300"}),
        StatusCode::ACCEPTED,
    )
    .await;
    let sleeper = v["job_ref"].as_str().unwrap().to_string();
    let v = v1(
        &s,
        &agent,
        &format!("/v1/leases/{lease}/ptys"),
        json!({}),
        StatusCode::CREATED,
    )
    .await;
    let pty = v["pty_ref"].as_str().unwrap().to_string();

    // A job that ends is shown ended, with nobody asking /v1 about it
    // (issue #36: the list showed jobs running long after they exited).
    let v = v1(
        &s,
        &agent,
        &format!("/v1/leases/{lease}/jobs"),
        json!({"command": "exit 3"}),
        StatusCode::ACCEPTED,
    )
    .await;
    let quick = v["job_ref"].as_str().unwrap().to_string();
    let watcher = b.sign_in("dora").await;
    let state_of = |html: &str, job: &str| -> String {
        let at = html
            .find(&format!(">{job}</a>"))
            .unwrap_or_else(|| panic!("{job} not listed: {html}"));
        // The job's cell ends (after its recording's link); the state's
        // cell is next.
        let rest = &html[at..];
        let rest = &rest[rest.find("</td>").unwrap()..];
        let td = rest.find("<td>").unwrap() + 4;
        rest[td..td + rest[td..].find("</td>").unwrap()].to_string()
    };
    let mut seen = String::new();
    for _ in 0..50 {
        let (st, html) = b.page("/console/leases", &watcher).await;
        assert_eq!(st, StatusCode::OK, "{html}");
        seen = state_of(&html, &quick);
        if seen == "failed" {
            assert_eq!(state_of(&html, &sleeper), "running");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(seen, "failed", "the list shows the job as it is");

    // Signed out: sign in first, for pages and forms alike.
    let r = b.get("/console/leases", None).await;
    assert_to_sign_in(r.status(), r.headers(), "leases, signed out");
    let r = b.get(&format!("/console/jobs/{long}"), None).await;
    assert_to_sign_in(r.status(), r.headers(), "job, signed out");
    let r = b
        .live_post(
            None,
            &format!("/console/leases/{lease}/release"),
            &[("action", "kill")],
        )
        .await;
    assert_to_sign_in(r.status(), r.headers(), "release, signed out");

    // The auditor of the tenant: the lease, its jobs and PTY; no forms.
    let dora = b.sign_in("dora").await;
    let (st, html) = b.page("/console/leases", &dora).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        "<h1>Leases, jobs and PTYs</h1>",
        "Live leases of tenant acme",
        "href=\"/console/leases\" aria-current=\"page\"",
        &format!("<code>{lease}</code>"),
        &format!("<code>{sandbox_ref}</code>"),
        &format!("<dd>{profile}</dd>"),
        "<dd>acme</dd>",
        "<dd>mcp</dd>",
        "embedded",
        &format!("<a href=\"/console/jobs/{long}\">{long}</a>"),
        &format!("<a href=\"/console/jobs/{sleeper}\">{sleeper}</a>"),
        &format!("<code>{pty}</code>"),
        "<meta http-equiv=\"refresh\" content=\"10\">",
        "Releasing leases and ending jobs and PTYs is for admins.",
    ] {
        assert!(html.contains(want), "the list lacks {want}: {html}");
    }
    for absent in ["/release\"", "/cancel\"", "/kill\""] {
        assert!(!html.contains(absent), "a form for an auditor: {absent}");
    }
    clean(&html, &dora);
    let dora_csrf = csrf_field(&html);

    // The tail: the end of stdout and stderr, escaped; no command.
    let html = page_until(
        &b,
        &format!("/console/jobs/{long}"),
        &dora,
        "&#60;b&#62;done&#60;/b&#62; &#38; out",
    )
    .await;
    for want in [
        "line 4000",
        "err-marker",
        "the end only",
        &format!("<code>{lease}</code>"),
        "Output (read-only)",
    ] {
        assert!(html.contains(want), "the tail lacks {want}: {html}");
    }
    assert!(!html.contains("<b>done</b>"), "unescaped output");
    assert!(
        !html.contains("line 2\nline 3\n"),
        "not only the end: {html}"
    );
    assert!(!html.contains("seq 1 4000"), "the command in the page");
    assert!(!html.contains("/cancel\""), "a cancel form for an auditor");
    clean(&html, &dora);
    let j = s.journal();
    let reads: Vec<&str> = events(&j, "job_output", "ok")
        .into_iter()
        .filter(|l| l.contains(&long))
        .collect();
    assert!(!reads.is_empty(), "the tail is not audited: {j}");

    // The auditor's forged actions: the broker's code, nothing done.
    let html = b
        .live_post_follow(
            &dora,
            &format!("/console/leases/{lease}/release"),
            &[("csrf", &dora_csrf), ("action", "kill"), ("confirm", "yes")],
            "/console/leases?error=action_denied",
        )
        .await;
    assert!(
        html.contains("(action_denied)") && html.contains("role=\"alert\""),
        "{html}"
    );
    assert!(html.contains(&lease), "the lease is gone: {html}");
    b.live_post_follow(
        &dora,
        &format!("/console/jobs/{sleeper}/cancel"),
        &[("csrf", &dora_csrf)],
        &format!("/console/jobs/{sleeper}?error=action_denied"),
    )
    .await;
    b.live_post_follow(
        &dora,
        &format!("/console/ptys/{pty}/kill"),
        &[("csrf", &dora_csrf)],
        "/console/leases?error=action_denied",
    )
    .await;
    let j = s.journal();
    for action in ["release", "job_cancel", "pty_kill"] {
        assert_eq!(
            super::refusals(&j, action, "action_denied").len(),
            1,
            "{action}: {j}"
        );
    }
    let (_, v) = s.get(&agent, &format!("/v1/jobs/{sleeper}/status")).await;
    assert_eq!(v["state"], "running", "{v}");

    // An approver narrowed to lease:list: the lease, not its jobs; a job's
    // page is refused with the broker's code.
    let alice = b.sign_in("alice").await;
    let (st, html) = b.page("/console/leases", &alice).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(html.contains(&lease), "{html}");
    assert!(!html.contains(&long) && !html.contains(&pty), "{html}");
    let (st, html) = b.page(&format!("/console/jobs/{long}"), &alice).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{html}");
    assert!(html.contains("action_denied"), "{html}");

    // Another tenant: nothing, and no such job.
    let eve = b.sign_in("eve").await;
    let (st, html) = b.page("/console/leases", &eve).await;
    assert_eq!(st, StatusCode::OK);
    assert!(!html.contains(&lease) && !html.contains(&long), "{html}");
    assert!(html.contains("No lease is live."), "{html}");
    let (st, html) = b.page(&format!("/console/jobs/{long}"), &eve).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{html}");
    assert!(html.contains("job_not_found") && !html.contains("line 4000"));
    let eve_csrf = csrf_field(&html);
    let r = b
        .live_post(
            Some(&eve),
            &format!("/console/leases/{lease}/release"),
            &[("csrf", &eve_csrf), ("action", "kill"), ("confirm", "yes")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(r.headers()[LOCATION], "/console/leases?error=action_denied");

    // The admin: every tenant, with the forms.
    let root = b.sign_in("root").await;
    let (st, html) = b.page("/console/leases", &root).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        "Live leases of all tenants",
        &format!("action=\"/console/leases/{lease}/release\""),
        &format!("action=\"/console/jobs/{sleeper}/cancel\""),
        &format!("action=\"/console/ptys/{pty}/kill\""),
        "value=\"pause\"",
        "value=\"kill\"",
    ] {
        assert!(html.contains(want), "the admin's list lacks {want}: {html}");
    }
    // The finished job has no cancel form.
    assert!(!html.contains(&format!("/console/jobs/{long}/cancel")));
    clean(&html, &root);
    let csrf = csrf_field(&html);

    // CSRF: none, or another session's: 403, nothing done.
    for bad in [None, Some(dora_csrf.as_str()), Some("forged")] {
        let mut f = vec![("action", "kill")];
        if let Some(c) = bad {
            f.push(("csrf", c));
        }
        let r = b
            .live_post(Some(&root), &format!("/console/leases/{lease}/release"), &f)
            .await;
        assert_eq!(r.status(), StatusCode::FORBIDDEN, "{bad:?}");
        assert_security_headers(r.headers(), "refused release");
        let r = b
            .live_post(
                Some(&root),
                &format!("/console/jobs/{sleeper}/cancel"),
                &f[1..],
            )
            .await;
        assert_eq!(r.status(), StatusCode::FORBIDDEN, "{bad:?}");
    }
    let (st, _) = s.get(&agent, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::OK, "the lease survived forged forms");

    // Cancel the running job: back to its page, which says so.
    let html = b
        .live_post_follow(
            &root,
            &format!("/console/jobs/{sleeper}/cancel"),
            &[("csrf", &csrf)],
            &format!("/console/jobs/{sleeper}?done=job_cancelled"),
        )
        .await;
    assert!(
        html.contains("Cancelled.") && html.contains(">cancelled</dd>"),
        "{html}"
    );
    assert!(html.contains("still-running"), "{html}");
    clean(&html, &root);
    let (_, v) = s.get(&agent, &format!("/v1/jobs/{sleeper}/status")).await;
    assert_eq!(v["state"], "cancelled", "{v}");

    // Kill the PTY.
    let html = b
        .live_post_follow(
            &root,
            &format!("/console/ptys/{pty}/kill"),
            &[("csrf", &csrf)],
            "/console/leases?done=pty_killed",
        )
        .await;
    assert!(
        html.contains("The PTY&#39;s process was ended.")
            || html.contains("The PTY's process was ended."),
        "{html}"
    );
    let (_, v) = s.get(&agent, &format!("/v1/ptys/{pty}/status")).await;
    assert_eq!(v["state"], "cancelled", "{v}");

    // A release that is neither pause nor kill: the broker's code.
    b.live_post_follow(
        &root,
        &format!("/console/leases/{lease}/release"),
        &[("csrf", &csrf), ("action", "explode")],
        "/console/leases?error=invalid_action",
    )
    .await;

    // Kill the lease: asked first (nothing happens yet), then gone for
    // the agent too.
    let r = b
        .live_post(
            Some(&root),
            &format!("/console/leases/{lease}/release"),
            &[("csrf", &csrf), ("action", "kill")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let html = r.text().await.unwrap();
    assert!(
        html.contains("Kill this lease?")
            && html.contains("name=\"action\" value=\"kill\"")
            && html.contains("name=\"confirm\" value=\"yes\""),
        "{html}"
    );
    clean(&html, &root);
    let (st, _) = s.get(&agent, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::OK, "killed before confirming");
    let html = b
        .live_post_follow(
            &root,
            &format!("/console/leases/{lease}/release"),
            &[("csrf", &csrf), ("action", "kill"), ("confirm", "yes")],
            "/console/leases?done=killed",
        )
        .await;
    assert!(!html.contains(&format!("<code>{lease}</code>")), "{html}");
    clean(&html, &root);
    let (st, v) = s.get(&agent, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{v}");

    // Audited as /v1 audits them, as the admin.
    let j = s.journal();
    for action in ["job_cancel", "pty_kill", "release"] {
        let ok = events(&j, action, "ok");
        assert_eq!(ok.len(), 1, "{action}: {j}");
        assert!(ok[0].contains(&lease), "{action}: {}", ok[0]);
    }
    assert!(events(&j, "release", "ok")[0].contains("\"release_action\":\"kill\""));
    assert!(!j.contains(PASSWORD));
    // A bad reference in a form is no page, and never echoed.
    let r = b
        .live_post(
            Some(&root),
            "/console/ptys/%3Cscript%3E/kill",
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let (st, html) = b.page("/console/leases?error=%3Cscript%3E", &root).await;
    assert_eq!(st, StatusCode::OK);
    assert!(!html.contains("<script") && !html.contains("role=\"alert\""));
    s.stop().await;
}

/// What the receiver got: headers (lower-case names) and body.
type Got = Arc<Mutex<Vec<(Vec<(String, String)>, Vec<u8>)>>>;

/// A webhook on 127.0.0.1: each request is recorded; the first `hang`
/// requests get no answer for a minute, the next `fail` get 503, the rest
/// 200.
async fn receiver(hang: usize, fail: usize) -> (String, Got) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks/approvals", l.local_addr().unwrap());
    let got: Got = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = l.accept().await else {
                return;
            };
            let g = g.clone();
            tokio::spawn(async move {
                let mut buf = vec![];
                let mut chunk = [0u8; 4096];
                let (head_end, len) = loop {
                    let n = c.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
                        let len = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        break (i + 4, len);
                    }
                };
                while buf.len() < head_end + len {
                    let n = c.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                let headers = head
                    .lines()
                    .skip(1)
                    .filter_map(|l| l.split_once(':'))
                    .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))
                    .collect();
                let body = buf[head_end..head_end + len].to_vec();
                let nth = {
                    let mut g = g.lock().unwrap();
                    g.push((headers, body));
                    g.len()
                };
                if nth <= hang {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    return;
                }
                let answer = if nth <= hang + fail {
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                } else {
                    "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                };
                let _ = c.write_all(answer.as_bytes()).await;
                let _ = c.shutdown().await;
            });
        }
    });
    (url, got)
}

fn notify_section(url: &str, secret: &std::path::Path) -> cube_adapter::config::NotifySection {
    cube_adapter::config::NotifySection {
        url: url.to_string(),
        ca_file: None,
        secret_file: Some(secret.to_path_buf()),
        console_url: Some("https://console.example:18080".into()),
        max_attempts: 5,
        retry_initial_ms: 50,
        timeout_seconds: 2,
        queue: 16,
    }
}

/// A plan that needs approval is told to the webhook: a first attempt
/// that hangs and a second that fails are retried; the message is signed
/// (HMAC over timestamp and body), names the tenant, template, profile,
/// plan and expiry, links to the review page, and holds no parameter
/// value; planning answered at once all the while.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_notifications_are_signed_retried_and_never_block() {
    let (url, got) = receiver(1, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("notify.secret");
    let secret = "a shared secret of the webhook, 0123456789";
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let section = notify_section(&url, &secret_file);
    let s = Server::start_with(|c| {
        crate::tasks::configure(c);
        c.console.notify = Some(section);
        c.validate().unwrap();
    })
    .await;
    let agent = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "agent-n",
        "--action",
        "task:*",
    ]);
    let hidden = "a parameter value never to leave";
    let t0 = Instant::now();
    let p = plan_word_count(&s, &agent, hidden).await;
    let took = t0.elapsed();
    // The webhook's first attempt hangs for its whole 2 s timeout.
    assert!(
        took < Duration::from_millis(1500),
        "planning waited: {took:?}"
    );
    let plan = p["plan_ref"].as_str().unwrap().to_string();

    // Hang (timed out), 503, then accepted.
    let mut n = 0;
    for _ in 0..200 {
        n = got.lock().unwrap().len();
        if n >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(n, 3, "attempts");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = got.lock().unwrap().clone();
    assert_eq!(got.len(), 3, "nothing more after it was accepted");
    let (_, first_body) = &got[0];
    for (headers, body) in &got {
        assert_eq!(body, first_body, "a retry sends the same message");
        let h = |k: &str| {
            headers
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no {k} header"))
        };
        assert_eq!(h("content-type"), "application/json");
        let ts = h("x-cube-timestamp");
        let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(secret.as_bytes()).unwrap();
        m.update(format!("{ts}.").as_bytes());
        m.update(body);
        let want = format!("sha256={}", hex::encode(m.finalize().into_bytes()));
        assert_eq!(h("x-cube-signature"), want, "the HMAC");
        let age = cube_adapter::clock::system_now().unix_timestamp() - ts.parse::<i64>().unwrap();
        assert!((0..120).contains(&age), "timestamp {ts}");
    }
    let v: Value = serde_json::from_slice(first_body).unwrap();
    let text = v["text"].as_str().unwrap();
    let link = format!("https://console.example:18080/console/plans/{plan}");
    for want in [
        "acme",
        "word-count",
        "trusted",
        plan.as_str(),
        p["expires_at"].as_str().unwrap(),
        link.as_str(),
    ] {
        assert!(text.contains(want), "the message lacks {want}: {text}");
    }
    assert_eq!(v["cube_adapter"]["review_url"], link.as_str());
    assert_eq!(v["cube_adapter"]["tenant"], "acme");
    let raw = String::from_utf8_lossy(first_body);
    assert!(!raw.contains(hidden), "a parameter value in the message");
    assert!(!raw.contains("/bin/sh"), "the command in the message");
    assert!(!raw.contains(secret), "the secret in the message");
    // The link is the console's review page of the plan.
    let b = Browser::new(&s);
    user(
        &s,
        &["add", "alice", "--tenant", "acme", "--role", "approver"],
    );
    let alice = b.sign_in("alice").await;
    let (st, html) = b.page(&format!("/console/plans/{plan}"), &alice).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    s.stop().await;
}

/// A webhook nobody answers and a full queue: planning still answers at
/// once, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_webhook_never_blocks_planning() {
    // A port with nothing behind it, and one that accepts and never answers.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (hanging, got) = receiver(usize::MAX, 0).await;
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("notify.secret");
    std::fs::write(&secret_file, "0123456789abcdef0123456789abcdef").unwrap();
    for url in [format!("http://{dead}/hook"), hanging] {
        let mut section = notify_section(&url, &secret_file);
        section.queue = 1;
        section.retry_initial_ms = 1000;
        let s = Server::start_with(|c| {
            crate::tasks::configure(c);
            c.console.notify = Some(section);
        })
        .await;
        let agent = s.token(&[
            "--tenant",
            "acme",
            "--subject",
            "agent-d",
            "--action",
            "task:*",
        ]);
        for i in 0..4 {
            let t0 = Instant::now();
            plan_word_count(&s, &agent, &format!("plan {i}")).await;
            let took = t0.elapsed();
            assert!(
                took < Duration::from_millis(1500),
                "{url}: planning waited {took:?}"
            );
        }
        s.stop().await;
    }
    // The hanging one was reached (so its wait was real), once at a time.
    assert!(!got.lock().unwrap().is_empty());
}

/// A trusted task's lease: on the admin's list with its task and no
/// forms (it ends with its task, and the broker would not find it for a
/// person); not on the tenant's list, as `GET /v1/leases` does not show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_tasks_lease_is_the_tasks() {
    let s = Server::start_with(crate::tasks::configure).await;
    let agent = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "agent-t",
        "--action",
        "task:*",
    ]);
    people(&s);
    let plan = v1(
        &s,
        &agent,
        "/v1/tasks/plan",
        json!({"template": "sleeper", "parameters": {"secs": 60}}),
        StatusCode::CREATED,
    )
    .await;
    let pr = plan["plan_ref"].as_str().unwrap();
    let task = v1(
        &s,
        &agent,
        &format!("/v1/task-plans/{pr}/submit"),
        json!({}),
        StatusCode::ACCEPTED,
    )
    .await;
    let tr = task["task_ref"].as_str().unwrap().to_string();
    let b = Browser::new(&s);
    let root = b.sign_in("root").await;
    let (st, html) = b.page("/console/leases", &root).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(
        html.contains(&format!("<code>{tr}</code> (released with its task)")),
        "{html}"
    );
    assert!(
        !html.contains("/release\""),
        "a release form for a task's lease: {html}"
    );
    assert!(
        !html.contains("/cancel\"") && !html.contains("/kill\""),
        "{html}"
    );
    assert_clean(&html, &s, Some(&root));
    let dora = b.sign_in("dora").await;
    let (st, html) = b.page("/console/leases", &dora).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(
        !html.contains(&tr) && html.contains("No lease is live."),
        "{html}"
    );
    let (st, v) = s
        .post(&agent, &format!("/v1/tasks/{tr}/cancel"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    s.stop().await;
}

/// A lease's card shows the preset applied to its sandbox (`NAME@VERSION`
/// and the start of its digest) and its egress destinations, "narrowed"
/// once an operator narrowed them; a lease with neither shows neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leases_card_shows_its_preset_and_egress() {
    use cube_adapter::config::{Preset, Profile, ProfileEgress};
    let s = Server::start_with(|c| {
        let preset: Preset =
            toml::from_str("version = \"2026-12-07\"\nbootstrap = [\"true\"]\n").unwrap();
        c.presets.insert("claw".into(), preset);
        c.profiles.insert(
            "claw".into(),
            Profile {
                template_preset: Some("claw".into()),
                ..Profile::default()
            },
        );
        let egress: ProfileEgress = toml::from_str(
            "destinations = [\"api.test.invalid:8080\", \"*.mirror.test.invalid:8080\"]\n",
        )
        .unwrap();
        c.profiles.insert(
            "brokered".into(),
            Profile {
                egress: Some(egress),
                ..Profile::default()
            },
        );
    })
    .await;
    people(&s);
    let claw = s.acquire_in("claw", "card-preset").await;
    let brokered = s.acquire_in("brokered", "card-egress").await;
    let (_, status) = s.get(&s.admin, &format!("/v1/leases/{claw}/status")).await;
    let digest = status["preset_digest"].as_str().unwrap().to_string();
    let b = Browser::new(&s);
    let root = b.sign_in("root").await;
    let card = |html: &str, lease: &str| -> String {
        let at = html
            .find(&format!("id=\"h-{lease}\""))
            .unwrap_or_else(|| panic!("{lease} not listed: {html}"));
        let rest = &html[at..];
        rest[..rest.find("</section>").unwrap()].to_string()
    };

    let (st, html) = b.page("/console/leases", &root).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    let c = card(&html, &claw);
    assert!(
        c.contains(&format!(
            "<dd class=\"lease-preset\">claw@2026-12-07 <code title=\"SHA-256 of the preset as applied\">{}…</code></dd>",
            &digest[..12]
        )),
        "{c}"
    );
    assert!(!c.contains(&digest), "the whole digest: {c}");
    assert!(!c.contains("lease-egress"), "{c}");
    let c = card(&html, &brokered);
    assert!(
        c.contains("<dd class=\"lease-egress\"><code>api.test.invalid:8080</code>, <code>*.mirror.test.invalid:8080</code></dd>"),
        "{c}"
    );
    assert!(!c.contains("lease-preset"), "{c}");
    // An admin's card has the narrowing form, each destination checked.
    assert!(
        c.contains(&format!("action=\"/console/leases/{brokered}/egress\"")),
        "{c}"
    );
    assert!(
        c.contains("name=\"keep:api.test.invalid:8080\" value=\"1\" checked"),
        "{c}"
    );
    assert!(!card(&html, &claw).contains("/egress\""));
    // An auditor sees the destinations and no form; a forged POST is
    // refused (admin_required) and changes nothing.
    let dora = b.sign_in("dora").await;
    let (_, dhtml) = b.page("/console/leases", &dora).await;
    if dhtml.contains(&format!("id=\"h-{brokered}\"")) {
        assert!(!card(&dhtml, &brokered).contains("/egress\""));
    }
    let dcsrf = super::csrf_field(&dhtml);
    let r = b
        .live_post(
            Some(&dora),
            &format!("/console/leases/{brokered}/egress"),
            &[("csrf", &dcsrf)],
        )
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        r.headers()[LOCATION],
        "/console/leases?error=admin_required"
    );
    // The admin keeps one, then the form can only narrow: one that is no
    // longer the lease's is refused.
    let csrf = super::csrf_field(&html);
    let done = b
        .live_post_follow(
            &root,
            &format!("/console/leases/{brokered}/egress"),
            &[("csrf", &csrf), ("keep:api.test.invalid:8080", "1")],
            "/console/leases?done=egress_narrowed",
        )
        .await;
    assert!(done.contains("Narrowed."), "{done}");
    assert!(
        card(&done, &brokered).contains(
            "<dd class=\"lease-egress\"><code>api.test.invalid:8080</code> (narrowed)</dd>"
        ),
        "{done}"
    );
    let r = b
        .live_post(
            Some(&root),
            &format!("/console/leases/{brokered}/egress"),
            &[("csrf", &csrf), ("keep:*.mirror.test.invalid:8080", "1")],
        )
        .await;
    assert_eq!(
        r.headers()[LOCATION],
        "/console/leases?error=invalid_request"
    );
    let narrowed = s.events("egress_narrow");
    assert_eq!(narrowed.len(), 1, "{narrowed:#?}");
    assert!(narrowed[0]["identity_digest"].is_string());
    assert_eq!(narrowed[0]["destination"], "api.test.invalid:8080");
    assert_clean(&done, &s, Some(&root));

    let out = s.cli(&["lease", "egress", &brokered, "--none"]);
    assert!(out.status.success(), "{out:?}");
    let (_, html) = b.page("/console/leases", &root).await;
    let c = card(&html, &brokered);
    assert!(
        c.contains("<dd class=\"lease-egress\">none (narrowed)</dd>"),
        "{c}"
    );
    assert!(!c.contains("/egress\""), "nothing left to narrow: {c}");
    assert_clean(&html, &s, Some(&root));
    s.stop().await;
}
