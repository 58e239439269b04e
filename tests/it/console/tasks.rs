//! Console: tasks (issue 15). Shares the helpers of `console/mod.rs`.
//!
//! An agent plans and runs trusted tasks; the console lists them (with
//! filters and pages), shows a task's status, outputs and evidence to
//! those `/v1` shows them to, serves the receipt as `/v1` does (the real
//! `receipt verify` CLI accepts the file), verifies it server-side as the
//! CLI does, and lets admins (only) cancel a task.

use std::time::Duration;

use super::*;

/// The HTML escapes askama writes, undone (to read JSON out of a page).
fn unescape(s: &str) -> String {
    s.replace("&#34;", "\"")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&#38;", "&")
        .replace("&amp;", "&")
}

/// The text of the first `<pre class="{class}">` of a page.
fn pre(html: &str, class: &str) -> String {
    let start = format!("<pre class=\"{class}\">");
    let at = html.find(&start).expect("the pre block") + start.len();
    let end = html[at..].find("</pre>").unwrap();
    unescape(&html[at..at + end])
}

/// `cube-adapter receipt verify FILE --state-dir …`: exit code and verdict.
fn cli_verify(s: &Server, file: &std::path::Path) -> (i32, Value) {
    let out = std::process::Command::new(BIN)
        .args(["receipt", "verify"])
        .arg(file)
        .arg("--state-dir")
        .arg(&s.state)
        .arg("--config")
        .arg(s.empty_config())
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v)
}

async fn task_state(s: &Server, token: &str, task: &str) -> Value {
    let (st, v) = s.get(token, &format!("/v1/tasks/{task}/status")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v
}

async fn wait_ended(s: &Server, token: &str, task: &str) {
    for _ in 0..300 {
        if task_state(s, token, task).await["execution_ended"] == true {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("task {task} did not end");
}

impl Browser {
    /// POST the cancel form of a task: the answer (not followed).
    async fn post_task_cancel(
        &self,
        session: &str,
        task: &str,
        csrf: Option<&str>,
    ) -> reqwest::Response {
        let fields: Vec<(&str, &str)> = csrf.map(|c| ("csrf", c)).into_iter().collect();
        self.http
            .post(format!("{}/console/tasks/{task}/cancel", self.url))
            .header("cookie", format!("{SESSION}={session}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(&fields))
            .send()
            .await
            .unwrap()
    }
}

/// The list, the detail, the receipt and its verification, cancel; who
/// sees what; sign-in, CSRF and tenant limits; the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_list_detail_receipt_and_cancel() {
    let clock = ManualClock::starting_now();
    let s = Server::start_with(|c| {
        crate::tasks::configure(c);
        c.clock = clock.clone().into();
    })
    .await;
    let agent = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "agent-a",
        "--action",
        "task:*",
    ]);
    let bob = s.token(&["--tenant", "acme", "--subject", "bob", "--role", "approver"]);
    user(
        &s,
        &["add", "alice", "--tenant", "acme", "--role", "approver"],
    );
    user(
        &s,
        &["add", "dora", "--tenant", "acme", "--role", "auditor"],
    );
    user(
        &s,
        &["add", "eve", "--tenant", "other", "--role", "approver"],
    );
    user(&s, &["add", "root", "--tenant", "ops", "--role", "admin"]);
    let b = Browser::new(&s);
    let secret = "SECRET-WORDS one two three four";
    let clean = |html: &str, id: &str| {
        assert_clean(html, &s, Some(id));
        assert!(!html.contains(&agent), "the agent's token in the page");
        assert!(!html.contains(&bob), "the approver's token in the page");
        assert!(!html.contains(secret), "a parameter in the page");
    };

    // Sign-in is required for every page and form.
    for path in [
        "/console/tasks",
        "/console/tasks/task_x",
        "/console/tasks/task_x/receipt",
        "/console/tasks/task_x/verify",
    ] {
        let r = b.get(path, None).await;
        assert_to_sign_in(r.status(), r.headers(), path);
    }
    let r = b
        .http
        .post(format!("{}/console/tasks/task_x/cancel", s.url))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("csrf=x")
        .send()
        .await
        .unwrap();
    assert_to_sign_in(r.status(), r.headers(), "cancel");

    // An agent plans word-count, bob approves, the agent submits and
    // finalizes: a receipt. Then a sleeper that keeps running.
    let plan = plan_word_count(&s, &agent, secret).await;
    let pr = plan["plan_ref"].as_str().unwrap().to_string();
    let (st, v) = s
        .post(&bob, &format!("/v1/task-plans/{pr}/approve"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, v) = s
        .post(&agent, &format!("/v1/task-plans/{pr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let done = v["task_ref"].as_str().unwrap().to_string();
    wait_ended(&s, &agent, &done).await;
    let (st, res) = s
        .post(&agent, &format!("/v1/tasks/{done}/result"), json!({}))
        .await;
    assert_eq!(st, StatusCode::OK, "{res}");
    assert_eq!(res["state"], "succeeded", "{res}");
    let echo_sha = res["result"]["output_evidence"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "echo")
        .unwrap()["sha256"]
        .as_str()
        .unwrap()
        .to_string();
    // Creation times are in seconds: the sleeper is the newer one.
    clock.advance(time::Duration::seconds(2));
    let (st, v) = s
        .post(
            &agent,
            "/v1/tasks/plan",
            json!({"template": "sleeper", "parameters": {"secs": 60}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let spr = v["plan_ref"].as_str().unwrap().to_string();
    let (st, v) = s
        .post(&agent, &format!("/v1/task-plans/{spr}/submit"), json!({}))
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let running = v["task_ref"].as_str().unwrap().to_string();
    assert_eq!(task_state(&s, &agent, &running).await["state"], "running");
    // Another tenant's task (no approval needed; it ends by itself).
    let other_agent = s.token(&[
        "--tenant",
        "other",
        "--subject",
        "agent-o",
        "--action",
        "task:*",
    ]);
    let (st, v) = s
        .post(
            &other_agent,
            "/v1/tasks/plan",
            json!({"template": "sleeper", "parameters": {"secs": 1}}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let (st, v) = s
        .post(
            &other_agent,
            &format!("/v1/task-plans/{}/submit", v["plan_ref"].as_str().unwrap()),
            json!({}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let other = v["task_ref"].as_str().unwrap().to_string();

    // The approver's list: both, newest first, linked.
    let alice = b.sign_in("alice").await;
    let (st, html) = b.page("/console/tasks", &alice).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        "<h1>Tasks</h1>",
        "href=\"/console/tasks\" aria-current=\"page\"",
        &format!("<a href=\"/console/tasks/{done}\">{done}</a>"),
        &format!("<a href=\"/console/tasks/{running}\">{running}</a>"),
        &format!("<a href=\"/console/plans/{pr}\">{pr}</a>"),
        "<label for=\"state\">State</label>",
        "<option value=\"word-count\">word-count</option>",
        "tenant acme",
    ] {
        assert!(html.contains(want), "the list lacks {want}: {html}");
    }
    assert!(
        html.find(&running).unwrap() < html.find(&done).unwrap(),
        "newest first: {html}"
    );
    assert!(
        !html.contains("<label for=\"tenant\">"),
        "a tenant filter for a non-admin"
    );
    assert!(!html.contains(&other), "another tenant's task: {html}");
    clean(&html, &alice);

    // Filters: state, template, reference search; each narrows the list.
    for (q, shown, hidden) in [
        ("state=succeeded", &done, &running),
        ("state=active", &running, &done),
        ("template=sleeper", &running, &done),
        (&format!("q={}", &pr[5..15]) as &str, &done, &running),
        (&format!("q={}", &running[5..]) as &str, &running, &done),
    ] {
        let (st, html) = b.page(&format!("/console/tasks?{q}"), &alice).await;
        assert_eq!(st, StatusCode::OK, "{q}: {html}");
        assert!(html.contains(shown.as_str()), "{q} hides {shown}: {html}");
        assert!(
            !html.contains(hidden.as_str()),
            "{q} shows {hidden}: {html}"
        );
        assert!(html.contains("Clear the filters"), "{q}");
        clean(&html, &alice);
    }
    let (_, html) = b.page("/console/tasks?state=failed", &alice).await;
    assert!(html.contains("No task matches these filters."), "{html}");
    // Paging: one a page, then the older one through the cursor.
    let (_, html) = b.page("/console/tasks?limit=1", &alice).await;
    assert!(html.contains(&running) && !html.contains(&done), "{html}");
    let next = format!("/console/tasks?limit=1&#38;before={running}");
    assert!(html.contains(&next), "{html}");
    let (_, html) = b.page(&unescape(&next), &alice).await;
    assert!(html.contains(&done) && !html.contains(&running), "{html}");
    assert!(
        html.contains("First page") && !html.contains("Older tasks"),
        "{html}"
    );
    // Bad filters: a clear error with a stable code, never a panic.
    for q in [
        "state=bogus",
        "template=No%20Such",
        "q=%3Cscript%3E",
        "limit=0",
        "limit=abc",
        "before=task_nosuch",
        "before=task_00000000000000000000",
        "before=plan_x",
    ] {
        let (st, html) = b.page(&format!("/console/tasks?{q}"), &alice).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{q}: {html}");
        assert!(html.contains("(invalid_request)"), "{q}: {html}");
        assert!(!html.contains("<script>"), "{q}");
    }

    // The approver's detail: status, evidence, the receipt; no exposed
    // content (as /v1 status answers an approver), no cancel form.
    let (st, html) = b.page(&format!("/console/tasks/{done}"), &alice).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        &format!("<h1>Task <code>{done}</code></h1>") as &str,
        "<dd class=\"task-state\">succeeded</dd>",
        &format!("<a href=\"/console/plans/{pr}\">{pr}</a>"),
        "<dd>word-count</dd>",
        "<dd>trusted</dd>",
        plan["template_sha256"].as_str().unwrap(),
        plan["parameters_sha256"].as_str().unwrap(),
        plan["command_sha256"].as_str().unwrap(),
        &echo_sha,
        "Exposed outputs are shown to the task's requester and to admins",
        &format!("href=\"/console/tasks/{done}/receipt\" download"),
        &format!("href=\"/console/tasks/{done}/verify\""),
        "Audit chain head it names",
    ] {
        assert!(html.contains(want), "the detail lacks {want}: {html}");
    }
    assert!(
        !html.contains("&#34;words&#34;"),
        "outputs shown to an approver: {html}"
    );
    assert!(!html.contains("/cancel\""), "a cancel form for an approver");
    clean(&html, &alice);

    // The receipt as a file: what /v1 gives, and the real CLI accepts it.
    let r = b
        .get(&format!("/console/tasks/{done}/receipt"), Some(&alice))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_security_headers(r.headers(), "receipt");
    assert_eq!(
        r.headers()["content-disposition"],
        format!("attachment; filename=\"{done}.receipt.json\"").as_str()
    );
    assert_eq!(r.headers()["content-type"], "application/json");
    let bytes = r.bytes().await.unwrap();
    let got: Value = serde_json::from_slice(&bytes).unwrap();
    let (st, v1) = s.get(&bob, &format!("/v1/tasks/{done}/receipt")).await;
    assert_eq!(st, StatusCode::OK, "{v1}");
    // On /v1 as in the console: an auditor of the tenant follows the task
    // (status, receipt) but never reads its result.
    let auditor = s.token(&[
        "--tenant",
        "acme",
        "--subject",
        "audra",
        "--role",
        "auditor",
    ]);
    for what in ["status", "receipt"] {
        let (st, v) = s.get(&auditor, &format!("/v1/tasks/{done}/{what}")).await;
        assert_eq!(st, StatusCode::OK, "auditor {what}: {v}");
    }
    let (st, v) = s
        .post(&auditor, &format!("/v1/tasks/{done}/result"), json!({}))
        .await;
    assert!(st.is_client_error(), "an auditor read a result: {st} {v}");
    assert_eq!(got["receipt"], v1["receipt"]);
    assert_eq!(got["receipt"], res["receipt"]);
    assert_eq!(got["task_ref"], done.as_str());
    let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&got), keys(&v1), "the same answer as /v1");
    let file = s.dir.path().join(format!("{done}.receipt.json"));
    std::fs::write(&file, &bytes).unwrap();
    let (rc, cli) = cli_verify(&s, &file);
    assert_eq!(rc, 0, "{cli}");
    assert_eq!(
        (
            cli["valid"].clone(),
            cli["ed25519"].clone(),
            cli["hs256"].clone()
        ),
        (json!(true), json!(true), json!(true))
    );

    // Verify: each signature valid, the head in the journal, and the very
    // verdict the CLI prints.
    let (st, html) = b
        .page(&format!("/console/tasks/{done}/verify"), &alice)
        .await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(
        html.contains("Valid: every signature checked holds."),
        "{html}"
    );
    let receipt = &res["receipt"];
    for want in [
        receipt["signature"]["kid"].as_str().unwrap(),
        receipt["signatures"][0]["kid"].as_str().unwrap(),
        "<td>HS256</td>",
        "<td>EdDSA</td>",
        "yes: event ",
        "yes: the next event finalizes this task",
        receipt["payload"]["audit"]["chain_hash"].as_str().unwrap(),
    ] {
        assert!(html.contains(want), "the verify page lacks {want}: {html}");
    }
    assert_eq!(
        html.matches("<td class=\"ok\">valid</td>").count(),
        2,
        "{html}"
    );
    assert_eq!(
        serde_json::from_str::<Value>(&pre(&html, "verdict")).unwrap(),
        cli,
        "the page's verdict is the CLI's"
    );
    clean(&html, &alice);
    // A changed receipt fails the CLI; the page's code is the same one.
    let mut forged: Value = serde_json::from_slice(&bytes).unwrap();
    forged["receipt"]["payload"]["state"] = json!("failed");
    std::fs::write(&file, forged.to_string()).unwrap();
    let (rc, cli) = cli_verify(&s, &file);
    assert_eq!((rc, cli["valid"].clone()), (1, json!(false)), "{cli}");

    // The admin: exposed outputs, the result's evidence, the cancel form on
    // the running task (not on the finished one).
    let root = b.sign_in("root").await;
    let (st, html) = b.page(&format!("/console/tasks/{done}"), &root).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        "Output validation: <strong class=\"ok\">ok</strong>",
        "<h3>summary</h3>",
        "&#34;words&#34;: 5",
        &echo_sha,
    ] {
        assert!(
            html.contains(want),
            "the admin's detail lacks {want}: {html}"
        );
    }
    assert!(
        !html.contains("/cancel\""),
        "a cancel form on a finished task"
    );
    clean(&html, &root);
    // The admin's list: every tenant, with the tenant filter.
    let (_, html) = b.page("/console/tasks", &root).await;
    assert!(
        html.contains("<label for=\"tenant\">Tenant</label>"),
        "{html}"
    );
    assert!(
        html.contains("<td>acme</td>") && html.contains(&done),
        "{html}"
    );
    assert!(
        html.contains(&other) && html.contains("<td>other</td>"),
        "{html}"
    );
    let (_, html) = b.page("/console/tasks?tenant=other", &root).await;
    assert!(html.contains(&other) && !html.contains(&done), "{html}");
    let (_, html) = b.page("/console/tasks?tenant=nobody", &root).await;
    assert!(html.contains("No task matches"), "{html}");
    clean(&html, &root);

    // The auditor: the list, the detail without outputs, the verification.
    let dora = b.sign_in("dora").await;
    let (st, html) = b.page("/console/tasks", &dora).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(html.contains(&done) && html.contains(&running), "{html}");
    let (st, html) = b.page(&format!("/console/tasks/{done}"), &dora).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(html.contains(&echo_sha), "{html}");
    assert!(
        !html.contains("&#34;words&#34;"),
        "outputs shown to an auditor"
    );
    assert!(!html.contains("/cancel\""), "a cancel form for an auditor");
    // Who approved, by name (issue #36).
    assert!(html.contains("<dd id=\"approvers\">bob (acme, "), "{html}");
    clean(&html, &dora);
    // From request to receipt on one page: the plan names who asked, who
    // approved, the task it became and its receipt.
    let (st, html) = b.page(&format!("/console/plans/{pr}"), &dora).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    for want in [
        "<dd id=\"asked-by\">",
        "1 of 1: bob (token ",
        &format!(
            "<dd id=\"ran-as\"><a href=\"/console/tasks/{done}\">{done}</a>, succeeded; <a href=\"/console/tasks/{done}/verify\">its receipt, checked</a>"
        ),
    ] {
        assert!(html.contains(want), "the plan lacks {want}: {html}");
    }
    clean(&html, &dora);
    let (st, html) = b
        .page(&format!("/console/tasks/{done}/verify"), &dora)
        .await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(html.contains("Valid: every signature checked holds."));

    // Another tenant's approver: nothing, and 404 for the task.
    let eve = b.sign_in("eve").await;
    let (st, html) = b.page("/console/tasks", &eve).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(!html.contains(&done) && !html.contains(&running), "{html}");
    assert!(html.contains(&other), "{html}");
    // A non-admin's tenant parameter is ignored: still only their own.
    let (_, html) = b.page("/console/tasks?tenant=acme", &eve).await;
    assert!(!html.contains(&done) && html.contains(&other), "{html}");
    for path in [
        format!("/console/tasks/{done}"),
        format!("/console/tasks/{done}/receipt"),
        format!("/console/tasks/{done}/verify"),
        "/console/tasks/not-a-ref".to_string(),
    ] {
        let (st, html) = b.page(&path, &eve).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{path}: {html}");
        assert!(html.contains("(task_not_found)"), "{path}: {html}");
    }
    // A receipt not signed yet: the broker's code.
    let (st, html) = b
        .page(&format!("/console/tasks/{running}/receipt"), &alice)
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{html}");
    assert!(html.contains("(receipt_not_ready)"), "{html}");

    // Cancel: the approver's and the auditor's forged POSTs are refused
    // with the broker's code and audited, as on /v1; nothing is done.
    let (_, html) = b.page(&format!("/console/tasks/{running}"), &alice).await;
    assert!(
        html.contains("<dd class=\"task-state\">running</dd>"),
        "{html}"
    );
    assert!(!html.contains("/cancel\""), "{html}");
    for (who, id) in [("alice", &alice), ("dora", &dora)] {
        let (_, html) = b.page(&format!("/console/tasks/{running}"), id).await;
        let csrf = csrf_field(&html);
        let r = b.post_task_cancel(id, &running, Some(&csrf)).await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER, "{who}");
        let to = r.headers()[LOCATION].to_str().unwrap().to_string();
        assert_eq!(to, format!("/console/tasks/{running}?error=action_denied"));
        let (st, html) = b.page(&to, id).await;
        assert_eq!(st, StatusCode::OK, "{html}");
        assert!(
            html.contains("admins cancel tasks") && html.contains("(action_denied)"),
            "{who}: {html}"
        );
        clean(&html, id);
    }
    let (st, v) = s
        .post(&bob, &format!("/v1/tasks/{running}/cancel"), json!({}))
        .await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("action_denied")),
        "/v1 answers the same: {v}"
    );
    assert_eq!(task_state(&s, &agent, &running).await["state"], "running");
    // The admin's form: CSRF required, then the task ends.
    let (_, html) = b.page(&format!("/console/tasks/{running}"), &root).await;
    assert!(
        html.contains(&format!("action=\"/console/tasks/{running}/cancel\"")),
        "{html}"
    );
    let csrf = csrf_field(&html);
    let r = b.post_task_cancel(&root, &running, None).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = b
        .post_task_cancel(&root, &running, Some("forged-token"))
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(task_state(&s, &agent, &running).await["state"], "running");
    let r = b.post_task_cancel(&root, &running, Some(&csrf)).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let to = r.headers()[LOCATION].to_str().unwrap().to_string();
    assert_eq!(to, format!("/console/tasks/{running}?done=cancelled"));
    let (st, html) = b.page(&to, &root).await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert!(html.contains("Cancelled: the task"), "{html}");
    assert!(
        html.contains("<dd class=\"task-state\">cancelled</dd>"),
        "{html}"
    );
    assert!(!html.contains("/cancel\""), "no form once cancelled");
    clean(&html, &root);
    let v = task_state(&s, &agent, &running).await;
    assert_eq!(
        (v["state"].as_str(), v["receipt_ready"].as_bool()),
        (Some("cancelled"), Some(true))
    );
    // Only a known code is shown; nothing else from the query.
    let (_, html) = b
        .page(&format!("/console/tasks/{running}?error=%3Cb%3Ehi"), &root)
        .await;
    assert!(
        !html.contains("<b>hi") && !html.contains("role=\"alert\""),
        "{html}"
    );

    // The other tenant's task ends; finalized, its sandbox goes.
    wait_ended(&s, &other_agent, &other).await;
    let (st, v) = s
        .post(
            &other_agent,
            &format!("/v1/tasks/{other}/result"),
            json!({}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (_, v) = s.get(&s.admin, "/v1/leases").await;
    assert_eq!(v["leases"].as_array().map(Vec::len), Some(0), "{v}");

    // A person whose scopes have no task:status: refused, and recorded.
    user(
        &s,
        &[
            "add",
            "nina",
            "--tenant",
            "acme",
            "--role",
            "approver",
            "--action",
            "task:approve",
        ],
    );
    let nina = b.sign_in("nina").await;
    for path in [
        "/console/tasks".to_string(),
        format!("/console/tasks/{done}"),
    ] {
        let (st, html) = b.page(&path, &nina).await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{path}: {html}");
        assert!(html.contains("(action_denied)"), "{path}: {html}");
        assert!(!html.contains(&done), "nothing of the task: {html}");
    }

    // The journal: the listings, the reads and the refusals, no secret.
    let j = s.journal();
    assert!(events(&j, "task_list", "ok").len() >= 10, "{j}");
    assert!(!events(&j, "task_status", "ok").is_empty());
    assert!(!events(&j, "task_receipt", "ok").is_empty());
    assert_eq!(refusals(&j, "task_cancel", "action_denied").len(), 3, "{j}");
    assert_eq!(events(&j, "task_cancel", "ok").len(), 1, "{j}");
    assert_eq!(refusals(&j, "task_list", "action_denied").len(), 1, "{j}");
    assert_eq!(refusals(&j, "task_status", "action_denied").len(), 1, "{j}");
    assert!(!j.contains(secret));
    s.stop().await;
}
