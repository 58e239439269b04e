//! Keeping leases alive and cleaning them up: the background keepalive for
//! leases with running jobs, renewal caps, profiles, idle-lease GC and
//! lease recovery.

use std::time::Duration;

use cube_adapter::clock::ManualClock;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::kit::Server;

async fn acquire(s: &Server, session: &str, profile: &str) -> String {
    s.acquire_in(profile, session).await
}

/// Start a job, leave its sandbox alone for `quiet` seconds, then wait
/// for the job's end.
async fn job_end_unwatched(s: &Server, lease: &str, command: &str, quiet: u64) -> Value {
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/jobs"),
            json!({"command": command}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let job = v["job_ref"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_secs(quiet)).await;
    for _ in 0..300 {
        let (_, v) = s.get(&s.admin, &format!("/v1/jobs/{job}/status")).await;
        if v["state"] != "running" {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("job did not end");
}

/// A sandbox whose idle timeout (3 s, then killed) is shorter than its job
/// survives while the profile keeps it alive; without keepalive the job is
/// lost with its sandbox. Nobody looks at either while the jobs run: every
/// completed call is activity that restarts the idle clock, as on a real
/// CubeSandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_keeps_sandboxes_with_running_jobs() {
    let s = Server::start_with(|c| {
        c.gc_interval_seconds = 0;
        for (name, keep) in [("offline-code", true), ("persistent-code", false)] {
            let p = c.profiles.get_mut(name).unwrap();
            p.sandbox_timeout_seconds = 3;
            p.lifecycle.on_timeout = "kill".into();
            p.keepalive_enabled = keep;
            p.max_keepalive_seconds = 60;
        }
    })
    .await;
    let kept = acquire(&s, "kept", "offline-code").await;
    let dropped = acquire(&s, "dropped", "persistent-code").await;
    let (a, b) = tokio::join!(
        job_end_unwatched(&s, &kept, "sleep 6; echo done", 9),
        job_end_unwatched(&s, &dropped, "sleep 6; echo done", 9),
    );
    assert_eq!(a["state"], "succeeded", "{a}");
    assert_eq!(b["state"], "lost", "{b}");
    let (_, r) = s
        .get(&s.admin, &format!("/v1/leases/{dropped}/recover"))
        .await;
    assert_eq!(r["state"], "gone", "{r}");
    assert_eq!(r["recoverable"], false);
    let (_, r) = s.get(&s.admin, &format!("/v1/leases/{kept}/recover")).await;
    assert_eq!(r["state"], "running", "{r}");
    assert_eq!(r["jobs"][0]["state"], "succeeded");
    // The renewals are in the journal, as the appliance's own actions.
    let out = std::process::Command::new(crate::kit::BIN)
        .args(["audit", "export", "--state-dir"])
        .arg(&s.state)
        .output()
        .unwrap();
    let journal = String::from_utf8_lossy(&out.stdout);
    assert!(journal.contains("\"keepalive\""), "no keepalive events");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_is_capped_profiles_listed_and_idle_leases_collected() {
    let clock = ManualClock::starting_now();
    let s = Server::start_with(|c| {
        c.clock = clock.clone().into();
        c.gc_interval_seconds = 0;
        c.profiles
            .get_mut("offline-code")
            .unwrap()
            .max_keepalive_seconds = 2;
        c.profiles
            .get_mut("persistent-code")
            .unwrap()
            .lease_idle_ttl_seconds = 1;
    })
    .await;
    // Renewal: capped by the budget, and refused past it until the lease is used.
    let lease = acquire(&s, "renew", "offline-code").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/renew"),
            json!({"seconds": 100}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert!(v["timeout_seconds"].as_u64().unwrap() <= 2, "{v}");
    assert_eq!(v["capped"], true);
    clock.advance(time::Duration::milliseconds(2500));
    let (st, v) = s
        .post(&s.admin, &format!("/v1/leases/{lease}/renew"), json!({}))
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "keepalive_exhausted");
    let (st, _) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/exec"),
            json!({"command": "true"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/renew"),
            json!({"seconds": 1}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["capped"], false);
    for bad in [
        json!({"seconds": 0}),
        json!({"seconds": "x"}),
        json!({"extra": 1}),
    ] {
        let (st, _) = s
            .post(&s.admin, &format!("/v1/leases/{lease}/renew"), bad)
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
    }

    // Profiles: only those the caller may use.
    let agent = s.token(&["--tenant", "t1", "--profile", "persistent-code"]);
    let (st, v) = s.get(&agent, "/v1/profiles").await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let names: Vec<&str> = v["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["persistent-code"]);
    assert_eq!(v["profiles"][0]["lease_idle_ttl_seconds"], 1);
    let (_, v) = s.get(&s.admin, "/v1/profiles").await;
    assert!(v["profiles"].as_array().unwrap().len() >= 3);

    // GC: an agent may not run it; the admin collects the idle lease (and
    // only it), its sandbox and its jobs' records go with it.
    let idle = {
        let (st, v) = s
            .post(
                &agent,
                "/v1/leases/acquire",
                json!({"runtime": "mcp", "session_key": "idle", "profile": "persistent-code"}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        v["lease_ref"].as_str().unwrap().to_string()
    };
    let (st, v) = s
        .post(
            &agent,
            &format!("/v1/leases/{idle}/jobs"),
            json!({"command": "sleep 30"}),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let job = v["job_ref"].as_str().unwrap().to_string();
    let before = s.sandboxes();
    let (st, v) = s.post(&agent, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["code"], "admin_required");
    clock.advance(time::Duration::milliseconds(1500));
    let (st, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["collected"], 1, "{v}");
    assert_eq!(v["failed"], 0);
    let (st, _) = s.get(&agent, &format!("/v1/leases/{idle}/status")).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, _) = s.get(&agent, &format!("/v1/jobs/{job}/status")).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(s.sandboxes(), before - 1);
    // The renewed lease was used recently: still there.
    let (st, _) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    assert_eq!(st, StatusCode::OK);
    // The same session acquires a fresh lease.
    let (st, v) = s
        .post(
            &agent,
            "/v1/leases/acquire",
            json!({"runtime": "mcp", "session_key": "idle", "profile": "persistent-code"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["reused"], false);
    s.stop().await;
}

fn snapshots(s: &Server) -> usize {
    std::fs::read_dir(s.state.join("embedded/snapshots"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Checkpoints: gated by the profile, rolled back, deleted; and deleted
/// with their lease by release-kill and by GC (the reference leaked them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_roll_back_and_go_with_their_lease() {
    let clock = ManualClock::starting_now();
    let s = Server::start_with(|c| {
        c.clock = clock.clone().into();
        c.gc_interval_seconds = 0;
        let p = c.profiles.get_mut("checkpoint-code").unwrap();
        p.checkpoints_enabled = true;
        p.lease_idle_ttl_seconds = 2;
    })
    .await;
    let lease = acquire(&s, "ckpt", "checkpoint-code").await;
    let write = |content: &'static str| {
        let lease = lease.clone();
        let s = &s;
        async move {
            let (st, v) = s
                .post(
                    &s.admin,
                    &format!("/v1/leases/{lease}/write"),
                    json!({"path": "/workspace/f.txt", "content": content}),
                )
                .await;
            assert_eq!(st, StatusCode::OK, "{v}");
        }
    };
    write("one").await;
    let (st, c1) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/checkpoints"),
            json!({"name": "before two"}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{c1}");
    assert_eq!(c1["name"], "before two");
    let c1 = c1["checkpoint_ref"].as_str().unwrap().to_string();
    assert!(c1.starts_with("checkpoint_"));
    write("two").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/checkpoints/{c1}/rollback"),
            json!({"branch": "ignored"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (_, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/read"),
            json!({"path": "/workspace/f.txt"}),
        )
        .await;
    assert_eq!(v["content"], "one", "{v}");

    // A second one, deleted; a foreign or malformed ref is not found.
    let (_, c2) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/checkpoints"),
            json!({}),
        )
        .await;
    let c2 = c2["checkpoint_ref"].as_str().unwrap().to_string();
    assert_eq!(snapshots(&s), 2);
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{lease}/checkpoints/{c2}/delete"),
            json!({}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["deleted"], true);
    assert_eq!(snapshots(&s), 1);
    for bad in [c2.as_str(), "ckpt_zz", "ckpt_00000000000000000000"] {
        let (st, v) = s
            .post(
                &s.admin,
                &format!("/v1/leases/{lease}/checkpoints/{bad}/rollback"),
                json!({}),
            )
            .await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
        assert_eq!(v["error"]["code"], "checkpoint_not_found");
    }
    let (_, list) = s
        .get(&s.admin, &format!("/v1/leases/{lease}/checkpoints"))
        .await;
    assert_eq!(list["checkpoints"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["checkpoints"][0]["checkpoint_ref"], c1.as_str());
    // Each entry carries the reference's executor and sandbox_ref.
    assert_eq!(list["checkpoints"][0]["executor"], list["executor"]);
    assert_eq!(list["checkpoints"][0]["sandbox_ref"], list["sandbox_ref"]);
    let (_, st_) = s.get(&s.admin, &format!("/v1/leases/{lease}/status")).await;
    // The reference's count, and the list beside it.
    assert_eq!(st_["checkpoints"], 1, "{st_}");
    assert_eq!(st_["checkpoint_list"][0]["checkpoint_ref"], c1.as_str());

    // The profile gate.
    let plain = acquire(&s, "plain", "offline-code").await;
    let (st, v) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{plain}/checkpoints"),
            json!({}),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["code"], "checkpoint_denied");

    // Release-kill deletes a lease's checkpoints.
    let other = acquire(&s, "ckpt-kill", "checkpoint-code").await;
    let (st, _) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{other}/checkpoints"),
            json!({}),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED);
    assert_eq!(snapshots(&s), 2);
    let (st, _) = s
        .post(
            &s.admin,
            &format!("/v1/leases/{other}/release"),
            json!({"action": "kill"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(snapshots(&s), 1);

    // GC of the idle lease takes its checkpoint with it.
    clock.advance(time::Duration::milliseconds(2500));
    let (st, v) = s.post(&s.admin, "/v1/admin/gc", json!({})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["collected"], 1, "{v}");
    assert_eq!(snapshots(&s), 0, "GC left a snapshot behind");
    let (st, _) = s
        .get(&s.admin, &format!("/v1/leases/{lease}/checkpoints"))
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    s.stop().await;
}
