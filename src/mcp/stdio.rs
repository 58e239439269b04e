//! `cube-adapter mcp`: the tool set over stdio, as a client of an
//! appliance's `/v1` (for hosts that run MCP servers as local commands).
//!
//! Settings come from the environment, as in the reference facade:
//! `CUBE_ADAPTER_URL` (default `https://127.0.0.1:18080`),
//! `CUBE_ADAPTER_TOKEN` or `CUBE_ADAPTER_TOKEN_FILE`, `CUBE_ADAPTER_CA_FILE`,
//! `CUBE_ADAPTER_CLIENT_CERT_FILE` with `CUBE_ADAPTER_CLIENT_KEY_FILE`,
//! `CUBE_ADAPTER_PROFILE`, `CUBE_ADAPTER_RUNTIME`. Every refusal is decided
//! before any connection is tried.

use std::net::IpAddr;
use std::path::PathBuf;

use rmcp::ServiceExt;

use super::tools::Host;
use super::{McpServer, Upstream};
use crate::cube::Secret;

/// The default appliance URL.
pub const DEFAULT_URL: &str = "https://127.0.0.1:18080";

/// What `cube-adapter mcp` was told, checked.
#[derive(Debug)]
pub struct Settings {
    pub url: url::Url,
    pub token: Option<Secret>,
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<(PathBuf, PathBuf)>,
    pub host: Host,
}

fn is_loopback(u: &url::Url) -> bool {
    match u.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip).is_loopback(),
        Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip).is_loopback(),
        None => false,
    }
}

impl Settings {
    /// Read and check the settings from `var` (the environment).
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let get = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let raw = get("CUBE_ADAPTER_URL").unwrap_or_else(|| DEFAULT_URL.to_string());
        let url = url::Url::parse(&raw)
            .map_err(|e| format!("CUBE_ADAPTER_URL is not a URL ({e}): {raw}"))?;
        match url.scheme() {
            "https" => {}
            "http" if is_loopback(&url) => {}
            "http" => {
                return Err(format!(
                    "refusing plain HTTP to {}: only a loopback address may be reached without TLS \
                     (use https://, and CUBE_ADAPTER_CA_FILE for the appliance's CA)",
                    url.host_str().unwrap_or("?")
                ));
            }
            other => {
                return Err(format!(
                    "CUBE_ADAPTER_URL must be https:// (or http:// to loopback), not {other}://"
                ));
            }
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(
                "CUBE_ADAPTER_URL must not carry credentials; use CUBE_ADAPTER_TOKEN".into(),
            );
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(
                "CUBE_ADAPTER_URL takes no query or fragment (the profile is CUBE_ADAPTER_PROFILE)"
                    .into(),
            );
        }
        let token = match (get("CUBE_ADAPTER_TOKEN"), get("CUBE_ADAPTER_TOKEN_FILE")) {
            (Some(_), Some(_)) => {
                return Err("set CUBE_ADAPTER_TOKEN or CUBE_ADAPTER_TOKEN_FILE, not both".into());
            }
            (Some(t), None) => Some(Secret::new(t.trim())),
            (None, Some(f)) => {
                let t = std::fs::read_to_string(&f)
                    .map_err(|e| format!("cannot read CUBE_ADAPTER_TOKEN_FILE {f}: {e}"))?;
                let t = t.trim().to_string();
                if t.is_empty() {
                    return Err(format!("CUBE_ADAPTER_TOKEN_FILE {f} is empty"));
                }
                Some(Secret::new(t))
            }
            (None, None) => None,
        };
        if let Some(t) = &token
            && reqwest::header::HeaderValue::from_str(&format!("Bearer {}", t.expose())).is_err()
        {
            return Err("the token holds characters no HTTP header may carry".into());
        }
        let client_cert = match (
            get("CUBE_ADAPTER_CLIENT_CERT_FILE"),
            get("CUBE_ADAPTER_CLIENT_KEY_FILE"),
        ) {
            (Some(c), Some(k)) => Some((PathBuf::from(c), PathBuf::from(k))),
            (None, None) => None,
            _ => {
                return Err(
                    "CUBE_ADAPTER_CLIENT_CERT_FILE and CUBE_ADAPTER_CLIENT_KEY_FILE go together"
                        .into(),
                );
            }
        };
        if client_cert.is_some() && url.scheme() != "https" {
            return Err("a client certificate is only sent over https://".into());
        }
        if token.is_none() && client_cert.is_none() {
            return Err(
                "no identity: set CUBE_ADAPTER_TOKEN (or CUBE_ADAPTER_TOKEN_FILE) or a client certificate".into(),
            );
        }
        let ca_file = get("CUBE_ADAPTER_CA_FILE").map(PathBuf::from);
        if ca_file.is_some() && url.scheme() != "https" {
            return Err("CUBE_ADAPTER_CA_FILE is for https:// URLs".into());
        }
        let runtime = get("CUBE_ADAPTER_RUNTIME");
        if let Some(r) = &runtime
            && !crate::config::RUNTIMES.contains(&r.as_str())
        {
            return Err(format!(
                "CUBE_ADAPTER_RUNTIME must be one of {}",
                crate::config::RUNTIMES.join(", ")
            ));
        }
        Ok(Self {
            url,
            token,
            ca_file,
            client_cert,
            host: Host {
                profile: get("CUBE_ADAPTER_PROFILE"),
                runtime,
            },
        })
    }

    /// The HTTP client these settings call for.
    pub fn client(&self) -> Result<reqwest::Client, String> {
        let read =
            |p: &PathBuf| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
        // Straight to the appliance: no proxy from the environment (it
        // would see the token, and plain HTTP is allowed only because the
        // appliance is on loopback), no redirects; `localhost` is pinned to
        // the loopback addresses, whatever the resolver says.
        let mut b = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(310))
            .connect_timeout(std::time::Duration::from_secs(10))
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none());
        if let (Some(url::Host::Domain(d)), Some(port)) =
            (self.url.host(), self.url.port_or_known_default())
            && d.eq_ignore_ascii_case("localhost")
        {
            b = b.resolve_to_addrs(
                d,
                &[
                    std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                    std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
                ],
            );
        }
        if self.url.scheme() == "https" {
            let ca = self.ca_file.as_ref().map(read).transpose()?;
            let id = match &self.client_cert {
                Some((c, k)) => Some((read(c)?, read(k)?)),
                None => None,
            };
            let tls = crate::tls::client_config(
                ca.as_deref(),
                id.as_ref().map(|(c, k)| (c.as_slice(), k.as_slice())),
            )
            .map_err(|e| format!("TLS settings: {e}"))?;
            b = b.tls_backend_preconfigured(tls);
        }
        b.build().map_err(|e| format!("HTTP client: {e}"))
    }
}

/// Serve the tools on stdin/stdout until the host closes them.
pub async fn run(s: Settings) -> Result<(), String> {
    let http = s.client()?;
    let server = McpServer::new(
        Upstream::Remote {
            http,
            base: s.url.as_str().trim_end_matches('/').to_string(),
            token: s.token,
        },
        s.host,
    );
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| format!("MCP over stdio: {e}"))?;
    running
        .waiting()
        .await
        .map_err(|e| format!("MCP over stdio: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn transport_rules() {
        let ok = |p: &[(&str, &str)]| Settings::from_env(env(p));
        assert!(ok(&[("CUBE_ADAPTER_TOKEN", "t")]).is_ok());
        assert!(
            ok(&[
                ("CUBE_ADAPTER_URL", "http://127.0.0.1:1"),
                ("CUBE_ADAPTER_TOKEN", "t")
            ])
            .is_ok()
        );
        assert!(
            ok(&[
                ("CUBE_ADAPTER_URL", "http://[::1]:1"),
                ("CUBE_ADAPTER_TOKEN", "t")
            ])
            .is_ok()
        );
        assert!(
            ok(&[
                ("CUBE_ADAPTER_URL", "http://localhost:1"),
                ("CUBE_ADAPTER_TOKEN", "t")
            ])
            .is_ok()
        );
        for (p, want) in [
            (
                vec![
                    ("CUBE_ADAPTER_URL", "http://cube.invalid:1"),
                    ("CUBE_ADAPTER_TOKEN", "t"),
                ],
                "plain HTTP",
            ),
            (
                vec![
                    ("CUBE_ADAPTER_URL", "http://10.0.0.1:1"),
                    ("CUBE_ADAPTER_TOKEN", "t"),
                ],
                "plain HTTP",
            ),
            (vec![], "no identity"),
            (vec![("CUBE_ADAPTER_CLIENT_CERT_FILE", "/c")], "go together"),
            (
                vec![
                    ("CUBE_ADAPTER_URL", "http://127.0.0.1:1"),
                    ("CUBE_ADAPTER_CLIENT_CERT_FILE", "/c"),
                    ("CUBE_ADAPTER_CLIENT_KEY_FILE", "/k"),
                ],
                "only sent over https",
            ),
            (
                vec![
                    ("CUBE_ADAPTER_TOKEN", "t"),
                    ("CUBE_ADAPTER_TOKEN_FILE", "/t"),
                ],
                "not both",
            ),
            (
                vec![("CUBE_ADAPTER_URL", "ftp://x"), ("CUBE_ADAPTER_TOKEN", "t")],
                "https://",
            ),
            (
                vec![
                    ("CUBE_ADAPTER_TOKEN", "t"),
                    ("CUBE_ADAPTER_RUNTIME", "bash"),
                ],
                "RUNTIME",
            ),
            (
                vec![
                    ("CUBE_ADAPTER_URL", "https://x.invalid/?profile=wide"),
                    ("CUBE_ADAPTER_TOKEN", "t"),
                ],
                "no query",
            ),
            (vec![("CUBE_ADAPTER_TOKEN", "bad\ntoken")], "characters"),
        ] {
            let e = ok(&p).unwrap_err();
            assert!(e.contains(want), "{p:?}: {e}");
        }
    }
}
