//! Prometheus metrics: lock-free instruments, and the text exposition that
//! `/metrics` serves (docs/operations.md, "Metrics", lists every series).
//!
//! **Who owns what.** Each component owns the instruments it feeds, behind
//! its own `Arc`: the store its commit histograms, the journal its
//! operation counters and effect histograms, each backend client its error
//! counts, the broker its GC counters, the API its request histograms.
//! There is no process-global registry: in-process tests run several
//! appliances at once, and each must count only its own traffic (and the
//! house style has no global singletons). This module sits at the bottom
//! of the layers and uses nothing of the crate, so every layer may feed it.
//!
//! **No lock on the request path.** prometheus-client's `Histogram` holds
//! a mutex and its `Family` an `RwLock`, so the hot path does not use them:
//! `Histogram` here is a row of atomic buckets (its sum in integer
//! nanoseconds or units, one `fetch_add` each), and `Family` an
//! append-only open-addressing table of `OnceLock` slots, looked up with
//! atomic loads. A label set's first observation initialises its slot once
//! (`OnceLock`, which makes a racing initialiser of the *same* slot wait
//! for that one store); every later one is loads and `fetch_add`s.
//! prometheus-client does the encoding: at scrape time the values are read
//! into `Metric`s and written through its `Collector` and text encoder.
//!
//! Scrape-time values (leases by tenant, plans pending, certificate expiry,
//! process RSS, …) are read by the API's handler just before encoding; that
//! may take locks and read the store, off the request path.

use std::hash::{Hash, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;

/// Latency buckets in seconds: the reference's `.005 … 180 s`.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0,
];

/// Store commit buckets in seconds (an fsync: sub-millisecond to seconds).
pub const COMMIT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Events-per-commit buckets (group commit carries up to 512 writes).
pub const BATCH_BUCKETS: &[f64] = &[
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
];

/// A monotonic counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a histogram's integer sum counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SumUnit {
    Nanoseconds,
    Units,
}

/// A histogram with fixed bounds, lock-free: one atomic per bucket (the
/// last one `+Inf`) and an integer sum.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Box<[AtomicU64]>,
    sum: AtomicU64,
    unit: SumUnit,
}

impl Histogram {
    /// For durations (`observe_duration`), in seconds.
    pub fn seconds(bounds: &'static [f64]) -> Self {
        Self::new(bounds, SumUnit::Nanoseconds)
    }

    /// For counts (`observe_count`).
    pub fn counts(bounds: &'static [f64]) -> Self {
        Self::new(bounds, SumUnit::Units)
    }

    fn new(bounds: &'static [f64], unit: SumUnit) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
            unit,
        }
    }

    fn bump(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        if let Some(b) = self.buckets.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn observe_duration(&self, d: Duration) {
        debug_assert_eq!(self.unit, SumUnit::Nanoseconds);
        self.bump(d.as_secs_f64());
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn observe_count(&self, n: u64) {
        debug_assert_eq!(self.unit, SumUnit::Units);
        self.bump(n as f64);
        self.sum.fetch_add(n, Ordering::Relaxed);
    }

    /// Sum, count and per-bucket (not cumulative) counts, `+Inf` last.
    /// The count is the buckets' total, so `_count` and the `+Inf` bucket
    /// always agree.
    pub fn snapshot(&self) -> HistogramValue {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let raw = self.sum.load(Ordering::Relaxed) as f64;
        HistogramValue {
            sum: match self.unit {
                SumUnit::Nanoseconds => raw / 1e9,
                SumUnit::Units => raw,
            },
            count: counts.iter().sum(),
            buckets: self
                .bounds
                .iter()
                .copied()
                .chain(std::iter::once(f64::INFINITY))
                .zip(counts)
                .collect(),
        }
    }
}

/// A histogram's values at one scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramValue {
    pub sum: f64,
    pub count: u64,
    /// `(upper bound, observations in this bucket alone)`, `+Inf` last.
    pub buckets: Vec<(f64, u64)>,
}

/// Series a family holds at most; past that, new label sets are counted
/// in `Family::dropped` and not recorded (the label values come from
/// configuration and fixed sets, so this is a guard, not a limit).
pub const FAMILY_CAPACITY: usize = 4096;

type Slot<const N: usize, M> = OnceLock<([Box<str>; N], M)>;

/// Instruments by label values: an append-only table of `OnceLock` slots,
/// found by hashing the values and probing (no lock once a series exists).
pub struct Family<const N: usize, M> {
    slots: Box<[Slot<N, M>]>,
    make: fn() -> M,
    dropped: Counter,
}

impl<const N: usize, M> std::fmt::Debug for Family<N, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family")
            .field("series", &self.iter().count())
            .finish()
    }
}

impl<const N: usize, M> Family<N, M> {
    /// New series are made by `make`.
    pub fn new(make: fn() -> M) -> Self {
        Self::with_capacity(make, FAMILY_CAPACITY)
    }

    pub fn with_capacity(make: fn() -> M, capacity: usize) -> Self {
        Self {
            slots: (0..capacity.max(1)).map(|_| OnceLock::new()).collect(),
            make,
            dropped: Counter::default(),
        }
    }

    /// The series for `labels`, made on first use; `None` (and counted in
    /// `dropped`) when the family is full.
    pub fn get(&self, labels: [&str; N]) -> Option<&M> {
        let mut h = std::hash::DefaultHasher::new();
        labels.hash(&mut h);
        let n = self.slots.len();
        let start = usize::try_from(h.finish() % n as u64).unwrap_or(0);
        let same = |k: &[Box<str>; N]| k.iter().zip(labels.iter()).all(|(a, b)| **a == **b);
        for i in 0..n {
            let slot = self.slots.get((start + i) % n)?;
            let (k, m) = match slot.get() {
                Some(x) => x,
                None => slot.get_or_init(|| (labels.map(Box::from), (self.make)())),
            };
            if same(k) {
                return Some(m);
            }
        }
        self.dropped.inc();
        None
    }

    /// Every series with its label values.
    pub fn iter(&self) -> impl Iterator<Item = (&[Box<str>; N], &M)> {
        self.slots
            .iter()
            .filter_map(|s| s.get().map(|(k, m)| (k, m)))
    }

    /// Label sets refused because the family was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.get()
    }
}

impl<const N: usize> Family<N, Counter> {
    pub fn counters() -> Self {
        Self::new(Counter::default)
    }

    pub fn inc(&self, labels: [&str; N]) {
        if let Some(c) = self.get(labels) {
            c.inc();
        }
    }
}

/// One value of a series at one scrape.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Counter(u64),
    Gauge(f64),
    Histogram(HistogramValue),
}

/// One series: its label pairs and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: Vec<(String, String)>,
    pub value: Value,
}

/// A metric family at one scrape: what `/metrics` writes.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    /// The name as exposed, counters with their `_total`.
    pub name: &'static str,
    pub help: &'static str,
    pub kind: MetricType,
    pub samples: Vec<Sample>,
}

impl Metric {
    pub fn new(name: &'static str, kind: MetricType, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind,
            samples: vec![],
        }
    }

    pub fn counter(name: &'static str, help: &'static str) -> Self {
        Self::new(name, MetricType::Counter, help)
    }

    pub fn gauge(name: &'static str, help: &'static str) -> Self {
        Self::new(name, MetricType::Gauge, help)
    }

    pub fn histogram(name: &'static str, help: &'static str) -> Self {
        Self::new(name, MetricType::Histogram, help)
    }

    /// Add a series with `labels` (name, value pairs).
    pub fn with(mut self, labels: &[(&str, &str)], value: Value) -> Self {
        self.push(labels, value);
        self
    }

    pub fn push(&mut self, labels: &[(&str, &str)], value: Value) {
        self.samples.push(Sample {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            value,
        });
    }

    /// Every series of a family, its label values under `names`.
    pub fn with_family<const N: usize, M>(
        mut self,
        family: &Family<N, M>,
        names: [&str; N],
        value: impl Fn(&M) -> Value,
    ) -> Self {
        let mut rows: Vec<_> = family.iter().collect();
        rows.sort_by(|a, b| a.0.cmp(b.0));
        for (k, m) in rows {
            let labels: Vec<(&str, &str)> =
                names.iter().copied().zip(k.iter().map(|v| &**v)).collect();
            self.push(&labels, value(m));
        }
        self
    }
}

/// The labels `/metrics` drops when it is open (no `[metrics]
/// token_file`): they name tenants and profiles (#34 L9).
pub const PRIVATE_LABELS: &[&str] = &["tenant", "profile"];

/// `metrics` without the labels in `drop`: the series that differed only
/// by them are summed into one (counters, gauges, histograms alike; the
/// families that carry them are counts).
pub fn without_labels(metrics: Vec<Metric>, drop: &[&str]) -> Vec<Metric> {
    metrics
        .into_iter()
        .map(|mut m| {
            if !m
                .samples
                .iter()
                .any(|s| s.labels.iter().any(|(k, _)| drop.contains(&k.as_str())))
            {
                return m;
            }
            let mut out: Vec<Sample> = vec![];
            for mut s in std::mem::take(&mut m.samples) {
                s.labels.retain(|(k, _)| !drop.contains(&k.as_str()));
                match out.iter_mut().find(|o| o.labels == s.labels) {
                    Some(o) => merge(&mut o.value, s.value),
                    None => out.push(s),
                }
            }
            m.samples = out;
            m
        })
        .collect()
}

/// Add `v` into `into` (values of one family: the same kind).
fn merge(into: &mut Value, v: Value) {
    match (into, v) {
        (Value::Counter(a), Value::Counter(b)) => *a += b,
        (Value::Gauge(a), Value::Gauge(b)) => *a += b,
        (Value::Histogram(a), Value::Histogram(b)) => {
            a.sum += b.sum;
            a.count += b.count;
            for (x, y) in a.buckets.iter_mut().zip(b.buckets) {
                x.1 += y.1;
            }
        }
        _ => {}
    }
}

/// The metrics of one scrape, as a prometheus-client collector.
#[derive(Debug)]
struct Scrape(Vec<Metric>);

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for m in &self.0 {
            // The encoder appends `_total` to counters.
            let base = match m.kind {
                MetricType::Counter => m.name.strip_suffix("_total").unwrap_or(m.name),
                _ => m.name,
            };
            let mut me = encoder.encode_descriptor(base, m.help, None, m.kind)?;
            for s in &m.samples {
                let mut fe = me.encode_family(&s.labels)?;
                match &s.value {
                    Value::Counter(v) => {
                        prometheus_client::metrics::counter::ConstCounter::new(*v).encode(fe)?
                    }
                    Value::Gauge(v) => fe.encode_gauge(v)?,
                    Value::Histogram(h) => fe.encode_histogram::<Vec<(String, String)>>(
                        h.sum, h.count, &h.buckets, None,
                    )?,
                }
            }
        }
        Ok(())
    }
}

/// The Prometheus text format (0.0.4) of `metrics`.
pub fn encode(metrics: Vec<Metric>) -> Result<String, std::fmt::Error> {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Scrape(metrics)));
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?;
    Ok(out)
}

/// The `Content-Type` of `encode`'s text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// One audit sink's delivery state (fed by the sinks through
/// `Audit::set_sink_source`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkSample {
    pub name: String,
    /// Events committed and not yet delivered to this sink.
    pub lag: u64,
    /// Failed deliveries since start.
    pub failures: u64,
}

/// Reads the sinks' state at scrape time.
pub type SinkSource = Box<dyn Fn() -> Vec<SinkSample> + Send + Sync>;

/// The audit journal's instruments.
pub struct Audit {
    /// The reference's `cube_adapter_operations_total`: action, outcome,
    /// runtime, profile.
    pub operations: Family<4, Counter>,
    /// Intent to outcome of each effect: action, outcome, backend.
    pub effects: Family<3, Histogram>,
    sinks: OnceLock<SinkSource>,
}

impl Default for Audit {
    fn default() -> Self {
        Self {
            operations: Family::counters(),
            effects: Family::new(|| Histogram::seconds(LATENCY_BUCKETS)),
            sinks: OnceLock::new(),
        }
    }
}

impl std::fmt::Debug for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Audit")
            .field("operations", &self.operations)
            .field("effects", &self.effects)
            .field("sinks", &self.sinks.get().is_some())
            .finish()
    }
}

impl Audit {
    /// The extension point for audit sinks: `f` is called at each scrape
    /// and its samples become `cube_adapter_audit_sink_lag_events{sink}`,
    /// `cube_adapter_audit_sink_failures_total{sink}` and
    /// `cube_adapter_audit_pending_deliveries`. Set once; a second call is
    /// refused (returns false).
    pub fn set_sink_source(&self, f: SinkSource) -> bool {
        self.sinks.set(f).is_ok()
    }

    /// The sinks' state now, if a source is set.
    pub fn sinks(&self) -> Option<Vec<SinkSample>> {
        self.sinks.get().map(|f| f())
    }
}

/// The sinks' series: `cube_adapter_audit_sink_lag_events{sink}`,
/// `cube_adapter_audit_sink_failures_total{sink}` and
/// `cube_adapter_audit_pending_deliveries` (their lags added up).
pub fn sink_metrics(sinks: &[SinkSample]) -> Vec<Metric> {
    let mut lag = Metric::gauge(
        "cube_adapter_audit_sink_lag_events",
        "Committed audit events not yet delivered to the sink",
    );
    let mut failures = Metric::counter(
        "cube_adapter_audit_sink_failures_total",
        "Failed deliveries to the sink",
    );
    for s in sinks {
        lag.push(&[("sink", &s.name)], Value::Gauge(s.lag as f64));
        failures.push(&[("sink", &s.name)], Value::Counter(s.failures));
    }
    let pending = Metric::gauge(
        "cube_adapter_audit_pending_deliveries",
        "Undelivered sink copies of audit events (all sinks)",
    )
    .with(&[], Value::Gauge(sinks.iter().map(|s| s.lag as f64).sum()));
    vec![lag, failures, pending]
}

/// The store writer's instruments.
#[derive(Debug)]
pub struct Store {
    /// Each durable commit (one fsync), in seconds.
    pub commit: Histogram,
    /// Audit events carried by each commit.
    pub events_per_commit: Histogram,
}

impl Default for Store {
    fn default() -> Self {
        Self {
            commit: Histogram::seconds(COMMIT_BUCKETS),
            events_per_commit: Histogram::counts(BATCH_BUCKETS),
        }
    }
}

/// Garbage collection's instruments (the broker's GC pass).
#[derive(Debug)]
pub struct Gc {
    /// Passes, by result (`ok`, `failed`: refused before collecting).
    pub runs: Family<1, Counter>,
    /// The reference's `cube_adapter_gc_actions_total{outcome}`: idle
    /// leases `collected` or `failed`, sandboxes no lease holds
    /// `orphan_killed` or `orphan_failed`, task plans `plan_pruned`.
    pub actions: Family<1, Counter>,
}

impl Default for Gc {
    fn default() -> Self {
        Self {
            runs: Family::with_capacity(Counter::default, 8),
            actions: Family::with_capacity(Counter::default, 16),
        }
    }
}

/// The egress proxy's instruments (the broker's `egress`).
#[derive(Debug)]
pub struct Egress {
    /// Requests and tunnels by profile and result: `ok`, `error`, or the
    /// code that refused them.
    pub requests: Family<2, Counter>,
    /// Bytes moved for sandboxes, by profile and direction (`out`: from the
    /// sandbox, `in`: to it).
    pub bytes: Family<2, Counter>,
}

impl Default for Egress {
    fn default() -> Self {
        Self {
            requests: Family::with_capacity(Counter::default, 256),
            bytes: Family::with_capacity(Counter::default, 128),
        }
    }
}

impl<const N: usize> Family<N, Counter> {
    pub fn add(&self, labels: [&str; N], n: u64) {
        if let Some(c) = self.get(labels) {
            c.add(n);
        }
    }
}

/// The HTTP listener's instruments: route template, method, status class.
#[derive(Debug)]
pub struct Http {
    pub requests: Family<3, Histogram>,
}

impl Default for Http {
    fn default() -> Self {
        Self {
            requests: Family::new(|| Histogram::seconds(LATENCY_BUCKETS)),
        }
    }
}

/// `2xx`, `4xx`, …: the status class label.
pub fn status_class(status: u16) -> &'static str {
    match status / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        _ => "5xx",
    }
}

/// This process's resident memory, open descriptors and descriptor limit
/// (Linux `/proc/self`), for the standard `process_*` series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Process {
    pub resident_bytes: Option<u64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
}

impl Process {
    pub fn read() -> Self {
        let resident_bytes = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().strip_suffix("kB"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
            .map(|kb| kb * 1024);
        let open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        let max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Max open files"))
                    .and_then(|l| l.split_whitespace().nth(3))
                    .and_then(|v| v.parse::<u64>().ok())
            });
        Self {
            resident_bytes,
            open_fds,
            max_fds,
        }
    }

    pub fn metrics(&self) -> Vec<Metric> {
        let mut out = vec![];
        let mut one = |name, help, v: Option<u64>| {
            if let Some(v) = v {
                out.push(Metric::gauge(name, help).with(&[], Value::Gauge(v as f64)));
            }
        };
        one(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            self.resident_bytes,
        );
        one(
            "process_open_fds",
            "Number of open file descriptors",
            self.open_fds,
        );
        one(
            "process_max_fds",
            "Maximum number of open file descriptors",
            self.max_fds,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// #34 L9: open metrics lose the tenant and profile labels; the
    /// series they told apart are summed.
    #[test]
    fn private_labels_are_dropped_and_their_series_summed() {
        let mut leases = Metric::gauge("cube_adapter_leases", "x");
        leases.push(
            &[("state", "active"), ("tenant", "acme"), ("profile", "p1")],
            Value::Gauge(2.0),
        );
        leases.push(
            &[("state", "active"), ("tenant", "globex"), ("profile", "p2")],
            Value::Gauge(3.0),
        );
        leases.push(
            &[("state", "ended"), ("tenant", "acme"), ("profile", "p1")],
            Value::Gauge(1.0),
        );
        let ops = Metric::counter("cube_adapter_operations_total", "x")
            .with(&[("action", "exec"), ("profile", "a")], Value::Counter(4))
            .with(&[("action", "exec"), ("profile", "b")], Value::Counter(5));
        let other =
            Metric::gauge("cube_adapter_x", "x").with(&[("backend", "b")], Value::Gauge(1.0));
        let out = without_labels(vec![leases, ops, other.clone()], PRIVATE_LABELS);
        assert_eq!(out[0].samples.len(), 2);
        assert_eq!(
            out[0].samples[0].labels,
            [("state".to_string(), "active".to_string())]
        );
        assert_eq!(out[0].samples[0].value, Value::Gauge(5.0));
        assert_eq!(out[0].samples[1].value, Value::Gauge(1.0));
        assert_eq!(out[1].samples.len(), 1);
        assert_eq!(out[1].samples[0].value, Value::Counter(9));
        assert_eq!(out[2], other);
        let text = encode(out).unwrap();
        assert!(
            !text.contains("acme") && !text.contains("tenant="),
            "{text}"
        );
    }

    #[test]
    fn histogram_buckets_are_le_and_count_is_their_total() {
        let h = Histogram::seconds(&[0.1, 1.0]);
        h.observe_duration(Duration::from_millis(100));
        h.observe_duration(Duration::from_millis(500));
        h.observe_duration(Duration::from_secs(3));
        let v = h.snapshot();
        assert_eq!(v.count, 3);
        assert_eq!(v.buckets, vec![(0.1, 1), (1.0, 1), (f64::INFINITY, 1)]);
        assert!((v.sum - 3.6).abs() < 1e-9);
    }

    #[test]
    fn a_family_keeps_each_label_set_apart_and_refuses_past_capacity() {
        let f: Family<2, Counter> = Family::with_capacity(Counter::default, 3);
        f.inc(["a", "x"]);
        f.inc(["a", "x"]);
        f.inc(["a", "y"]);
        f.inc(["b", "x"]);
        f.inc(["c", "z"]);
        let mut got: Vec<(String, u64)> = f.iter().map(|(k, c)| (k.join("/"), c.get())).collect();
        got.sort();
        assert_eq!(
            got,
            vec![("a/x".into(), 2), ("a/y".into(), 1), ("b/x".into(), 1)]
        );
        assert_eq!(f.dropped(), 1);
    }

    #[test]
    fn a_sink_source_gives_the_sink_series_once_set() {
        let a = Audit::default();
        assert_eq!(a.sinks(), None, "no source: no sink series");
        let source: SinkSource = Box::new(|| {
            vec![
                SinkSample {
                    name: "file".into(),
                    lag: 3,
                    failures: 1,
                },
                SinkSample {
                    name: "http".into(),
                    lag: 4,
                    failures: 0,
                },
            ]
        });
        assert!(a.set_sink_source(source));
        assert!(!a.set_sink_source(Box::new(Vec::new)), "set once");
        let text = encode(sink_metrics(&a.sinks().unwrap())).unwrap();
        for line in [
            "cube_adapter_audit_sink_lag_events{sink=\"file\"} 3.0\n",
            "cube_adapter_audit_sink_failures_total{sink=\"file\"} 1\n",
            "cube_adapter_audit_sink_failures_total{sink=\"http\"} 0\n",
            "cube_adapter_audit_pending_deliveries 7.0\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn the_text_has_types_totals_and_buckets() {
        let h = Histogram::seconds(&[1.0]);
        h.observe_duration(Duration::from_millis(10));
        let text = encode(vec![
            Metric::counter("x_things_total", "Things").with(&[("k", "v\"q")], Value::Counter(2)),
            Metric::gauge("x_level", "Level").with(&[], Value::Gauge(1.5)),
            Metric::histogram("x_seconds", "Time").with(&[], Value::Histogram(h.snapshot())),
        ])
        .unwrap();
        assert!(text.contains("# TYPE x_things_total counter\n"), "{text}");
        assert!(text.contains("x_things_total{k=\"v\\\"q\"} 2\n"), "{text}");
        assert!(text.contains("x_level 1.5\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"1\"} 1\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"+Inf\"} 1\n"), "{text}");
        assert!(text.contains("x_seconds_count 1\n"), "{text}");
    }
}
