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
        /// A governed MCP tool called in a lease's sandbox.
        McpCall = "mcp_call",
        /// The governed MCP tools of a lease listed.
        McpTools = "mcp_tools",
        /// One step of a template preset applied at acquire.
        PresetStep = "preset_step",
        /// A request (or tunnel) the egress proxy made for a lease's
        /// sandbox, or refused.
        EgressRequest = "egress_request",
        /// An operator narrowed a live lease's egress destinations.
        EgressNarrow = "egress_narrow",
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
        // Session recordings.
        /// A chunk of a recording sealed: its digest in the chain.
        RecordingChunk = "recording_chunk",
        /// A recording closed: the digest of its whole file.
        RecordingSealed = "recording_sealed",
        /// A recording's file found changed under its sealed chunks (at a
        /// restart, before the appliance went on with it).
        RecordingDamaged = "recording_damaged",
        /// A recording replayed in the console.
        RecordingView = "recording_view",
        /// A recording's file downloaded.
        RecordingDownload = "recording_download",
        /// Retention removed a recording (`cleanup`: `age`, `lease_cap`,
        /// `total_cap`).
        RecordingDeleted = "recording_deleted",
        /// An operator set (`decision` `hold`) or lifted (`unhold`) a
        /// legal hold on a recording.
        RecordingHold = "recording_hold",
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
