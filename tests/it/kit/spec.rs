//! `docs/openapi.yaml` as the tests' oracle: every JSON answer the kit
//! receives (`Server::get`/`post`, `ProcRig::call`) is checked against the
//! schema the document gives for its operation and status (JSON Schema
//! 2020-12, with the `jsonschema` crate the appliance itself uses), so the
//! spec and the code cannot drift apart unseen.
//!
//! A status the operation does not list falls to its `default` response
//! (an operation without one is a failure); a path or method the document
//! does not know must be answered 404 or 405 with an `Error`. Each check is remembered (`Spec::seen`), so a
//! test can ask which operations have been seen answering.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::{Value, json};

/// The document, its validators by JSON pointer, and what has been checked.
pub struct Spec {
    pub doc: Value,
    validators: Mutex<HashMap<String, Arc<jsonschema::Validator>>>,
    seen: Mutex<BTreeSet<(String, String, u16)>>,
}

/// The one parsed `docs/openapi.yaml` of this test process.
pub fn spec() -> &'static Spec {
    static SPEC: OnceLock<Spec> = OnceLock::new();
    SPEC.get_or_init(|| {
        let doc: Value = serde_norway::from_str(cube_adapter::api::OPENAPI)
            .expect("docs/openapi.yaml is valid YAML");
        Spec {
            doc,
            validators: Mutex::new(HashMap::new()),
            seen: Mutex::new(BTreeSet::new()),
        }
    })
}

/// Read an answer (its JSON body, or null when it has none) and check it
/// against the document; panic with what differs.
pub async fn answer(method: &str, r: reqwest::Response) -> (reqwest::StatusCode, Value) {
    let status = r.status();
    let url = r.url().to_string();
    let json = r
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    let body = if json {
        let b = r.bytes().await.unwrap();
        serde_json::from_slice(&b).unwrap_or_else(|e| {
            panic!(
                "{method} {url} answered {status} with JSON that does not parse ({e}): {}",
                String::from_utf8_lossy(&b)
            )
        })
    } else {
        Value::Null
    };
    if json && let Err(e) = spec().check(method, &url, status.as_u16(), &body) {
        panic!("{method} {url} answered {status} outside docs/openapi.yaml: {e}");
    }
    (status, body)
}

/// `/` and `~` escaped for a JSON pointer segment.
fn esc(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

impl Spec {
    /// The documented path template a request path falls under (the one
    /// with the most literal segments).
    pub fn template(&self, path: &str) -> Option<String> {
        let path = path.split('?').next().unwrap_or(path);
        let segs: Vec<&str> = path.split('/').collect();
        let paths = self.doc["paths"].as_object()?;
        paths
            .keys()
            .filter_map(|t| {
                let ts: Vec<&str> = t.split('/').collect();
                if ts.len() != segs.len() {
                    return None;
                }
                let mut literal = 0;
                for (a, b) in ts.iter().zip(&segs) {
                    if a.starts_with('{') && a.ends_with('}') {
                        if b.is_empty() {
                            return None;
                        }
                    } else if a == b {
                        literal += 1;
                    } else {
                        return None;
                    }
                }
                Some((literal, t.clone()))
            })
            .max()
            .map(|(_, t)| t)
    }

    /// Follow an OpenAPI `$ref` (`#/…`) to the pointer it names.
    fn deref(&self, pointer: String) -> Result<String, String> {
        let mut p = pointer;
        for _ in 0..8 {
            let v = self
                .doc
                .pointer(&p)
                .ok_or_else(|| format!("nothing at {p}"))?;
            match v.get("$ref").and_then(Value::as_str) {
                Some(r) => p = r.trim_start_matches('#').to_string(),
                None => return Ok(p),
            }
        }
        Err(format!("a $ref loop at {p}"))
    }

    /// The pointer to the schema of an operation's answer in `media`, or
    /// `None` when the answer is documented without one.
    pub fn answer_schema(
        &self,
        method: &str,
        url: &str,
        status: u16,
        media: &str,
    ) -> Result<Option<String>, String> {
        let path = url
            .split_once("://")
            .and_then(|(_, rest)| rest.find('/').map(|i| &rest[i..]))
            .unwrap_or(url);
        // A route the document does not have is answered 404 (405 for a
        // method a path does not take) with an error, as `Error`.
        let unknown = |what: String| {
            if matches!(status, 404 | 405) && media == "application/json" {
                Ok(Some("/components/schemas/Error".to_string()))
            } else {
                Err(format!("{what}, and the answer is not 404 or 405"))
            }
        };
        let Some(t) = self.template(path) else {
            return unknown(format!("no path of the document matches {path}"));
        };
        let op = format!("/paths/{}/{}", esc(&t), method.to_ascii_lowercase());
        if self.doc.pointer(&op).is_none() {
            return unknown(format!("{t} documents no {method}"));
        }
        let key = status.to_string();
        let resp = [key.as_str(), &format!("{}XX", status / 100), "default"]
            .into_iter()
            .map(|k| format!("{op}/responses/{}", esc(k)))
            .find(|p| self.doc.pointer(p).is_some())
            .ok_or_else(|| format!("{method} {t} documents no {status} and no default"))?;
        let resp = self.deref(resp)?;
        self.seen
            .lock()
            .unwrap()
            .insert((method.to_ascii_uppercase(), t, status));
        let schema = format!("{resp}/content/{}/schema", esc(media));
        if self.doc.pointer(&schema).is_none() {
            return Ok(None);
        }
        Ok(Some(schema))
    }

    /// Check one answer against its documented schema.
    pub fn check(&self, method: &str, url: &str, status: u16, body: &Value) -> Result<(), String> {
        match self.answer_schema(method, url, status, "application/json")? {
            Some(pointer) => self.validate(&pointer, body),
            None => Ok(()),
        }
    }

    /// Check the events of a `text/event-stream` answer, each as
    /// `{"event", "data", "id"?}`, against the stream's documented schema.
    pub fn check_events(&self, method: &str, url: &str, events: &[Value]) -> Result<(), String> {
        let pointer = self
            .answer_schema(method, url, 200, "text/event-stream")?
            .ok_or_else(|| format!("{method} {url} documents no text/event-stream"))?;
        events.iter().try_for_each(|e| self.validate(&pointer, e))
    }

    fn validate(&self, pointer: &str, body: &Value) -> Result<(), String> {
        let v = self.validator(pointer)?;
        let errors: Vec<String> = v
            .iter_errors(body)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .take(5)
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "schema {pointer}: {}\nanswer: {body}",
                errors.join("; ")
            ))
        }
    }

    /// The validator of the schema at `pointer`: the whole document as the
    /// root (its `#/components/…` references resolve in it) with a `$ref`
    /// to that schema.
    pub fn validator(&self, pointer: &str) -> Result<Arc<jsonschema::Validator>, String> {
        if let Some(v) = self.validators.lock().unwrap().get(pointer) {
            return Ok(v.clone());
        }
        let mut root = self.doc.clone();
        // A URI fragment: `{` and `}` (path templates) percent-encoded.
        let fragment = pointer.replace('{', "%7B").replace('}', "%7D");
        root["$ref"] = json!(format!("#{fragment}"));
        let v = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .build(&root)
            .map_err(|e| format!("the schema at {pointer} does not compile: {e}"))?;
        let v = Arc::new(v);
        self.validators
            .lock()
            .unwrap()
            .insert(pointer.to_string(), v.clone());
        Ok(v)
    }

    /// Every (method, template, status) checked so far in this process.
    pub fn seen(&self) -> BTreeSet<(String, String, u16)> {
        self.seen.lock().unwrap().clone()
    }

    /// Every (method, template) the document has.
    pub fn operations(&self) -> Vec<(String, String)> {
        let mut out = vec![];
        for (t, item) in self.doc["paths"].as_object().into_iter().flatten() {
            for m in ["get", "post", "delete", "put", "patch"] {
                if item.get(m).is_some() {
                    out.push((m.to_ascii_uppercase(), t.clone()));
                }
            }
        }
        out
    }
}
