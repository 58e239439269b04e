//! The wall clock and random ids, the only ones this crate reads (the
//! appliance's `clock` and `ids` hold its own; a backend's sandboxes live
//! on the host's real time).

use time::OffsetDateTime;

/// The real wall clock.
#[allow(clippy::disallowed_methods)]
pub fn system_now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

/// The real wall clock as a `SystemTime` (file times).
#[allow(clippy::disallowed_methods)]
pub fn system_time() -> std::time::SystemTime {
    std::time::SystemTime::now()
}

/// `bytes` random bytes as lowercase hex (`2 × bytes` characters).
pub fn random_hex(bytes: usize) -> String {
    hex::encode(
        (0..bytes)
            .map(|_| rand::random::<u8>())
            .collect::<Vec<u8>>(),
    )
}
