//! The keys file (`--api-keys-file`): each tenant's API keys and, optionally, its limits. TOML,
//! or JSON when the file's name ends in `.json`:
//!
//! ```toml
//! [tenants.team-a]
//! keys = ["sk-team-a-1", "sk-team-a-2"]   # several, so that a key can be rotated
//! requests_per_second = 20
//! prompt_tokens_per_minute = 200000
//! output_tokens_per_minute = 50000
//! max_concurrent_requests = 16
//!
//! [tenants.batch]
//! keys = ["sk-batch"]                      # no limits: only the admission's fair share
//! ```

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The most tenants one file may hold (each is a `tenant` label value of the metrics).
pub const MAX_TENANTS: usize = 1000;

/// A tenant's limits; each is off when absent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// Requests per second (bursts of up to a second's worth).
    pub requests_per_second: Option<f64>,
    /// Prompt tokens per minute, as estimated at arrival (a quarter of the prompt's bytes).
    pub prompt_tokens_per_minute: Option<f64>,
    /// Output tokens per minute, charged at arrival as the request's `max_tokens`.
    pub output_tokens_per_minute: Option<f64>,
    /// Requests in flight at once (their answers included).
    pub max_concurrent_requests: Option<u32>,
}

impl Limits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        *self != Limits::default()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    keys: Vec<String>,
    requests_per_second: Option<f64>,
    prompt_tokens_per_minute: Option<f64>,
    output_tokens_per_minute: Option<f64>,
    max_concurrent_requests: Option<u32>,
}

impl Entry {
    fn limits(&self) -> Limits {
        Limits {
            requests_per_second: self.requests_per_second,
            prompt_tokens_per_minute: self.prompt_tokens_per_minute,
            output_tokens_per_minute: self.output_tokens_per_minute,
            max_concurrent_requests: self.max_concurrent_requests,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Text {
    #[serde(default)]
    tenants: BTreeMap<String, Entry>,
}

/// One tenant as the file says.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantEntry {
    /// Its name (the metrics' `tenant` label, the admission's fair-share id).
    pub name: String,
    /// Its keys.
    pub keys: Vec<String>,
    /// Its limits.
    pub limits: Limits,
}

/// A keys file that cannot be used, and why (never showing a key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot use the API keys file {}: {message}", path.display())]
pub struct KeysFileError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong (with the line, for a syntax error).
    pub message: String,
}

/// Reads and checks the file.
pub fn read(path: &Path) -> Result<Vec<TenantEntry>, KeysFileError> {
    let fail = |message: String| KeysFileError {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|err| fail(err.to_string()))?;
    let json = path
        .extension()
        .is_some_and(|ext| ext.eq_ignore_ascii_case("json"));
    parse(&text, json).map_err(fail)
}

/// Parses and checks the text of a keys file (JSON when `json`, else TOML).
pub fn parse(text: &str, json: bool) -> Result<Vec<TenantEntry>, String> {
    let parsed: Text = match json {
        true => serde_json::from_str(text).map_err(|err| {
            let message = err.to_string();
            let message = message.split(" at line ").next().unwrap_or_default();
            format!(
                "line {}, column {}: {}",
                err.line(),
                err.column(),
                redact(message)
            )
        })?,
        false => toml::from_str(text).map_err(|err| {
            let at = err.span().map_or(0, |span| span.start).min(text.len());
            let line = text[..at].matches('\n').count() + 1;
            format!("line {line}: {}", redact(err.message()))
        })?,
    };
    if parsed.tenants.len() > MAX_TENANTS {
        return Err(format!(
            "{} tenants, at most {MAX_TENANTS}",
            parsed.tenants.len()
        ));
    }
    let mut seen = HashSet::new();
    let mut tenants = Vec::new();
    for (name, entry) in parsed.tenants {
        check_name(&name)?;
        if entry.keys.is_empty() {
            return Err(format!("tenant {name:?} has no keys"));
        }
        for (i, key) in entry.keys.iter().enumerate() {
            if key.is_empty() || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(format!(
                    "tenant {name:?}: key {} is empty or holds whitespace",
                    i + 1
                ));
            }
            if !seen.insert(key.clone()) {
                return Err(format!(
                    "tenant {name:?}: key {} is also another key's",
                    i + 1
                ));
            }
        }
        let limits = entry.limits();
        check_limits(&name, &limits)?;
        tenants.push(TenantEntry {
            name,
            keys: entry.keys,
            limits,
        });
    }
    Ok(tenants)
}

/// `message` with every double-quoted text left out: a parser quotes the values it could not
/// use, and a value here may be a key.
fn redact(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for (i, part) in message.split('"').enumerate() {
        match i % 2 {
            0 => out.push_str(part),
            _ => out.push_str("\"…\""),
        }
    }
    out
}

/// 1 to 64 letters, digits, `.`, `_` or `-`.
fn check_name(name: &str) -> Result<(), String> {
    let valid = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    match valid {
        true => Ok(()),
        false => Err(format!(
            "tenant name {name:?} must be 1 to 64 letters, digits, '.', '_' or '-'"
        )),
    }
}

fn check_limits(name: &str, limits: &Limits) -> Result<(), String> {
    let rates = [
        ("requests_per_second", limits.requests_per_second),
        ("prompt_tokens_per_minute", limits.prompt_tokens_per_minute),
        ("output_tokens_per_minute", limits.output_tokens_per_minute),
    ];
    for (field, value) in rates {
        if let Some(value) = value {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!("tenant {name:?}: {field} must be a number above 0"));
            }
        }
    }
    if limits.max_concurrent_requests == Some(0) {
        return Err(format!(
            "tenant {name:?}: max_concurrent_requests must be at least 1"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_and_json_say_the_same() {
        let toml = r#"
            [tenants.team-a]
            keys = ["sk-a1", "sk-a2"]
            requests_per_second = 2.5
            max_concurrent_requests = 4
            [tenants.batch]
            keys = ["sk-b"]
        "#;
        let json = r#"{"tenants": {"team-a": {"keys": ["sk-a1", "sk-a2"], "requests_per_second": 2.5,
            "max_concurrent_requests": 4}, "batch": {"keys": ["sk-b"]}}}"#;
        let from_toml = parse(toml, false).unwrap();
        assert_eq!(from_toml, parse(json, true).unwrap());
        assert_eq!(from_toml[1].name, "team-a");
        assert_eq!(from_toml[1].limits.requests_per_second, Some(2.5));
        assert!(!from_toml[0].limits.any());
    }

    #[test]
    fn mistakes_are_named_and_keys_never_shown() {
        let cases = [
            (
                "[tenants.a]\nkeys = [\"k\"]\nrequests_per_second = 0",
                "requests_per_second must be",
            ),
            ("[tenants.a]\nkeys = []", "has no keys"),
            (
                "[tenants.a]\nkeys = [\"k1\"]\n[tenants.b]\nkeys = [\"k1\"]",
                "also another key's",
            ),
            ("[tenants.\"a b\"]\nkeys = [\"k\"]", "tenant name"),
            ("[tenants.a]\nkeys = [\"k\"]\nrps = 3", "unknown field"),
            ("[tenants.a]\nkeys = [\"k\"\n", "line 2"),
            ("[tenants.a]\nkeys = [\"with space\"]", "whitespace"),
            ("[tenants.a]\nkeys = \"k1\"", "line 2"),
            (
                "[tenants.a]\nkeys = [\"k\"]\nmax_concurrent_requests = 0",
                "at least 1",
            ),
        ];
        for (text, needle) in cases {
            let err = parse(text, false).unwrap_err();
            assert!(err.contains(needle), "{text:?}: {err}");
            assert!(!err.contains("k1\""), "{err}");
        }
    }
}
