//! Brokered egress (issue #39): what a profile's sandboxes may reach through
//! the appliance's egress proxy, by *name*, and the credentials the proxy
//! adds on their behalf so that the sandbox never holds them.
//!
//! ```toml
//! [egress.resolve]            # names the appliance resolves itself (as curl --resolve)
//! "api.test.invalid" = "10.213.0.2"
//!
//! [profiles.build.egress]
//! destinations = ["api.test.invalid", "*.pypi.example.org:443"]
//! requests_per_second = 20
//! max_bytes = 1073741824
//!
//! [profiles.build.egress.credentials."api.test.invalid"]
//! secret_file = "/etc/cube-secrets/api-token"
//! header = "Authorization"      # the default
//! prefix = "Bearer "            # the default; or basic_user = "ci" for basic auth
//! intercept = false             # HTTPS: end TLS with the egress CA to add it
//! ```
//!
//! A destination is a host name, `*.` and a suffix (any name below it, not
//! the suffix itself), or an IPv4 address, with an optional `:PORT`;
//! without one, ports 80 and 443. Names are compared in lower case without
//! a trailing dot.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The most destinations a profile may name.
pub const MAX_DESTINATIONS: usize = 256;

/// `[egress]`: what all profiles' egress shares.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EgressSection {
    /// Names the appliance resolves to the address given instead of asking
    /// its resolver. An address given here is reached even when it is
    /// private or loopback (the operator named it); one a resolver answered
    /// is not.
    pub resolve: BTreeMap<String, IpAddr>,
    /// Certificates (PEM) trusted for intercepted HTTPS destinations, besides
    /// the public roots the appliance ships (`webpki-roots`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_ca_file: Option<PathBuf>,
    /// Where the proxy also listens for sandboxes that reach the appliance
    /// over the network (a CubeSandbox deployment's MicroVMs): plain HTTP,
    /// each request naming its lease and that lease's proxy token in
    /// `Proxy-Authorization`. None: only the embedded backend's sandboxes,
    /// from inside their own network. A change needs a restart.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<std::net::SocketAddr>,
    /// `HOST:PORT` sandboxes reach `listen` at, when it differs (a NAT, a
    /// name); default: `listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
}

/// `[profiles.NAME.egress]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProfileEgress {
    /// Where the proxy connects for the sandbox; everything else is refused.
    pub destinations: Vec<String>,
    /// A credential the proxy presents to a destination, keyed by one of
    /// `destinations` as written there.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub credentials: BTreeMap<String, Credential>,
    /// Requests (and tunnels) a lease may start per second, on average (a
    /// burst of as many is allowed).
    #[serde(default = "default_rps")]
    pub requests_per_second: u32,
    /// Bytes a lease may move through the proxy, both ways together, over
    /// its life (in the appliance's memory: a restart starts again at 0).
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
}

fn default_rps() -> u32 {
    20
}

fn default_max_bytes() -> u64 {
    4 << 30
}

/// How the proxy presents a secret.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Credential {
    /// The secret, read on the appliance's host at each use (its trailing
    /// newline dropped): never sent to the sandbox.
    pub secret_file: PathBuf,
    /// The header it goes in (replacing one the sandbox sent).
    #[serde(default = "default_header")]
    pub header: String,
    /// What comes before the secret in the header's value.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Basic authentication instead: `Authorization: Basic
    /// base64(USER:SECRET)`; `header` and `prefix` are then not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub basic_user: Option<String>,
    /// For HTTPS: end the sandbox's TLS at the proxy with a certificate of
    /// the appliance's egress CA (which the sandbox must trust: a template
    /// or preset installs it), add the credential, and speak TLS to the
    /// destination. Without it, an HTTPS request to this destination is
    /// tunnelled as it is and gets no credential.
    #[serde(default)]
    pub intercept: bool,
}

fn default_header() -> String {
    "Authorization".into()
}

fn default_prefix() -> String {
    "Bearer ".into()
}

/// The host part of a destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// This name (or address) only.
    Exact(String),
    /// Any name ending in `.SUFFIX` (`*.SUFFIX`).
    Below(String),
}

/// A parsed destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub host: HostPattern,
    /// None: 80 and 443.
    pub port: Option<u16>,
}

/// Lower case, without a trailing dot.
pub fn normal_host(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

fn name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

impl Destination {
    /// `HOST`, `*.SUFFIX` or `ADDR`, with an optional `:PORT`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s != s.trim() || s.chars().any(char::is_whitespace) {
            return Err(format!("{s:?} has spaces"));
        }
        let (host, port) = match s.rsplit_once(':') {
            Some((h, p)) => {
                let port: u16 = p
                    .parse()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| format!("{s:?}: {p:?} is not a port (1 to 65535)"))?;
                (h, Some(port))
            }
            None => (s, None),
        };
        if host.contains(':') || host.starts_with('[') {
            return Err(format!(
                "{s:?}: IPv6 destinations are not supported; name the host"
            ));
        }
        let host = normal_host(host);
        let pattern = match host.strip_prefix("*.") {
            Some(suffix) if name_ok(suffix) && suffix.contains('.') => {
                HostPattern::Below(suffix.to_string())
            }
            Some(_) => {
                return Err(format!(
                    "{s:?}: a wildcard is `*.` and a name of at least two labels"
                ));
            }
            None if name_ok(&host) => HostPattern::Exact(host),
            None => {
                return Err(format!(
                    "{s:?} is not a host name, `*.NAME` or an IPv4 address"
                ));
            }
        };
        Ok(Self {
            host: pattern,
            port,
        })
    }

    /// Whether `host` (normalised) and `port` fall under it.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        let port_ok = match self.port {
            Some(p) => p == port,
            None => port == 80 || port == 443,
        };
        port_ok
            && match &self.host {
                HostPattern::Exact(h) => h == host,
                HostPattern::Below(s) => host
                    .strip_suffix(s.as_str())
                    .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.')),
            }
    }
}

/// Why a profile's egress is not valid.
fn problem(profile: &str, why: String) -> super::ConfigError {
    super::ConfigError::Invalid {
        at: format!("profile {profile}"),
        why: format!("egress.{why}"),
    }
}

impl ProfileEgress {
    /// The destinations, parsed (validated at load: never fails then).
    pub fn parsed(&self) -> Vec<(String, Destination)> {
        self.destinations
            .iter()
            .filter_map(|d| Some((d.clone(), Destination::parse(d).ok()?)))
            .collect()
    }

    pub(super) fn validate(&self, profile: &str) -> Result<(), super::ConfigError> {
        if self.destinations.is_empty() {
            return Err(problem(
                profile,
                "destinations is empty (leave egress out for none)".into(),
            ));
        }
        if self.destinations.len() > MAX_DESTINATIONS {
            return Err(problem(
                profile,
                format!("destinations: at most {MAX_DESTINATIONS}"),
            ));
        }
        for d in &self.destinations {
            Destination::parse(d).map_err(|e| problem(profile, format!("destinations: {e}")))?;
        }
        if self.requests_per_second == 0 || self.max_bytes == 0 {
            return Err(problem(
                profile,
                "requests_per_second and max_bytes must be at least 1".into(),
            ));
        }
        for (key, c) in &self.credentials {
            let at = |why: String| problem(profile, format!("credentials.{key:?}: {why}"));
            if !self.destinations.contains(key) {
                return Err(at("is not one of destinations, as written there".into()));
            }
            if !c.secret_file.is_absolute() {
                return Err(at("secret_file must be an absolute path".into()));
            }
            let header_ok = !c.header.is_empty()
                && c.header
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !header_ok {
                return Err(at(format!("header {:?} is not a header name", c.header)));
            }
            if c.prefix.chars().any(|ch| ch.is_control()) {
                return Err(at("prefix has control characters".into()));
            }
            if let Some(u) = &c.basic_user
                && (u.is_empty() || u.contains(':') || u.chars().any(char::is_control))
            {
                return Err(at(
                    "basic_user is empty or has ':' or control characters".into()
                ));
            }
            if Destination::parse(key).ok().and_then(|d| d.port) == Some(443) && !c.intercept {
                return Err(at(
                    "port 443 is HTTPS: the proxy can add a credential there only with intercept = true"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

impl EgressSection {
    /// The proxy's address as sandboxes that reach it over the network
    /// name it.
    pub fn advertised(&self) -> Option<String> {
        self.advertise
            .clone()
            .or_else(|| self.listen.map(|a| a.to_string()))
    }

    pub(super) fn validate(&self) -> Result<(), super::ConfigError> {
        for name in self.resolve.keys() {
            let n = normal_host(name);
            if !name_ok(&n) || n != *name {
                return Err(super::ConfigError::Invalid {
                    at: "[egress]".into(),
                    why: format!("resolve: {name:?} is not a host name in lower case"),
                });
            }
        }
        if let Some(a) = &self.advertise {
            let ok = self.listen.is_some()
                && a.rsplit_once(':').is_some_and(|(h, p)| {
                    !h.is_empty()
                        && !h.chars().any(|c| c.is_whitespace() || c == '/' || c == '@')
                        && p.parse::<u16>().is_ok_and(|p| p > 0)
                });
            if !ok {
                return Err(super::ConfigError::Invalid {
                    at: "[egress]".into(),
                    why: format!("advertise {a:?} must be HOST:PORT, with listen set"),
                });
            }
        }
        if let Some(p) = &self.upstream_ca_file
            && !p.is_absolute()
        {
            return Err(super::ConfigError::Invalid {
                at: "[egress]".into(),
                why: "upstream_ca_file must be an absolute path".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_parse_and_match_by_name() {
        let d = Destination::parse("API.Test.invalid.").unwrap();
        assert!(d.matches("api.test.invalid", 80));
        assert!(d.matches("api.test.invalid", 443));
        assert!(!d.matches("api.test.invalid", 8080));
        assert!(!d.matches("x.api.test.invalid", 80));
        let w = Destination::parse("*.example.org:8443").unwrap();
        assert!(w.matches("a.example.org", 8443));
        assert!(w.matches("a.b.example.org", 8443));
        assert!(!w.matches("example.org", 8443));
        assert!(!w.matches("badexample.org", 8443));
        assert!(!w.matches("a.example.org", 443));
        assert!(
            Destination::parse("10.1.2.3:8000")
                .unwrap()
                .matches("10.1.2.3", 8000)
        );
        for bad in [
            "",
            " a.b",
            "a b",
            "*.com",
            "*",
            "a..b",
            "-a.b",
            "a.b:0",
            "a.b:70000",
            "[::1]:80",
            "a.b:x",
            "*.*.b.c",
        ] {
            assert!(Destination::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn credentials_name_a_destination_and_https_needs_interception() {
        let toml = r#"
            destinations = ["api.test.invalid", "secure.test.invalid:443"]
            [credentials."api.test.invalid"]
            secret_file = "/etc/cube-secrets/api"
        "#;
        let e: ProfileEgress = toml::from_str(toml).unwrap();
        assert!(e.validate("p").is_ok());
        assert_eq!(e.requests_per_second, 20);
        let c = &e.credentials["api.test.invalid"];
        assert_eq!(
            (c.header.as_str(), c.prefix.as_str()),
            ("Authorization", "Bearer ")
        );

        let mut bad = e.clone();
        bad.credentials
            .insert("other.test.invalid".into(), c.clone());
        let err = bad.validate("p").unwrap_err().to_string();
        assert!(err.contains("not one of destinations"), "{err}");

        let mut https = e.clone();
        https
            .credentials
            .insert("secure.test.invalid:443".into(), c.clone());
        let err = https.validate("p").unwrap_err().to_string();
        assert!(err.contains("intercept = true"), "{err}");
        https
            .credentials
            .get_mut("secure.test.invalid:443")
            .unwrap()
            .intercept = true;
        assert!(https.validate("p").is_ok());

        let mut header = e.clone();
        header
            .credentials
            .get_mut("api.test.invalid")
            .unwrap()
            .header = "X Key".into();
        assert!(header.validate("p").is_err());
        let mut rel = e;
        rel.credentials
            .get_mut("api.test.invalid")
            .unwrap()
            .secret_file = "api".into();
        assert!(rel.validate("p").is_err());
    }
}
