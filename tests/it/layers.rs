//! Layers point down only: a module may use what is below it, never what is
//! above (docs/architecture.md, "Layers").
//!
//! The appliance: `cli → app → {api, mcp, admin, console} → broker →
//! {audit, auth} → store`, with `config`, `cube` and `embedded` between the
//! store and the broker. The embedded backend is a crate of its own
//! (`crates/embedded`, `cube_embedded`, named `embedded` in the appliance):
//! cargo keeps it from using the appliance at all, and its own modules are
//! ranked too, from the system calls up to the HTTP service.
//!
//! The test reads every `crate::…` path (and, in the embedded crate's
//! top-level files, `super::…`; in `main.rs`, `cube_adapter::…`), maps it to
//! the top-level module it names, and checks each edge against the ranks
//! below. The edges still to be cut are listed in `KNOWN`: the test fails
//! when a new upward edge appears *and* when a known one is gone, so the
//! list only ever shrinks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Higher uses lower. Equal ranks may not use each other.
const RANKS: &[(&str, u32)] = &[
    // `cube_embedded::wire`: CubeAPI and envd messages (`cube::wire`).
    ("wire", 0),
    ("clock", 0),
    ("ids", 0),
    ("telemetry", 0),
    ("metrics", 0),
    ("systemd", 0),
    ("secrets", 1),
    ("store", 2),
    ("tls", 3),
    ("audit", 4),
    ("auth", 4),
    ("cube", 4),
    ("embedded", 5),
    ("config", 6),
    ("broker", 7),
    // The agent hosts' snippets: the console and `connect` both use them.
    ("clients", 7),
    // Over api: a connection over a cap is answered with the API's own
    // error envelope (`api::ApiError`).
    ("server", 9),
    ("api", 8),
    ("admin", 8),
    // Over admin and ops: the console's Identities page runs the admin
    // socket's own identity handler (`admin::identity`) as the person.
    ("console", 10),
    ("mcp", 9),
    ("ops", 9),
    ("standalone", 10),
    ("app", 11),
    ("bench", 12),
    ("cli", 13),
    ("main", 14),
];

/// Upward edges that exist today and are to be cut (issue 13).
const KNOWN: &[(&str, &str)] = &[];

/// The embedded backend's modules (`crates/embedded/src`): higher uses
/// lower, equal ranks may not use each other; the crate root (`lib.rs`)
/// serves them all.
const EMBEDDED_RANKS: &[(&str, u32)] = &[
    ("clock", 0),
    ("error", 0),
    ("seccomp", 0),
    ("sys", 0),
    ("templates", 0),
    ("tree", 0),
    ("wire", 0),
    ("egress", 1),
    ("egress_tap", 1),
    ("envd", 1),
    ("gateway", 1),
    ("subids", 1),
    ("launch", 2),
    ("cgroup", 3),
    ("disk", 3),
    ("procs", 4),
    ("volumes", 4),
    ("sandbox", 5),
    ("proxy", 6),
];

fn rank_in(ranks: &[(&str, u32)], m: &str) -> Option<u32> {
    ranks.iter().find(|(n, _)| *n == m).map(|(_, r)| *r)
}

/// The top-level modules a source text names through `prefix` (`crate` or
/// `cube_adapter`), with the second path segment (for `cube::wire`).
fn uses(text: &str, prefix: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    let pat = format!("{prefix}::");
    let mut rest = text;
    while let Some(i) = rest.find(&pat) {
        // Not part of a longer identifier (`my_crate::`).
        let before = rest[..i].chars().last();
        rest = &rest[i + pat.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let ident = |s: &str| -> String {
            s.chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        };
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::c, d::{e, f}}`: the first segment of each item.
            let mut depth = 0;
            let mut item_start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && (c.is_alphanumeric() || c == '_') => {
                        let first = ident(&group[j..]);
                        let after = &group[j + first.len()..];
                        let second = after.strip_prefix("::").map(ident).unwrap_or_default();
                        out.push((first, second));
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let first = ident(rest);
            let after = &rest[first.len()..];
            let second = after.strip_prefix("::").map(ident).unwrap_or_default();
            out.push((first, second));
        }
    }
    out
}

fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, files);
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p);
        }
    }
}

/// Edges `(from, to)` with the files that make them.
type Edges = BTreeMap<(String, String), BTreeSet<String>>;

/// The upward edges of the crate under `src` (`from -> to (in files)`),
/// and the modules without a rank.
fn upward_edges(
    src: &Path,
    ranks: &[(&str, u32)],
    extra: impl Fn(&str, &Path, &str) -> Vec<(String, String)>,
) -> (Edges, BTreeSet<String>) {
    let mut files = vec![];
    walk(src, &mut files);
    let mut edges = Edges::new();
    let mut unranked = BTreeSet::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        let mut found = uses(&text, "crate");
        found.extend(extra(&top, rel, &text));
        for (to, _) in found {
            if to == top || to.is_empty() {
                continue;
            }
            for m in [&top, &to] {
                if rank_in(ranks, m).is_none() {
                    unranked.insert(m.clone());
                }
            }
            let (Some(rf), Some(rt)) = (rank_in(ranks, &top), rank_in(ranks, &to)) else {
                continue;
            };
            if rf <= rt {
                edges
                    .entry((top.clone(), to))
                    .or_default()
                    .insert(rel.display().to_string());
            }
        }
    }
    (edges, unranked)
}

#[test]
fn layers_point_down_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (upward, unranked) = upward_edges(&src, RANKS, |top, _, text| {
        let mut v = vec![];
        if top == "main" {
            v.extend(uses(text, "cube_adapter"));
        }
        // The embedded crate by its own name counts as `embedded`, but
        // for its wire types, which sit below everything that speaks them.
        v.extend(uses(text, "cube_embedded").into_iter().map(|(m, _)| {
            let m = if m == "wire" { "wire" } else { "embedded" };
            (m.to_string(), String::new())
        }));
        v
    });
    assert!(
        unranked.is_empty(),
        "modules without a rank in RANKS: {unranked:?}"
    );
    let new: Vec<String> = upward
        .iter()
        .filter(|((f, t), _)| !KNOWN.contains(&(f.as_str(), t.as_str())))
        .map(|((f, t), w)| format!("{f} -> {t} (in {w:?})"))
        .collect();
    assert!(
        new.is_empty(),
        "a lower layer uses a higher one:\n  {}",
        new.join("\n  ")
    );
    let gone: Vec<_> = KNOWN
        .iter()
        .filter(|(f, t)| !upward.contains_key(&(f.to_string(), t.to_string())))
        .collect();
    assert!(
        gone.is_empty(),
        "these edges are cut: remove them from KNOWN: {gone:?}"
    );
}

/// The embedded crate: its modules point down only, and nothing in it
/// names the appliance (cargo would refuse a dependency on it; this keeps
/// a path in a comment or a string from pretending otherwise).
#[test]
fn the_embedded_crate_points_down_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/embedded/src");
    let (upward, unranked) = upward_edges(&src, EMBEDDED_RANKS, |_, rel, text| {
        // In a top-level file `super::` is the crate root (but in its
        // tests, the file's own module).
        if rel.components().count() == 1 {
            uses(text.split("#[cfg(test)]").next().unwrap_or(text), "super")
        } else {
            vec![]
        }
    });
    assert!(
        unranked.is_empty(),
        "modules without a rank in EMBEDDED_RANKS: {unranked:?}"
    );
    let up: Vec<String> = upward
        .iter()
        .map(|((f, t), w)| format!("{f} -> {t} (in {w:?})"))
        .collect();
    assert!(
        up.is_empty(),
        "a lower layer of the embedded crate uses a higher one:\n  {}",
        up.join("\n  ")
    );
    let mut files = vec![];
    walk(&src, &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(
            !text.contains("cube_adapter"),
            "{} names the appliance",
            f.display()
        );
    }
}

#[test]
fn the_parser_reads_grouped_and_nested_paths() {
    let text = "use crate::{a, b::c, d::{e, f}};\nfn x() { crate::g::h(); my_crate::z(); }";
    assert_eq!(
        uses(text, "crate"),
        [
            ("a".into(), String::new()),
            ("b".into(), "c".into()),
            ("d".into(), String::new()),
            ("g".into(), "h".into())
        ]
    );
}
