//! Signed execution receipts.
//!
//! A receipt is `{payload, signature, signatures}`:
//! - `signature` is the reference adapter's HS256 envelope
//!   (`{alg: "HS256", kid: "hmac-" + sha256(key)[:12], value}`, the value
//!   being base64url(HMAC-SHA256(key, canonical JSON of the payload))), so
//!   its verifier works unchanged with a shared key;
//! - `signatures` adds an Ed25519 signature over the same bytes, which anyone
//!   holding the appliance's public key (`STATE/receipt-ed25519.pub`, or
//!   `GET /v1/receipts/public-key`) can check offline:
//!   `cube-adapter receipt verify`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64URL;
use hmac::{Hmac, Mac};
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use serde_json::{Value, json};
use sha2::Digest;

use crate::config::tasks::canonical;
use crate::store::Sealer;

/// The sealed private key, under the state directory.
pub const KEY_FILE: &str = "receipt-ed25519.key";
/// The public key (base64url of the raw 32 bytes), for verifiers.
pub const PUBLIC_FILE: &str = "receipt-ed25519.pub";

#[derive(Clone)]
pub struct Signer {
    hs_key: Arc<[u8]>,
    ed: Arc<Ed25519KeyPair>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer(***)")
    }
}

fn hs_kid(key: &[u8]) -> String {
    format!("hmac-{}", &hex::encode(sha2::Sha256::digest(key))[..12])
}

fn ed_kid(public: &[u8]) -> String {
    format!(
        "ed25519-{}",
        &hex::encode(sha2::Sha256::digest(public))[..12]
    )
}

fn hs256(key: &[u8], msg: &[u8]) -> Option<String> {
    let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(key).ok()?;
    m.update(msg);
    Some(B64URL.encode(m.finalize().into_bytes()))
}

/// The HS256 key derived from the appliance's secret (when no key file is
/// configured).
pub fn derived_hs_key(appliance_key: &[u8]) -> Vec<u8> {
    let mut m = match <Hmac<sha2::Sha256> as Mac>::new_from_slice(appliance_key) {
        Ok(m) => m,
        Err(_) => return vec![],
    };
    m.update(b"cube-adapter receipt hs256 v1");
    m.finalize().into_bytes().to_vec()
}

/// Why a receipt key (the HS256 key file, the Ed25519 key pair, a public
/// key file) could not be read or made.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: a receipt HMAC key must be at least 32 bytes", path.display())]
    ShortHmacKey { path: PathBuf },
    /// The sealed private key does not open under the store key.
    #[error("{}: {source}", path.display())]
    Unseal {
        path: PathBuf,
        #[source]
        source: crate::secrets::SecretsError,
    },
    #[error("could not generate the receipt signing key")]
    Generate,
    #[error("seal the receipt key: {0}")]
    Seal(#[source] crate::secrets::SecretsError),
    /// The private or the public key file could not be written.
    #[error(transparent)]
    Write(#[from] crate::tls::TlsError),
    #[error("{}: not an Ed25519 key", path.display())]
    NotEd25519 { path: PathBuf },
    #[error("{}: no public_key field", path.display())]
    NoPublicKeyField { path: PathBuf },
    #[error("{}: not a base64url Ed25519 public key", path.display())]
    NotBase64 { path: PathBuf },
    #[error("{}: an Ed25519 public key is 32 bytes", path.display())]
    PublicKeyLength { path: PathBuf },
}

/// A failed read of `path`, for `map_err`.
fn read_error(path: &Path) -> impl FnOnce(std::io::Error) -> KeyError {
    let path = path.to_path_buf();
    move |source| KeyError::Read { path, source }
}

/// Why a document is not a receipt that can be checked.
#[derive(Debug, thiserror::Error)]
pub enum ReceiptError {
    /// Not JSON, or JSON with a key twice (`parse_strict`).
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("ambiguous: both a receipt and a payload at the top level")]
    Ambiguous,
    #[error("not a receipt: no payload object")]
    NoPayload,
}

/// A configured HS256 key file: at least 32 bytes (surrounding whitespace
/// ignored).
pub fn read_hs_key(path: &Path) -> Result<Vec<u8>, KeyError> {
    let raw = std::fs::read(path).map_err(read_error(path))?;
    let key = raw.trim_ascii().to_vec();
    if key.len() < 32 {
        return Err(KeyError::ShortHmacKey {
            path: path.to_path_buf(),
        });
    }
    Ok(key)
}

impl Signer {
    /// Load the Ed25519 key from `state` (sealed under the store key),
    /// creating it on first use, and write the public key beside it.
    pub fn load_or_create(
        state: &Path,
        sealer: &Sealer,
        hs_key: Vec<u8>,
    ) -> Result<Self, KeyError> {
        let path = state.join(KEY_FILE);
        let pkcs8 = match std::fs::read_to_string(&path) {
            Ok(sealed) => sealer
                .open(sealed.trim())
                .map_err(|source| KeyError::Unseal {
                    path: path.clone(),
                    source,
                })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let doc = Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new())
                    .map_err(|_| KeyError::Generate)?;
                let sealed = sealer.seal(doc.as_ref()).map_err(KeyError::Seal)?;
                crate::tls::write_private(&path, format!("{sealed}\n").as_bytes(), 0o600)?;
                doc.as_ref().to_vec()
            }
            Err(e) => return Err(read_error(&path)(e)),
        };
        let ed = Ed25519KeyPair::from_pkcs8(&pkcs8)
            .map_err(|_| KeyError::NotEd25519 { path: path.clone() })?;
        let public = format!("{}\n", B64URL.encode(ed.public_key().as_ref()));
        let pub_path = state.join(PUBLIC_FILE);
        if std::fs::read_to_string(&pub_path).ok().as_deref() != Some(public.as_str()) {
            crate::tls::write_private(&pub_path, public.as_bytes(), 0o644)?;
        }
        Ok(Self {
            hs_key: hs_key.into(),
            ed: Arc::new(ed),
        })
    }

    /// `{alg, crv, kid, public_key}` of the Ed25519 key.
    pub fn public_key(&self) -> super::dto::PublicKey {
        let public = self.ed.public_key().as_ref();
        super::dto::PublicKey {
            alg: "EdDSA".into(),
            crv: "Ed25519".into(),
            kid: ed_kid(public),
            public_key: B64URL.encode(public),
        }
    }

    /// The key id of the HS256 key (`hmac-` and the start of its digest).
    pub fn hs_kid(&self) -> String {
        hs_kid(&self.hs_key)
    }

    /// Check a receipt with this appliance's own keys: what
    /// `receipt verify --state-dir` finds on the appliance (both
    /// signatures), and each signature on its own.
    pub fn check(&self, doc: &Value) -> Result<(Verdict, Vec<SignatureCheck>), ReceiptError> {
        examine(doc, Some(self.ed.public_key().as_ref()), Some(&self.hs_key))
    }

    /// The signed envelope of `payload`.
    pub fn sign(&self, payload: Value) -> Value {
        let msg = canonical(&payload);
        let public = self.ed.public_key().as_ref();
        let ed_sig = B64URL.encode(self.ed.sign(msg.as_bytes()).as_ref());
        json!({
            "payload": payload,
            "signature": {
                "alg": "HS256",
                "kid": hs_kid(&self.hs_key),
                "value": hs256(&self.hs_key, msg.as_bytes()).unwrap_or_default(),
            },
            "signatures": [{
                "alg": "EdDSA",
                "crv": "Ed25519",
                "kid": ed_kid(public),
                "value": ed_sig,
            }],
        })
    }
}

/// JSON with every key once: a receipt with a key twice could be read one
/// way by the verifier and another way by whoever trusts it.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, ReceiptError> {
    use serde::de::{self, Deserialize, MapAccess, SeqAccess, Visitor};

    struct Strict(Value);
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
            Ok(Value::Bool(b))
        }
        fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
            Ok(json!(n))
        }
        fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
            Ok(json!(n))
        }
        fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
            Ok(json!(n))
        }
        fn visit_str<E>(self, s: &str) -> Result<Value, E> {
            Ok(Value::String(s.to_string()))
        }
        fn visit_string<E>(self, s: String) -> Result<Value, E> {
            Ok(Value::String(s))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_none<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut v = vec![];
            while let Some(Strict(x)) = seq.next_element()? {
                v.push(x);
            }
            Ok(Value::Array(v))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut m = serde_json::Map::new();
            while let Some(k) = map.next_key::<String>()? {
                if m.contains_key(&k) {
                    return Err(de::Error::custom(format!("the key {k:?} appears twice")));
                }
                let Strict(v) = map.next_value()?;
                m.insert(k, v);
            }
            Ok(Value::Object(m))
        }
    }
    impl<'de> Deserialize<'de> for Strict {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(V).map(Strict)
        }
    }
    Ok(serde_json::from_slice::<Strict>(bytes)?.0)
}

/// What `receipt verify` found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    /// Every signature checked holds, and at least one was checked.
    pub valid: bool,
    /// `true`/`false` when checked, `None` when no key was given for it.
    pub ed25519: Option<bool>,
    pub hs256: Option<bool>,
    pub task_ref: Option<String>,
    pub state: Option<String>,
    pub template_sha256: Option<String>,
}

/// Check a receipt (bare, or inside an appliance response) against the
/// keys given: `public_key` is the raw Ed25519 key, `hs_key` the HMAC key.
pub fn verify(
    doc: &Value,
    public_key: Option<&[u8]>,
    hs_key: Option<&[u8]>,
) -> Result<Verdict, ReceiptError> {
    examine(doc, public_key, hs_key).map(|(v, _)| v)
}

/// The receipt object (bare, or the `receipt` of an appliance response) and
/// its payload.
fn receipt_parts(doc: &Value) -> Result<(&Value, &Value), ReceiptError> {
    let r = match doc.get("receipt") {
        Some(_) if doc.get("payload").is_some() => return Err(ReceiptError::Ambiguous),
        Some(r) if r.is_object() => r,
        _ => doc,
    };
    let payload = r
        .get("payload")
        .filter(|p| p.is_object())
        .ok_or(ReceiptError::NoPayload)?;
    Ok((r, payload))
}

/// Check every signature of a receipt once: each on its own (the HS256
/// envelope first, then the `signatures` entries in order; a signature is
/// checked only against the key whose id it names), and the verdict from
/// those results. The verdict's HS256 is the envelope under `hs_key`
/// whatever key id it names; its Ed25519 holds when an `EdDSA` entry naming
/// `public_key` holds.
fn examine(
    doc: &Value,
    public_key: Option<&[u8]>,
    hs_key: Option<&[u8]>,
) -> Result<(Verdict, Vec<SignatureCheck>), ReceiptError> {
    let (r, payload) = receipt_parts(doc)?;
    let msg = canonical(payload);
    let text = |s: &Value, k: &str| s.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let mut each = vec![];
    let mut hs = hs_key.map(|_| false);
    if let Some(s) = r.get("signature") {
        let holds = hs_key.map(|k| hs_holds(k, &msg, s));
        hs = holds;
        let (alg, kid) = (text(s, "alg"), text(s, "kid"));
        let named = hs_key.is_some_and(|k| alg == "HS256" && hs_kid(k) == kid);
        each.push(SignatureCheck {
            valid: holds.filter(|_| named),
            alg,
            kid,
        });
    }
    let mut ed25519 = public_key.map(|_| false);
    for s in r
        .get("signatures")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let (alg, kid) = (text(s, "alg"), text(s, "kid"));
        let valid = public_key
            .filter(|pk| alg == "EdDSA" && ed_kid(pk) == kid)
            .map(|pk| ed_holds(pk, &msg, s));
        if valid == Some(true) {
            ed25519 = Some(true);
        }
        each.push(SignatureCheck { alg, kid, valid });
    }
    let checked: Vec<bool> = [ed25519, hs].into_iter().flatten().collect();
    let field = |k: &str| payload.get(k).and_then(Value::as_str).map(str::to_string);
    let verdict = Verdict {
        valid: !checked.is_empty() && checked.iter().all(|ok| *ok),
        ed25519,
        hs256: hs,
        task_ref: field("task_ref"),
        state: field("state"),
        template_sha256: field("template_sha256"),
    };
    Ok((verdict, each))
}

/// Whether one Ed25519 signature entry (`{alg, kid, value}`) holds for
/// `msg` under the raw public key `pk`.
fn ed_holds(pk: &[u8], msg: &str, sig: &Value) -> bool {
    sig.get("value")
        .and_then(Value::as_str)
        .and_then(|v| B64URL.decode(v).ok())
        .is_some_and(|sig| {
            UnparsedPublicKey::new(&ED25519, pk)
                .verify(msg.as_bytes(), &sig)
                .is_ok()
        })
}

/// Whether the HS256 envelope (`{alg: "HS256", kid, value}`) holds for
/// `msg` under `key` (compared in constant time).
fn hs_holds(key: &[u8], msg: &str, sig: &Value) -> bool {
    if sig.get("alg") != Some(&json!("HS256")) {
        return false;
    }
    let got = sig.get("value").and_then(Value::as_str).unwrap_or("");
    let want = hs256(key, msg.as_bytes()).unwrap_or_default();
    !want.is_empty() && subtle::ConstantTimeEq::ct_eq(got.as_bytes(), want.as_bytes()).into()
}

/// One signature a receipt carries, as checked one by one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SignatureCheck {
    /// `HS256` (the `signature` envelope) or the entry's `alg`.
    pub alg: String,
    /// The key id the receipt names for it.
    pub kid: String,
    /// `Some(valid)` when checked; `None` when it names a key not given
    /// (another key id, or an algorithm this verifier does not know).
    pub valid: Option<bool>,
}

/// Each signature of a receipt (bare, or inside a response), checked with
/// the same primitives as [`verify`]: the HS256 envelope first, then the
/// `signatures` entries in order. A signature is checked only against the
/// key whose id it names.
pub fn check_each(
    doc: &Value,
    public_key: Option<&[u8]>,
    hs_key: Option<&[u8]>,
) -> Result<Vec<SignatureCheck>, ReceiptError> {
    examine(doc, public_key, hs_key).map(|(_, each)| each)
}

/// The raw public key from a `receipt-ed25519.pub` file (base64url, or the
/// `public_key` field of `GET /v1/receipts/public-key`'s JSON).
pub fn read_public_key(path: &Path) -> Result<Vec<u8>, KeyError> {
    let text = std::fs::read_to_string(path).map_err(read_error(path))?;
    let t = text.trim();
    let b64 = match serde_json::from_str::<Value>(t) {
        Ok(v) => v
            .get("public_key")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| KeyError::NoPublicKeyField {
                path: path.to_path_buf(),
            })?,
        Err(_) => t.to_string(),
    };
    let k = B64URL
        .decode(b64.trim_end_matches('='))
        .map_err(|_| KeyError::NotBase64 {
            path: path.to_path_buf(),
        })?;
    if k.len() != 32 {
        return Err(KeyError::PublicKeyLength {
            path: path.to_path_buf(),
        });
    }
    Ok(k)
}

/// Where a state directory keeps the receipt public key.
pub fn public_key_path(state: &Path) -> PathBuf {
    state.join(PUBLIC_FILE)
}

/// `cube-adapter receipt verify`: exit 0 when every signature checked
/// holds, 1 when one does not, 2 when nothing could be checked (no key, an
/// unreadable file). Prints the verdict as JSON on stdout.
pub fn verify_command(
    file: &Path,
    public_key: Option<&Path>,
    state_dir: Option<&Path>,
    config: Option<&Path>,
    hmac_key_file: Option<&Path>,
) -> i32 {
    let usage = |m: &dyn std::fmt::Display| {
        eprintln!("error: {m}");
        2
    };
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) => return usage(&format_args!("read {}: {e}", file.display())),
    };
    let doc: Value = match parse_strict(&bytes) {
        Ok(v) => v,
        Err(e) => return usage(&format_args!("{}: {e}", file.display())),
    };
    let mut pk = None;
    let mut hs = None;
    if let Some(f) = public_key {
        match read_public_key(f) {
            Ok(k) => pk = Some(k),
            Err(e) => return usage(&e),
        }
    }
    if let Some(f) = hmac_key_file {
        match read_hs_key(f) {
            Ok(k) => hs = Some(k),
            Err(e) => return usage(&e),
        }
    }
    if let Some(d) = state_dir {
        if pk.is_none() {
            match read_public_key(&public_key_path(d)) {
                Ok(k) => pk = Some(k),
                Err(e) => return usage(&e),
            }
        }
        if hs.is_none() {
            // The key the appliance signs with: its configured file, or the
            // one derived from its secret.
            let configured = crate::config::Config::load(config, &[], &Default::default())
                .ok()
                .and_then(|(c, _)| c.receipts.hmac_key_file);
            hs = match configured {
                Some(f) => read_hs_key(&f).ok(),
                None => std::fs::read(d.join("hmac.key"))
                    .ok()
                    .filter(|k| k.len() == 32)
                    .map(|k| derived_hs_key(&k)),
            };
            if hs.is_none() {
                eprintln!("note: the HS256 key is not readable here; checking Ed25519 only");
            }
        }
    }
    if pk.is_none() && hs.is_none() {
        return usage(
            &"give --public-key (the appliance's receipt-ed25519.pub), --state-dir or --hmac-key-file",
        );
    }
    match verify(&doc, pk.as_deref(), hs.as_deref()) {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            if v.valid { 0 } else { 1 }
        }
        Err(e) => usage(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_and_verify() {
        let dir = tempfile::tempdir().unwrap();
        let sealer = Sealer::load_or_create(&dir.path().join("secret.key")).unwrap();
        let s = Signer::load_or_create(dir.path(), &sealer, vec![7; 32]).unwrap();
        let r = s.sign(json!({"task_ref": "task_x", "state": "succeeded", "n": 1, "é": "ü"}));
        let pk = read_public_key(&public_key_path(dir.path())).unwrap();
        let v = verify(&r, Some(&pk), Some(&[7; 32])).unwrap();
        assert!(v.valid && v.ed25519 == Some(true) && v.hs256 == Some(true));
        assert_eq!(v.task_ref.as_deref(), Some("task_x"));
        // Wrapped in a response, too.
        assert!(
            verify(&json!({"receipt": r}), Some(&pk), None)
                .unwrap()
                .valid
        );
        // The same key after a reload.
        let s2 = Signer::load_or_create(dir.path(), &sealer, vec![7; 32]).unwrap();
        assert_eq!(s.public_key(), s2.public_key());
        // Any change breaks both signatures.
        let mut bad = r.clone();
        bad["payload"]["state"] = json!("failed");
        let v = verify(&bad, Some(&pk), Some(&[7; 32])).unwrap();
        assert!(!v.valid && v.ed25519 == Some(false) && v.hs256 == Some(false));
        assert!(!verify(&r, None, Some(&[8; 32])).unwrap().valid);
        assert!(
            !verify(&r, None, None).unwrap().valid,
            "nothing checked is not valid"
        );
        // A key twice is refused, however it would be read.
        let text = r.to_string();
        let dup = text.replacen("{\"payload\":{", "{\"payload\":{\"state\":\"failed\",", 1);
        assert_ne!(dup, text);
        assert!(
            parse_strict(dup.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        assert_eq!(parse_strict(text.as_bytes()).unwrap(), r);
        assert_eq!(
            verify(&json!({"receipt": r, "payload": {}}), Some(&pk), None)
                .unwrap_err()
                .to_string(),
            "ambiguous: both a receipt and a payload at the top level"
        );
        assert_eq!(
            verify(&json!({"x": 1}), Some(&pk), None)
                .unwrap_err()
                .to_string(),
            "not a receipt: no payload object"
        );
        let short = dir.path().join("short.key");
        std::fs::write(&short, "too short\n").unwrap();
        assert_eq!(
            read_hs_key(&short).unwrap_err().to_string(),
            format!(
                "{}: a receipt HMAC key must be at least 32 bytes",
                short.display()
            )
        );
        // One by one: both hold; a key not given is not checked; a change
        // breaks each; the signer's own check agrees with `verify`.
        let each = check_each(&r, Some(&pk), Some(&[7; 32])).unwrap();
        assert_eq!(
            each.iter()
                .map(|c| (c.alg.as_str(), c.valid))
                .collect::<Vec<_>>(),
            [("HS256", Some(true)), ("EdDSA", Some(true))]
        );
        assert_eq!(each[1].kid, s.public_key().kid);
        assert_eq!(each[0].kid, s.hs_kid());
        let each = check_each(&r, Some(&pk), None).unwrap();
        assert_eq!(each[0].valid, None);
        let each = check_each(&bad, Some(&pk), Some(&[7; 32])).unwrap();
        assert!(each.iter().all(|c| c.valid == Some(false)), "{each:?}");
        let (v, each) = s.check(&r).unwrap();
        assert!(v.valid && each.iter().all(|c| c.valid == Some(true)));
        let (v, each) = s.check(&bad).unwrap();
        assert!(!v.valid && each.iter().all(|c| c.valid == Some(false)));
        // A signature under another key id is listed, not checked.
        let mut other = r.clone();
        other["signatures"][0]["kid"] = json!("ed25519-000000000000");
        let (v, each) = s.check(&other).unwrap();
        assert_eq!(v.ed25519, Some(false));
        assert_eq!(each[1].valid, None);
    }
}
