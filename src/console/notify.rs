//! Approval notifications (`[console.notify]`): a webhook told when a plan
//! needs approval.
//!
//! - **When**: `plan_task` made a plan `pending_approval` (committed). The
//!   broker calls [`Notifier::plan_needs_approval`], which only puts the
//!   notice on a bounded in-memory queue (`queue`, default 256) and
//!   returns: planning never waits on the webhook and never fails for it.
//!   A full queue drops the notice with a warning (which counts the notices
//!   dropped since start).
//! - **Why in memory**: a notification is a convenience; the plan itself is
//!   in the store and on the console's Approvals page whatever happens to
//!   its message. Notices queued when the appliance stops are not sent.
//! - **What**: a POST of Slack/Teams-compatible JSON (`{"text": …}`, and
//!   the same facts under `cube_adapter`) naming the tenant, template,
//!   profile, plan and expiry, and the link
//!   `<console_url>/console/plans/<plan_ref>`. Never a parameter value or
//!   the command.
//! - **Signature** (with `secret_file`): `X-Cube-Timestamp: <unix seconds>`
//!   and `X-Cube-Signature: sha256=<hex>`, the HMAC-SHA-256 under the
//!   shared secret of `<timestamp>.<body>`.
//! - **Retries**: a connection error, a timeout, 408, 425, 429 or a 5xx is
//!   tried again after `retry_initial_ms`, doubled each time (at most five
//!   minutes) plus up to half again of random jitter, `max_attempts` in
//!   all; any other answer that is not 2xx is final. One message at a
//!   time, in order.
//! - The URL (often a credential itself) and the secret are never logged:
//!   logs name the plan and the webhook's host.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hmac::Mac;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::broker::{PlanListener, PlanNeedsApproval};
use crate::config::{Config, NotifySection};

/// The signature header.
pub const SIGNATURE_HEADER: &str = "x-cube-signature";
/// The timestamp header (Unix seconds), covered by the signature.
pub const TIMESTAMP_HEADER: &str = "x-cube-timestamp";
/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// The broker's side: queues notices, never waits.
pub struct Notifier {
    tx: mpsc::Sender<PlanNeedsApproval>,
    /// Notices dropped since start (the queue full or the sender stopped),
    /// for the warning.
    dropped: AtomicU64,
}

impl PlanListener for Notifier {
    fn plan_needs_approval(&self, n: PlanNeedsApproval) {
        if let Err(e) = self.tx.try_send(n) {
            let total = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            let (why, n) = match e {
                mpsc::error::TrySendError::Full(n) => ("the queue is full", n),
                mpsc::error::TrySendError::Closed(n) => ("the sender has stopped", n),
            };
            tracing::warn!(
                plan_ref = %n.plan_ref,
                dropped = total,
                "approval notification dropped: {why}"
            );
        }
    }
}

/// Everything one delivery needs.
struct Delivery {
    http: reqwest::Client,
    url: reqwest::Url,
    /// For logs: the webhook's host, never its URL.
    host: String,
    secret: Option<Vec<u8>>,
    console_url: String,
    attempts: u32,
    first_retry: Duration,
    clock: crate::clock::Clock,
}

/// The console's base URL for links: `console_url`, else the appliance's
/// public URL on the listener's port (as the Connect page finds it, with
/// no request: [`super::connect::public_url`]).
pub fn console_base(cfg: &Config, n: &NotifySection, listen: std::net::SocketAddr) -> String {
    if let Some(u) = &n.console_url {
        return u.trim_end_matches('/').to_string();
    }
    super::connect::public_url(cfg, listen, None)
}

/// The message for a plan: Slack/Teams-compatible `text`, and the facts
/// under `cube_adapter`. Names and times only.
pub fn message(n: &PlanNeedsApproval, console_base: &str) -> Value {
    let link = format!("{console_base}/console/plans/{}", n.plan_ref);
    let risky = if n.risks.is_empty() {
        String::new()
    } else {
        format!(" Risky: {}.", n.risks.join("; "))
    };
    let text = format!(
        "A task plan needs approval: template {} (profile {}) asked by {} for tenant {}, plan {}, expires {}.{risky} Review it: {}",
        n.template, n.profile, n.requester, n.tenant, n.plan_ref, n.expires_at, link
    );
    json!({
        "text": text,
        "cube_adapter": {
            "event": "plan_needs_approval",
            "plan_ref": n.plan_ref,
            "tenant": n.tenant,
            "template": n.template,
            "profile": n.profile,
            "expires_at": n.expires_at,
            "requester": n.requester,
            "risks": n.risks,
            "review_url": link,
        }
    })
}

/// `sha256=<hex>`: the HMAC-SHA-256 of `<timestamp>.<body>` under `secret`.
pub fn signature(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    match <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(secret) {
        Ok(mut m) => {
            m.update(timestamp.to_string().as_bytes());
            m.update(b".");
            m.update(body);
            format!("sha256={}", hex::encode(m.finalize().into_bytes()))
        }
        // HMAC takes any key length: not reached.
        Err(_) => String::new(),
    }
}

/// A started sender: the listener to give the broker, and its task.
pub type Started = (Arc<Notifier>, tokio::task::JoinHandle<()>);

/// Start the sender, if `[console.notify]` is configured: the listener to
/// give the broker and the task (it ends when `stop` is cancelled).
pub fn start(
    cfg: &Config,
    listen: std::net::SocketAddr,
    stop: CancellationToken,
) -> Result<Option<Started>, String> {
    let Some(n) = &cfg.console.notify else {
        return Ok(None);
    };
    let url = reqwest::Url::parse(&n.url)
        .map_err(|e| format!("console.notify: url is not a URL ({e})"))?;
    let (secret, tls) = n.client().map_err(|e| e.to_string())?;
    let http = reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .http1_only()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(n.timeout_seconds))
        .timeout(Duration::from_secs(n.timeout_seconds))
        .user_agent(concat!("cube-adapter/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("console.notify: HTTP client: {e}"))?;
    let (tx, rx) = mpsc::channel(n.queue);
    let d = Delivery {
        http,
        host: url.host_str().unwrap_or_default().to_string(),
        url,
        secret,
        console_url: console_base(cfg, n, listen),
        attempts: n.max_attempts,
        first_retry: Duration::from_millis(n.retry_initial_ms),
        clock: cfg.clock.clone(),
    };
    let task = tokio::spawn(run(d, rx, stop));
    Ok(Some((
        Arc::new(Notifier {
            tx,
            dropped: AtomicU64::new(0),
        }),
        task,
    )))
}

async fn run(d: Delivery, mut rx: mpsc::Receiver<PlanNeedsApproval>, stop: CancellationToken) {
    loop {
        let n = tokio::select! {
            _ = stop.cancelled() => return,
            n = rx.recv() => match n {
                Some(n) => n,
                None => return,
            },
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = d.deliver(&n) => {}
        }
    }
}

/// How one attempt went.
enum Attempt {
    Sent,
    /// Worth another try.
    Retry(String),
    /// Not worth another.
    Final(String),
}

impl Delivery {
    async fn deliver(&self, n: &PlanNeedsApproval) {
        let body = message(n, &self.console_url).to_string().into_bytes();
        let mut wait = self.first_retry;
        for attempt in 1..=self.attempts {
            match self.attempt(&body).await {
                Attempt::Sent => {
                    tracing::info!(plan_ref = %n.plan_ref, host = %self.host, attempt, "approval notification sent");
                    return;
                }
                Attempt::Final(why) => {
                    tracing::warn!(plan_ref = %n.plan_ref, host = %self.host, attempt, "approval notification refused: {why}");
                    return;
                }
                Attempt::Retry(why) if attempt < self.attempts => {
                    let jitter = wait.mul_f64(rand::random::<f64>() / 2.0);
                    tracing::info!(plan_ref = %n.plan_ref, host = %self.host, attempt, "approval notification failed ({why}); trying again");
                    tokio::time::sleep(wait + jitter).await;
                    wait = (wait * 2).min(MAX_BACKOFF);
                }
                Attempt::Retry(why) => {
                    tracing::warn!(plan_ref = %n.plan_ref, host = %self.host, attempt, "approval notification given up: {why}");
                }
            }
        }
    }

    async fn attempt(&self, body: &[u8]) -> Attempt {
        let mut r = self
            .http
            .post(self.url.clone())
            .header("content-type", "application/json")
            .body(body.to_vec());
        if let Some(s) = &self.secret {
            let ts = self.clock.unix();
            r = r
                .header(TIMESTAMP_HEADER, ts.to_string())
                .header(SIGNATURE_HEADER, signature(s, ts, body));
        }
        match r.send().await {
            Ok(a) if a.status().is_success() => Attempt::Sent,
            Ok(a) => {
                let st = a.status();
                let why = format!("HTTP {}", st.as_u16());
                if st.is_server_error() || matches!(st.as_u16(), 408 | 425 | 429) {
                    Attempt::Retry(why)
                } else {
                    Attempt::Final(why)
                }
            }
            // The error's text may carry the URL: name its kind only.
            Err(e) if e.is_timeout() => Attempt::Retry("timed out".into()),
            Err(e) if e.is_connect() => Attempt::Retry("cannot connect".into()),
            Err(_) => Attempt::Retry("the request failed".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_and_signature() {
        let n = PlanNeedsApproval {
            plan_ref: "plan_0123456789abcdef0123".into(),
            tenant: "acme".into(),
            template: "word-count".into(),
            requester: "agent-a".into(),
            risks: vec!["text: mentions production".into()],
            profile: "trusted".into(),
            expires_at: "2030-01-01T00:00:00Z".into(),
        };
        let v = message(&n, "https://adapter.example:18080");
        let text = v["text"].as_str().unwrap();
        for want in [
            "acme",
            "word-count",
            "trusted",
            "2030-01-01T00:00:00Z",
            "https://adapter.example:18080/console/plans/plan_0123456789abcdef0123",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        assert_eq!(
            v["cube_adapter"]["review_url"],
            "https://adapter.example:18080/console/plans/plan_0123456789abcdef0123"
        );
        // HMAC-SHA-256 of "<ts>.<body>" (computed independently).
        let s = signature(b"Jefe", 0, b"what do ya want for nothing?");
        assert_eq!(
            s,
            "sha256=37f471929915ccd2cbbe79feb84ffcff4f2bb25e15fc41c2506687331ae179cc"
        );
        assert_ne!(s, signature(b"Jefe", 1, b"what do ya want for nothing?"));
        assert_ne!(s, signature(b"Jeff", 0, b"what do ya want for nothing?"));
    }

    #[test]
    fn console_base_falls_back_to_the_first_server_name() {
        let n = NotifySection {
            url: "https://hooks.example/x".into(),
            ca_file: None,
            secret_file: None,
            console_url: None,
            max_attempts: 1,
            retry_initial_ms: 10,
            timeout_seconds: 1,
            queue: 1,
        };
        let listen: std::net::SocketAddr = "0.0.0.0:18443".parse().unwrap();
        let mut cfg = Config::default();
        // Listening on every address with no server name: a name the
        // certificate covers (the host's name or address, else localhost),
        // never the unspecified address, on the listener's port.
        let base = console_base(&cfg, &n, listen);
        let host = base
            .strip_prefix("https://")
            .and_then(|b| b.strip_suffix(":18443"))
            .unwrap_or_else(|| panic!("{base}"));
        assert!(
            !host.is_empty() && host != "0.0.0.0" && host != "[::]",
            "{base}"
        );
        let covered = crate::tls::server_names(&[], listen);
        assert!(
            covered.iter().any(|c| *c == host.trim_matches(['[', ']'])),
            "{host} not in {covered:?}"
        );
        cfg.server_names = vec!["adapter.example".into(), "10.0.0.1".into()];
        assert_eq!(
            console_base(&cfg, &n, listen),
            "https://adapter.example:18443"
        );
        cfg.server_names = vec!["fd00::1".into()];
        assert_eq!(console_base(&cfg, &n, listen), "https://[fd00::1]:18443");
        let n = NotifySection {
            console_url: Some("https://console.example/".into()),
            ..n
        };
        assert_eq!(console_base(&cfg, &n, listen), "https://console.example");
    }
}
