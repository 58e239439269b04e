//! Console: audit (issue 15). Shares the helpers of `console/mod.rs`.
//!
//! Events with known tenants, actions, outcomes and request ids are made
//! by refused `/v1` calls (a token without actions asking for
//! `GET /v1/leases`: a `lease_list` event, `rejected`, with the tenant's
//! digest and the request id given), then searched, paged and exported
//! through the console as auditors, an approver and an admin.

use super::*;

use std::collections::BTreeSet;

/// `GET /v1/leases` with a token that may not list: a rejected
/// `lease_list` event carrying `request_id`.
async fn refused_list(s: &Server, token: &str, request_id: &str) {
    let r = s
        .http
        .get(format!("{}/v1/leases", s.url))
        .bearer_auth(token)
        .header("x-request-id", request_id)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
}

/// The journal's events as JSON values.
fn parsed(j: &str) -> Vec<Value> {
    j.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The sequence numbers of the rows of a results page.
fn seqs(html: &str) -> Vec<u64> {
    html.match_indices("<td class=\"seq\">")
        .map(|(i, m)| {
            html[i + m.len()..]
                .split('<')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

/// The next page's link, if any (HTML-unescaped).
fn next_link(html: &str) -> Option<String> {
    let at = html.find("id=\"next-page\" href=\"")? + 21;
    Some(
        html[at..]
            .split('"')
            .next()?
            .replace("&#38;", "&")
            .replace("&amp;", "&"),
    )
}

async fn page(b: &Browser, id: &str, path: &str) -> (StatusCode, String) {
    let r = b.get(path, Some(id)).await;
    let st = r.status();
    assert_security_headers(r.headers(), path);
    (st, r.text().await.unwrap())
}

/// An RFC 4180 reader: records of fields (quoted fields may hold commas,
/// doubled quotes and line breaks).
fn read_csv(text: &str) -> Vec<Vec<String>> {
    let mut rows = vec![];
    let mut row = vec![];
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if quoted {
            match c {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    field.push('"');
                }
                '"' => quoted = false,
                c => field.push(c),
            }
            continue;
        }
        match c {
            '"' => quoted = true,
            ',' => row.push(std::mem::take(&mut field)),
            '\r' => {
                assert_eq!(chars.next(), Some('\n'), "CRLF line ends");
                row.push(std::mem::take(&mut field));
                rows.push(std::mem::take(&mut row));
            }
            c => field.push(c),
        }
    }
    assert!(
        field.is_empty() && row.is_empty(),
        "a last line without CRLF"
    );
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_search_paging_scope_and_export() {
    let s = Server::start().await;
    user(
        &s,
        &["add", "audra", "--tenant", "alpha", "--role", "auditor"],
    );
    user(
        &s,
        &["add", "bert", "--tenant", "beta", "--role", "auditor"],
    );
    user(
        &s,
        &["add", "apollo", "--tenant", "alpha", "--role", "approver"],
    );
    user(&s, &["add", "root", "--tenant", "ops", "--role", "admin"]);
    let b = Browser::new(&s);

    // Signed out: the page and both exports send to the sign-in form.
    for path in [
        "/console/audit",
        "/console/audit?action=lease_list",
        "/console/audit/export.jsonl",
        "/console/audit/export.csv",
    ] {
        let r = b.get(path, None).await;
        assert_to_sign_in(r.status(), r.headers(), path);
    }

    // 55 refused calls in tenant alpha, 5 in beta; one alpha request id
    // starts with `-` (a formula to a spreadsheet).
    let alpha = s.token(&["--tenant", "alpha", "--no-actions"]);
    let beta = s.token(&["--tenant", "beta", "--no-actions"]);
    for i in 0..55 {
        refused_list(&s, &alpha, &format!("alpha-{i}")).await;
    }
    refused_list(&s, &alpha, "-alpha-formula").await;
    for i in 0..5 {
        refused_list(&s, &beta, &format!("beta-{i}")).await;
    }
    let j = parsed(&s.journal());
    let by_req = |r: &str| -> Value {
        j.iter()
            .find(|e| e["request_id"] == r)
            .unwrap_or_else(|| panic!("no event with request id {r}"))
            .clone()
    };
    let alpha_digest = by_req("alpha-0")["tenant_digest"]
        .as_str()
        .unwrap()
        .to_string();
    let beta_digest = by_req("beta-0")["tenant_digest"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(alpha_digest, beta_digest);
    let lists_of = |d: &str| -> Vec<u64> {
        j.iter()
            .filter(|e| e["action"] == "lease_list" && e["tenant_digest"] == d)
            .map(|e| e["seq"].as_u64().unwrap())
            .collect()
    };
    let alpha_lists = lists_of(&alpha_digest);
    let beta_lists = lists_of(&beta_digest);
    assert_eq!((alpha_lists.len(), beta_lists.len()), (56, 5));

    // An auditor of alpha: alpha's events only, newest first, 50 a page,
    // every one once across the pages.
    let audra = b.sign_in("audra").await;
    let (st, html) = page(&b, &audra, "/console/audit?action=lease_list").await;
    assert_eq!(st, StatusCode::OK, "{html}");
    assert_clean(&html, &s, Some(&audra));
    for want in [
        "<h1>Audit</h1>",
        "<label for=\"from\">",
        "<label for=\"request_id\">",
        "<label for=\"plan_ref\">",
        "<label for=\"task_ref\">",
        "Events of tenant alpha",
        "id=\"chain-head\"",
        "cube-adapter audit verify",
        "href=\"/console/audit/export.jsonl?action=lease_list\"",
    ] {
        assert!(html.contains(want), "{want}");
    }
    let mut seen = seqs(&html);
    assert_eq!(seen.len(), 50);
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "newest first");
    let next = next_link(&html).expect("a next page");
    assert!(
        next.starts_with("/console/audit?action=lease_list&after="),
        "{next}"
    );
    let (st, html2) = page(&b, &audra, &next).await;
    assert_eq!(st, StatusCode::OK);
    assert!(next_link(&html2).is_none(), "only two pages");
    seen.extend(seqs(&html2));
    let mut want = alpha_lists.clone();
    want.reverse();
    assert_eq!(seen, want, "every alpha event once, none of beta");
    assert!(!html.contains("beta-") && !html2.contains("beta-"));

    // Each filter narrows to exactly its events.
    let (_, html) = page(&b, &audra, "/console/audit?request_id=alpha-7").await;
    assert_eq!(
        seqs(&html),
        vec![by_req("alpha-7")["seq"].as_u64().unwrap()]
    );
    let identity = by_req("alpha-3")["identity_digest"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, html) = page(
        &b,
        &audra,
        &format!("/console/audit?identity={identity}&outcome=rejected&action=lease_list"),
    )
    .await;
    assert_eq!(seqs(&html).len(), 50, "{html}");
    let (_, html) = page(&b, &audra, "/console/audit?outcome=ok&action=lease_list").await;
    assert!(seqs(&html).is_empty() && html.contains("No event matches."));
    // A time range: everything since an hour ago, nothing from before 2000.
    let (_, html) = page(&b, &audra, "/console/audit?to=2000-01-01&action=lease_list").await;
    assert!(seqs(&html).is_empty());
    let (_, html) = page(
        &b,
        &audra,
        "/console/audit?from=2000-01-01&request_id=alpha-9",
    )
    .await;
    assert_eq!(seqs(&html).len(), 1);
    // The searches themselves (runtime `console`): audra's, in alpha.
    let (_, html) = page(
        &b,
        &audra,
        "/console/audit?runtime=console&action=audit_search",
    )
    .await;
    assert!(seqs(&html).len() >= 7, "{html}");

    // An identity by its subject (in the searcher's tenant).
    let (_, html) = page(
        &b,
        &audra,
        "/console/audit?identity=audra&action=audit_search",
    )
    .await;
    let audra_looks = seqs(&html);
    assert!(audra_looks.len() >= 8, "{html}");

    // Another tenant, asked for: refused, recorded.
    let (st, html) = page(&b, &audra, "/console/audit?tenant=beta").await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    assert!(html.contains("action_denied"), "{html}");
    // beta's auditor sees beta's five.
    let bert = b.sign_in("bert").await;
    let (_, html) = page(&b, &bert, "/console/audit?action=lease_list").await;
    let mut want = beta_lists.clone();
    want.reverse();
    assert_eq!(seqs(&html), want);

    // Bad input: a clear message, 400, nothing searched.
    for (q, msg) in [
        ("from=yesterday", "from is not a time"),
        ("from=2026-01-02&to=2026-01-01", "from must be before to"),
        ("after=abc", "after is not a cursor"),
        ("outcome=great", "outcome must be one of"),
    ] {
        let (st, html) = page(&b, &audra, &format!("/console/audit?{q}")).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{q}");
        assert!(
            html.contains(msg) && html.contains("invalid_request"),
            "{q}: {html}"
        );
    }
    let long = "x".repeat(300);
    let (st, _) = page(&b, &audra, &format!("/console/audit?action={long}")).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);

    // An approver: refused (the journal is for auditors and admins),
    // recorded as on /v1.
    let apollo = b.sign_in("apollo").await;
    for path in ["/console/audit", "/console/audit/export.jsonl"] {
        let (st, html) = page(&b, &apollo, path).await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{path}");
        assert!(html.contains("action_denied"), "{html}");
        assert_clean(&html, &s, Some(&apollo));
    }

    // Export, JSONL: exactly the journal's lines for the filter, oldest
    // first, as an attachment.
    let r = b
        .get(
            "/console/audit/export.jsonl?action=lease_list",
            Some(&audra),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["content-disposition"],
        "attachment; filename=\"audit.jsonl\""
    );
    let got = r.text().await.unwrap();
    let full = s.journal();
    let want: Vec<&str> = full
        .lines()
        .filter(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["action"] == "lease_list" && v["tenant_digest"] == alpha_digest.as_str()
        })
        .collect();
    assert_eq!(got.lines().collect::<Vec<_>>(), want);

    // The admin: every tenant; CSV that parses back, formula-safe.
    let root = b.sign_in("root").await;
    let (st, html) = page(&b, &root, "/console/audit?action=lease_list").await;
    assert_eq!(st, StatusCode::OK);
    assert!(html.contains("Events of all tenants"));
    let (st, html) = page(&b, &root, "/console/audit?tenant=beta&action=lease_list").await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(seqs(&html).len(), 5);
    let (st, html) = page(&b, &root, "/console/audit?identity=someone").await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(html.contains("identity needs a tenant"));
    let r = b
        .get("/console/audit/export.csv?action=lease_list", Some(&root))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/csv")
    );
    assert_eq!(
        r.headers()["content-disposition"],
        "attachment; filename=\"audit.csv\""
    );
    let rows = read_csv(&r.text().await.unwrap());
    let head = &rows[0];
    assert_eq!(head[0], "seq");
    let col = |n: &str| head.iter().position(|h| h == n).unwrap();
    let (seq_c, req_c, act_c) = (col("seq"), col("request_id"), col("action"));
    let mut all_lists: Vec<u64> = alpha_lists.iter().chain(&beta_lists).copied().collect();
    all_lists.sort();
    let got: Vec<u64> = rows[1..]
        .iter()
        .map(|r| r[seq_c].parse().unwrap())
        .collect();
    assert_eq!(got, all_lists);
    assert!(rows.iter().all(|r| r.len() == head.len()));
    assert!(rows[1..].iter().all(|r| r[act_c] == "lease_list"));
    let formula: Vec<&Vec<String>> = rows
        .iter()
        .filter(|r| r[req_c].contains("alpha-formula"))
        .collect();
    assert_eq!(formula.len(), 1);
    assert_eq!(formula[0][req_c], "'-alpha-formula");
    for r in &rows[1..] {
        for c in r {
            assert!(
                !c.starts_with(['=', '+', '-', '@']),
                "a cell a spreadsheet would run: {c}"
            );
        }
    }

    // Every look was recorded as the person who looked.
    let j = parsed(&s.journal());
    let looks = |action: &str, outcome: &str| {
        j.iter()
            .filter(|e| e["action"] == action && e["outcome"] == outcome)
            .count()
    };
    assert!(looks("audit_search", "ok") >= 11);
    assert_eq!(looks("audit_export", "ok"), 2);
    // Refused: audra's beta, apollo's, the five bad ones and root's.
    assert!(looks("audit_search", "rejected") >= 8);
    assert_eq!(looks("audit_export", "rejected"), 1);
    let denied: BTreeSet<&str> = j
        .iter()
        .filter(|e| e["action"] == "audit_search" && e["outcome"] == "rejected")
        .filter_map(|e| e["error_code"].as_str())
        .collect();
    assert_eq!(denied, BTreeSet::from(["action_denied", "invalid_request"]));
    assert!(j.iter().all(|e| !e.to_string().contains(PASSWORD)));
    // The subject search found audra's own searches, and only them.
    let of_seq = |n: u64| j.iter().find(|e| e["seq"] == n).unwrap().clone();
    let audra_id = of_seq(audra_looks[0])["identity_digest"].clone();
    let all_audra: Vec<u64> = j
        .iter()
        .filter(|e| e["action"] == "audit_search" && e["identity_digest"] == audra_id)
        .map(|e| e["seq"].as_u64().unwrap())
        .filter(|s| *s <= audra_looks[0])
        .rev()
        .collect();
    assert_eq!(audra_looks, all_audra);
    assert_eq!(
        of_seq(audra_looks[0])["tenant_digest"],
        alpha_digest.as_str()
    );
}
