//! The clock adapter: wall-clock time, formatted the way records and
//! responses carry it (UTC, RFC 3339, second precision).
//!
//! The only place that reads the real clock (`clippy.toml` bans
//! `OffsetDateTime::now_utc` and `SystemTime::now` elsewhere). Components
//! that decide by time (the broker, the audit journal, the authenticator,
//! the local CA) hold a [`Clock`] given at construction, the system clock
//! unless a test passes a [`ManualClock`]; code with no clock at hand (the
//! embedded backend, the CLI) calls [`system_now`].
//!
//! `Instant::now()` for deadlines and timeouts stays where it is.

use std::sync::{Arc, Mutex, PoisonError};

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// Where "now" comes from. Cheap to clone; the default is the system clock.
///
/// An enum rather than `Arc<dyn Trait>`: there are exactly two clocks, the
/// real one (no allocation, no dynamic dispatch) and the manual one for
/// tests, and `Default`, `Debug` and `Clone` come for free.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// The real wall clock.
    #[default]
    System,
    /// A clock that moves only when told (tests).
    Manual(ManualClock),
}

impl Clock {
    /// Now, in UTC.
    pub fn now(&self) -> OffsetDateTime {
        match self {
            Self::System => system_now(),
            Self::Manual(m) => m.now(),
        }
    }

    /// Now, as text (`YYYY-MM-DDTHH:MM:SSZ`) and as Unix seconds.
    pub fn stamp(&self) -> (String, i64) {
        let t = self.now();
        (rfc3339(t), t.unix_timestamp())
    }

    /// Now, as text.
    pub fn text(&self) -> String {
        rfc3339(self.now())
    }

    /// Now, as Unix seconds.
    pub fn unix(&self) -> i64 {
        self.now().unix_timestamp()
    }
}

impl From<ManualClock> for Clock {
    fn from(m: ManualClock) -> Self {
        Self::Manual(m)
    }
}

/// A clock for tests: starts where it is told and moves only by `set` and
/// `advance`. Clones share the same time (keep one, give the other away
/// as `Clock::from(m.clone())`).
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<OffsetDateTime>>);

impl ManualClock {
    pub fn new(start: OffsetDateTime) -> Self {
        Self(Arc::new(Mutex::new(start)))
    }

    /// Starting at the real time now.
    pub fn starting_now() -> Self {
        Self::new(system_now())
    }

    pub fn now(&self) -> OffsetDateTime {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn set(&self, t: OffsetDateTime) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = t;
    }

    /// Move forward (or back, with a negative duration).
    pub fn advance(&self, by: time::Duration) {
        let mut t = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        *t = t.saturating_add(by);
    }
}

/// The real wall clock, for code with no [`Clock`] at hand.
#[allow(clippy::disallowed_methods)]
pub fn system_now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

/// The real wall clock as a `SystemTime` (file times, `tar` headers).
#[allow(clippy::disallowed_methods)]
pub fn system_time() -> std::time::SystemTime {
    std::time::SystemTime::now()
}

/// `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339(t: OffsetDateTime) -> String {
    t.replace_nanosecond(0)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

/// Now on the system clock, as text and as Unix seconds (code with no
/// [`Clock`] at hand).
pub fn now() -> (String, i64) {
    Clock::System.stamp()
}

/// The Unix seconds of an RFC 3339 timestamp (None if it is not one).
pub fn parse_unix(ts: &str) -> Option<i64> {
    OffsetDateTime::parse(ts, &Rfc3339)
        .ok()
        .map(|t| t.unix_timestamp())
}

/// Unix seconds as `YYYY-MM-DDTHH:MM:SSZ` (empty if out of range).
pub fn format_unix(secs: i64) -> String {
    OffsetDateTime::from_unix_timestamp(secs)
        .map(rfc3339)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let start = OffsetDateTime::from_unix_timestamp(1_700_000_000).unwrap();
        let m = ManualClock::new(start);
        let c = Clock::from(m.clone());
        assert_eq!(c.unix(), 1_700_000_000);
        assert_eq!(c.text(), "2023-11-14T22:13:20Z");
        m.advance(time::Duration::seconds(90));
        assert_eq!(c.stamp(), ("2023-11-14T22:14:50Z".into(), 1_700_000_090));
        m.set(start);
        assert_eq!(c.unix(), 1_700_000_000);
    }

    #[test]
    fn system_clock_is_the_default() {
        assert!(matches!(Clock::default(), Clock::System));
        assert!(Clock::default().unix() > 1_700_000_000);
    }
}
