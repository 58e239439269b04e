//! Template presets (`[presets.NAME]`, issue #39): what a team's sandboxes
//! need before an agent gets them, pinned and versioned by the operator.
//! A profile names one (`template_preset`). A preset holds:
//!
//! - `version`: the operator's name for this state of it (leases will record
//!   it with a digest of the whole preset);
//! - `template`: the template it is made for, if one (a profile that names
//!   the preset must use it);
//! - `bootstrap`: commands run as root once the sandbox exists (stop the
//!   image's own initialisation, which could rewrite what follows);
//! - `files`: configuration files written in the sandbox, mode 0600 by
//!   default, whose content may name secret files on the appliance's host
//!   (`${FILE:/etc/cube-secrets/models/api-key}`), read when the sandbox is
//!   made and never kept in an image, an event or a log;
//! - `after`: commands run once the files are there (restart the app);
//! - `prechecks`: commands that must exit 0, else the sandbox is not handed
//!   out;
//! - `models`: for a model configuration, the provider, the model ids it
//!   serves, the default, fallbacks and aliases, each checked here so that
//!   a provider or model id that does not match, or a hard-to-see mistake (a
//!   trailing space), is refused by `config check` rather than found by an
//!   agent.
//!
//! Root in the sandbox can read the files a preset writes (the reference
//! says so too): brokered credentials keep a key out of the sandbox
//! altogether.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The most commands of each kind a preset may run.
pub const MAX_COMMANDS: usize = 32;
/// The most files a preset may write.
pub const MAX_FILES: usize = 32;
/// The largest file a preset may write (after its secrets are read in).
pub const MAX_FILE_BYTES: usize = 256 * 1024;
/// The longest wait for one step.
pub const MAX_STEP_SECONDS: u64 = 600;

/// `[presets.NAME]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Preset {
    pub version: String,
    #[serde(default)]
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bootstrap: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<PresetFile>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prechecks: Vec<String>,
    /// How long each command may take.
    #[serde(default = "default_step")]
    pub step_timeout_seconds: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Models>,
}

fn default_step() -> u64 {
    60
}

fn default_mode() -> String {
    "0600".into()
}

/// `[[presets.NAME.files]]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PresetFile {
    /// Where in the sandbox (absolute).
    pub path: String,
    /// What it holds; `${FILE:/abs/path}` is replaced by that file's content
    /// (its trailing newline dropped) when the sandbox is made.
    pub content: String,
    /// Octal, as `chmod` takes it (default `0600`).
    #[serde(default = "default_mode")]
    pub mode: String,
}

/// `[presets.NAME.models]`: a model configuration's names, checked.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Models {
    /// The provider's id (`deepseek`).
    pub provider: String,
    /// The model ids it serves (`deepseek-chat`).
    pub available: Vec<String>,
    /// `PROVIDER/MODEL`.
    pub default: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<String>,
    /// A short name for a `PROVIDER/MODEL`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub aliases: BTreeMap<String, String>,
}

/// Every `${FILE:…}` path in `text`, in order; or why one is malformed.
pub fn secret_files(text: &str) -> Result<Vec<&str>, PresetProblem> {
    let mut out = vec![];
    let mut rest = text;
    while let Some(i) = rest.find("${FILE:") {
        let after = &rest[i + "${FILE:".len()..];
        let Some(end) = after.find('}') else {
            return Err(PresetProblem::Unclosed);
        };
        let p = &after[..end];
        if !p.starts_with('/') || p.chars().any(char::is_whitespace) || p.contains("..") {
            return Err(PresetProblem::SecretPath(p.to_string()));
        }
        out.push(p);
        rest = &after[end + 1..];
    }
    Ok(out)
}

/// Why an id is not one: what a person would not see.
fn id_problem(what: &str, id: &str) -> Option<String> {
    if id.is_empty() {
        return Some(format!("{what} is empty"));
    }
    if id != id.trim() {
        let side = if id.starts_with(char::is_whitespace) {
            "a leading"
        } else {
            "a trailing"
        };
        return Some(format!("{what} {id:?} has {side} space"));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "._:-".contains(*c)))
    {
        return Some(format!("{what} {id:?} holds {c:?}"));
    }
    None
}

impl Models {
    /// A `PROVIDER/MODEL` this configuration serves, or why not.
    fn model_ref(&self, what: &str, r: &str) -> Result<(), PresetProblem> {
        if let Some(p) = id_problem(what, r.split_once('/').map_or(r, |(p, _)| p)) {
            return Err(PresetProblem::Models(p));
        }
        let Some((provider, model)) = r.split_once('/') else {
            return Err(PresetProblem::Models(format!(
                "{what} {r:?} must be PROVIDER/MODEL"
            )));
        };
        if let Some(p) = id_problem(what, model) {
            return Err(PresetProblem::Models(p));
        }
        if provider != self.provider {
            return Err(PresetProblem::Models(format!(
                "{what} {r:?} names provider {provider:?}; the preset's is {:?}",
                self.provider
            )));
        }
        if !self.available.iter().any(|m| m == model) {
            return Err(PresetProblem::Models(format!(
                "{what} {r:?} names a model the provider does not serve (available: {})",
                self.available.join(", ")
            )));
        }
        Ok(())
    }

    fn check(&self) -> Result<(), PresetProblem> {
        if let Some(p) = id_problem("provider", &self.provider) {
            return Err(PresetProblem::Models(p));
        }
        if self.available.is_empty() {
            return Err(PresetProblem::Models("available names no model".into()));
        }
        for m in &self.available {
            if let Some(p) = id_problem("available model", m) {
                return Err(PresetProblem::Models(p));
            }
        }
        self.model_ref("default", &self.default)?;
        for f in &self.fallbacks {
            self.model_ref("fallback", f)?;
        }
        for (alias, r) in &self.aliases {
            if let Some(p) = id_problem("alias", alias) {
                return Err(PresetProblem::Models(p));
            }
            self.model_ref(&format!("alias {alias}"), r)?;
        }
        Ok(())
    }
}

impl Preset {
    /// Everything that must hold before the preset may be used; `secrets`
    /// says whether the secret files it names must be readable now (at
    /// start and `config check`, on the host that serves).
    pub fn validate(&self, name: &str, secrets: bool) -> Result<(), PresetError> {
        if !super::valid_profile_name(name) {
            return Err(PresetError::Name(name.to_string()));
        }
        self.check(secrets).map_err(|problem| PresetError::Invalid {
            preset: name.to_string(),
            problem,
        })
    }

    fn check(&self, secrets: bool) -> Result<(), PresetProblem> {
        use PresetProblem as P;
        let v = &self.version;
        if v.is_empty() || v.len() > 64 || v != v.trim() || v.chars().any(|c| c.is_control()) {
            return Err(P::Version);
        }
        if let Some(t) = &self.template
            && id_problem("template", t).is_some()
        {
            return Err(P::Template(t.clone()));
        }
        for (what, list) in [
            ("bootstrap", &self.bootstrap),
            ("after", &self.after),
            ("prechecks", &self.prechecks),
        ] {
            if list.len() > MAX_COMMANDS {
                return Err(P::TooMany(what));
            }
            if list.iter().any(|c| c.trim().is_empty() || c.contains('\0')) {
                return Err(P::Command(what));
            }
        }
        if !(1..=MAX_STEP_SECONDS).contains(&self.step_timeout_seconds) {
            return Err(P::StepTimeout);
        }
        if self.files.len() > MAX_FILES {
            return Err(P::TooMany("files"));
        }
        for f in &self.files {
            let at = || f.path.clone();
            if !f.path.starts_with('/')
                || f.path.ends_with('/')
                || f.path.split('/').any(|c| c == ".." || c == ".")
                || f.path.chars().any(|c| c.is_control())
            {
                return Err(P::FilePath(at()));
            }
            let mode_ok = (3..=4).contains(&f.mode.len())
                && f.mode.chars().all(|c| ('0'..='7').contains(&c))
                && u32::from_str_radix(&f.mode, 8).is_ok_and(|m| m & 0o7002 == 0);
            if !mode_ok {
                return Err(P::Mode(at(), f.mode.clone()));
            }
            if f.content.len() > MAX_FILE_BYTES {
                return Err(P::TooLarge(at()));
            }
            for s in secret_files(&f.content)? {
                if secrets
                    && let Err(e) = std::fs::metadata(Path::new(s)).and_then(|m| {
                        if m.is_file() {
                            Ok(())
                        } else {
                            Err(std::io::Error::other("not a regular file"))
                        }
                    })
                {
                    return Err(P::Secret {
                        path: s.to_string(),
                        why: e.to_string(),
                    });
                }
            }
        }
        if let Some(m) = &self.models {
            m.check()?;
        }
        Ok(())
    }
}

/// Why `[presets.NAME]` is refused.
#[derive(Debug, thiserror::Error)]
pub enum PresetError {
    #[error("preset name '{0}' must match ^[a-z][a-z0-9-]{{0,62}}$")]
    Name(String),
    #[error("presets.{preset}: {problem}")]
    Invalid {
        preset: String,
        #[source]
        problem: PresetProblem,
    },
}

impl PresetError {
    /// The preset it is about.
    pub fn preset(&self) -> &str {
        match self {
            Self::Name(n) | Self::Invalid { preset: n, .. } => n,
        }
    }
}

/// What is wrong in a preset.
#[derive(Debug, thiserror::Error)]
pub enum PresetProblem {
    #[error("version is required: 1 to 64 characters, no surrounding spaces")]
    Version,
    #[error("template {0:?} is not a template id")]
    Template(String),
    #[error("{0} has more than the allowed number of entries")]
    TooMany(&'static str),
    #[error("{0} has an empty command")]
    Command(&'static str),
    #[error("step_timeout_seconds must be 1..={MAX_STEP_SECONDS}")]
    StepTimeout,
    #[error("file path {0:?} must be absolute, without . or .. components")]
    FilePath(String),
    #[error("file {0}: mode {1:?} must be octal (like 0600), not world-writable, no set-id bits")]
    Mode(String, String),
    #[error("file {0}: its content is larger than {MAX_FILE_BYTES} bytes")]
    TooLarge(String),
    #[error("an unclosed ${{FILE:…}}")]
    Unclosed,
    #[error("${{FILE:{0}}} must name an absolute path without spaces or ..")]
    SecretPath(String),
    #[error("secret file {path} cannot be read: {why}")]
    Secret { path: String, why: String },
    #[error("models: {0}")]
    Models(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn openclaw(secret: &Path) -> Preset {
        toml::from_str(&format!(
            r#"
version = "2026-12-07"
template = "openclaw"
bootstrap = ["systemctl stop openclaw-init || true"]
after = ["systemctl restart openclaw || true"]
prechecks = ["test -s /root/.openclaw/openclaw.json"]
[[files]]
path = "/root/.openclaw/openclaw.json"
content = '{{"apiKey": "${{FILE:{}}}"}}'
[models]
provider = "deepseek"
available = ["deepseek-chat", "deepseek-reasoner"]
default = "deepseek/deepseek-chat"
fallbacks = ["deepseek/deepseek-reasoner"]
aliases = {{ fast = "deepseek/deepseek-chat" }}
"#,
            secret.display()
        ))
        .unwrap()
    }

    #[test]
    fn an_openclaw_style_preset_is_valid_and_names_its_secret() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("api-key");
        std::fs::write(&key, "sk-test\n").unwrap();
        let p = openclaw(&key);
        p.validate("openclaw-deepseek", true).unwrap();
        assert_eq!(
            secret_files(&p.files[0].content).unwrap(),
            [key.to_str().unwrap()]
        );
        assert_eq!(p.files[0].mode, "0600");
    }

    #[test]
    fn each_mistake_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("api-key");
        std::fs::write(&key, "sk-test\n").unwrap();
        type Change = Box<dyn Fn(&mut Preset)>;
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|p| p.models.as_mut().unwrap().provider = "deepseek ".into()),
                "provider \"deepseek \" has a trailing space",
            ),
            (
                Box::new(|p| {
                    p.models.as_mut().unwrap().fallbacks = vec!["deepseek/deepseek-coder".into()]
                }),
                "fallback \"deepseek/deepseek-coder\" names a model the provider does not serve",
            ),
            (
                Box::new(|p| p.models.as_mut().unwrap().default = "openai/deepseek-chat".into()),
                "names provider \"openai\"; the preset's is \"deepseek\"",
            ),
            (
                Box::new(|p| p.models.as_mut().unwrap().default = "deepseek-chat".into()),
                "must be PROVIDER/MODEL",
            ),
            (
                Box::new(|p| {
                    p.models
                        .as_mut()
                        .unwrap()
                        .aliases
                        .insert("x".into(), "deepseek/deepseek-chat ".into());
                }),
                "has a trailing space",
            ),
            (Box::new(|p| p.version = " ".into()), "version is required"),
            (
                Box::new(|p| p.files[0].mode = "0666".into()),
                "not world-writable",
            ),
            (
                Box::new(|p| p.files[0].path = "/root/../etc/passwd".into()),
                "must be absolute",
            ),
            (
                Box::new(|p| p.files[0].content = "${FILE:/nonexistent/key}".into()),
                "secret file /nonexistent/key cannot be read",
            ),
            (
                Box::new(|p| p.files[0].content = "${FILE:relative}".into()),
                "must name an absolute path",
            ),
            (
                Box::new(|p| p.prechecks.push(" ".into())),
                "prechecks has an empty command",
            ),
        ];
        for (change, want) in cases {
            let mut p = openclaw(&key);
            change(&mut p);
            let e = p
                .validate("openclaw-deepseek", true)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
            assert!(e.starts_with("presets.openclaw-deepseek: "), "{e}");
        }
    }
}
