//! `World`: a network the test makes itself, for sandboxes to reach: a
//! network namespace joined to the host's by a veth pair, with TCP servers
//! and a DNS server of the test's own in it. Nothing leaves the machine:
//! the addresses are routed to the veth only (root needed, like `ip netns`).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

pub struct World {
    /// The netns's name (`ip netns`) and the host end of the veth.
    name: String,
    host_if: String,
    /// The host's address on the veth (a host address: never reachable
    /// from a sandbox).
    pub host_addr: Ipv4Addr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl World {
    /// A world with `addrs` (each /24 gets a host address ending in .1 on
    /// the veth, so the host routes it there). Each TCP server answers
    /// `hello ADDR:PORT` and closes; the DNS server answers A queries for
    /// the `names` given.
    pub fn new(
        addrs: &[Ipv4Addr],
        tcp: &[SocketAddr],
        dns_at: Option<Ipv4Addr>,
        names: &[(&str, Ipv4Addr)],
    ) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let name = format!("cubet{}-{n}", std::process::id() % 100_000);
        let host_if = format!("cth{}x{n}", std::process::id() % 100_000);
        let peer_if = format!("ctn{}x{n}", std::process::id() % 100_000);
        ip(&["netns", "add", &name]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if, "netns", &name,
        ]);
        let mut host_addr = None;
        let mut nets = std::collections::BTreeSet::new();
        for a in addrs {
            let o = a.octets();
            if nets.insert((o[0], o[1], o[2])) {
                let h = Ipv4Addr::new(o[0], o[1], o[2], 1);
                host_addr.get_or_insert(h);
                ip(&["addr", "add", &format!("{h}/24"), "dev", &host_if]);
            }
            ip(&[
                "-n",
                &name,
                "addr",
                "add",
                &format!("{a}/24"),
                "dev",
                &peer_if,
            ]);
        }
        ip(&["link", "set", &host_if, "up"]);
        ip(&["-n", &name, "link", "set", &peer_if, "up"]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        let host_addr = host_addr.expect("at least one address");
        ip(&[
            "-n",
            &name,
            "route",
            "add",
            "default",
            "via",
            &host_addr.to_string(),
        ]);

        let stop = Arc::new(AtomicBool::new(false));
        let ns = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tcp = tcp.to_vec();
        let names: Vec<(String, Ipv4Addr)> =
            names.iter().map(|(n, a)| (n.to_string(), *a)).collect();
        let s = stop.clone();
        // One thread enters the namespace and makes every socket there;
        // sockets stay in the namespace they were made in.
        let maker = std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let mut threads = vec![];
            for a in tcp {
                let l = TcpListener::bind(a).unwrap();
                l.set_nonblocking(true).unwrap();
                let s = s.clone();
                threads.push(std::thread::spawn(move || serve_tcp(l, a, &s)));
            }
            if let Some(d) = dns_at {
                let u = UdpSocket::bind((d, 53)).unwrap();
                u.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                let s = s.clone();
                threads.push(std::thread::spawn(move || serve_dns(u, &names, &s)));
            }
            tx.send(threads).unwrap();
        });
        maker.join().unwrap();
        let threads = rx.recv().unwrap();
        Self {
            name,
            host_if,
            host_addr,
            stop,
            threads,
        }
    }
}

impl World {
    /// The network namespace's name (for `ip netns exec`).
    pub fn netns(&self) -> &str {
        &self.name
    }

    /// An HTTP/1.1 server at `a` (one of the world's addresses) that answers
    /// every request with 200 and, as its body, the request's head as it
    /// arrived (request line and headers).
    pub fn serve_http_echo(&mut self, a: SocketAddr) {
        let ns = std::fs::File::open(format!("/run/netns/{}", self.name)).unwrap();
        let s = self.stop.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let l = TcpListener::bind(a).unwrap();
            l.set_nonblocking(true).unwrap();
            tx.send(std::thread::spawn(move || serve_echo(l, &s)))
                .unwrap();
        })
        .join()
        .unwrap();
        self.threads.push(rx.recv().unwrap());
    }
}

fn serve_echo(l: TcpListener, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match l.accept() {
            Ok((mut c, _)) => {
                let _ = c.set_nonblocking(false);
                let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
                    match c.read(&mut b) {
                        Ok(1) => head.push(b[0]),
                        _ => break,
                    }
                }
                let _ = c.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        head.len()
                    )
                    .as_bytes(),
                );
                let _ = c.write_all(&head);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn serve_tcp(l: TcpListener, a: SocketAddr, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match l.accept() {
            Ok((mut c, _)) => {
                let _ = c.set_nonblocking(false);
                let _ = c.write_all(format!("hello {a}\n").as_bytes());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A DNS server for A queries: the names given, NXDOMAIN for others.
fn serve_dns(u: UdpSocket, names: &[(String, Ipv4Addr)], stop: &AtomicBool) {
    let mut buf = [0u8; 512];
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, from)) = u.recv_from(&mut buf) else {
            continue;
        };
        let q = &buf[..n];
        if n < 12 {
            continue;
        }
        // The question: labels up to a zero, then type and class.
        let mut i = 12;
        let mut labels = vec![];
        while i < n && q[i] != 0 {
            let len = q[i] as usize;
            labels.push(String::from_utf8_lossy(&q[i + 1..(i + 1 + len).min(n)]).to_string());
            i += 1 + len;
        }
        let end = i + 5;
        if end > n {
            continue;
        }
        let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
        let name = labels.join(".").to_ascii_lowercase();
        let found = names.iter().find(|(k, _)| *k == name).map(|(_, a)| *a);
        let mut r = Vec::with_capacity(64);
        r.extend_from_slice(&q[..2]);
        let answer = found.filter(|_| qtype == 1);
        r.extend_from_slice(if found.is_some() {
            &[0x81, 0x80]
        } else {
            &[0x81, 0x83]
        });
        r.extend_from_slice(&[0, 1, 0, u8::from(answer.is_some()), 0, 0, 0, 0]);
        r.extend_from_slice(&q[12..end]);
        if let Some(a) = answer {
            r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
            r.extend_from_slice(&a.octets());
        }
        let _ = u.send_to(&r, from);
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Read what a TCP server says (test side, for checking the world works).
pub fn hello(a: SocketAddr) -> String {
    let mut c = std::net::TcpStream::connect_timeout(&a, Duration::from_secs(3)).unwrap();
    let mut s = String::new();
    c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let _ = c.read_to_string(&mut s);
    s
}
