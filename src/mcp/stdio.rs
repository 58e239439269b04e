//! `cube-adapter mcp`: the tool set over stdio, as a client of an
//! appliance's `/v1` (for hosts that run MCP servers as local commands).
//!
//! Settings come from flags (`Flags`: `--url`, `--token-file`, `--ca-file`,
//! `--client-cert` with `--client-key`, `--profile`, `--runtime`) and, for
//! what no flag names, from the environment, as in the reference facade:
//! `CUBE_ADAPTER_URL` (default `https://127.0.0.1:18080`),
//! `CUBE_ADAPTER_TOKEN` or `CUBE_ADAPTER_TOKEN_FILE`, `CUBE_ADAPTER_CA_FILE`,
//! `CUBE_ADAPTER_CLIENT_CERT_FILE` with `CUBE_ADAPTER_CLIENT_KEY_FILE`,
//! `CUBE_ADAPTER_PROFILE`, `CUBE_ADAPTER_RUNTIME`. A flag wins over its
//! variables, and an identity flag (`--token-file`, `--client-cert`) over
//! every identity variable: hosts pass their whole environment on, so an
//! exported `CUBE_ADAPTER_TOKEN` must not fight the configured token file.
//! Every refusal is decided before any connection is tried.

use std::net::IpAddr;
use std::path::PathBuf;

use rmcp::ServiceExt;

use super::tools::Host;
use super::{McpServer, Upstream};
use crate::cube::Secret;

/// The default appliance URL.
pub const DEFAULT_URL: &str = "https://127.0.0.1:18080";

/// What the command line says (each `None` when the flag is absent).
#[derive(Debug, Clone, Default)]
pub struct Flags {
    pub url: Option<String>,
    pub token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    pub profile: Option<String>,
    pub runtime: Option<String>,
}

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

/// What is wrong with the settings of `cube-adapter mcp` (exit 2), or
/// what stops it once they are right (exit 1). `from` names where a value
/// came from: a flag, a variable, the default.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("{0} is empty")]
    EmptyFlag(&'static str),
    #[error("{from} is not a URL ({source}): {raw}")]
    NotAUrl {
        from: &'static str,
        raw: String,
        source: url::ParseError,
    },
    #[error(
        "refusing plain HTTP to {0}: only a loopback address may be reached without TLS \
         (use https://, and --ca-file for the appliance's CA)"
    )]
    PlainHttp(String),
    #[error("{from} must be https:// (or http:// to loopback), not {scheme}://")]
    Scheme { from: &'static str, scheme: String },
    #[error("{0} must not carry credentials; use --token-file")]
    Credentials(&'static str),
    #[error("{0} takes no query or fragment (the profile is --profile)")]
    QueryOrFragment(&'static str),
    #[error("--client-cert and --client-key go together")]
    CertFlagsApart,
    #[error(
        "CUBE_ADAPTER_TOKEN and CUBE_ADAPTER_TOKEN_FILE are both set in the \
         environment and name two tokens: unset one of them (an exported \
         CUBE_ADAPTER_TOKEN reaches this command through the host), or give \
         --token-file FILE, which wins over both"
    )]
    TwoTokens,
    #[error(
        "CUBE_ADAPTER_CLIENT_CERT_FILE and CUBE_ADAPTER_CLIENT_KEY_FILE go \
         together (or give --client-cert and --client-key)"
    )]
    CertVariablesApart,
    #[error("the token holds characters no HTTP header may carry")]
    TokenNotAHeader,
    #[error("a client certificate is only sent over https://")]
    CertOverHttp,
    #[error(
        "no identity: give --token-file FILE (or set CUBE_ADAPTER_TOKEN or \
         CUBE_ADAPTER_TOKEN_FILE) or a client certificate"
    )]
    NoIdentity,
    #[error("{0} is for https:// URLs")]
    CaOverHttp(&'static str),
    #[error("{from} must be one of {} (not {runtime})", crate::config::RUNTIMES.join(", "))]
    Runtime { from: &'static str, runtime: String },
    #[error("cannot read {from} {}: {source}", path.display())]
    ReadToken {
        from: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{from} {} is empty", path.display())]
    EmptyToken { from: &'static str, path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TLS settings: {0}")]
    Tls(#[source] crate::tls::TlsError),
    #[error("HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("MCP over stdio: {0}")]
    Serve(String),
}

/// A token read from `file`, named `what` in messages.
fn read_token(file: &std::path::Path, what: &'static str) -> Result<Secret, SettingsError> {
    let t = std::fs::read_to_string(file).map_err(|source| SettingsError::ReadToken {
        from: what,
        path: file.to_path_buf(),
        source,
    })?;
    let t = t.trim().to_string();
    if t.is_empty() {
        return Err(SettingsError::EmptyToken {
            from: what,
            path: file.to_path_buf(),
        });
    }
    Ok(Secret::new(t))
}

impl Settings {
    /// Read and check the settings from the environment alone (`var`).
    #[cfg(test)]
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Self, SettingsError> {
        Self::resolve(&Flags::default(), var)
    }

    /// Read and check the settings: `flags` first, then `var` (the
    /// environment) for what no flag names.
    pub fn resolve(
        flags: &Flags,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingsError> {
        let get = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        for (name, empty) in [
            (
                "--url",
                flags.url.as_ref().is_some_and(|v| v.trim().is_empty()),
            ),
            (
                "--profile",
                flags.profile.as_ref().is_some_and(|v| v.trim().is_empty()),
            ),
            (
                "--runtime",
                flags.runtime.as_ref().is_some_and(|v| v.trim().is_empty()),
            ),
            (
                "--token-file",
                flags
                    .token_file
                    .as_ref()
                    .is_some_and(|v| v.as_os_str().is_empty()),
            ),
            (
                "--ca-file",
                flags
                    .ca_file
                    .as_ref()
                    .is_some_and(|v| v.as_os_str().is_empty()),
            ),
            (
                "--client-cert",
                flags
                    .client_cert
                    .as_ref()
                    .is_some_and(|v| v.as_os_str().is_empty()),
            ),
            (
                "--client-key",
                flags
                    .client_key
                    .as_ref()
                    .is_some_and(|v| v.as_os_str().is_empty()),
            ),
        ] {
            if empty {
                return Err(SettingsError::EmptyFlag(name));
            }
        }
        // Where each setting came from, for the messages.
        let (raw, url_src) = match (&flags.url, get("CUBE_ADAPTER_URL")) {
            (Some(u), _) => (u.clone(), "--url"),
            (None, Some(u)) => (u, "CUBE_ADAPTER_URL"),
            (None, None) => (DEFAULT_URL.to_string(), "the default URL"),
        };
        let url = url::Url::parse(&raw).map_err(|source| SettingsError::NotAUrl {
            from: url_src,
            raw: raw.clone(),
            source,
        })?;
        match url.scheme() {
            "https" => {}
            "http" if is_loopback(&url) => {}
            "http" => {
                return Err(SettingsError::PlainHttp(
                    url.host_str().unwrap_or("?").to_string(),
                ));
            }
            other => {
                return Err(SettingsError::Scheme {
                    from: url_src,
                    scheme: other.to_string(),
                });
            }
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(SettingsError::Credentials(url_src));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(SettingsError::QueryOrFragment(url_src));
        }
        let identity_flags =
            flags.token_file.is_some() || flags.client_cert.is_some() || flags.client_key.is_some();
        let (token, client_cert) = if identity_flags {
            // The flags name the identity; no identity variable counts.
            let token = flags
                .token_file
                .as_deref()
                .map(|f| read_token(f, "--token-file"))
                .transpose()?;
            let cert = match (&flags.client_cert, &flags.client_key) {
                (Some(c), Some(k)) => Some((c.clone(), k.clone())),
                (None, None) => None,
                _ => return Err(SettingsError::CertFlagsApart),
            };
            (token, cert)
        } else {
            let token = match (get("CUBE_ADAPTER_TOKEN"), get("CUBE_ADAPTER_TOKEN_FILE")) {
                (Some(_), Some(_)) => return Err(SettingsError::TwoTokens),
                (Some(t), None) => Some(Secret::new(t.trim())),
                (None, Some(f)) => Some(read_token(
                    std::path::Path::new(&f),
                    "CUBE_ADAPTER_TOKEN_FILE",
                )?),
                (None, None) => None,
            };
            let cert = match (
                get("CUBE_ADAPTER_CLIENT_CERT_FILE"),
                get("CUBE_ADAPTER_CLIENT_KEY_FILE"),
            ) {
                (Some(c), Some(k)) => Some((PathBuf::from(c), PathBuf::from(k))),
                (None, None) => None,
                _ => return Err(SettingsError::CertVariablesApart),
            };
            (token, cert)
        };
        if let Some(t) = &token
            && reqwest::header::HeaderValue::from_str(&format!("Bearer {}", t.expose())).is_err()
        {
            return Err(SettingsError::TokenNotAHeader);
        }
        if client_cert.is_some() && url.scheme() != "https" {
            return Err(SettingsError::CertOverHttp);
        }
        if token.is_none() && client_cert.is_none() {
            return Err(SettingsError::NoIdentity);
        }
        let (ca_file, ca_src) = match (&flags.ca_file, get("CUBE_ADAPTER_CA_FILE")) {
            (Some(f), _) => (Some(f.clone()), "--ca-file"),
            (None, Some(f)) => (Some(PathBuf::from(f)), "CUBE_ADAPTER_CA_FILE"),
            (None, None) => (None, ""),
        };
        if ca_file.is_some() && url.scheme() != "https" {
            return Err(SettingsError::CaOverHttp(ca_src));
        }
        let (runtime, runtime_src) = match (&flags.runtime, get("CUBE_ADAPTER_RUNTIME")) {
            (Some(r), _) => (Some(r.trim().to_string()), "--runtime"),
            (None, Some(r)) => (Some(r.trim().to_string()), "CUBE_ADAPTER_RUNTIME"),
            (None, None) => (None, ""),
        };
        if let Some(r) = &runtime
            && !crate::config::RUNTIMES.contains(&r.as_str())
        {
            return Err(SettingsError::Runtime {
                from: runtime_src,
                runtime: r.clone(),
            });
        }
        let profile = flags
            .profile
            .as_ref()
            .map(|p| p.trim().to_string())
            .or_else(|| get("CUBE_ADAPTER_PROFILE").map(|p| p.trim().to_string()));
        Ok(Self {
            url,
            token,
            ca_file,
            client_cert,
            host: Host { profile, runtime },
        })
    }

    /// The HTTP client these settings call for.
    pub fn client(&self) -> Result<reqwest::Client, SettingsError> {
        let read = |p: &PathBuf| {
            std::fs::read(p).map_err(|source| SettingsError::Read {
                path: p.clone(),
                source,
            })
        };
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
            .map_err(SettingsError::Tls)?;
            b = b.tls_backend_preconfigured(tls);
        }
        b.build().map_err(SettingsError::Client)
    }
}

/// Serve the tools on stdin/stdout until the host closes them.
pub async fn run(s: Settings) -> Result<(), SettingsError> {
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
        .map_err(|e| SettingsError::Serve(e.to_string()))?;
    running
        .waiting()
        .await
        .map_err(|e| SettingsError::Serve(e.to_string()))?;
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
                "both set in the environment",
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
            let e = ok(&p).unwrap_err().to_string();
            assert!(e.contains(want), "{p:?}: {e}");
        }
    }

    #[test]
    fn flags_win_over_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "from-the-file\n").unwrap();
        let flags = Flags {
            url: Some("http://127.0.0.1:7".into()),
            token_file: Some(file.clone()),
            profile: Some("wide".into()),
            runtime: Some("hermes".into()),
            ..Default::default()
        };
        // What Claude Code and OpenCode pass on: the user's exported token,
        // a token file, a URL and runtime of another appliance, an
        // incomplete client certificate.
        let noisy = env(&[
            ("CUBE_ADAPTER_TOKEN", "exported"),
            ("CUBE_ADAPTER_TOKEN_FILE", "/nonexistent"),
            ("CUBE_ADAPTER_URL", "ftp://elsewhere"),
            ("CUBE_ADAPTER_RUNTIME", "bash"),
            ("CUBE_ADAPTER_PROFILE", "narrow"),
            ("CUBE_ADAPTER_CLIENT_CERT_FILE", "/c"),
        ]);
        let s = Settings::resolve(&flags, &noisy).unwrap();
        assert_eq!(s.token.unwrap().expose(), "from-the-file");
        assert_eq!(s.url.as_str(), "http://127.0.0.1:7/");
        assert!(s.client_cert.is_none());
        assert_eq!(
            s.host,
            Host {
                profile: Some("wide".into()),
                runtime: Some("hermes".into())
            }
        );
        // Without flags the environment is read as before.
        let s = Settings::resolve(
            &Flags::default(),
            env(&[
                ("CUBE_ADAPTER_TOKEN", "t"),
                ("CUBE_ADAPTER_RUNTIME", "openclaw"),
                ("CUBE_ADAPTER_PROFILE", "p"),
            ]),
        )
        .unwrap();
        assert_eq!(s.token.unwrap().expose(), "t");
        assert_eq!(s.host.runtime.as_deref(), Some("openclaw"));
        assert_eq!(s.host.profile.as_deref(), Some("p"));
        // A client certificate by flags: no token from the environment.
        let flags = Flags {
            client_cert: Some("/c.pem".into()),
            client_key: Some("/c.key".into()),
            ..Default::default()
        };
        let s = Settings::resolve(&flags, env(&[("CUBE_ADAPTER_TOKEN", "exported")])).unwrap();
        assert!(s.token.is_none());
        assert!(s.client_cert.is_some());
        // Flags are checked as strictly as the variables.
        for (flags, want) in [
            (
                Flags {
                    client_cert: Some("/c.pem".into()),
                    ..Default::default()
                },
                "--client-cert and --client-key go together",
            ),
            (
                Flags {
                    runtime: Some("bash".into()),
                    ..Default::default()
                },
                "--runtime must be one of",
            ),
            (
                Flags {
                    url: Some("http://cube.invalid".into()),
                    ..Default::default()
                },
                "plain HTTP",
            ),
            (
                Flags {
                    token_file: Some(dir.path().join("missing")),
                    ..Default::default()
                },
                "cannot read --token-file",
            ),
            (
                Flags {
                    url: Some(" ".into()),
                    ..Default::default()
                },
                "--url is empty",
            ),
        ] {
            let e = Settings::resolve(&flags, env(&[("CUBE_ADAPTER_TOKEN", "t")]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{flags:?}: {e}");
        }
        // Two identity variables conflict: the message names both and the way out.
        let e = Settings::from_env(env(&[
            ("CUBE_ADAPTER_TOKEN", "t"),
            ("CUBE_ADAPTER_TOKEN_FILE", "/t"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("CUBE_ADAPTER_TOKEN and CUBE_ADAPTER_TOKEN_FILE")
                && e.contains("--token-file"),
            "{e}"
        );
        assert!(!e.contains("from-the-file"));
    }
}
