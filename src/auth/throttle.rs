//! Refusing guesses without locking people out.
//!
//! Failed sign-ins are counted per credential *and source address*: a
//! token id (bearer tokens are `cat_<id>_<secret>`) or a user name (HTTP
//! Basic), together with where the attempt came from. [`MAX_FAILURES`] in
//! [`WINDOW`] block that pair for a while; each block in a row doubles the
//! next one, up to [`MAX_BLOCK`]. Someone guessing a person's password, or
//! a known token's secret, from one place cannot lock that person or agent
//! out elsewhere. Every failure from a source, whatever it named, also
//! counts for the source: [`MAX_SOURCE_FAILURES`] in a window block all
//! sign-ins from it that are not already verified. Loopback is exempt for
//! bearer tokens (on a jump host every local agent shares it, and a token
//! costs no argon2 check); so is "no address", the re-checks of open
//! event streams. Password sign-ins from loopback are not exempt: an SSH
//! port-forward arrives as loopback, and each guess holds the one argon2
//! turn every person's sign-in waits for, so [`MAX_SOURCE_FAILURES`]
//! failed passwords from loopback in a window block password sign-ins
//! from loopback (its own key: local agents' tokens go on working).
//!
//! A blocked attempt is refused before any check with 429
//! `sign_in_throttled` and `Retry-After`; a credential already verified
//! (and cached) keeps working. The start of each block is reported once
//! ([`Blocked`]) so that it is audited once, not per guess. HTTP Basic has a
//! global ceiling on top: one password check at a time, each waiting at
//! most a moment for its turn (`Authenticator::authenticate_basic`).
//!
//! Memory is bounded: at most [`MAX_ENTRIES`] keys. When full, what is
//! neither blocked nor recent goes (at most once per [`PRUNE_EVERY`], so a
//! flood does not rescan the map on every guess); if it is still full, new
//! keys are not added (those already counted go on counting). A blocked
//! source adds no keys at all.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The window failures are counted in.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Failures of one credential from one source per window before a block.
pub const MAX_FAILURES: u32 = 5;
/// Failures of any credential from one source per window before a block.
pub const MAX_SOURCE_FAILURES: u32 = 50;
/// The longest block (blocks in a row double from one [`WINDOW`]).
pub const MAX_BLOCK: Duration = Duration::from_secs(15 * 60);
/// Keys kept at most.
pub const MAX_ENTRIES: usize = 10_000;
/// How often a full map is pruned at most.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// Where a request comes from (an IPv6 client by its /64, an IPv4-mapped
/// address as IPv4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    /// No address (a sign-in that did not come over the network).
    pub const UNSPECIFIED: Source = Source(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));

    pub fn new(ip: IpAddr) -> Self {
        let ip = match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => {
                    let s = v6.segments();
                    IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
                }
            },
            v4 => v4,
        };
        Self(ip)
    }

    pub fn ip(&self) -> IpAddr {
        self.0
    }
}

/// What a sign-in attempt names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Credential {
    /// A bearer token's id.
    Token(String),
    /// An HTTP Basic user name.
    User(String),
    /// Nothing that could be told apart (a malformed token).
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Source(Source),
    Pair(Credential, Source),
    /// Password failures from a loopback source (exempt from `Source`).
    LoopbackPasswords(Source),
}

/// The keys that refuse `cred` from `source` while blocked.
fn keys_of(source: Source, cred: &Credential) -> Vec<Key> {
    let mut keys = vec![Key::Source(source), Key::Pair(cred.clone(), source)];
    if matches!(cred, Credential::User(_)) && source.ip().is_loopback() {
        keys.push(Key::LoopbackPasswords(source));
    }
    keys
}

#[derive(Debug)]
struct Entry {
    failures: u32,
    since: Instant,
    blocked_until: Option<Instant>,
    /// Blocks in a row (reset after a quiet [`MAX_BLOCK`]).
    strikes: u32,
    last: Instant,
}

/// A block that has just begun: audited once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// The credential blocked, or `None` when the whole source is.
    pub credential: Option<Credential>,
    pub source: Source,
    pub for_: Duration,
}

/// Counts failures; decides refusals.
#[derive(Debug, Default)]
pub struct Throttle {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    map: HashMap<Key, Entry>,
    /// When a full map was last pruned.
    pruned: Option<Instant>,
}

impl State {
    /// Make room if full: drop what is neither blocked nor recent, at most
    /// once per [`PRUNE_EVERY`]. Whether a new key fits.
    fn room(&mut self, now: Instant) -> bool {
        if self.map.len() < MAX_ENTRIES {
            return true;
        }
        if self.pruned.is_none_or(|t| now - t >= PRUNE_EVERY) {
            self.pruned = Some(now);
            self.map
                .retain(|_, e| e.blocked_until.is_some_and(|u| u > now) || now - e.last < WINDOW);
        }
        self.map.len() < MAX_ENTRIES
    }
}

impl Throttle {
    /// Whether an attempt may be checked: `Err(seconds to wait)` while its
    /// credential from this source, or the source, is blocked.
    pub fn admit(&self, source: Source, cred: &Credential) -> Result<(), u64> {
        let now = Instant::now();
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let wait = keys_of(source, cred)
            .iter()
            .filter_map(|k| state.map.get(k)?.blocked_until)
            .filter(|until| *until > now)
            .map(|until| until - now)
            .max();
        match wait {
            Some(w) => Err(w.as_secs() + u64::from(w.subsec_nanos() > 0)),
            None => Ok(()),
        }
    }

    /// Count a failed attempt; the blocks it starts. While the source is
    /// blocked its credentials are not counted (nothing was checked).
    pub fn failed(&self, source: Source, cred: &Credential) -> Vec<Blocked> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let source_blocked = state
            .map
            .get(&Key::Source(source))
            .and_then(|e| e.blocked_until)
            .is_some_and(|u| u > now);
        let mut started = vec![];
        let mut keys = vec![];
        // The source first: if only one key fits, it is the source's.
        if !source.ip().is_loopback() && !source.ip().is_unspecified() {
            keys.push((Key::Source(source), MAX_SOURCE_FAILURES));
        } else if source.ip().is_loopback() && matches!(cred, Credential::User(_)) {
            keys.push((Key::LoopbackPasswords(source), MAX_SOURCE_FAILURES));
        }
        if cred != &Credential::Unknown && !source_blocked {
            keys.push((Key::Pair(cred.clone(), source), MAX_FAILURES));
        }
        for (key, max) in keys {
            if !state.map.contains_key(&key) && !state.room(now) {
                continue;
            }
            let e = state.map.entry(key.clone()).or_insert(Entry {
                failures: 0,
                since: now,
                blocked_until: None,
                strikes: 0,
                last: now,
            });
            if now - e.last >= MAX_BLOCK {
                e.strikes = 0;
            }
            e.last = now;
            if e.blocked_until.is_some_and(|u| u > now) {
                continue;
            }
            if now - e.since >= WINDOW {
                e.failures = 0;
                e.since = now;
            }
            e.failures += 1;
            if e.failures >= max {
                let for_ = WINDOW.saturating_mul(1 << e.strikes.min(4)).min(MAX_BLOCK);
                e.blocked_until = Some(now + for_);
                e.strikes += 1;
                e.failures = 0;
                e.since = now + for_;
                started.push(Blocked {
                    credential: match key {
                        Key::Pair(c, _) => Some(c),
                        Key::Source(_) | Key::LoopbackPasswords(_) => None,
                    },
                    source,
                    for_,
                });
            }
        }
        started
    }

    /// Keys kept (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.state.lock().map(|s| s.map.len()).unwrap_or(0)
    }

    /// A successful check: the credential's failures from this source are
    /// forgotten (the source's are not).
    pub fn succeeded(&self, source: Source, cred: &Credential) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.map.remove(&Key::Pair(cred.clone(), source));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(s: &str) -> Source {
        Source::new(s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])))
    }

    #[test]
    fn a_pair_is_blocked_but_not_the_credential_elsewhere() {
        let t = Throttle::default();
        let (a, b) = (src("192.0.2.1"), src("192.0.2.2"));
        let alice = Credential::User("alice".into());
        for _ in 0..MAX_FAILURES - 1 {
            assert!(t.failed(a, &alice).is_empty());
            assert_eq!(t.admit(a, &alice), Ok(()));
        }
        let started = t.failed(a, &alice);
        assert_eq!(started.len(), 1);
        assert_eq!(started[0].for_, WINDOW);
        let wait = t.admit(a, &alice).unwrap_err();
        assert!((59..=60).contains(&wait), "{wait}");
        // Alice from elsewhere, and others from the attacker's address.
        assert_eq!(t.admit(b, &alice), Ok(()));
        assert_eq!(t.admit(a, &Credential::User("bob".into())), Ok(()));
    }

    #[test]
    fn a_source_guessing_many_names_is_blocked_except_on_loopback() {
        let t = Throttle::default();
        let a = src("198.51.100.7");
        let mut blocked = 0;
        for i in 0..MAX_SOURCE_FAILURES {
            blocked += t.failed(a, &Credential::User(format!("u{i}"))).len();
        }
        assert_eq!(blocked, 1, "one block: the source's");
        assert!(t.admit(a, &Credential::User("new".into())).is_err());
        // Tokens from loopback: never blocked as a source.
        let lo = src("127.0.0.1");
        for i in 0..MAX_SOURCE_FAILURES * 2 {
            t.failed(lo, &Credential::Token(format!("t{i}")));
        }
        assert_eq!(t.admit(lo, &Credential::Token("new".into())), Ok(()));
    }

    /// #34 L6: password guesses from loopback (an SSH port-forward) block
    /// password sign-ins from loopback, as from any address, and leave
    /// loopback's tokens and other addresses alone.
    #[test]
    fn password_guesses_from_loopback_are_blocked_but_not_its_tokens() {
        let t = Throttle::default();
        let lo = src("127.0.0.1");
        let mut blocked = vec![];
        for i in 0..MAX_SOURCE_FAILURES {
            blocked.extend(t.failed(lo, &Credential::User(format!("u{i}"))));
        }
        assert_eq!(blocked.len(), 1, "{blocked:?}");
        assert_eq!(blocked[0].credential, None);
        let wait = t.admit(lo, &Credential::User("alice".into())).unwrap_err();
        assert!((59..=60).contains(&wait), "{wait}");
        assert_eq!(t.admit(lo, &Credential::Token("agent".into())), Ok(()));
        assert_eq!(t.admit(lo, &Credential::Unknown), Ok(()));
        assert_eq!(
            t.admit(src("192.0.2.1"), &Credential::User("alice".into())),
            Ok(())
        );
    }

    #[test]
    fn success_forgets_and_ipv6_counts_by_prefix() {
        let t = Throttle::default();
        let a = src("2001:db8:1:2::1");
        let b = src("2001:db8:1:2::ffff");
        assert_eq!(a, b);
        assert_eq!(src("::ffff:192.0.2.1"), src("192.0.2.1"));
        let tok = Credential::Token("abc".into());
        for _ in 0..MAX_FAILURES - 1 {
            t.failed(a, &tok);
        }
        t.succeeded(b, &tok);
        assert!(t.failed(a, &tok).is_empty(), "the count started over");
    }

    #[test]
    fn memory_is_bounded() {
        let t = Throttle::default();
        let lo = src("127.0.0.1");
        for i in 0..MAX_ENTRIES * 2 {
            t.failed(lo, &Credential::Token(format!("n{i}")));
        }
        assert!(t.len() <= MAX_ENTRIES, "{}", t.len());
    }

    #[test]
    fn many_names_from_one_address_stay_bounded() {
        let t = Throttle::default();
        let a = src("203.0.113.9");
        for i in 0..MAX_ENTRIES * 2 {
            t.failed(a, &Credential::User(format!("n{i}")));
        }
        // Counting stops with the source's block: its key and the names
        // before it.
        let n = t.len();
        assert!(n <= MAX_SOURCE_FAILURES as usize + 1, "{n}");
        assert!(t.admit(a, &Credential::User("new".into())).is_err());
    }

    #[test]
    fn a_full_map_takes_no_new_keys_but_keeps_counting() {
        let t = Throttle::default();
        let lo = src("127.0.0.1");
        for i in 0..MAX_ENTRIES {
            t.failed(lo, &Credential::Token(format!("n{i}")));
        }
        assert_eq!(t.len(), MAX_ENTRIES);
        // All recent: nothing to prune, and no room for a new name.
        t.failed(lo, &Credential::Token("late".into()));
        assert_eq!(t.len(), MAX_ENTRIES);
        // A name already counted still gets blocked.
        let n0 = Credential::Token("n0".into());
        for _ in 1..MAX_FAILURES {
            t.failed(lo, &n0);
        }
        assert!(t.admit(lo, &n0).is_err());
    }
}
