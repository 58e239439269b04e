//! What `/metrics` reads from the store at scrape time: leases, jobs and
//! PTYs by tenant and profile, plans waiting for approval, open intents
//! and uncertain outcomes. One short read transaction on the blocking pool,
//! off the request path.

use std::collections::{BTreeMap, HashMap};

use super::{Broker, Result};
use crate::store::jobs::JobState;
use crate::store::leases::LeaseState;
use crate::store::plans::PlanState;

/// Counts by `(tenant, profile)`.
pub type ByTenant = BTreeMap<(String, String), u64>;

/// The store's state at one scrape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Leases by state (`running`, `paused`, …), tenant and profile.
    pub leases: BTreeMap<(String, String, String), u64>,
    /// Running jobs by tenant and their lease's profile.
    pub jobs: ByTenant,
    /// Running PTYs by tenant and their lease's profile.
    pub ptys: ByTenant,
    /// Plans waiting for an approver (not yet expired).
    pub plans_pending: u64,
    /// Age in seconds of the oldest of them (0: none).
    pub oldest_pending_age: i64,
    /// Intents with no outcome (an effect in flight, or left by a crash).
    pub open_intents: u64,
    /// Outcome events recorded `uncertain` (crash recovery could not tell
    /// whether the effect happened).
    pub uncertain_outcomes: u64,
}

/// A lease that holds a sandbox (`running` or `paused`): counted in the
/// reference's `cube_adapter_active_leases`.
pub fn holds_sandbox(state: &str) -> bool {
    state == LeaseState::Running.as_str() || state == LeaseState::Paused.as_str()
}

impl Broker {
    /// Read the gauges (`/metrics`).
    pub async fn gauges(&self) -> Result<Gauges> {
        let now = self.now().1;
        let g = self
            .inner
            .store
            .read(move |txn| {
                let mut g = Gauges::default();
                let leases = crate::store::leases::all(txn)?;
                let profile: HashMap<&str, &str> = leases
                    .iter()
                    .map(|l| (l.lease_ref.as_str(), l.profile.as_str()))
                    .collect();
                for l in &leases {
                    *g.leases
                        .entry((
                            l.state.as_str().to_string(),
                            l.tenant.clone(),
                            l.profile.clone(),
                        ))
                        .or_default() += 1;
                }
                let of = |lease: &str| profile.get(lease).copied().unwrap_or("").to_string();
                for j in crate::store::jobs::all(txn)? {
                    if j.state == JobState::Running {
                        *g.jobs
                            .entry((j.tenant.clone(), of(&j.lease_ref)))
                            .or_default() += 1;
                    }
                }
                for p in crate::store::ptys::all(txn)? {
                    if p.is_running() {
                        *g.ptys
                            .entry((p.tenant.clone(), of(&p.lease_ref)))
                            .or_default() += 1;
                    }
                }
                for pl in crate::store::plans::all(txn)? {
                    if pl.state == PlanState::PendingApproval && pl.expires_unix > now {
                        g.plans_pending += 1;
                        let age = crate::clock::parse_unix(&pl.created_at)
                            .map(|c| now.saturating_sub(c).max(0))
                            .unwrap_or(0);
                        g.oldest_pending_age = g.oldest_pending_age.max(age);
                    }
                }
                g.open_intents = crate::store::journal::pending(txn)?.len() as u64;
                g.uncertain_outcomes = crate::store::audit_index::Reader::open(txn)?.count(
                    crate::store::audit_index::Field::Outcome,
                    crate::audit::event::Outcome::Uncertain.as_str(),
                )?;
                Ok(g)
            })
            .await?;
        Ok(g)
    }
}
