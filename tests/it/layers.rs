//! Layers point down only: a module may use what is below it, never what is
//! above (design.md, "Rules learned from the first round").
//!
//! `cli → app → {api, mcp, admin, console} → broker → {audit, auth} → store`,
//! with `config`, `cube` and `embedded` between the store and the broker,
//! and `cube::wire` the only part of `cube` that `embedded` uses (the
//! embedded backend speaks the wire; it does not use our client).
//!
//! The test reads every `crate::…` path under `src/` (and `cube_adapter::…`
//! in `main.rs`), maps it to the top-level module it names, and checks each
//! edge against the ranks below. The edges still to be cut are listed in
//! `KNOWN`: the test fails when a new upward edge appears *and* when a known
//! one is gone, so the list only ever shrinks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Higher uses lower. Equal ranks may not use each other.
const RANKS: &[(&str, u32)] = &[
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

fn rank(m: &str) -> Option<u32> {
    RANKS.iter().find(|(n, _)| *n == m).map(|(_, r)| *r)
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

#[test]
fn layers_point_down_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    walk(&src, &mut files);
    let mut edges: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    let mut unranked = BTreeSet::new();
    let mut wire_only = vec![];
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
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
        if top == "main" {
            found.extend(uses(&text, "cube_adapter"));
        }
        for (to, second) in found {
            if to == top || to.is_empty() {
                continue;
            }
            if rank(&top).is_none() {
                unranked.insert(top.clone());
            }
            if rank(&to).is_none() {
                unranked.insert(to.clone());
            }
            if top == "embedded" && to == "cube" && second != "wire" {
                wire_only.push(format!("{} uses cube::{second}", rel.display()));
            }
            edges
                .entry((top.clone(), to))
                .or_default()
                .insert(rel.display().to_string());
        }
    }
    assert!(
        unranked.is_empty(),
        "modules without a rank in RANKS: {unranked:?}"
    );
    assert!(
        wire_only.is_empty(),
        "embedded uses cube beyond cube::wire: {wire_only:?}"
    );
    let mut upward = BTreeMap::new();
    for ((from, to), where_) in &edges {
        let (rf, rt) = (rank(from).unwrap(), rank(to).unwrap());
        if rf <= rt {
            upward.insert((from.as_str(), to.as_str()), where_);
        }
    }
    let new: Vec<String> = upward
        .iter()
        .filter(|(e, _)| !KNOWN.contains(e))
        .map(|((f, t), w)| format!("{f} -> {t} (in {w:?})"))
        .collect();
    assert!(
        new.is_empty(),
        "a lower layer uses a higher one:\n  {}",
        new.join("\n  ")
    );
    let gone: Vec<_> = KNOWN.iter().filter(|e| !upward.contains_key(*e)).collect();
    assert!(
        gone.is_empty(),
        "these edges are cut: remove them from KNOWN: {gone:?}"
    );
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
