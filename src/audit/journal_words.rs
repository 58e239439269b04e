//! The journal's words across releases (`store::vocab`): a journal the
//! previous release wrote reads, exports and verifies byte for byte, and
//! words of another release survive. Here rather than beside the
//! vocabulary because it runs `audit verify` (the store sits below the
//! journal).

use std::collections::BTreeSet;

use sha2::Digest;

use std::fmt;

use crate::store::event::{fits, unshaped};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::store::event::{Event, GENESIS};
use crate::store::vocab::{Action, Outcome, Phase, UnknownWord};
use crate::store::{Store, WriteOps};

/// A journal the previous release (08437a1, before these enums) wrote
/// and exported (`audit export`): leases, commands, files, jobs, PTYs,
/// checkpoints, a trusted task, identities, refusals, a timeout, a
/// crash recovered and one reconciled. Made by hand with that release's
/// binary; never rewritten.
const PREVIOUS: &str = include_str!("../../tests/fixtures/journal-08437a1.jsonl");

fn previous() -> Vec<(&'static str, Event)> {
    PREVIOUS
        .lines()
        .map(|l| (l, serde_json::from_str::<Event>(l).unwrap()))
        .collect()
}

/// The chain's links and hashes, checked event by event: the hash is
/// over the event's serialised bytes, so a word that serialised one
/// byte differently would break it.
fn check_chain(events: &[Event]) {
    let mut prev = GENESIS.to_string();
    for (i, ev) in events.iter().enumerate() {
        assert_eq!(ev.seq, i as u64 + 1);
        assert_eq!(ev.prev_hash, prev, "event {}: its link", ev.seq);
        assert_eq!(ev.compute_hash(), ev.hash, "event {}: its hash", ev.seq);
        prev = ev.hash.clone();
    }
}

/// The events in a new store, as their exported lines, and the
/// appliance's own check (`audit verify`) over them.
async fn verify_in_a_store(lines: Vec<String>) -> crate::audit::Verified {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store
        .write(move |txn, _| {
            for (i, l) in lines.iter().enumerate() {
                txn.insert_event(i as u64 + 1, l.as_bytes())?;
            }
            Ok(())
        })
        .await
        .unwrap();
    let v = crate::audit::verify(&store).unwrap();
    store.close().await;
    v
}

#[test]
fn the_previous_release_journal_reads_as_known_words_and_verifies() {
    let all = previous();
    assert_eq!(all.len(), 125);
    for (line, ev) in &all {
        assert!(ev.phase.is_known(), "{line}");
        assert!(ev.action.is_known(), "{line}");
        assert!(ev.outcome.is_known(), "{line}");
        // Exported exactly as that release exported it.
        assert_eq!(crate::audit::export_line(ev), *line);
    }
    let events: Vec<Event> = all.into_iter().map(|(_, e)| e).collect();
    check_chain(&events);
    // Every phase and outcome is in it, and many actions.
    let phases: BTreeSet<&str> = events.iter().map(|e| e.phase.as_str()).collect();
    assert_eq!(phases, Phase::WORDS.iter().copied().collect());
    let outcomes: BTreeSet<&str> = events.iter().map(|e| e.outcome.as_str()).collect();
    assert_eq!(outcomes, Outcome::WORDS.iter().copied().collect());
    let actions: BTreeSet<&str> = events.iter().map(|e| e.action.as_str()).collect();
    assert!(actions.len() >= 40, "{actions:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_release_journal_passes_audit_verify() {
    let all = previous();
    let head = all.last().map(|(_, e)| e.hash.clone()).unwrap();
    let v = verify_in_a_store(all.iter().map(|(l, _)| l.to_string()).collect()).await;
    assert_eq!((v.events, v.last_seq, v.head), (125, 125, head));
}

/// A word of another release (here a future one's action, phase and
/// outcome) reads as `Unknown`, serialises to the same bytes as the
/// string did, and so hashes as that release hashed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn words_of_another_release_read_serialise_and_verify_as_they_were() {
    let all = previous();
    let k = all
        .iter()
        .position(|(_, e)| e.action == Action::Exec && e.outcome == Outcome::Ok)
        .unwrap();
    let (line, known) = &all[k];
    let edit = |s: &str| {
        s.replace("\"action\":\"exec\"", "\"action\":\"exec_detached\"")
            .replace("\"outcome\":\"ok\"", "\"outcome\":\"partial\"")
            .replace("\"phase\":\"outcome\"", "\"phase\":\"after\\\"math\"")
    };
    let edited = edit(line);
    assert_ne!(edited, *line);
    let ev: Event = serde_json::from_str(&edited).unwrap();
    assert_eq!(ev.action, Action::Unknown("exec_detached".into()));
    assert_eq!(ev.outcome, Outcome::Unknown("partial".into()));
    assert_eq!(ev.phase, Phase::Unknown("after\"math".into()));
    assert!(!ev.action.is_known());
    assert_eq!(crate::audit::export_line(&ev), edited);
    // The bytes hashed are the known event's with the words changed,
    // hashed here without the enums: what a release that knew these
    // words as strings computes.
    let mut body = known.clone();
    body.hash = String::new();
    let body = edit(&serde_json::to_string(&body).unwrap());
    let mut h = sha2::Sha256::new();
    h.update(known.prev_hash.as_bytes());
    h.update(b"\n");
    h.update(body.as_bytes());
    assert_eq!(ev.compute_hash(), hex::encode(h.finalize()));
    // The journal linked again from the edited event on verifies.
    let mut events: Vec<Event> = all.iter().map(|(_, e)| e.clone()).collect();
    events[k] = ev;
    for i in k..events.len() {
        if i > k {
            events[i].prev_hash = events[i - 1].hash.clone();
        }
        events[i].hash = events[i].compute_hash();
    }
    check_chain(&events);
    let head = events.last().map(|e| e.hash.clone()).unwrap();
    let lines = events.iter().map(crate::audit::export_line).collect();
    let v = verify_in_a_store(lines).await;
    assert_eq!((v.events, v.head), (125, head));
}

fn check_vocabulary<T>(all: &[T], words: &[&str])
where
    T: Clone
        + fmt::Debug
        + fmt::Display
        + PartialEq
        + FromStr<Err = UnknownWord>
        + Serialize
        + for<'de> Deserialize<'de>,
{
    assert_eq!(all.len(), words.len());
    let distinct: BTreeSet<&&str> = words.iter().collect();
    assert_eq!(distinct.len(), words.len(), "a word twice");
    for (v, w) in all.iter().zip(words) {
        assert!(fits(w), "{w}");
        assert_eq!(v.to_string(), *w);
        assert_eq!(w.parse::<T>().as_ref(), Ok(v));
        let json = serde_json::to_string(v).unwrap();
        assert_eq!(json, serde_json::to_string(w).unwrap());
        assert_eq!(serde_json::from_str::<T>(&json).unwrap(), *v);
    }
    assert!("no_such_word".parse::<T>().is_err());
    // Any string reads, and writes back as it was.
    for json in ["\"no_such_word\"", "\"\\u00e9t\\u00e9\"", "\"a\\nb\""] {
        let v: T = serde_json::from_str(json).unwrap();
        let back: String = serde_json::from_str(json).unwrap();
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            serde_json::to_string(&back).unwrap()
        );
    }
    assert!(serde_json::from_str::<T>("7").is_err());
}

#[test]
fn every_word_is_one_variant_and_reads_back() {
    check_vocabulary(Phase::ALL, Phase::WORDS);
    check_vocabulary(Outcome::ALL, Outcome::WORDS);
    check_vocabulary(Action::ALL, Action::WORDS);
    assert_eq!(Phase::default(), Phase::Blank);
    assert_eq!(Outcome::default(), Outcome::Pending);
    assert_eq!(Action::default().as_str(), "");
}

#[test]
fn an_unknown_word_too_long_is_bounded_as_any_field() {
    let long = "w".repeat(crate::store::event::FIELD_MAX + 1);
    let mut a: Action = serde_json::from_value(long.clone().into()).unwrap();
    a.bound();
    assert_eq!(a, Action::Unknown(unshaped(&long).into()));
    let mut known = Action::Exec;
    known.bound();
    assert_eq!(known, Action::Exec);
}
