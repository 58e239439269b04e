//! The service manager's notification protocol (`sd_notify`): `READY=1`
//! once the store is open and the listener is bound, `WATCHDOG=1` at half
//! the watchdog interval, `EXTEND_TIMEOUT_USEC=` during a long schema
//! upgrade (`store::audit_index::rebuild`), `STOPPING=1` at shutdown. Without
//! `$NOTIFY_SOCKET` (not under systemd, or not `Type=notify`) nothing is
//! sent.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// How long one notification may wait for room in the receiver's queue.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Send one notification; false when there is no socket or it failed.
pub fn notify(msg: &str) -> bool {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return false;
    };
    // A receiver whose queue is full (systemd busy, or a test that is not
    // reading) must not hold the service: give up after a moment.
    let _ = sock.set_write_timeout(Some(SEND_TIMEOUT));
    let bytes = path.as_encoded_bytes();
    let sent = match bytes.strip_prefix(b"@") {
        // An abstract socket (Linux).
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name)
                .and_then(|a| sock.send_to_addr(msg.as_bytes(), &a))
        }
        None => sock.send_to(msg.as_bytes(), &path),
    };
    sent.is_ok()
}

/// The watchdog interval systemd asked for, if it is ours.
fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Some(pid) = std::env::var("WATCHDOG_PID").ok()
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// Tell systemd the service is ready and keep its watchdog fed (from a
/// task on the runtime: a stuck runtime stops the pings and systemd
/// restarts the service).
pub fn ready(status: &str) {
    if !notify(&format!("READY=1\nSTATUS={status}")) {
        return;
    }
    if let Some(every) = watchdog_interval() {
        tokio::spawn(async move {
            let mut t = tokio::time::interval(every / 2);
            loop {
                t.tick().await;
                // Off the runtime's workers: a send may wait SEND_TIMEOUT.
                let _ = tokio::task::spawn_blocking(|| notify("WATCHDOG=1")).await;
            }
        });
    }
}
