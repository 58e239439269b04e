//! What a sandbox may reach on the network, and how it gets there.
//!
//! Every sandbox has its own network namespace. Without egress it holds
//! only a loopback interface. With egress (internet access, or any
//! `allowOut` entry), the sandbox's init starts `pasta` (Debian's `passt`)
//! before it enters that namespace: pasta stays in the host's network
//! namespace, gives the sandbox a tap interface and carries its TCP, UDP
//! and ICMP through ordinary sockets of its own. Nothing is forwarded from
//! the sandbox to the host's loopback (`-T none -U none`) or the gateway's
//! address (`--no-map-gw`), and nothing from the host into the sandbox
//! (`-t none -u none`). pasta is a child of the sandbox's init, so it ends
//! with the sandbox.
//!
//! The destinations are filtered by nftables rules in the sandbox's network
//! namespace, installed by the init before anything of the sandbox runs. The
//! namespace belongs to the init's user namespace; what the sandbox runs
//! lives in a nested one (see `launch.rs`), so no process of the sandbox,
//! root included, can change the rules, the interface or the routes.
//!
//! The policy is CubeSandbox's (`cube-protocol.md` §1.16): `allowOut` beats
//! `denyOut` beats the default, which is allow with internet access and deny
//! without. Entries are IPv4 addresses or CIDRs, optionally with a port or
//! port range (`203.0.113.0/24:443`, `10.1.2.3:8000-8100`, an extension of
//! this backend). Whatever the policy, the host's own addresses are never
//! reachable. Sandboxes have IPv4 only. Names resolve through pasta, which
//! forwards DNS queries sent to `DNS_FORWARD` to the host's first resolver.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The address a sandbox's `/etc/resolv.conf` names: pasta forwards UDP
/// queries to it to the host's first name server.
pub const DNS_FORWARD: &str = "169.254.1.1";

/// What a denied packet gets.
const REJECT: &str = "reject with icmpx type admin-prohibited";

/// One destination: a network and, optionally, a range of ports (TCP and
/// UDP alike).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Dest {
    pub addr: Ipv4Addr,
    pub prefix: u8,
    pub ports: Option<(u16, u16)>,
}

/// A destination this backend cannot filter by, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadDest {
    #[error(
        "{0:?}: IPv6 destinations are not supported by the embedded backend \
         (its sandboxes have IPv4 only)"
    )]
    Ipv6(String),
    #[error("{dest:?}: {ports}")]
    Ports { dest: String, ports: BadPorts },
    #[error("{0:?}: the prefix length must be 0 to 32")]
    Prefix(String),
    #[error(
        "{0:?}: domain names are not supported by the embedded backend; \
         name addresses or CIDRs"
    )]
    DomainName(String),
    #[error("{0:?} is not an IPv4 address or CIDR")]
    NotAnAddress(String),
}

/// A port or range of ports that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadPorts {
    #[error("{0:?} is not a port (1 to 65535)")]
    NotAPort(String),
    #[error("the port range {0}-{1} is empty")]
    Empty(u16, u16),
}

impl Dest {
    /// `ADDR`, `ADDR/PREFIX`, either followed by `:PORT` or `:LOW-HIGH`.
    pub fn parse(s: &str) -> Result<Self, BadDest> {
        let t = s.trim();
        if t.contains("::") || t.starts_with('[') || t.matches(':').count() > 1 {
            return Err(BadDest::Ipv6(s.to_string()));
        }
        let (net, ports) = match t.split_once(':') {
            Some((n, p)) => (
                n,
                Some(parse_ports(p).map_err(|ports| BadDest::Ports {
                    dest: s.to_string(),
                    ports,
                })?),
            ),
            None => (t, None),
        };
        let (a, prefix) = match net.split_once('/') {
            Some((a, p)) => (
                a,
                p.parse::<u8>()
                    .ok()
                    .filter(|p| *p <= 32)
                    .ok_or_else(|| BadDest::Prefix(s.to_string()))?,
            ),
            None => (net, 32),
        };
        let addr: Ipv4Addr = a.parse().map_err(|_| {
            if a.chars().any(|c| c.is_ascii_alphabetic()) {
                BadDest::DomainName(s.to_string())
            } else {
                BadDest::NotAnAddress(s.to_string())
            }
        })?;
        let mask = if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(prefix))
        };
        Ok(Self {
            addr: Ipv4Addr::from(u32::from(addr) & mask),
            prefix,
            ports,
        })
    }

    /// The nftables match for this destination.
    fn matcher(&self) -> String {
        let mut m = format!("ip daddr {}/{}", self.addr, self.prefix);
        if let Some((lo, hi)) = self.ports {
            m.push_str(" meta l4proto { tcp, udp } th dport ");
            if lo == hi {
                m.push_str(&lo.to_string());
            } else {
                m.push_str(&format!("{lo}-{hi}"));
            }
        }
        m
    }
}

fn parse_ports(p: &str) -> Result<(u16, u16), BadPorts> {
    let port = |x: &str| {
        x.parse::<u16>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| BadPorts::NotAPort(x.to_string()))
    };
    match p.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (port(a)?, port(b)?);
            if a > b {
                return Err(BadPorts::Empty(a, b));
            }
            Ok((a, b))
        }
        None => {
            let n = port(p)?;
            Ok((n, n))
        }
    }
}

/// A sandbox's egress: how it reaches the network, and where to.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Egress {
    /// What is not named below: allowed (internet access) or denied.
    pub default_allow: bool,
    pub allow: Vec<Dest>,
    pub deny: Vec<Dest>,
    /// The host's own addresses, never reachable.
    pub host: Vec<Ipv4Addr>,
}

impl Egress {
    /// The policy for a new sandbox; None when it has no network at all (no
    /// internet access and nothing allowed).
    pub fn from_request(
        internet: bool,
        allow_out: &[String],
        deny_out: &[String],
    ) -> Result<Option<Self>, BadDest> {
        let allow = allow_out
            .iter()
            .map(|s| Dest::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        let deny = deny_out
            .iter()
            .map(|s| Dest::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        if !internet && allow.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self {
            default_allow: internet,
            allow,
            deny,
            host: host_addresses(),
        }))
    }

    /// The nftables ruleset of the sandbox's network namespace: loopback
    /// and the DNS forwarder first, then the host's addresses (refused),
    /// `allow` (accepted), `deny` (refused), and the default (refused at the
    /// end without internet access). IPv6 leaves nothing but loopback. A denied packet is answered
    /// at once with "administratively prohibited", so a denied connect
    /// fails then ("No route to host") instead of hanging.
    pub fn ruleset(&self) -> String {
        let mut r = String::from("table inet cube_egress {\n  chain out {\n");
        r.push_str(&format!(
            "    type filter hook output priority 0; policy {};\n",
            if self.default_allow { "accept" } else { "drop" }
        ));
        r.push_str("    oifname \"lo\" accept\n");
        r.push_str("    meta nfproto ipv6 drop\n");
        r.push_str(&format!("    ip daddr {DNS_FORWARD} udp dport 53 accept\n"));
        for h in &self.host {
            r.push_str(&format!("    ip daddr {h} {REJECT}\n"));
        }
        for d in &self.allow {
            r.push_str(&format!("    {} accept\n", d.matcher()));
        }
        for d in &self.deny {
            r.push_str(&format!("    {} {REJECT}\n", d.matcher()));
        }
        if !self.default_allow {
            r.push_str(&format!("    {REJECT}\n"));
        }
        r.push_str("  }\n}\n");
        r
    }
}

/// The host's IPv4 addresses, loopback excepted (a sandbox's loopback is
/// its own).
pub fn host_addresses() -> Vec<Ipv4Addr> {
    let mut v: Vec<Ipv4Addr> = nix::ifaddrs::getifaddrs()
        .map(|it| {
            it.filter_map(|i| i.address)
                .filter_map(|a| a.as_sockaddr_in().map(|s| s.ip()))
                .filter(|ip| !ip.is_loopback())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.dedup();
    v
}

/// Where the programs egress needs are: `pasta` and `nft`.
#[derive(Debug, Clone)]
pub struct Tools {
    pub pasta: PathBuf,
    pub nft: PathBuf,
}

const TOOL_DIRS: &[&str] = &["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin"];

fn find_tool(name: &str) -> Option<PathBuf> {
    TOOL_DIRS
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The egress programs missing on this host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sandboxes with network access need {} on the host", self.names())]
pub struct MissingTools {
    pub pasta: bool,
    pub nft: bool,
}

impl MissingTools {
    fn names(&self) -> String {
        let mut missing = vec![];
        if self.pasta {
            missing.push("pasta (Debian package passt)");
        }
        if self.nft {
            missing.push("nft (Debian package nftables)");
        }
        missing.join(" and ")
    }
}

impl Tools {
    pub fn find() -> Result<Self, MissingTools> {
        let pasta = find_tool("pasta");
        let nft = find_tool("nft");
        match (pasta, nft) {
            (Some(pasta), Some(nft)) => Ok(Self { pasta, nft }),
            (p, n) => Err(MissingTools {
                pasta: p.is_none(),
                nft: n.is_none(),
            }),
        }
    }
}

/// The arguments pasta runs with, for the network namespace open as
/// `netns_fd` in pasta's own descriptor table.
pub fn pasta_args(netns_fd: i32) -> Vec<String> {
    [
        "--config-net",
        "--foreground",
        "--quiet",
        "--ipv4-only",
        "--runas",
        "0:0",
        "--no-map-gw",
        "--tcp-ports",
        "none",
        "--udp-ports",
        "none",
        "--tcp-ns",
        "none",
        "--udp-ns",
        "none",
        "--dns-forward",
        DNS_FORWARD,
        "--netns",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("/proc/self/fd/{netns_fd}")])
    .collect()
}

/// Whether the current network namespace has a default route (pasta has
/// configured its interface).
pub fn has_default_route() -> bool {
    std::fs::read_to_string("/proc/net/route")
        .map(|t| {
            t.lines()
                .skip(1)
                .any(|l| l.split_whitespace().nth(1) == Some("00000000"))
        })
        .unwrap_or(false)
}

/// The sandbox's `/etc/resolv.conf`.
pub fn resolv_conf() -> String {
    format!(
        "# cube-adapter: pasta forwards these queries to the host's resolver\nnameserver {DNS_FORWARD}\n"
    )
}

/// In the sandbox's init, before it builds the sandbox's root (the host's
/// programs are still at hand) and before any limit is set: start pasta
/// (a child of the init, in the host's network namespace), enter a network
/// namespace of the init's own, hand it to pasta, wait until pasta has
/// configured it, and install the filter. Single-threaded, like the init.
pub fn enter(egress: &Egress) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;

    use anyhow::Context;
    use nix::sys::socket::{
        AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, recvmsg,
        sendmsg, socketpair,
    };

    use super::sys::{self, Forked};

    let tools = Tools::find().map_err(anyhow::Error::msg)?;
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .context("socketpair")?;
    let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("pipe")?;
    let pasta = match sys::fork_single_threaded().context("fork pasta")? {
        Forked::Child => {
            drop(ours);
            drop(err_r);
            // The namespace arrives without O_CLOEXEC: pasta inherits it.
            let mut buf = [0u8; 1];
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
            let fd = recvmsg::<()>(
                theirs.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::empty(),
            )
            .ok()
            .and_then(|m| {
                m.cmsgs().ok()?.find_map(|c| match c {
                    ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
                    _ => None,
                })
            });
            let Some(fd) = fd else {
                std::process::exit(126)
            };
            let err = std::process::Command::new(&tools.pasta)
                .args(pasta_args(fd))
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::from(err_w))
                .exec();
            eprintln!("cannot run {}: {err}", tools.pasta.display());
            std::process::exit(127)
        }
        Forked::Parent(p) => p,
    };
    drop(theirs);
    drop(err_w);
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare network")?;
    sys::loopback_up().context("bring up lo")?;
    let ns = nix::fcntl::open(
        "/proc/self/ns/net",
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .context("open the network namespace")?;
    sendmsg::<()>(
        ours.as_raw_fd(),
        &[std::io::IoSlice::new(b"n")],
        &[ControlMessage::ScmRights(&[ns.as_raw_fd()])],
        MsgFlags::empty(),
        None,
    )
    .context("hand the network namespace to pasta")?;
    drop(ns);
    drop(ours);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !has_default_route() {
        use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
        let ended = !matches!(
            waitpid(pasta, Some(WaitPidFlag::WNOHANG)),
            Ok(WaitStatus::StillAlive)
        );
        if ended || std::time::Instant::now() > deadline {
            let _ = nix::sys::signal::kill(pasta, nix::sys::signal::Signal::SIGKILL);
            let mut said = String::new();
            if ended {
                use std::io::Read;
                let _ = std::fs::File::from(err_r)
                    .take(2048)
                    .read_to_string(&mut said);
            }
            let said = said
                .lines()
                .filter(|l| !l.contains("syslog"))
                .collect::<Vec<_>>()
                .join("; ");
            anyhow::bail!(
                "the sandbox's network (pasta) {}{}",
                if ended {
                    "exited"
                } else {
                    "was not ready within 10 s"
                },
                if said.is_empty() {
                    String::new()
                } else {
                    format!(": {said}")
                }
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // pasta's errors go to this pipe for as long as it runs: the init keeps
    // the reading end (a closed one would end pasta with SIGPIPE).
    std::mem::forget(err_r);
    let mut nft = std::process::Command::new(&tools.nft)
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("run {}", tools.nft.display()))?;
    if let Some(mut stdin) = nft.stdin.take() {
        use std::io::Write;
        stdin
            .write_all(egress.ruleset().as_bytes())
            .context("write the egress rules")?;
    }
    let out = nft.wait_with_output().context("wait for nft")?;
    anyhow::ensure!(
        out.status.success(),
        "nft refused the sandbox's egress rules: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_parse_and_are_normalised() {
        let d = Dest::parse("10.1.2.3/8").unwrap();
        assert_eq!(
            (d.addr, d.prefix, d.ports),
            (Ipv4Addr::new(10, 0, 0, 0), 8, None)
        );
        let d = Dest::parse("203.0.113.5:443").unwrap();
        assert_eq!((d.prefix, d.ports), (32, Some((443, 443))));
        let d = Dest::parse(" 0.0.0.0/0:8000-8100 ").unwrap();
        assert_eq!(
            (d.addr, d.prefix, d.ports),
            (Ipv4Addr::UNSPECIFIED, 0, Some((8000, 8100)))
        );
        for (bad, says) in [
            ("example.com", "domain names"),
            ("*.example.com", "domain names"),
            ("2001:db8::/32", "IPv6"),
            ("[2001:db8::1]:443", "IPv6"),
            ("10.0.0.0/33", "prefix"),
            ("10.0.0.0/8:0", "port"),
            ("10.0.0.0/8:99999", "port"),
            ("10.0.0.0/8:90-80", "empty"),
            ("10.0.0", "not an IPv4"),
        ] {
            let e = Dest::parse(bad).unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn no_network_without_internet_or_allowed_destinations() {
        assert_eq!(
            Egress::from_request(false, &[], &["10.0.0.0/8".into()]),
            Ok(None)
        );
        let e = Egress::from_request(false, &["198.51.100.7".into()], &[])
            .unwrap()
            .unwrap();
        assert!(!e.default_allow);
        assert!(Egress::from_request(true, &[], &["nope".into()]).is_err());
    }

    #[test]
    fn the_ruleset_puts_the_host_and_allow_before_deny() {
        let e = Egress {
            default_allow: true,
            allow: vec![Dest::parse("10.9.0.0/16:443").unwrap()],
            deny: vec![Dest::parse("10.0.0.0/8").unwrap()],
            host: vec![Ipv4Addr::new(192, 0, 2, 2)],
        };
        let r = e.ruleset();
        assert!(r.contains("policy accept;"), "{r}");
        assert!(!r.contains(&format!("\n    {REJECT}\n")), "{r}");
        let host = r.find(&format!("ip daddr 192.0.2.2 {REJECT}")).unwrap();
        let allow = r
            .find("ip daddr 10.9.0.0/16 meta l4proto { tcp, udp } th dport 443 accept")
            .unwrap();
        let deny = r.find(&format!("ip daddr 10.0.0.0/8 {REJECT}")).unwrap();
        let dns = r.find("ip daddr 169.254.1.1 udp dport 53 accept").unwrap();
        assert!(dns < host && host < allow && allow < deny, "{r}");
        let closed = Egress {
            default_allow: false,
            ..e
        };
        let r = closed.ruleset();
        assert!(r.contains("policy drop;"), "{r}");
        assert!(r.ends_with(&format!("    {REJECT}\n  }}\n}}\n")), "{r}");
    }
}
