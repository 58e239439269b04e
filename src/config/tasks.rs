//! Task templates: operator-owned commands that agents may ask to run with
//! parameters, behind independent human approval (reference §3.10).
//!
//! A template fixes the command (`argv`, with `${name}` placeholders: a
//! whole argument, or attached to literal text as in `--opt=${name}`), the
//! profile it runs under, the JSON Schema its
//! parameters must satisfy (a closed object, Draft 2020-12, no external
//! references) and the outputs it must leave behind. Everything is checked
//! when the configuration loads: a template that cannot be used safely stops
//! the appliance from starting, with the reason.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::Digest;

/// Largest output a template may declare (bytes).
pub const MAX_OUTPUT_BYTES: u64 = 8 * 1024 * 1024;
/// Longest description (bytes).
pub const MAX_DESCRIPTION: usize = 1024;
/// Longest plan lifetime (30 days).
pub const MAX_PLAN_TTL: u64 = 30 * 24 * 3600;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TaskCommand {
    /// The program and its arguments; `${name}` (at most one per element,
    /// alone or with literal text around it) is replaced by the parameter
    /// `name`.
    pub argv: Vec<String>,
    #[serde(default = "default_cwd")]
    pub cwd: String,
}

fn default_cwd() -> String {
    "/workspace".into()
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    #[default]
    Json,
    Text,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Expose {
    /// The content is returned in the task's result.
    #[default]
    Content,
    /// Only its digest is.
    Digest,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TaskOutput {
    pub name: String,
    /// Under /workspace or /tmp.
    pub path: String,
    #[serde(default)]
    pub format: OutputFormat,
    #[serde(default)]
    pub expose: Expose,
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    #[serde(default = "yes")]
    pub required: bool,
    /// A JSON Schema the (JSON) output must satisfy.
    #[serde(default)]
    pub schema: Option<Value>,
}

fn default_max_bytes() -> u64 {
    64 * 1024
}

fn yes() -> bool {
    true
}

fn default_ttl() -> u64 {
    900
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Most approvals a template may require.
pub const MAX_APPROVALS: u32 = 10;

/// A rule that marks a parameter's value as risky (issue #36): the review
/// highlights it and the approval notification names it. A value is
/// risky when a string matches `pattern`, or a number is above `above` or
/// below `below`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RiskRule {
    /// A declared parameter (top level).
    pub parameter: String,
    /// A regular expression (Rust `regex` syntax) a string value is
    /// searched with: `(?i)\bdrop\s+table\b`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub above: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub below: Option<f64>,
    /// What makes it risky, in words for the approver (1..=200 bytes).
    pub note: String,
}

/// A parameter a rule found risky, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Risk {
    pub parameter: String,
    pub note: String,
}

/// Longest risk note (bytes).
pub const MAX_RISK_NOTE: usize = 200;

/// `[tasks.<name>]` in the configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TaskTemplate {
    pub description: String,
    /// The profile the task's sandbox is leased with.
    pub profile: String,
    /// JSON Schema of the parameters: `type = "object"` and
    /// `additionalProperties = false`.
    pub parameters: Value,
    pub command: TaskCommand,
    #[serde(default = "yes")]
    pub approval_required: bool,
    /// How long a plan stays valid for approval and submission.
    #[serde(default = "default_ttl")]
    pub plan_ttl_seconds: u64,
    #[serde(default)]
    pub outputs: Vec<TaskOutput>,
    /// Parameters whose value may start with `-` where it starts an
    /// argument (`"${name}"`, `"${name}.txt"`). Any other parameter in
    /// such a place is refused a leading `-` (it would be read as an
    /// option); after literal text (`"--opt=${name}"`) any value is fine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_leading_dash: Vec<String>,
    /// Approvals from distinct people a plan needs (1..=10): no person
    /// counts twice, the requester never counts.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub approvals_required: u32,
    /// A plan must say why it is asked for (`reason`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub reason_required: bool,
    /// Parameters may hold printable ASCII only (and spaces): anything
    /// else is refused when the plan is made.
    #[serde(default, skip_serializing_if = "is_false")]
    pub parameters_ascii_only: bool,
    /// Accept bidirectional controls (U+202E and the like) in parameters;
    /// refused by default, as they make text read other than it runs.
    #[serde(default, skip_serializing_if = "is_false")]
    pub allow_bidi_controls: bool,
    /// Values the approver should look at twice (`[[tasks.NAME.risk]]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub risk: Vec<RiskRule>,
    /// The approver group: the subjects who may decide on its plans
    /// (approvers of the plan's tenant, or admins, and one of these);
    /// empty: any approver of the tenant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvers: Vec<String>,
}

/// An `argv` element with a placeholder: the literal text before it, the
/// parameter's name, the literal text after it.
#[derive(Debug, PartialEq, Eq)]
struct Placeholder<'a> {
    prefix: &'a str,
    name: &'a str,
    suffix: &'a str,
}

/// The placeholder of an element (`None`: a literal), or why the element
/// is malformed (an unclosed `${`, an empty name, two placeholders).
fn placeholder(arg: &str) -> Result<Option<Placeholder<'_>>, PlaceholderError> {
    let Some((prefix, rest)) = arg.split_once("${") else {
        return Ok(None);
    };
    let Some((name, suffix)) = rest.split_once('}') else {
        return Err(PlaceholderError::Unclosed);
    };
    if name.is_empty() || name.contains('{') {
        return Err(PlaceholderError::Malformed);
    }
    if suffix.contains("${") {
        return Err(PlaceholderError::Several);
    }
    Ok(Some(Placeholder {
        prefix,
        name,
        suffix,
    }))
}

/// Reject references that leave the schema document.
fn local_refs_only(v: &Value, at: &str) -> Result<(), SchemaError> {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("$ref", Value::String(r)) if !r.starts_with('#') => {
                        return Err(SchemaError::ExternalRef {
                            at: at.to_string(),
                            reference: r.clone(),
                        });
                    }
                    ("$dynamicRef" | "$recursiveRef", Value::String(_)) => {
                        return Err(SchemaError::DynamicRef {
                            at: at.to_string(),
                            keyword: k.clone(),
                        });
                    }
                    _ => local_refs_only(x, at)?,
                }
            }
            Ok(())
        }
        Value::Array(a) => a.iter().try_for_each(|x| local_refs_only(x, at)),
        _ => Ok(()),
    }
}

/// A valid Draft 2020-12 schema that compiles here (no external references).
pub fn check_schema(schema: &Value, at: &str) -> Result<jsonschema::Validator, SchemaError> {
    local_refs_only(schema, at)?;
    jsonschema::draft202012::meta::validate(schema).map_err(|e| SchemaError::NotSchema {
        at: at.to_string(),
        source: Box::new(e.to_owned()),
    })?;
    // Offline: nothing outside the schema is ever fetched, whatever the
    // crate's features.
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .offline()
        .build(schema)
        .map_err(|e| SchemaError::Compile {
            at: at.to_string(),
            source: Box::new(e),
        })
}

/// A template's schemas, compiled once (at start).
pub struct Compiled {
    pub parameters: jsonschema::Validator,
    /// One per output, in order (`None`: no schema).
    pub outputs: Vec<Option<jsonschema::Validator>>,
    /// One per risk rule, in order (`None`: no pattern).
    pub risk: Vec<Option<regex::Regex>>,
}

/// A risk rule's pattern, compiled (at most 1 MiB of automaton).
fn risk_pattern(p: &str) -> Result<regex::Regex, regex::Error> {
    regex::RegexBuilder::new(p).size_limit(1 << 20).build()
}

impl TaskTemplate {
    pub fn compile(&self) -> Result<Compiled, CompileError> {
        Ok(Compiled {
            parameters: check_schema(&self.parameters, "parameters")?,
            outputs: self
                .outputs
                .iter()
                .map(|o| {
                    o.schema
                        .as_ref()
                        .map(|s| check_schema(s, "output"))
                        .transpose()
                })
                .collect::<Result<_, _>>()?,
            risk: self
                .risk
                .iter()
                .map(|r| r.pattern.as_deref().map(risk_pattern).transpose())
                .collect::<Result<_, _>>()
                .map_err(CompileError::Pattern)?,
        })
    }

    /// Everything that must hold before the template may be used.
    pub fn validate(&self, name: &str, profiles: &[&str]) -> Result<(), TemplateError> {
        if !super::valid_profile_name(name) {
            return Err(TemplateError::Name(name.to_string()));
        }
        self.check(profiles)
            .map_err(|problem| TemplateError::Invalid {
                task: name.to_string(),
                problem,
            })
    }

    /// [`Self::validate`]'s checks of the template, its name aside.
    fn check(&self, profiles: &[&str]) -> Result<(), TemplateProblem> {
        use TemplateProblem as P;
        if self.description.trim().is_empty() || self.description.len() > MAX_DESCRIPTION {
            return Err(P::Description);
        }
        if !profiles.contains(&self.profile.as_str()) {
            return Err(P::Profile(self.profile.clone()));
        }
        if self.parameters.get("type") != Some(&json!("object"))
            || self.parameters.get("additionalProperties") != Some(&json!(false))
        {
            return Err(P::NotClosed);
        }
        check_schema(&self.parameters, "parameters")?;
        let declared: Vec<&str> = self
            .parameters
            .get("properties")
            .and_then(Value::as_object)
            .map(|m| m.keys().map(String::as_str).collect())
            .unwrap_or_default();
        if self.command.argv.is_empty() {
            return Err(P::EmptyArgv);
        }
        for a in &self.command.argv {
            if a.is_empty() {
                return Err(P::EmptyArg);
            }
            match placeholder(a) {
                Ok(Some(p)) if declared.contains(&p.name) => {}
                Ok(Some(p)) => return Err(P::Undeclared(p.name.to_string())),
                Err(why) => {
                    return Err(P::Element {
                        arg: a.clone(),
                        why,
                    });
                }
                Ok(None) => {}
            }
        }
        if let Some(n) = self
            .allow_leading_dash
            .iter()
            .find(|n| !declared.contains(&n.as_str()))
        {
            return Err(P::LeadingDash(n.clone()));
        }
        super::paths::check(&self.command.cwd).map_err(P::Cwd)?;
        if self.approvals_required == 0 || self.approvals_required > MAX_APPROVALS {
            return Err(P::Approvals);
        }
        if self.approvals_required > 1 && !self.approval_required {
            return Err(P::ApprovalsWithout(self.approvals_required));
        }
        for r in &self.risk {
            r.check(&declared).map_err(|problem| P::Risk {
                parameter: r.parameter.clone(),
                problem,
            })?;
        }
        for a in &self.approvers {
            if a.trim().is_empty() || a.len() > 128 || a.trim() != a {
                return Err(P::Approvers);
            }
        }
        if !self.approvers.is_empty() && self.approvals_required as usize > self.approvers.len() {
            return Err(P::TooFewApprovers {
                required: self.approvals_required,
                named: self.approvers.len(),
            });
        }
        if !self.approvers.is_empty() && !self.approval_required {
            return Err(P::ApproversWithout);
        }
        if self.parameters_ascii_only && self.allow_bidi_controls {
            return Err(P::Contradiction);
        }
        if self.plan_ttl_seconds == 0 || self.plan_ttl_seconds > MAX_PLAN_TTL {
            return Err(P::PlanTtl);
        }
        let mut names = vec![];
        for o in &self.outputs {
            if !super::valid_profile_name(&o.name) {
                return Err(P::OutputName(o.name.clone()));
            }
            let twice = names.contains(&o.name.as_str());
            names.push(o.name.as_str());
            o.check(twice).map_err(|problem| P::Output {
                name: o.name.clone(),
                problem,
            })?;
        }
        Ok(())
    }

    /// SHA-256 of what the template makes run (the description aside): a
    /// plan made under one digest is never approved, submitted or finalized
    /// under another.
    pub fn digest(&self, name: &str) -> String {
        let mut v = json!({
            "name": name,
            "profile": self.profile,
            "parameters": self.parameters,
            "argv": self.command.argv,
            "cwd": self.command.cwd,
            "approval_required": self.approval_required,
            "plan_ttl_seconds": self.plan_ttl_seconds,
            "outputs": self.outputs,
        });
        // Only when set: the digests of other templates stay the
        // reference's.
        if let Some(m) = v.as_object_mut() {
            if !self.allow_leading_dash.is_empty() {
                m.insert("allow_leading_dash".into(), json!(self.allow_leading_dash));
            }
            if self.approvals_required != 1 {
                m.insert("approvals_required".into(), json!(self.approvals_required));
            }
            if !self.risk.is_empty() {
                m.insert("risk".into(), json!(self.risk));
            }
            if !self.approvers.is_empty() {
                m.insert("approvers".into(), json!(self.approvers));
            }
            for (k, on) in [
                ("reason_required", self.reason_required),
                ("parameters_ascii_only", self.parameters_ascii_only),
                ("allow_bidi_controls", self.allow_bidi_controls),
            ] {
                if on {
                    m.insert(k.into(), json!(true));
                }
            }
        }
        hex::encode(sha2::Sha256::digest(canonical(&v).as_bytes()))
    }

    /// What agents and approvers see: no output paths, no sizes.
    pub fn contract(&self, name: &str) -> Value {
        json!({
            "name": name,
            "description": self.description,
            "profile": self.profile,
            "parameters": self.parameters,
            "approval_required": self.approval_required,
            "plan_ttl_seconds": self.plan_ttl_seconds,
            "outputs": self.outputs.iter().map(|o| json!({
                "name": o.name, "format": o.format, "expose": o.expose, "required": o.required,
            })).collect::<Vec<_>>(),
            "template_sha256": self.digest(name),
        })
    }

    /// The risky values of `params` (already validated): one entry per
    /// rule that matches, in the rules' order. `compiled` is this
    /// template's (its patterns compiled once, with the policy).
    pub fn risks(&self, compiled: &Compiled, params: &Value) -> Vec<Risk> {
        self.risk
            .iter()
            .zip(&compiled.risk)
            .filter(|(r, re)| {
                let v = params.get(&r.parameter);
                let by_pattern = match (re, v) {
                    (Some(re), Some(Value::String(s))) => re.is_match(s),
                    _ => false,
                };
                let n = v.and_then(Value::as_f64);
                let by_range = n.is_some_and(|n| {
                    r.above.is_some_and(|a| n > a) || r.below.is_some_and(|b| n < b)
                });
                by_pattern || by_range
            })
            .map(|(r, _)| Risk {
                parameter: r.parameter.clone(),
                note: r.note.clone(),
            })
            .collect()
    }

    /// The shell command for `params` (already validated against the
    /// schema): each placeholder becomes the parameter's value, and every
    /// element is shell-quoted. Null, arrays and objects cannot stand for an
    /// argument; a value that would start an argument with `-` is refused
    /// unless `allow_leading_dash` names its parameter.
    pub fn render(&self, params: &Value) -> Result<String, RenderError> {
        let mut out = Vec::with_capacity(self.command.argv.len());
        for a in &self.command.argv {
            let s = match placeholder(a)? {
                Some(Placeholder {
                    prefix,
                    name: p,
                    suffix,
                }) => {
                    let v = Self::value(params, p)?;
                    if prefix.is_empty()
                        && v.starts_with('-')
                        && !self.allow_leading_dash.iter().any(|n| n == p)
                    {
                        return Err(RenderError::LeadingDash(p.to_string()));
                    }
                    format!("{prefix}{v}{suffix}")
                }
                None => a.clone(),
            };
            out.push(shell_quote(&s));
        }
        Ok(out.join(" "))
    }

    /// A parameter's value as an argument.
    fn value(params: &Value, p: &str) -> Result<String, RenderError> {
        Ok(match params.get(p) {
            Some(Value::String(s)) if s.contains('\0') => {
                return Err(RenderError::Nul(p.to_string()));
            }
            Some(Value::String(s)) => s.clone(),
            Some(Value::Bool(b)) => b.to_string(),
            Some(Value::Number(n)) => n.to_string(),
            Some(_) => return Err(RenderError::NotScalar(p.to_string())),
            None => return Err(RenderError::Missing(p.to_string())),
        })
    }
}

impl RiskRule {
    /// The rule's own settings; `declared`: the template's parameters.
    fn check(&self, declared: &[&str]) -> Result<(), RiskProblem> {
        if !declared.contains(&self.parameter.as_str()) {
            return Err(RiskProblem::Undeclared);
        }
        if self.note.trim().is_empty() || self.note.len() > MAX_RISK_NOTE {
            return Err(RiskProblem::Note);
        }
        if self.pattern.is_none() && self.above.is_none() && self.below.is_none() {
            return Err(RiskProblem::NoTest);
        }
        if let Some(p) = &self.pattern {
            risk_pattern(p).map_err(RiskProblem::Pattern)?;
        }
        Ok(())
    }
}

impl TaskOutput {
    /// The output's own settings; `twice`: an earlier output has its name.
    fn check(&self, twice: bool) -> Result<(), OutputProblem> {
        if twice {
            return Err(OutputProblem::Twice);
        }
        super::paths::check(&self.path)?;
        if self.max_bytes == 0 || self.max_bytes > MAX_OUTPUT_BYTES {
            return Err(OutputProblem::MaxBytes);
        }
        if let Some(s) = &self.schema {
            if self.format != OutputFormat::Json {
                return Err(OutputProblem::NotJson);
            }
            check_schema(s, "schema")?;
        }
        Ok(())
    }
}

/// Why a task template is refused when the configuration loads.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A name that is not a profile-style name.
    #[error("task template name '{0}' must match ^[a-z][a-z0-9-]{{0,62}}$")]
    Name(String),
    /// The template named `task` cannot be used safely.
    #[error("task {task}: {problem}")]
    Invalid {
        task: String,
        #[source]
        problem: TemplateProblem,
    },
}

/// What is wrong in a task template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateProblem {
    #[error("description is required (at most {max} bytes)", max = MAX_DESCRIPTION)]
    Description,
    /// Its profile is not configured.
    #[error("profile '{0}' is not defined")]
    Profile(String),
    #[error(
        "parameters must be a closed object schema (type = \"object\", additionalProperties = false)"
    )]
    NotClosed,
    /// The parameters' schema (`at`: `parameters`).
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("command.argv must not be empty")]
    EmptyArgv,
    #[error("command.argv has an empty element")]
    EmptyArg,
    /// A placeholder of a parameter the schema does not declare.
    #[error("command.argv uses ${{{0}}}, which parameters do not declare")]
    Undeclared(String),
    /// A malformed element of `argv`.
    #[error("command.argv element '{arg}': {why}")]
    Element {
        arg: String,
        #[source]
        why: PlaceholderError,
    },
    #[error("allow_leading_dash names '{0}', which parameters do not declare")]
    LeadingDash(String),
    #[error("command.cwd: {0}")]
    Cwd(#[source] super::paths::PathError),
    #[error("approvals_required must be 1..={max}", max = MAX_APPROVALS)]
    Approvals,
    #[error("approvals_required = {0} needs approval_required = true")]
    ApprovalsWithout(u32),
    /// A `[[tasks.NAME.risk]]` rule, by its parameter.
    #[error("risk rule for '{parameter}': {problem}")]
    Risk {
        parameter: String,
        #[source]
        problem: RiskProblem,
    },
    #[error("approvers names subjects (1 to 128 bytes, no surrounding spaces)")]
    Approvers,
    #[error("approvals_required = {required} but approvers names only {named}")]
    TooFewApprovers { required: u32, named: usize },
    #[error("approvers needs approval_required = true")]
    ApproversWithout,
    #[error("parameters_ascii_only and allow_bidi_controls contradict each other")]
    Contradiction,
    #[error("plan_ttl_seconds must be 1..={max}", max = MAX_PLAN_TTL)]
    PlanTtl,
    #[error("output name '{0}' must match ^[a-z][a-z0-9-]{{0,62}}$")]
    OutputName(String),
    /// An output, by its name.
    #[error("output {name}: {problem}")]
    Output {
        name: String,
        #[source]
        problem: OutputProblem,
    },
}

/// What is wrong in a risk rule.
#[derive(Debug, thiserror::Error)]
pub enum RiskProblem {
    #[error("parameters do not declare it")]
    Undeclared,
    #[error("note is required (at most {max} bytes)", max = MAX_RISK_NOTE)]
    Note,
    #[error("give pattern, above or below")]
    NoTest,
    #[error("pattern: {0}")]
    Pattern(#[source] regex::Error),
}

/// What is wrong in a declared output.
#[derive(Debug, thiserror::Error)]
pub enum OutputProblem {
    #[error("the name is used twice")]
    Twice,
    #[error(transparent)]
    Path(#[from] super::paths::PathError),
    #[error("max_bytes must be 1..={max}", max = MAX_OUTPUT_BYTES)]
    MaxBytes,
    #[error("a schema needs format = \"json\"")]
    NotJson,
    /// Its schema (`at`: `schema`).
    #[error(transparent)]
    Schema(#[from] SchemaError),
}

/// Why a JSON Schema is refused; `at` says whose, as messages name it.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// A reference that leaves the document.
    #[error("{at}: $ref '{reference}' leaves the schema (only #… references are allowed)")]
    ExternalRef { at: String, reference: String },
    /// `$dynamicRef` or `$recursiveRef`.
    #[error("{at}: {keyword} is not allowed")]
    DynamicRef { at: String, keyword: String },
    /// Not a Draft 2020-12 schema.
    #[error("{at}: not a valid JSON Schema (Draft 2020-12): {source}")]
    NotSchema {
        at: String,
        source: Box<jsonschema::ValidationError<'static>>,
    },
    /// A schema that does not compile here.
    #[error("{at}: {source}")]
    Compile {
        at: String,
        source: Box<jsonschema::ValidationError<'static>>,
    },
}

/// Why a template's schemas or risk patterns do not compile (they were
/// checked when the configuration loaded).
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The parameters' (`at`: `parameters`) or an output's (`output`).
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("pattern: {0}")]
    Pattern(#[source] regex::Error),
}

/// Why an `argv` element's placeholder is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceholderError {
    #[error("an unclosed \"${{\"")]
    Unclosed,
    #[error("a placeholder is \"${{name}}\"")]
    Malformed,
    #[error("at most one placeholder per element")]
    Several,
}

/// Why parameters cannot make the command (400 `invalid_parameters`);
/// each names the parameter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// A malformed element (refused at load: only if the check is skipped).
    #[error(transparent)]
    Placeholder(#[from] PlaceholderError),
    /// A value that would start an argument with `-`.
    #[error("{0}: must not start with '-' here (it would be read as an option)")]
    LeadingDash(String),
    #[error("{0}: must not contain NUL")]
    Nul(String),
    /// Null, an array or an object.
    #[error("{0}: must be a string, number or boolean")]
    NotScalar(String),
    #[error("{0}: is required by the command")]
    Missing(String),
}

/// Python's `shlex.quote`, so that rendered commands (and their digests)
/// match the reference's.
pub fn shell_quote(s: &str) -> String {
    if s.is_empty() {
        return "''".into();
    }
    let safe = s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"@%+=:,./-_".contains(&b));
    if safe {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\"'\"'"))
    }
}

/// Canonical JSON: keys sorted at every level, no spaces, non-ASCII as is
/// (Python's `json.dumps(sort_keys=True, separators=(",", ":"),
/// ensure_ascii=False)` for the values used here).
pub fn canonical(v: &Value) -> String {
    fn walk(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let sorted: BTreeMap<&String, &Value> = m.iter().collect();
                out.push('{');
                for (i, (k, x)) in sorted.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    walk(x, out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    walk(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut s = String::new();
    walk(v, &mut s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> TaskTemplate {
        TaskTemplate {
            description: "train".into(),
            profile: "offline-code".into(),
            parameters: json!({
                "type": "object", "additionalProperties": false,
                "required": ["epochs"],
                "properties": {"epochs": {"type": "integer", "minimum": 1}, "name": {"type": "string"}},
            }),
            command: TaskCommand {
                argv: vec![
                    "train".into(),
                    "--epochs".into(),
                    "${epochs}".into(),
                    "${name}".into(),
                ],
                cwd: "/workspace".into(),
            },
            approval_required: true,
            plan_ttl_seconds: 900,
            outputs: vec![],
            allow_leading_dash: vec![],
            approvals_required: 1,
            reason_required: false,
            parameters_ascii_only: false,
            allow_bidi_controls: false,
            risk: vec![],
            approvers: vec![],
        }
    }

    #[test]
    fn risky_values_are_named() {
        let mut t = template();
        t.risk = vec![
            RiskRule {
                parameter: "epochs".into(),
                pattern: None,
                above: Some(10.0),
                below: None,
                note: "a long run".into(),
            },
            RiskRule {
                parameter: "name".into(),
                pattern: Some(r"(?i)\bdrop\s+table\b|rm\s+-rf".into()),
                above: None,
                below: None,
                note: "destructive".into(),
            },
        ];
        t.validate("train", &["offline-code"]).unwrap();
        let c = t.compile().unwrap();
        assert!(t.risks(&c, &json!({"epochs": 3, "name": "x"})).is_empty());
        let r = t.risks(
            &c,
            &json!({"epochs": 30, "name": "please DROP  table users"}),
        );
        let notes: Vec<&str> = r.iter().map(|r| r.note.as_str()).collect();
        assert_eq!(notes, ["a long run", "destructive"]);
        assert_ne!(t.digest("train"), template().digest("train"));
        let mut bad = t.clone();
        bad.risk[1].pattern = Some("(".into());
        assert!(
            bad.validate("train", &["offline-code"])
                .unwrap_err()
                .to_string()
                .contains("pattern")
        );
        let mut bad = t.clone();
        bad.approvers = vec!["alice".into()];
        bad.approvals_required = 2;
        assert!(
            bad.validate("train", &["offline-code"])
                .unwrap_err()
                .to_string()
                .contains("approvers names only 1")
        );
        bad.approvals_required = 1;
        bad.validate("train", &["offline-code"]).unwrap();
        assert_ne!(bad.digest("train"), t.digest("train"));
        let mut bad = t.clone();
        bad.risk[0].parameter = "nope".into();
        assert!(
            bad.validate("train", &["offline-code"])
                .unwrap_err()
                .to_string()
                .contains("do not declare")
        );
    }

    #[test]
    fn validation() {
        let p = ["offline-code"];
        template().validate("train", &p).unwrap();
        // Attached to literal text is fine; one placeholder per element.
        let mut t = template();
        t.command.argv[2] = "--e=${epochs}".into();
        t.validate("train", &p).unwrap();
        for (bad, why) in [
            ("--e=${epochs}${name}", "at most one placeholder"),
            ("--e=${epochs", "unclosed"),
            ("--e=${}", "a placeholder is"),
        ] {
            let mut t = template();
            t.command.argv[2] = bad.into();
            let e = t.validate("train", &p).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let mut t = template();
        t.allow_leading_dash = vec!["nope".into()];
        assert!(
            t.validate("train", &p)
                .unwrap_err()
                .to_string()
                .contains("allow_leading_dash")
        );
        let mut t = template();
        t.command.argv[2] = "${nope}".into();
        assert!(
            t.validate("train", &p)
                .unwrap_err()
                .to_string()
                .contains("do not declare")
        );
        let mut t = template();
        t.parameters["additionalProperties"] = json!(true);
        assert!(
            t.validate("train", &p)
                .unwrap_err()
                .to_string()
                .contains("closed object")
        );
        let mut t = template();
        t.parameters["properties"]["x"] = json!({"$ref": "https://example.invalid/s.json"});
        assert!(
            t.validate("train", &p)
                .unwrap_err()
                .to_string()
                .contains("leaves the schema")
        );
        let mut t = template();
        t.parameters["properties"]["x"] = json!({"type": "strong"});
        assert!(
            t.validate("train", &p)
                .unwrap_err()
                .to_string()
                .contains("JSON Schema")
        );
        let mut t = template();
        t.profile = "nope".into();
        assert!(t.validate("train", &p).is_err());
        let mut t = template();
        t.command.cwd = "/etc".into();
        assert!(t.validate("train", &p).is_err());
        assert!(template().validate("Bad_Name", &p).is_err());
    }

    #[test]
    fn rendering_quotes_like_shlex() {
        let t = template();
        let c = t.render(&json!({"epochs": 3, "name": "a b'c"})).unwrap();
        assert_eq!(c, "train --epochs 3 'a b'\"'\"'c'");
        assert!(t.render(&json!({"epochs": [1], "name": "x"})).is_err());
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a/b.c:d=e"), "a/b.c:d=e");
        assert_eq!(shell_quote("$(id)"), "'$(id)'");
    }

    /// A value that would start an argument with `-` is refused (option
    /// injection, issue #34 L2) unless the template allows it for that
    /// parameter; after literal text it is only a value.
    #[test]
    fn leading_dashes_start_no_option() {
        let t = template();
        let e = t
            .render(&json!({"epochs": 3, "name": "-rf"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("name: must not start with '-'"), "{e}");
        assert!(t.render(&json!({"epochs": -3, "name": "x"})).is_err());
        let mut t = template();
        t.command.argv[3] = "--name=${name}".into();
        assert_eq!(
            t.render(&json!({"epochs": 3, "name": "-rf x"})).unwrap(),
            "train --epochs 3 '--name=-rf x'"
        );
        t.command.argv[3] = "${name}.txt".into();
        assert!(t.render(&json!({"epochs": 3, "name": "-o"})).is_err());
        assert_eq!(
            t.render(&json!({"epochs": 3, "name": "o"})).unwrap(),
            "train --epochs 3 o.txt"
        );
        t.allow_leading_dash = vec!["name".into()];
        assert_eq!(
            t.render(&json!({"epochs": 3, "name": "-o"})).unwrap(),
            "train --epochs 3 -o.txt"
        );
        assert!(t.render(&json!({"epochs": -3, "name": "o"})).is_err());
        // Only a template that sets it digests it.
        let base = template();
        assert!(!canonical(&serde_json::to_value(&base).unwrap()).contains("allow_leading_dash"));
        assert_ne!(base.digest("train"), t.digest("train"));
    }

    #[test]
    fn canonical_json_and_digest() {
        assert_eq!(
            canonical(&json!({"b": 1, "a": {"d": [1, "é"], "c": null}})),
            r#"{"a":{"c":null,"d":[1,"é"]},"b":1}"#
        );
        let t = template();
        let mut t2 = template();
        t2.description = "other words".into();
        assert_eq!(
            t.digest("train"),
            t2.digest("train"),
            "the description is not covered"
        );
        t2.command.argv.push("--more".into());
        assert_ne!(t.digest("train"), t2.digest("train"));
        assert!(t.contract("train").get("outputs").is_some());
    }
}
