//! argon2 checks (people's passwords, and bearer tokens issued before
//! schema 4 until their first use) and the hashing of new passwords set in
//! the console, on one dedicated thread that reuses one memory block.
//!
//! An argon2id check with the default parameters fills 19 MiB. Run on the
//! blocking pool, every check allocated its own block on whichever thread
//! took it, and each thread's allocator arena kept it: memory grew with the
//! number of attempts. Here the thread owns a block, made and filled once at
//! start (so the process's footprint does not change at the first sign-in),
//! and every check fills it again; it grows only for a stored hash with a
//! larger memory cost, and never with the number of attempts. Checks queue
//! on a bounded channel; a full queue is refused (`Throttled`).

use argon2::password_hash::PasswordHash;
use argon2::{Algorithm, Argon2, Block, Params, Version};
use base64::Engine;
use subtle::ConstantTimeEq;

use super::AuthError;

/// One piece of work for the argon2 thread; the answer goes back on
/// `reply`.
enum Job {
    /// Whether `secret` matches a PHC string (`None`: the dummy, same
    /// cost, never a match).
    Check {
        phc: Option<String>,
        secret: Vec<u8>,
        reply: tokio::sync::oneshot::Sender<bool>,
    },
    /// A new PHC string for `secret` (default parameters, random salt).
    Hash {
        secret: Vec<u8>,
        reply: tokio::sync::oneshot::Sender<Option<String>>,
    },
}

/// The argon2 thread and its queue. The thread ends when the pool is
/// dropped (the channel closes).
pub(crate) struct Pool {
    tx: std::sync::mpsc::SyncSender<Job>,
}

impl Pool {
    /// Start the thread, with room for `queue` waiting checks.
    /// (A thread that cannot be started leaves a closed queue: every
    /// check is then `Unavailable`.)
    pub(crate) fn start(queue: usize) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(queue.max(1));
        let started = std::thread::Builder::new()
            .name("argon2".into())
            .spawn(move || {
                let dummy = dummy_phc();
                let mut blocks: Vec<Block> = Vec::new();
                // Made and filled now: the block is part of the resting
                // footprint, not of the first sign-in's.
                let _ = check(&mut blocks, &dummy, b"warm-up");
                while let Ok(job) = rx.recv() {
                    match job {
                        Job::Check { phc, secret, reply } => {
                            let ok = match &phc {
                                Some(phc) => check(&mut blocks, phc, &secret),
                                None => {
                                    let _ = check(&mut blocks, &dummy, &secret);
                                    false
                                }
                            };
                            let _ = reply.send(ok);
                        }
                        Job::Hash { secret, reply } => {
                            let _ = reply.send(hash(&mut blocks, &secret));
                        }
                    }
                }
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start the argon2 thread: password checks fail");
        }
        Self { tx }
    }

    /// Whether `secret` matches `phc` (`None`: no record, the same cost and
    /// `false`). `Throttled` when the queue is full.
    pub(crate) async fn verify(
        &self,
        phc: Option<String>,
        secret: &[u8],
    ) -> Result<bool, AuthError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Job::Check {
            phc,
            secret: secret.to_vec(),
            reply,
        })?;
        answer.await.map_err(|_| AuthError::Unavailable)
    }

    /// A PHC string for `secret` (argon2id, default parameters, a random
    /// salt), made on the argon2 thread. `Throttled` when the queue is full.
    pub(crate) async fn hash(&self, secret: &[u8]) -> Result<String, AuthError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Job::Hash {
            secret: secret.to_vec(),
            reply,
        })?;
        answer.await.ok().flatten().ok_or(AuthError::Unavailable)
    }

    fn send(&self, job: Job) -> Result<(), AuthError> {
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::TrySendError::Full(_)) => Err(AuthError::Throttled(1)),
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => Err(AuthError::Unavailable),
        }
    }
}

/// A PHC string with the default parameters, a random salt and a random
/// hash: checking against it costs what a real check costs, and nothing
/// matches it.
fn dummy_phc() -> String {
    phc(&rand::random(), &rand::random())
}

/// The PHC string of an argon2id hash with the default parameters.
fn phc(salt: &[u8; 16], hash: &[u8; 32]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD_NO_PAD;
    let p = Params::default();
    format!(
        "$argon2id$v=19$m={},t={},p={}${}${}",
        p.m_cost(),
        p.t_cost(),
        p.p_cost(),
        b64.encode(salt),
        b64.encode(hash)
    )
}

/// A new hash of `secret` (argon2id, default parameters, a random salt)
/// filling `blocks` (grown to the default cost if short; never shrunk).
fn hash(blocks: &mut Vec<Block>, secret: &[u8]) -> Option<String> {
    let params = Params::default();
    let need = params.block_count();
    if blocks.len() < need {
        blocks.resize(need, Block::default());
    }
    let memory = blocks.get_mut(..need)?;
    let salt: [u8; 16] = rand::random();
    let mut out = [0u8; 32];
    Argon2::new(Algorithm::Argon2id, Version::V0x13, params)
        .hash_password_into_with_memory(secret, &salt, &mut out, memory)
        .ok()?;
    Some(phc(&salt, &out))
}

/// Whether `secret` matches the PHC string `phc`, filling `blocks` (grown
/// to the hash's memory cost if it is short; never shrunk).
fn check(blocks: &mut Vec<Block>, phc: &str, secret: &[u8]) -> bool {
    let Ok(h) = PasswordHash::new(phc) else {
        return false;
    };
    let (Ok(alg), Ok(params)) = (Algorithm::try_from(h.algorithm), Params::try_from(&h)) else {
        return false;
    };
    let version = h
        .version
        .map(Version::try_from)
        .transpose()
        .ok()
        .flatten()
        .unwrap_or_default();
    let (Some(salt), Some(expected)) = (h.salt, h.hash) else {
        return false;
    };
    let mut salt_buf = [0u8; 64];
    let Ok(salt) = salt.decode_b64(&mut salt_buf) else {
        return false;
    };
    let need = params.block_count();
    if blocks.len() < need {
        blocks.resize(need, Block::default());
    }
    let Some(memory) = blocks.get_mut(..need) else {
        return false;
    };
    let mut out = vec![0u8; expected.len()];
    Argon2::new(alg, version, params)
        .hash_password_into_with_memory(secret, salt, &mut out, memory)
        .is_ok()
        && bool::from(out.as_slice().ct_eq(expected.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use argon2::password_hash::{PasswordHasher, PasswordVerifier, SaltString};

    #[test]
    fn matches_what_argon2_made_and_nothing_else() {
        let salt = SaltString::encode_b64(b"0123456789abcdef").unwrap();
        let phc = Argon2::default()
            .hash_password(b"correct horse", &salt)
            .unwrap()
            .to_string();
        let mut blocks = vec![];
        assert!(check(&mut blocks, &phc, b"correct horse"));
        assert!(!check(&mut blocks, &phc, b"correct horsf"));
        assert_eq!(blocks.len(), Params::default().block_count());
        // Other parameters (smaller here): the same block, not a new one.
        let small = Argon2::new(
            Algorithm::Argon2id,
            Version::V0x13,
            Params::new(8 * 1024, 1, 1, None).unwrap(),
        )
        .hash_password(b"other", &salt)
        .unwrap()
        .to_string();
        assert!(check(&mut blocks, &small, b"other"));
        assert_eq!(blocks.len(), Params::default().block_count());
        assert!(!check(&mut blocks, &dummy_phc(), b"anything"));
        assert!(!check(&mut blocks, "not a hash", b"x"));
    }

    #[tokio::test]
    async fn pool_answers() {
        let pool = Pool::start(1);
        let salt = SaltString::encode_b64(b"0123456789abcdef").unwrap();
        let phc = Argon2::default()
            .hash_password(b"pw", &salt)
            .unwrap()
            .to_string();
        assert_eq!(pool.verify(Some(phc.clone()), b"pw").await, Ok(true));
        assert_eq!(pool.verify(Some(phc), b"nope").await, Ok(false));
        assert_eq!(pool.verify(None, b"pw").await, Ok(false));
        // A hash made on the thread: a PHC string argon2 itself accepts,
        // a fresh salt each time.
        let made = pool.hash(b"new password").await.unwrap();
        let parsed = PasswordHash::new(&made).unwrap();
        assert!(
            Argon2::default()
                .verify_password(b"new password", &parsed)
                .is_ok()
        );
        assert!(
            Argon2::default()
                .verify_password(b"other password", &parsed)
                .is_err()
        );
        assert_ne!(made, pool.hash(b"new password").await.unwrap());
        assert_eq!(pool.verify(Some(made), b"new password").await, Ok(true));
    }
}
