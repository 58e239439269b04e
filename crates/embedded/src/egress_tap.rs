//! The egress tap: how the appliance's egress proxy is reached from inside
//! a sandbox, and only from there.
//!
//! The sandbox's agent (in the sandbox's own network namespace) listens on
//! `127.0.0.1:EGRESS_PROXY_PORT` there, bound before anything of the
//! sandbox runs. The launcher binds a unix socket, `run/egress.sock` in the
//! sandbox's directory (mode 0600, in the backend's private state
//! directory: the sandbox cannot see it), and hands it to the agent too.
//! The appliance connects to that socket (`attach`); the agent passes it
//! every TCP connection accepted on the port, as a descriptor
//! (`SCM_RIGHTS`, one byte `b'c'` per descriptor), and closes its own copy.
//! The newest attachment replaces an older one. A connection accepted while
//! nothing is attached (an appliance restarting) waits up to `HOLD` for
//! one, then is closed.
//!
//! Nothing listens on the host's loopback: the port is in the sandbox's
//! network namespace, and the descriptors cross only the unix socket. A
//! sandbox without a network namespace of its own (`isolation = "none"`)
//! has no tap. The listener lives in the agent: a backend that restarts
//! re-adopts its sandboxes and the appliance attaches again.
//!
//! The sandbox is untrusted: `attach` checks that what it receives is a
//! connected TCP socket, and closes anything else.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, SockaddrStorage, getpeername, getsockname,
    getsockopt, recvmsg, sendmsg, sockopt,
};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::wire::EGRESS_PROXY_PORT;

/// In a sandbox's directory: the unix socket the appliance attaches to.
pub const SOCKET: &str = "run/egress.sock";
/// Its name in the run directory.
pub const SOCKET_NAME: &str = "egress.sock";

/// How long a connection accepted with nothing attached waits for an
/// attachment before it is closed.
pub const HOLD: Duration = Duration::from_secs(10);

/// At most this many connections wait for an attachment; past it the agent
/// accepts no more (they wait in the kernel's backlog) until some leave.
const MAX_HELD: usize = 256;

/// The one byte sent with each descriptor.
const PAYLOAD: &[u8] = b"c";

/// The most descriptors one message can carry (`SCM_MAX_FD`): room for
/// them all, so that no control message is ever truncated (the kernel
/// would install the ones that fit, and nix would not say which).
const SCM_MAX_FD: usize = 253;

/// How many received connections wait for the appliance to take them.
const CHANNEL: usize = 64;

/// The egress socket of sandbox `sandbox_id` of the embedded backend whose
/// state directory is `state_dir`: what `attach` connects to.
pub fn egress_socket(state_dir: &Path, sandbox_id: &str) -> PathBuf {
    state_dir.join("sandboxes").join(sandbox_id).join(SOCKET)
}

/// Attach to a sandbox's egress tap (`egress_socket`): every connection a
/// process of the sandbox makes to `127.0.0.1:EGRESS_PROXY_PORT` arrives
/// on the channel, in order. The channel closes when the sandbox closes the
/// socket (it ended, or another attachment replaced this one); dropping the
/// receiver detaches.
pub async fn attach(socket: &Path) -> std::io::Result<mpsc::Receiver<TcpStream>> {
    let stream = connect(socket).await?;
    let (tx, rx) = mpsc::channel(CHANNEL);
    tokio::spawn(receive(stream, tx));
    Ok(rx)
}

/// Connect through an `O_PATH` descriptor of the socket's directory:
/// socket paths are limited to 108 bytes, state directories are not.
async fn connect(socket: &Path) -> std::io::Result<UnixStream> {
    use nix::fcntl::{OFlag, open};
    let not_a_socket =
        || std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a socket path");
    let dir = socket.parent().ok_or_else(not_a_socket)?;
    let name = socket.file_name().ok_or_else(not_a_socket)?;
    let fd = open(
        dir,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    let short = in_dir(&fd, name);
    let stream = UnixStream::connect(short).await;
    drop(fd);
    stream
}

/// `/proc/self/fd/N/NAME` for a descriptor `dir` of a directory.
pub(crate) fn in_dir(dir: &OwnedFd, name: &std::ffi::OsStr) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
}

/// The appliance's side: receive descriptors until the sandbox closes the
/// socket or the receiver is dropped.
async fn receive(stream: UnixStream, tx: mpsc::Sender<TcpStream>) {
    loop {
        tokio::select! {
            () = tx.closed() => return,
            r = stream.readable() => if r.is_err() { return },
        }
        let got = stream.try_io(Interest::READABLE, || recv_fds(stream.as_raw_fd()));
        let fds = match got {
            Ok(Some(fds)) => fds,
            Ok(None) => return,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::debug!(error = %e, "egress tap: receive failed");
                return;
            }
        };
        for fd in fds {
            match tcp_stream(fd) {
                Ok(tcp) => {
                    if tx.send(tcp).await.is_err() {
                        return;
                    }
                }
                Err(why) => {
                    // Only a sandbox whose agent was replaced sends anything
                    // else: one warning, and no more from it.
                    tracing::warn!("egress tap: a sandbox sent {why}; detached from it");
                    return;
                }
            }
        }
    }
}

/// One `recvmsg`: the descriptors it carried (owned at once), or None at
/// the end of the stream.
fn recv_fds(sock: RawFd) -> std::io::Result<Option<Vec<OwnedFd>>> {
    let mut buf = [0u8; 64];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
    let msg = recvmsg::<()>(
        sock,
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )?;
    let mut fds = vec![];
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            fds.extend(raw.into_iter().map(crate::sys::own_received_fd));
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        // More than the agent ever sends: what came is closed (dropped).
        return Err(std::io::Error::other("truncated control data"));
    }
    // A stream's descriptors come with at least one byte.
    Ok((msg.bytes > 0 || !fds.is_empty()).then_some(fds))
}

/// What a sandbox sent, if it is a connected TCP socket; else what it is.
fn tcp_stream(fd: OwnedFd) -> Result<TcpStream, &'static str> {
    use nix::sys::socket::{AddressFamily, SockType, SockaddrLike};
    use nix::sys::stat::{SFlag, fstat};
    let st = fstat(&fd).map_err(|_| "an unreadable descriptor")?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
        return Err("a descriptor that is not a socket");
    }
    if getsockopt(&fd, sockopt::SockType) != Ok(SockType::Stream)
        || crate::sys::socket_protocol(fd.as_fd()).ok() != Some(libc::IPPROTO_TCP)
    {
        return Err("a socket that is not a TCP stream");
    }
    let family = getsockname::<SockaddrStorage>(fd.as_raw_fd())
        .ok()
        .and_then(|a| a.family());
    if !matches!(family, Some(AddressFamily::Inet | AddressFamily::Inet6)) {
        return Err("a socket that is not an internet one");
    }
    if getpeername::<SockaddrStorage>(fd.as_raw_fd()).is_err() {
        return Err("a TCP socket that is not connected");
    }
    let s = std::net::TcpStream::from(fd);
    s.set_nonblocking(true)
        .map_err(|_| "a socket that cannot be made non-blocking")?;
    TcpStream::from_std(s).map_err(|_| "a socket the runtime cannot take")
}

/// The sandbox's side, made by the launcher and the agent before anything
/// of the sandbox runs: the unix listener the appliance attaches to, and
/// the TCP listener on `127.0.0.1:EGRESS_PROXY_PORT` of the sandbox's
/// network namespace.
pub(crate) struct Tap {
    host: std::os::unix::net::UnixListener,
    sandbox: std::net::TcpListener,
}

impl Tap {
    /// Bind the port in the current network namespace (the agent's, which
    /// must be the sandbox's own).
    pub(crate) fn bind(host: std::os::unix::net::UnixListener) -> std::io::Result<Self> {
        let sandbox = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, EGRESS_PROXY_PORT))?;
        Ok(Self { host, sandbox })
    }

    /// Serve the tap for the agent's life (in its runtime).
    pub(crate) async fn serve(self) -> std::io::Result<()> {
        self.host.set_nonblocking(true)?;
        self.sandbox.set_nonblocking(true)?;
        let host = UnixListener::from_std(self.host)?;
        let sandbox = TcpListener::from_std(self.sandbox)?;
        serve(host, sandbox, HOLD).await;
        Ok(())
    }
}

/// A connection waiting to be passed on, until `until`.
struct Held {
    fd: OwnedFd,
    until: Instant,
}

/// Pass the connections accepted on `sandbox` to the newest peer accepted
/// on `host`, each held at most `hold` while none is attached.
async fn serve(host: UnixListener, sandbox: TcpListener, hold: Duration) {
    let mut peer: Option<UnixStream> = None;
    let mut held: VecDeque<Held> = VecDeque::new();
    loop {
        let now = Instant::now();
        while held.front().is_some_and(|h| h.until <= now) {
            held.pop_front();
        }
        let expiry = held.front().map(|h| h.until);
        tokio::select! {
            r = host.accept() => match r {
                Ok((s, _)) => peer = Some(s),
                Err(_) => backoff().await,
            },
            r = sandbox.accept(), if held.len() < MAX_HELD => match r.and_then(|(s, _)| s.into_std()) {
                // Timed from now: the loop may have waited long since `now`.
                Ok(s) => held.push_back(Held { fd: s.into(), until: Instant::now() + hold }),
                Err(_) => backoff().await,
            },
            r = ready(peer.as_ref(), Interest::WRITABLE), if !held.is_empty() => {
                if r.is_err() || !pass_on(peer.as_ref(), &mut held) {
                    peer = None;
                }
            }
            r = ready(peer.as_ref(), Interest::READABLE) => {
                if r.is_err() || !still_there(peer.as_ref()) {
                    peer = None;
                }
            }
            () = sleep_until(expiry) => {}
        }
    }
}

/// After a failed accept (out of descriptors, say): wait a little rather
/// than fail again at once.
async fn backoff() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Wait until the attached peer is ready for `interest`; never without one.
async fn ready(peer: Option<&UnixStream>, interest: Interest) -> std::io::Result<()> {
    match peer {
        Some(p) => p.ready(interest).await.map(|_| ()),
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Send the held connections, oldest first, while the socket takes them;
/// false when the peer is gone (the rest stay held for the next one).
fn pass_on(peer: Option<&UnixStream>, held: &mut VecDeque<Held>) -> bool {
    let Some(p) = peer else { return false };
    while let Some(h) = held.front() {
        match p.try_io(Interest::WRITABLE, || send_fd(p.as_raw_fd(), &h.fd)) {
            // Our copy closes as it is dropped.
            Ok(()) => drop(held.pop_front()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(_) => return false,
        }
    }
    true
}

fn send_fd(sock: RawFd, fd: &OwnedFd) -> std::io::Result<()> {
    let fds = [fd.as_raw_fd()];
    sendmsg::<()>(
        sock,
        &[IoSlice::new(PAYLOAD)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
        None,
    )?;
    Ok(())
}

/// The peer never writes: readable means it closed (or wrote anyway,
/// which is read and ignored). False when it is gone.
fn still_there(peer: Option<&UnixStream>) -> bool {
    let Some(p) = peer else { return false };
    let mut buf = [0u8; 64];
    match p.try_read(&mut buf) {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A tap served on a listener of the test's (any port of the host's
    /// loopback: the agent's own is fixed, in its namespace).
    async fn tap(dir: &Path) -> (PathBuf, std::net::SocketAddr) {
        tap_holding(dir, HOLD).await
    }

    async fn tap_holding(dir: &Path, hold: Duration) -> (PathBuf, std::net::SocketAddr) {
        let path = dir.join("egress.sock");
        let host = UnixListener::bind(&path).unwrap();
        let sandbox = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = sandbox.local_addr().unwrap();
        tokio::spawn(serve(host, sandbox, hold));
        (path, addr)
    }

    async fn echo_through(rx: &mut mpsc::Receiver<TcpStream>, addr: std::net::SocketAddr) {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"ping\n").await.unwrap();
        let mut s = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping\n");
        s.write_all(b"pong\n").await.unwrap();
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong\n");
    }

    #[tokio::test]
    async fn egress_tap_passes_connections_and_the_newest_attachment_wins() {
        let dir = tempfile::tempdir().unwrap();
        let (path, addr) = tap(dir.path()).await;
        let mut first = attach(&path).await.unwrap();
        echo_through(&mut first, addr).await;
        let mut second = attach(&path).await.unwrap();
        // The first attachment is closed once the tap takes the second.
        let end = tokio::time::timeout(Duration::from_secs(10), first.recv()).await;
        assert!(end.unwrap().is_none());
        echo_through(&mut second, addr).await;
    }

    #[tokio::test]
    async fn egress_tap_holds_a_connection_until_an_appliance_attaches() {
        let dir = tempfile::tempdir().unwrap();
        let (path, addr) = tap(dir.path()).await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"held\n").await.unwrap();
        let mut third = attach(&path).await.unwrap();
        let mut s = tokio::time::timeout(Duration::from_secs(10), third.recv())
            .await
            .unwrap()
            .unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"held\n");
        s.write_all(b"seen\n").await.unwrap();
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"seen\n");
    }

    #[tokio::test]
    async fn egress_tap_closes_a_connection_nobody_attached_for() {
        let dir = tempfile::tempdir().unwrap();
        let (_path, addr) = tap_holding(dir.path(), Duration::from_millis(50)).await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
            .await
            .unwrap();
        assert_eq!(n.unwrap(), 0, "closed by the tap");
    }

    #[tokio::test]
    async fn egress_tap_attach_passes_connected_tcp_and_detaches_at_anything_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("egress.sock");
        let host = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut rx = attach(&path).await.unwrap();
        let (peer, _) = host.accept().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let listening = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(listening.local_addr().unwrap()).unwrap();
        let fds = [
            c.as_raw_fd(),
            file.as_raw_fd(),
            a.as_raw_fd(),
            listening.as_raw_fd(),
            udp.as_raw_fd(),
        ];
        sendmsg::<()>(
            peer.as_raw_fd(),
            &[IoSlice::new(PAYLOAD)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        drop(peer);
        let got = rx.recv().await.unwrap();
        assert_eq!(got.local_addr().unwrap(), c.local_addr().unwrap());
        assert!(
            rx.recv().await.is_none(),
            "only the connected TCP stream, then detached"
        );
    }

    #[test]
    fn egress_socket_is_in_the_sandboxs_run_directory() {
        assert_eq!(
            egress_socket(Path::new("/s/embedded"), "abc"),
            Path::new("/s/embedded/sandboxes/abc/run/egress.sock")
        );
    }
}
