//! The words of the audit journal: an event's `phase`, `action` and
//! `outcome`. Each is an enum that serialises to the plain string the
//! journal has always held, so an event hashes to the same bytes as before.
//!
//! Each enum also has `Unknown`: a word this release does not know, read
//! from a journal another release wrote. It keeps the word as it was, so
//! that event still reads, serialises and verifies byte for byte. The code
//! never makes one (but for `Action::default()`, the empty word of an event
//! not yet given its action); reading never fails on a word.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::event::{fits, unshaped};

/// A word that is not in a vocabulary (what [`FromStr`] refuses).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{vocabulary} has no word {word:?}")]
pub struct UnknownWord {
    pub vocabulary: &'static str,
    pub word: String,
}

/// Declares one vocabulary: its variants and their words, `Unknown` for a
/// word of another release, and the string forms (`as_str`, `Display`,
/// `FromStr`, serde as the plain string).
macro_rules! vocabulary {
    (
        $(#[$meta:meta])*
        $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $word:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )*
            /// A word this release does not know, as another release wrote
            /// it. Only reading a journal makes one.
            Unknown(Box<str>),
        }

        impl $name {
            /// Every known word's variant, in the order declared.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            /// Every known word, in the order declared.
            pub const WORDS: &'static [&'static str] = &[$($word,)*];

            /// The word as the journal holds it.
            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$variant => $word,)*
                    $name::Unknown(w) => w,
                }
            }

            /// The known variant with this word, if there is one.
            pub fn known(word: &str) -> Option<Self> {
                match word {
                    $($word => Some($name::$variant),)*
                    _ => None,
                }
            }

            /// Whether this release knows the word.
            pub fn is_known(&self) -> bool {
                !matches!(self, $name::Unknown(_))
            }

            /// The word as an event keeps it: an unknown word that does not
            /// [`fits`] becomes its [`unshaped`] form (`Event::bound`).
            /// Every known word fits.
            pub(crate) fn bound(&mut self) {
                if let $name::Unknown(w) = self
                    && !fits(w)
                {
                    *w = unshaped(w).into();
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        /// Only a known word parses: a word from outside (a query, a
        /// command line) is checked against this release's vocabulary.
        impl FromStr for $name {
            type Err = UnknownWord;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::known(s).ok_or_else(|| UnknownWord {
                    vocabulary: stringify!($name),
                    word: s.to_string(),
                })
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        /// Any string reads: a word this release does not know becomes
        /// `Unknown`, kept as it was.
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Word;
                impl serde::de::Visitor<'_> for Word {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a string")
                    }
                    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<$name, E> {
                        Ok($name::known(v).unwrap_or_else(|| $name::Unknown(v.into())))
                    }
                }
                d.deserialize_str(Word)
            }
        }
    };
}

vocabulary! {
    /// Where an event stands in its operation.
    #[derive(Default)]
    Phase {
        /// Recorded before an effect, with outcome `pending`.
        Intent = "intent",
        /// The intent's result, with the intent's `operation_id`.
        Outcome = "outcome",
        /// A single-step record: a rejection, a read, a change done in one
        /// transaction.
        Event = "event",
        /// No phase: how the task events appended with the change they
        /// record (not through `Journal::record`, which names a blank
        /// phase `event`) have always been written: `task_plan`,
        /// `task_approve`, `task_deny`, `task_submit`, `task_finalize`,
        /// `task_cancel`. Single steps too. The default.
        #[default]
        Blank = "",
    }
}

vocabulary! {
    /// How an operation ended. The order is the console's filter choices.
    #[derive(Default)]
    Outcome {
        /// It happened.
        Ok = "ok",
        /// A known refusal: it did not happen.
        Rejected = "rejected",
        /// It failed.
        Error = "error",
        /// It may or may not have happened (a timeout, an unrecorded
        /// outcome, a crash between intent and outcome).
        Uncertain = "uncertain",
        /// An intent, waiting for its outcome. The default: every event
        /// is given its outcome before it is appended.
        #[default]
        Pending = "pending",
        /// An intent an operator resolved (`audit reconcile`).
        Reconciled = "reconciled",
    }
}

vocabulary! {
    /// What was done. The API's, the console's, the operator's and the
    /// appliance's own actions.
    Action {
        // Leases.
        Acquire = "acquire",
        LeaseList = "lease_list",
        Status = "status",
        Renew = "renew",
        Release = "release",
        LeaseRecover = "lease_recover",
        Profiles = "profiles",
        /// The appliance setting a sandbox's idle timeout back (or shorter,
        /// for a keepalive).
        Keepalive = "keepalive",
        // Commands and files in a lease's sandbox.
        Exec = "exec",
        Read = "read",
        Write = "write",
        List = "list",
        Stat = "stat",
        Mkdir = "mkdir",
        Remove = "remove",
        Move = "move",
        ArtifactUpload = "artifact_upload",
        ArtifactDownload = "artifact_download",
        // Checkpoints.
        CheckpointList = "checkpoint_list",
        CheckpointCreate = "checkpoint_create",
        CheckpointRollback = "checkpoint_rollback",
        CheckpointDelete = "checkpoint_delete",
        CheckpointFork = "checkpoint_fork",
        // Jobs.
        JobStart = "job_start",
        JobStatus = "job_status",
        JobOutput = "job_output",
        JobCancel = "job_cancel",
        JobEvents = "job_events",
        JobRecover = "job_recover",
        // PTYs.
        PtyCreate = "pty_create",
        PtyStatus = "pty_status",
        PtyInput = "pty_input",
        PtyResize = "pty_resize",
        PtyKill = "pty_kill",
        PtyEvents = "pty_events",
        PtyOutput = "pty_output",
        // Trusted tasks.
        TaskTemplates = "task_templates",
        TaskPlan = "task_plan",
        TaskPlanList = "task_plan_list",
        TaskPlanReview = "task_plan_review",
        TaskApprove = "task_approve",
        TaskDeny = "task_deny",
        TaskSubmit = "task_submit",
        TaskStarted = "task_started",
        TaskSetup = "task_setup",
        TaskState = "task_state",
        TaskStatus = "task_status",
        TaskList = "task_list",
        TaskResult = "task_result",
        TaskFinalize = "task_finalize",
        TaskCancel = "task_cancel",
        TaskReceipt = "task_receipt",
        TaskPlanExpired = "task_plan_expired",
        TaskPlanPruned = "task_plan_pruned",
        // Identities (the admin socket and the console).
        TokenCreate = "token_create",
        TokenRevoke = "token_revoke",
        CertIdentityCreate = "cert_identity_create",
        UserAdd = "user_add",
        UserPasswd = "user_passwd",
        UserDisable = "user_disable",
        UserEnable = "user_enable",
        UserRemove = "user_remove",
        // The console and sign-in.
        ConsoleSignIn = "console_sign_in",
        ConsoleSignOut = "console_sign_out",
        SignInThrottled = "sign_in_throttled",
        AuditSearch = "audit_search",
        AuditExport = "audit_export",
        McpSessionEvicted = "mcp_session_evicted",
        // Upkeep and recovery.
        AdminGc = "admin_gc",
        GcRelease = "gc_release",
        OrphanKill = "orphan_kill",
        AuditRecover = "audit_recover",
        AuditReconcile = "audit_reconcile",
    }
}

/// The empty word, which no action has: an event not yet given its action
/// (`Event::default()`). Every event the appliance records gets one from
/// `Journal::event`.
impl Default for Action {
    fn default() -> Self {
        Action::Unknown(Box::default())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use sha2::Digest;

    use super::*;
    use crate::store::event::{Event, GENESIS};
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
}
