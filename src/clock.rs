//! The clock adapter: wall-clock time, formatted the way records and
//! responses carry it (UTC, RFC 3339, second precision).

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339(t: OffsetDateTime) -> String {
    t.replace_nanosecond(0)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

/// Now, as text and as Unix seconds.
pub fn now() -> (String, i64) {
    let t = OffsetDateTime::now_utc();
    (rfc3339(t), t.unix_timestamp())
}

/// Unix seconds as `YYYY-MM-DDTHH:MM:SSZ` (empty if out of range).
pub fn format_unix(secs: i64) -> String {
    OffsetDateTime::from_unix_timestamp(secs)
        .map(rfc3339)
        .unwrap_or_default()
}
