//! Start-up, phase 5: what leaves the appliance on its own — approval
//! notifications, the audit sinks, sign-in blocks into the journal — and
//! revocations that other replicas made.

use super::Tasks;
use crate::audit::event::{Action, Outcome};
use crate::auth::Authenticator;
use crate::broker::Broker;
use crate::config::Config;

/// Start the notifier (`[console.notify]`), the audit sinks (each reads
/// the journal from its own cursor; their lag is scraped with `/metrics`),
/// the recorder of sign-in blocks and the revocation watch.
pub(super) fn start(
    cfg: &Config,
    broker: &Broker,
    authn: &Authenticator,
    blocks: tokio::sync::mpsc::Receiver<crate::auth::throttle::Blocked>,
    listen: std::net::SocketAddr,
    tasks: &mut Tasks,
) -> anyhow::Result<()> {
    if let Some((n, task)) = crate::console::notify::start(cfg, listen, tasks.stop.clone())
        .map_err(anyhow::Error::msg)?
    {
        broker.set_plan_listener(n);
        tasks.drained("approval notifier", task);
    }
    let sinks = broker.journal().sinks();
    // As a message: its text already says its source, which `{:#}` would
    // print again.
    let prepared = sinks
        .prepare(&cfg.audit.sinks)
        .map_err(anyhow::Error::msg)?;
    // Not under `tasks.stop`: the sinks go on delivering while the other
    // tasks end, and are stopped after them (`Step::StopSinks`).
    for c in sinks.start(prepared, tokio_util::sync::CancellationToken::new()) {
        tracing::info!("{c}");
    }
    let s2 = sinks.clone();
    broker
        .journal()
        .metrics()
        .set_sink_source(Box::new(move || {
            s2.status()
                .into_iter()
                .map(|s| crate::metrics::SinkSample {
                    name: s.name,
                    lag: s.lag,
                    failures: s.failures,
                })
                .collect()
        }));
    tasks.drained(
        "sign-in block recorder",
        tokio::spawn(audit_blocks(
            broker.journal().clone(),
            blocks,
            tasks.stop.clone(),
        )),
    );
    // Revocations made by other replicas (a shared store) reach this one's
    // cache within `auth::STAMP_POLL`.
    tasks.drained(
        "revocation watch",
        tokio::spawn(authn.clone().watch_revocations(tasks.stop.clone())),
    );
    Ok(())
}

/// Record each sign-in block in the journal: who was blocked (a digest of
/// the token id or user name, none when a whole address is), from where
/// (a digest of the address), for how long. One event per block, however
/// many attempts it then refuses.
async fn audit_blocks(
    journal: crate::audit::Journal,
    mut rx: tokio::sync::mpsc::Receiver<crate::auth::throttle::Blocked>,
    stop: tokio_util::sync::CancellationToken,
) {
    use crate::auth::throttle::Credential;
    loop {
        let b = tokio::select! {
            _ = stop.cancelled() => return,
            b = rx.recv() => match b {
                Some(b) => b,
                None => return,
            },
        };
        let mut ev = journal.event(Action::SignInThrottled);
        ev.outcome = Outcome::Rejected;
        ev.error_code = Some("sign_in_throttled".into());
        ev.identity_digest = match &b.credential {
            Some(Credential::Token(id)) => Some(journal.digest("token_id", id.as_bytes())),
            Some(Credential::User(name)) => Some(journal.digest("user", name.as_bytes())),
            Some(Credential::Unknown) | None => None,
        };
        ev.note_digest = Some(journal.digest("source", b.source.ip().to_string().as_bytes()));
        ev.duration_ms = Some(u64::try_from(b.for_.as_millis()).unwrap_or(u64::MAX));
        if let Err(e) = journal.record(ev).await {
            tracing::warn!(error = %e, "a sign-in block was not audited");
        }
    }
}
