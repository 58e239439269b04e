//! Search the audit journal through its indexes (`store::audit_index`):
//! every indexed filter is a range scan, several are intersected by
//! leapfrogging (each index jumps to the next `seq` the others agree on),
//! and a time range narrows the `seq` range through the minute index. The
//! journal's `seq` is the cursor. Pages run newest first; exports oldest
//! first, in batches (each in its own read transaction, up to a `seq`
//! fixed first: events never change once written).

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::event::Event;
use crate::store::StoreError;
use crate::store::audit_index::{Field, Reader, key};

/// What to look for: index keys that must all match, and a time range
/// (`from` inclusive, `to` exclusive, Unix seconds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    pub from: Option<i64>,
    pub to: Option<i64>,
    keys: Vec<String>,
}

impl Query {
    /// Events whose `field` is `value` (again for the same field: no event
    /// matches both unless the values are equal).
    pub fn with(mut self, field: Field, value: &str) -> Self {
        let k = key(field, value);
        if !self.keys.contains(&k) {
            self.keys.push(k);
        }
        self
    }

    pub fn between(mut self, from: Option<i64>, to: Option<i64>) -> Self {
        self.from = from;
        self.to = to;
        self
    }

    fn in_time(&self, ev: &Event) -> bool {
        if self.from.is_none() && self.to.is_none() {
            return true;
        }
        let Ok(t) = OffsetDateTime::parse(&ev.ts, &Rfc3339) else {
            return false;
        };
        let t = t.unix_timestamp();
        self.from.is_none_or(|f| t >= f) && self.to.is_none_or(|to| t < to)
    }

    /// The `seq` range that holds every event of the time range.
    fn span(&self, r: &Reader, last: u64) -> Result<Option<(u64, u64)>, StoreError> {
        if self.from.is_none() && self.to.is_none() {
            return Ok((last > 0).then_some((1, last)));
        }
        let lo = self.from.map(|f| f.div_euclid(60)).unwrap_or(0).max(0) as u64;
        let hi = match self.to {
            Some(t) if t <= 0 => return Ok(None),
            Some(t) => (t - 1).div_euclid(60) as u64,
            None => u64::MAX,
        };
        Ok(r.seq_span(lo, hi)?.map(|(a, b)| (a, b.min(last))))
    }
}

/// A page of results and the cursor of the next one.
#[derive(Debug, Clone, Default)]
pub struct Found {
    pub events: Vec<Event>,
    /// Pass as `before` for the next (older) page; `None`: this was the last.
    pub next: Option<u64>,
}

/// The next `seq` in `lo..=hi`, from `at` towards `lo` (down) or `hi`
/// (up), that every key has.
fn next_candidate(
    r: &Reader,
    keys: &[String],
    lo: u64,
    hi: u64,
    at: u64,
    down: bool,
) -> Result<Option<u64>, StoreError> {
    let mut c = at;
    loop {
        if c < lo || c > hi {
            return Ok(None);
        }
        let mut agreed = true;
        for k in keys {
            let s = if down {
                r.at_or_below(k, c)?
            } else {
                r.at_or_above(k, c)?
            };
            match s {
                None => return Ok(None),
                Some(s) if s != c => {
                    c = s;
                    agreed = false;
                    break;
                }
                Some(_) => {}
            }
        }
        if agreed {
            return Ok(Some(c));
        }
    }
}

/// At most `limit` events matching `q`, newest first, with `seq < before`
/// (`None`: from the newest).
pub fn page(
    txn: &crate::store::Rx,
    q: &Query,
    before: Option<u64>,
    limit: usize,
) -> Result<Found, StoreError> {
    let r = Reader::open(txn)?;
    let last = super::last_seq(txn)?;
    let Some((lo, hi)) = q.span(&r, last)? else {
        return Ok(Found::default());
    };
    let mut at = match before {
        Some(0) => return Ok(Found::default()),
        Some(b) => (b - 1).min(hi),
        None => hi,
    };
    let mut out = Found::default();
    while let Some(c) = next_candidate(&r, &q.keys, lo, hi, at, true)? {
        if out.events.len() == limit {
            out.next = Some(c + 1);
            break;
        }
        if let Some(mut ev) = r.event(c)? {
            ev.seq = c;
            if q.in_time(&ev) {
                out.events.push(ev);
            }
        }
        // `c >= lo >= 1`: sequence numbers start at 1.
        at = c - 1;
    }
    Ok(out)
}

/// Events matching `q` with `from <= seq <= to`, oldest first, each handed
/// to `out`, until `limit` have been handed: the `seq` to go on from
/// (`None`: the range is done).
pub fn forward(
    txn: &crate::store::Rx,
    q: &Query,
    from: u64,
    to: u64,
    limit: usize,
    mut out: impl FnMut(Event) -> Result<(), StoreError>,
) -> Result<Option<u64>, StoreError> {
    let r = Reader::open(txn)?;
    let last = super::last_seq(txn)?;
    let Some((lo, hi)) = q.span(&r, last.min(to))? else {
        return Ok(None);
    };
    let lo = lo.max(from);
    let mut at = lo;
    // Candidates looked at (a time range's edges may hold events of other
    // times): bounded per batch, as the matches are.
    let mut budget = limit.saturating_mul(8).max(1);
    let mut handed = 0;
    while let Some(c) = next_candidate(&r, &q.keys, lo, hi, at, false)? {
        if handed == limit || budget == 0 {
            return Ok(Some(c));
        }
        budget -= 1;
        if let Some(mut ev) = r.event(c)? {
            ev.seq = c;
            if q.in_time(&ev) {
                out(ev)?;
                handed += 1;
            }
        }
        at = c + 1;
    }
    Ok(None)
}

/// A time given to a search: RFC 3339 (`2026-05-01T10:00:00Z`, an offset
/// allowed), or `YYYY-MM-DD`, `YYYY-MM-DDTHH:MM` or `YYYY-MM-DDTHH:MM:SS`
/// (UTC; what a browser's date and time fields send). Unix seconds.
pub fn parse_time(s: &str) -> Option<i64> {
    let s = s.trim();
    if let Some(t) = crate::clock::parse_unix(s) {
        return Some(t);
    }
    let fmt_date = time::macros::format_description!("[year]-[month]-[day]");
    let fmt_min = time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]");
    let fmt_sec =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]");
    if let Ok(d) = time::Date::parse(s, &fmt_date) {
        return Some(d.midnight().assume_utc().unix_timestamp());
    }
    for f in [fmt_sec, fmt_min] {
        if let Ok(t) = time::PrimitiveDateTime::parse(s, &f) {
            return Some(t.assume_utc().unix_timestamp());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::event::{Action, Outcome};
    use crate::store::Store;

    /// The five actions the test journal cycles through.
    const ACTIONS: [Action; 5] = [
        Action::Exec,
        Action::Read,
        Action::Write,
        Action::List,
        Action::Stat,
    ];

    /// Which events a query must find.
    type Want = Box<dyn Fn(&Event) -> bool>;

    /// 300 events: tenant i%3, action `ACTIONS[i%5]`, outcome ok unless i%7==0, one
    /// minute apart from 2026-01-01T00:00Z; request id `r{i}`.
    async fn store() -> (tempfile::TempDir, Store, Vec<Event>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mut all = vec![];
        for i in 0..300u64 {
            let e = Event {
                action: ACTIONS[i as usize % 5].clone(),
                outcome: if i % 7 == 0 {
                    Outcome::Error
                } else {
                    Outcome::Ok
                },
                tenant_digest: Some(format!("t{}", i % 3)),
                request_id: Some(format!("r{i}")),
                ts: rfc(1_767_225_600 + i as i64 * 60),
                ..Default::default()
            };
            let e = store
                .write(move |txn, chain| chain.append(txn, e))
                .await
                .unwrap();
            all.push(e);
        }
        (dir, store, all)
    }

    fn rfc(unix: i64) -> String {
        OffsetDateTime::from_unix_timestamp(unix)
            .unwrap()
            .format(&Rfc3339)
            .unwrap()
    }

    /// Every page, newest first, following the cursor.
    fn all_pages(store: &Store, q: &Query, size: usize) -> Vec<u64> {
        let mut seen = vec![];
        let mut before = None;
        loop {
            let f = store.read_now(|txn| page(txn, q, before, size)).unwrap();
            assert!(f.events.len() <= size);
            seen.extend(f.events.iter().map(|e| e.seq));
            match f.next {
                Some(n) => before = Some(n),
                None => return seen,
            }
        }
    }

    fn forward_all(store: &Store, q: &Query, batch: usize) -> Vec<u64> {
        let mut seen = vec![];
        let mut from = 1;
        loop {
            let next = store
                .read_now(|txn| {
                    forward(txn, q, from, u64::MAX, batch, |e| {
                        seen.push(e.seq);
                        Ok(())
                    })
                })
                .unwrap();
            match next {
                Some(n) => from = n,
                None => return seen,
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn filters_find_exactly_their_events() {
        let (_d, store, all) = store().await;
        let t0 = 1_767_225_600i64;
        let cases: Vec<(Query, Want)> = vec![
            (Query::default(), Box::new(|_| true)),
            (
                Query::default().with(Field::Tenant, "t1"),
                Box::new(|e| e.tenant_digest.as_deref() == Some("t1")),
            ),
            (
                Query::default()
                    .with(Field::Tenant, "t2")
                    .with(Field::Action, "list")
                    .with(Field::Outcome, "error"),
                Box::new(|e| {
                    e.tenant_digest.as_deref() == Some("t2")
                        && e.action == Action::List
                        && e.outcome == Outcome::Error
                }),
            ),
            (
                Query::default().with(Field::RequestId, "r42"),
                Box::new(|e| e.request_id.as_deref() == Some("r42")),
            ),
            (
                Query::default().with(Field::Action, "nope"),
                Box::new(|_| false),
            ),
            (
                Query::default().between(Some(t0 + 100 * 60), Some(t0 + 150 * 60 + 1)),
                Box::new(move |e| (101..=151).contains(&e.seq)),
            ),
            (
                Query::default()
                    .with(Field::Tenant, "t0")
                    .between(Some(t0 + 30), None),
                Box::new(|e| e.tenant_digest.as_deref() == Some("t0") && e.seq > 1),
            ),
            (
                Query::default().between(None, Some(t0)),
                Box::new(|_| false),
            ),
        ];
        for (i, (q, want)) in cases.iter().enumerate() {
            let mut expect: Vec<u64> = all.iter().filter(|e| want(e)).map(|e| e.seq).collect();
            assert_eq!(forward_all(&store, q, 7), expect, "case {i} forward");
            expect.reverse();
            assert_eq!(all_pages(&store, q, 10), expect, "case {i} pages");
            assert_eq!(all_pages(&store, q, 1000), expect, "case {i} one page");
        }
    }

    /// An event stamped out of order (its writer was slow) is found by its
    /// own time, not its place in the journal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn late_stamped_events_are_found_by_their_time() {
        let (_d, store, _) = store().await;
        let late = Event {
            action: Action::Exec,
            outcome: Outcome::Ok,
            ts: rfc(1_767_225_600 + 5 * 60 + 10),
            ..Default::default()
        };
        let late = store
            .write(move |txn, chain| chain.append(txn, late))
            .await
            .unwrap();
        let q =
            Query::default().between(Some(1_767_225_600 + 5 * 60), Some(1_767_225_600 + 6 * 60));
        assert_eq!(all_pages(&store, &q, 10), vec![late.seq, 6]);
        assert_eq!(forward_all(&store, &q, 1), vec![6, late.seq]);
    }

    #[test]
    fn times_parse() {
        assert_eq!(parse_time("2026-01-01"), Some(1_767_225_600));
        assert_eq!(parse_time("2026-01-01T00:01"), Some(1_767_225_660));
        assert_eq!(parse_time("2026-01-01T00:01:05"), Some(1_767_225_665));
        assert_eq!(parse_time("2026-01-01T01:00:00+01:00"), Some(1_767_225_600));
        assert_eq!(parse_time("yesterday"), None);
        assert_eq!(parse_time("2026-13-01"), None);
    }
}
