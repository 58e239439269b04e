//! Nothing hidden (issue #36): the characters a reader of a plan cannot
//! see, or cannot tell apart from others, made visible.
//!
//! A plan's parameters and its rendered command are what an approver
//! approves. A right-to-left override (U+202E) shows `txt.exe` as
//! `exe.txt`, a zero-width space is invisible, and `mаin` with a Cyrillic
//! `а` looks exactly like `main`. [`Scan`] finds them: bidirectional
//! controls, invisible (format and default-ignorable) characters, other
//! controls, spaces other than U+0020, unassigned or private code points,
//! and words mixing scripts (UTS #39 mixed-script detection, from the
//! `unicode-security` crate; general categories from `unicode-properties`).
//! [`pieces`] splits a text into what may be shown as it is and escapes
//! (`U+202E`) to show highlighted in place of the hidden characters.
//!
//! Bidirectional controls in parameters are refused when a plan is made
//! unless the template allows them (`allow_bidi_controls`); a template
//! may refuse anything but ASCII (`parameters_ascii_only`).

use serde::Serialize;
use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};
use unicode_security::MixedScript;

/// Why a character is shown escaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Hidden {
    /// A bidirectional control: reorders what follows it on screen.
    Bidi,
    /// Takes no space on screen (format characters, zero-width joiners,
    /// variation selectors, fillers).
    Invisible,
    /// A control character (tabs and newlines among them), or a line or
    /// paragraph separator.
    Control,
    /// A space that is not U+0020.
    Space,
    /// Unassigned, private-use or a surrogate: nothing a reader can check.
    Unassigned,
}

impl Hidden {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bidi => "bidirectional control",
            Self::Invisible => "invisible character",
            Self::Control => "control character",
            Self::Space => "unusual space",
            Self::Unassigned => "unassigned or private character",
        }
    }
}

/// The Bidi_Control property (Unicode's PropList.txt): the twelve
/// characters that change the display order of text.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// Default-ignorable characters that are not format characters (Unicode's
/// DerivedCoreProperties.txt): they draw nothing.
fn is_ignorable_mark(c: char) -> bool {
    matches!(
        c,
        '\u{034F}'
            | '\u{115F}'
            | '\u{1160}'
            | '\u{17B4}'
            | '\u{17B5}'
            | '\u{180B}'..='\u{180F}'
            | '\u{3164}'
            | '\u{FE00}'..='\u{FE0F}'
            | '\u{FFA0}'
            | '\u{E0100}'..='\u{E01EF}'
    )
}

/// What hides `c`, if anything does.
pub fn hidden(c: char) -> Option<Hidden> {
    if c == ' ' || c.is_ascii_graphic() {
        return None;
    }
    if is_bidi_control(c) {
        return Some(Hidden::Bidi);
    }
    if is_ignorable_mark(c) {
        return Some(Hidden::Invisible);
    }
    match c.general_category() {
        GeneralCategory::Format => Some(Hidden::Invisible),
        GeneralCategory::Control
        | GeneralCategory::LineSeparator
        | GeneralCategory::ParagraphSeparator => Some(Hidden::Control),
        GeneralCategory::SpaceSeparator => Some(Hidden::Space),
        GeneralCategory::Unassigned | GeneralCategory::PrivateUse | GeneralCategory::Surrogate => {
            Some(Hidden::Unassigned)
        }
        _ => None,
    }
}

/// The name of a well-known hidden character, for the escape's tooltip.
fn name(c: char) -> Option<&'static str> {
    Some(match c {
        '\u{202A}' => "LEFT-TO-RIGHT EMBEDDING",
        '\u{202B}' => "RIGHT-TO-LEFT EMBEDDING",
        '\u{202C}' => "POP DIRECTIONAL FORMATTING",
        '\u{202D}' => "LEFT-TO-RIGHT OVERRIDE",
        '\u{202E}' => "RIGHT-TO-LEFT OVERRIDE",
        '\u{2066}' => "LEFT-TO-RIGHT ISOLATE",
        '\u{2067}' => "RIGHT-TO-LEFT ISOLATE",
        '\u{2068}' => "FIRST STRONG ISOLATE",
        '\u{2069}' => "POP DIRECTIONAL ISOLATE",
        '\u{200E}' => "LEFT-TO-RIGHT MARK",
        '\u{200F}' => "RIGHT-TO-LEFT MARK",
        '\u{061C}' => "ARABIC LETTER MARK",
        '\u{200B}' => "ZERO WIDTH SPACE",
        '\u{200C}' => "ZERO WIDTH NON-JOINER",
        '\u{200D}' => "ZERO WIDTH JOINER",
        '\u{2060}' => "WORD JOINER",
        '\u{FEFF}' => "ZERO WIDTH NO-BREAK SPACE",
        '\u{00AD}' => "SOFT HYPHEN",
        '\u{00A0}' => "NO-BREAK SPACE",
        '\t' => "TAB",
        '\n' => "LINE FEED",
        '\r' => "CARRIAGE RETURN",
        _ => return None,
    })
}

/// A piece of text as shown: as it is, or one hidden character escaped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The text itself, or the escape (`U+202E`).
    pub text: String,
    /// Why it is escaped (`None`: shown as it is).
    pub hidden: Option<Hidden>,
    /// A word that mixes scripts (shown as it is, flagged).
    pub confusable: bool,
    /// For an escape or a flagged word: what it is, in words.
    pub title: String,
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric()
        || matches!(
            c.general_category(),
            GeneralCategory::NonspacingMark | GeneralCategory::SpacingMark
        )
}

/// A run of visible text as pieces: its words that mix scripts flagged.
fn push_run(out: &mut Vec<Piece>, run: &str) {
    let mut plain = String::new();
    let mut word = String::new();
    let flush_word = |out: &mut Vec<Piece>, plain: &mut String, word: &mut String| {
        if word.is_empty() {
            return;
        }
        if !word.is_ascii() && !word.as_str().is_single_script() {
            if !plain.is_empty() {
                out.push(Piece::plain(std::mem::take(plain)));
            }
            let others: Vec<String> = word
                .chars()
                .filter(|c| !c.is_ascii())
                .map(|c| format!("U+{:04X}", u32::from(c)))
                .collect();
            out.push(Piece {
                title: format!(
                    "this word mixes scripts and may imitate another: its non-ASCII letters are {}",
                    others.join(" ")
                ),
                text: std::mem::take(word),
                hidden: None,
                confusable: true,
            });
        } else {
            plain.push_str(word);
            word.clear();
        }
    };
    for c in run.chars() {
        if is_word_char(c) {
            word.push(c);
        } else {
            flush_word(out, &mut plain, &mut word);
            plain.push(c);
        }
    }
    flush_word(out, &mut plain, &mut word);
    if !plain.is_empty() {
        out.push(Piece::plain(plain));
    }
}

impl Piece {
    fn plain(text: String) -> Self {
        Self {
            text,
            hidden: None,
            confusable: false,
            title: String::new(),
        }
    }
}

/// `s` as pieces to show: runs of visible text (words mixing scripts
/// flagged), and each hidden character as its own escaped piece.
pub fn pieces(s: &str) -> Vec<Piece> {
    let mut out = vec![];
    let mut run = String::new();
    for c in s.chars() {
        match hidden(c) {
            None => run.push(c),
            Some(h) => {
                if !run.is_empty() {
                    push_run(&mut out, &std::mem::take(&mut run));
                }
                let code = format!("U+{:04X}", u32::from(c));
                out.push(Piece {
                    title: match name(c) {
                        Some(n) => format!("{code} {n} ({})", h.as_str()),
                        None => format!("{code} ({})", h.as_str()),
                    },
                    text: code,
                    hidden: Some(h),
                    confusable: false,
                });
            }
        }
    }
    if !run.is_empty() {
        push_run(&mut out, &run);
    }
    out
}

/// The words of `s` (runs of letters, marks and digits) that mix scripts:
/// `mаin` with a Cyrillic `а` is one.
pub fn mixed_script_words(s: &str) -> Vec<String> {
    let mut out: Vec<String> = vec![];
    for w in s.split(|c: char| !is_word_char(c)) {
        if !w.is_ascii() && !w.is_single_script() && !out.iter().any(|o| o == w) {
            out.push(w.to_string());
        }
    }
    out
}

/// What a text hides: each kind of hidden character found (with the first
/// such character), and the words that mix scripts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Scan {
    /// Code points found, as `U+XXXX`, with their kind, each once.
    pub hidden: Vec<(String, Hidden)>,
    pub mixed_script: Vec<String>,
}

impl Scan {
    pub fn of(s: &str) -> Self {
        let mut scan = Self::default();
        scan.add(s);
        scan
    }

    /// Add what `s` hides.
    pub fn add(&mut self, s: &str) {
        for c in s.chars() {
            if let Some(h) = hidden(c) {
                let code = format!("U+{:04X}", u32::from(c));
                if !self.hidden.iter().any(|(x, _)| *x == code) {
                    self.hidden.push((code, h));
                }
            }
        }
        for w in mixed_script_words(s) {
            if !self.mixed_script.contains(&w) {
                self.mixed_script.push(w);
            }
        }
    }

    /// Every string in a JSON value, keys included.
    pub fn add_json(&mut self, v: &serde_json::Value) {
        match v {
            serde_json::Value::String(s) => self.add(s),
            serde_json::Value::Array(a) => a.iter().for_each(|x| self.add_json(x)),
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    self.add(k);
                    self.add_json(x);
                }
            }
            _ => {}
        }
    }

    pub fn is_clean(&self) -> bool {
        self.hidden.is_empty() && self.mixed_script.is_empty()
    }

    pub fn has(&self, kind: Hidden) -> bool {
        self.hidden.iter().any(|(_, h)| *h == kind)
    }

    /// One line for a banner: what was found.
    pub fn summary(&self) -> String {
        let mut parts = vec![];
        for kind in [
            Hidden::Bidi,
            Hidden::Invisible,
            Hidden::Control,
            Hidden::Space,
            Hidden::Unassigned,
        ] {
            let codes: Vec<&str> = self
                .hidden
                .iter()
                .filter(|(_, h)| *h == kind)
                .map(|(c, _)| c.as_str())
                .collect();
            if !codes.is_empty() {
                parts.push(format!("{} ({})", kind.as_str(), codes.join(", ")));
            }
        }
        if !self.mixed_script.is_empty() {
            parts.push(format!(
                "words mixing scripts, which may imitate others ({})",
                self.mixed_script
                    .iter()
                    .map(|w| {
                        let foreign: Vec<String> = w
                            .chars()
                            .filter(|c| !c.is_ascii())
                            .map(|c| format!("U+{:04X}", u32::from(c)))
                            .collect();
                        format!("{w} with {}", foreign.join(" "))
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        parts.join("; ")
    }
}

/// The first string of a JSON value (keys included) that `refuse` finds
/// fault with: its dotted path and the character at fault.
pub fn first_fault(v: &serde_json::Value, refuse: &dyn Fn(char) -> bool) -> Option<(String, char)> {
    fn walk(
        v: &serde_json::Value,
        at: &str,
        refuse: &dyn Fn(char) -> bool,
    ) -> Option<(String, char)> {
        let here = |a: &str| {
            if a.is_empty() {
                "$".to_string()
            } else {
                a.to_string()
            }
        };
        match v {
            serde_json::Value::String(s) => s.chars().find(|c| refuse(*c)).map(|c| (here(at), c)),
            serde_json::Value::Array(a) => a.iter().enumerate().find_map(|(i, x)| {
                walk(
                    x,
                    &if at.is_empty() {
                        i.to_string()
                    } else {
                        format!("{at}.{i}")
                    },
                    refuse,
                )
            }),
            serde_json::Value::Object(m) => m.iter().find_map(|(k, x)| {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                if let Some(c) = k.chars().find(|c| refuse(*c)) {
                    return Some((format!("{path} (its name)"), c));
                }
                walk(x, &path, refuse)
            }),
            _ => None,
        }
    }
    walk(v, "", refuse)
}

/// `U+XXXX NAME` of a character, for messages.
pub fn describe(c: char) -> String {
    let code = format!("U+{:04X}", u32::from(c));
    match name(c) {
        Some(n) => format!("{code} {n}"),
        None => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_hides_is_found() {
        let s = Scan::of("RTL-override: \u{202E}exe.txt");
        assert_eq!(s.hidden, vec![("U+202E".into(), Hidden::Bidi)]);
        let s = Scan::of("a\u{200B}b\u{00A0}c\td");
        assert!(s.has(Hidden::Invisible) && s.has(Hidden::Space) && s.has(Hidden::Control));
        assert!(!s.has(Hidden::Bidi));
        // A Cyrillic а in a Latin word; a wholly Cyrillic word is fine,
        // as are accented Latin letters.
        let s = Scan::of("git checkout m\u{0430}in");
        assert_eq!(s.mixed_script, vec!["m\u{0430}in".to_string()]);
        assert!(Scan::of("привет café main-2 x_y").is_clean());
        assert!(Scan::of("plain ascii: rm -rf /tmp/x").is_clean());
        assert!(
            s.summary()
                .contains("mixing scripts, which may imitate others (m\u{0430}in with U+0430)"),
            "{}",
            s.summary()
        );
    }

    #[test]
    fn pieces_escape_only_hidden_characters() {
        let p = pieces("a\u{202E}bc\u{200B}");
        let texts: Vec<&str> = p.iter().map(|x| x.text.as_str()).collect();
        assert_eq!(texts, ["a", "U+202E", "bc", "U+200B"]);
        assert_eq!(p[1].hidden, Some(Hidden::Bidi));
        assert!(
            p[1].title.contains("RIGHT-TO-LEFT OVERRIDE"),
            "{}",
            p[1].title
        );
        assert_eq!(p[2].hidden, None);
        assert_eq!(pieces("é ok").len(), 1);
        // A word mixing scripts is its own, flagged piece.
        let p = pieces("git checkout m\u{0430}in now");
        let texts: Vec<&str> = p.iter().map(|x| x.text.as_str()).collect();
        assert_eq!(texts, ["git checkout ", "m\u{0430}in", " now"]);
        assert!(
            p[1].confusable && p[1].title.contains("U+0430"),
            "{:?}",
            p[1]
        );
    }

    #[test]
    fn the_first_fault_is_named_by_its_path() {
        let v = serde_json::json!({"a": "fine", "b": ["x", "y\u{202E}z"]});
        let (at, c) = first_fault(&v, &|c| hidden(c) == Some(Hidden::Bidi)).unwrap();
        assert_eq!((at.as_str(), c), ("b.1", '\u{202E}'));
        let v = serde_json::json!({"k\u{2066}": 1});
        assert!(
            first_fault(&v, &is_bidi_control)
                .unwrap()
                .0
                .contains("its name")
        );
        assert!(first_fault(&serde_json::json!({"a": "é"}), &|c| !c.is_ascii()).is_some());
        assert_eq!(describe('\u{202E}'), "U+202E RIGHT-TO-LEFT OVERRIDE");
    }
}
