//! What P and D receive: the client's JSON body with the few fields vLLM's Mooncake proxy changes,
//! every other field passed through untouched.
//!
//! Only the top level of the body is parsed, and nothing is copied: each field's value stays the
//! raw JSON text it is in the client's bytes and is written back as is, so a long prompt or
//! message list is copied once into each upstream body, not rebuilt and re-escaped.

use std::borrow::{Borrow, Cow};
use std::collections::BTreeMap;
use std::fmt;

use pd_protocol::vllm::KvTransferParams;
use serde::de::{Deserializer, IgnoredAny, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::error::Category;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::backend::Pair;

/// The body field P and D read their transfer instructions from.
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// Why a client's body cannot be forwarded.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Not JSON at all.
    #[error("the request body is not valid JSON: {0}")]
    NotJson(serde_json::Error),
    /// JSON, but not an object.
    #[error("the request body must be a JSON object")]
    NotObject,
}

/// A field name, borrowed from the client's bytes unless it had escapes to undo.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key<'a>(Cow<'a, str>);

impl Borrow<str> for Key<'_> {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, key: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(key)))
            }
            fn visit_str<E>(self, key: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(key.to_owned())))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

/// A client's request body: a JSON object, field by field (the last of a repeated name wins),
/// each value the raw JSON text it is in the bytes the body was parsed from.
#[derive(Debug, Clone)]
pub struct Body<'a> {
    fields: BTreeMap<Key<'a>, &'a RawValue>,
    /// The length of the client's bytes: what a rewritten body starts its buffer at.
    len: usize,
}

/// One change [`Body::render`] makes to the client's fields. Field names are the proxy's own:
/// plain text, nothing in them for JSON to escape.
#[derive(Debug, Clone, Copy)]
pub enum Edit<'e> {
    /// The field set to this raw JSON, added when the client did not send it.
    Set(&'e str, &'e str),
    /// The field set to this raw JSON, only when the client sent it.
    Replace(&'e str, &'e str),
    /// The field left out.
    Remove(&'e str),
}

impl Edit<'_> {
    fn key(&self) -> &str {
        match self {
            Edit::Set(key, _) | Edit::Replace(key, _) | Edit::Remove(key) => key,
        }
    }

    /// What the edit may add to a body.
    fn extra_len(&self) -> usize {
        match self {
            Edit::Set(key, value) | Edit::Replace(key, value) => key.len() + value.len() + 4,
            Edit::Remove(_) => 0,
        }
    }
}

impl<'a> Body<'a> {
    /// Parses the client's body.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, BodyError> {
        match serde_json::from_slice(bytes) {
            Ok(fields) => Ok(Body {
                fields,
                len: bytes.len(),
            }),
            Err(err) if err.classify() != Category::Data => Err(BodyError::NotJson(err)),
            // Well-formed so far but not an object; still, broken JSON is told as such.
            Err(_) => match serde_json::from_slice::<IgnoredAny>(bytes) {
                Ok(_) => Err(BodyError::NotObject),
                Err(err) => Err(BodyError::NotJson(err)),
            },
        }
    }

    /// The raw JSON of the field `name`, when the client sent it.
    pub fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.fields.get(name).copied()
    }

    /// The field `name` as a number, read as the engines' OpenAI servers read one (pydantic's
    /// lax mode): a JSON number, a string holding one (`"64"` is 64), or `true` or `false` (1
    /// and 0).
    pub fn number(&self, name: &str) -> Option<f64> {
        let text = self.get(name)?.get().trim();
        match text {
            "true" => return Some(1.0),
            "false" => return Some(0.0),
            _ => {}
        }
        let text = text
            .strip_prefix('"')
            .and_then(|t| t.strip_suffix('"'))
            .unwrap_or(text);
        text.trim().parse::<f64>().ok().filter(|n| n.is_finite())
    }

    /// The field `name` as a boolean, read as the engines' OpenAI servers read one (see
    /// [`flag_of`]). `None` when it is absent, `null` or not a boolean to them.
    pub fn flag(&self, name: &str) -> Option<bool> {
        flag_of(self.get(name)?.get())
    }

    /// Sets the field `name` to `value` (what [`Body::render`] then writes, as if the client
    /// had sent it).
    pub fn insert(&mut self, name: &'static str, value: &'a RawValue) {
        self.fields.insert(Key(Cow::Borrowed(name)), value);
    }

    /// The body with `edits` made, as bytes: the client's fields in name order (each as sent,
    /// unless edited), then the fields the edits add.
    pub fn render(&self, edits: &[Edit<'_>]) -> Vec<u8> {
        let extra: usize = edits.iter().map(Edit::extra_len).sum();
        let mut out = Vec::with_capacity(self.len + extra + 2);
        out.push(b'{');
        for (key, value) in &self.fields {
            let value = match edits.iter().find(|edit| edit.key() == key.0) {
                None => value.get(),
                Some(Edit::Set(_, value) | Edit::Replace(_, value)) => value,
                Some(Edit::Remove(_)) => continue,
            };
            write_field(&mut out, key, value);
        }
        for edit in edits {
            if let Edit::Set(key, value) = edit {
                if !self.fields.contains_key(*key) {
                    write_field(&mut out, &Key::own(key), value);
                }
            }
        }
        out.push(b'}');
        out
    }
}

/// Appends `"key":value` (after a comma unless it is the first field).
fn write_field(out: &mut Vec<u8>, key: &Key<'_>, raw: &str) {
    if out.len() > 1 {
        out.push(b',');
    }
    key.write(out);
    out.push(b':');
    out.extend_from_slice(raw.as_bytes());
}

impl<'k> Key<'k> {
    /// A name the proxy sets (the fields of [`Edit`]): plain text, with nothing JSON escapes.
    fn own(name: &'k str) -> Self {
        debug_assert!(
            name.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\'),
            "{name:?} needs escaping"
        );
        Key(Cow::Borrowed(name))
    }

    /// Appends the name as a JSON string. A borrowed name had no escapes in the client's JSON
    /// (serde_json lends the text only then, and a JSON string holds no bare quote, backslash or
    /// control character), so it goes back as it came; a name that had escapes is escaped again.
    fn write(&self, out: &mut Vec<u8>) {
        match &self.0 {
            Cow::Borrowed(name) => {
                out.push(b'"');
                out.extend_from_slice(name.as_bytes());
                out.push(b'"');
            }
            Cow::Owned(name) => {
                serde_json::to_writer(&mut *out, name).expect("a string serializes into memory")
            }
        }
    }
}

/// The raw JSON text of `value`.
pub fn raw_json(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("a JSON value serializes")
}

/// What P is sent in place of the client's fields: an answer of one token, whole, without the
/// token ids (P's answer is not relayed), that cannot end before that token. vLLM's connectors
/// send the KV only when P's request ends on its length cap; its EOS and `stop_token_ids` test
/// runs first, so a first token that is EOS or a stop token would end P "stopped" and leave D
/// waiting for KV that never comes. `min_tokens: 1` masks both until the cap (and stop strings,
/// which vLLM checks only past `min_tokens`).
const PREFILL_EDITS: [Edit<'static>; 6] = [
    Edit::Set("stream", "false"),
    Edit::Set("max_tokens", "1"),
    Edit::Replace("max_completion_tokens", "1"),
    Edit::Set("min_tokens", "1"),
    Edit::Remove("stream_options"),
    Edit::Remove("return_token_ids"),
];

impl Body<'_> {
    /// P's body: `stream: false`, `max_tokens: 1`, `max_completion_tokens: 1` when present,
    /// `min_tokens: 1`, no `stream_options` nor `return_token_ids`, and `kv_transfer_params`
    /// set to `params` (raw JSON).
    pub fn prefill(&self, params: &str) -> Vec<u8> {
        let [stream, max_tokens, max_completion_tokens, min_tokens, stream_options, token_ids] =
            PREFILL_EDITS;
        self.render(&[
            stream,
            max_tokens,
            max_completion_tokens,
            min_tokens,
            stream_options,
            token_ids,
            Edit::Set(KV_TRANSFER_PARAMS, params),
        ])
    }

    /// D's body: the client's, with `kv_transfer_params` set to `params` (raw JSON).
    pub fn decode(&self, params: &str) -> Vec<u8> {
        self.render(&[Edit::Set(KV_TRANSFER_PARAMS, params)])
    }

    /// The body of a request D serves alone (no P, no KV to pull): the client's, without any
    /// transfer instructions a client may have sent (`kv_transfer_params`, SGLang's bootstrap
    /// fields).
    pub fn alone(&self) -> Vec<u8> {
        self.render(&[
            Edit::Remove(KV_TRANSFER_PARAMS),
            Edit::Remove("bootstrap_host"),
            Edit::Remove("bootstrap_port"),
            Edit::Remove("bootstrap_room"),
        ])
    }
}

/// The fields of D's `kv_transfer_params` that name where the KV is (`remote_bootstrap_addr`,
/// `remote_engine_id`), as raw JSON: written once per (prefill, dp rank) pair, not per request.
pub fn kv_source(bootstrap_addr: &str, engine_id: &str) -> Box<str> {
    format!(
        r#""remote_bootstrap_addr":{},"remote_engine_id":{}"#,
        raw_json(&bootstrap_addr),
        raw_json(&engine_id)
    )
    .into()
}

/// `kv_transfer_params` as raw JSON, the fields in [`KvTransferParams`]' order: for P, or for
/// D (`remote_prefill`) with the [`kv_source`] of the pair it pulls from. Written directly:
/// serde's way, through the type's pass-through map and each string escaped anew, cost
/// several times the instructions.
fn sent_params(remote_prefill: bool, kv_source: Option<&str>, transfer_id: &str) -> String {
    let mut params = Vec::with_capacity(96 + kv_source.map_or(0, str::len) + transfer_id.len());
    params.extend_from_slice(if remote_prefill {
        br#"{"do_remote_decode":false,"do_remote_prefill":true,"#
    } else {
        br#"{"do_remote_decode":true,"do_remote_prefill":false,"#
    });
    if let Some(kv_source) = kv_source {
        params.extend_from_slice(kv_source.as_bytes());
        params.push(b',');
    }
    params.extend_from_slice(br#""transfer_id":"#);
    serde_json::to_writer(&mut params, transfer_id).expect("a string serializes into memory");
    params.push(b'}');
    String::from_utf8(params).expect("JSON text is UTF-8")
}

/// `kv_transfer_params` for P, as raw JSON: compute the KV for a remote decoder.
pub fn prefill_params(transfer_id: &str, sequential: bool) -> String {
    if !sequential {
        return sent_params(false, None, transfer_id);
    }
    let mut params = KvTransferParams {
        do_remote_decode: true,
        do_remote_prefill: false,
        transfer_id: Some(transfer_id.to_owned()),
        ..KvTransferParams::default()
    };
    // What vLLM's NIXL proxy sends P: the fields P fills in, as nulls.
    for field in [
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
    ] {
        params.extra.insert(field.to_owned(), Value::Null);
    }
    raw_json(&params)
}

/// A raw JSON value as a boolean, read as pydantic's lax mode reads one (the engines' OpenAI
/// servers): `true` or `false`, a number equal to 1 or 0, or a string `"1"`, `"t"`, `"y"`,
/// `"on"`, `"yes"` or `"true"` (`"0"`, `"f"`, `"n"`, `"off"`, `"no"`, `"false"`) in any case.
/// `None` for anything else.
pub fn flag_of(raw: &str) -> Option<bool> {
    const TRUE: [&str; 6] = ["1", "t", "y", "on", "yes", "true"];
    const FALSE: [&str; 6] = ["0", "f", "n", "off", "no", "false"];
    let raw = raw.trim();
    match raw {
        "true" => Some(true),
        "false" => Some(false),
        _ if raw.starts_with('"') => {
            // Decoded, escapes and all, as the engine's JSON parser decodes it.
            let word: String = serde_json::from_str(raw).ok()?;
            let is = |words: [&str; 6]| words.iter().any(|w| word.eq_ignore_ascii_case(w));
            [(TRUE, true), (FALSE, false)]
                .into_iter()
                .find_map(|(words, value)| is(words).then_some(value))
        }
        _ => match raw.parse::<f64>() {
            Ok(1.0) => Some(true),
            Ok(0.0) => Some(false),
            _ => None,
        },
    }
}

/// `kv_transfer_params` for D in concurrent mode, as raw JSON: pull the KV of `transfer_id`
/// from `pair`.
pub fn decode_params(transfer_id: &str, pair: &Pair) -> String {
    sent_params(true, pair.kv_source.as_deref(), transfer_id)
}

/// `kv_transfer_params` for D in concurrent mode pulling the KV of `transfer_id` from
/// `engine_id` at `bootstrap_addr`: the pair's engine once it re-registered under a new id.
pub fn decode_params_from(transfer_id: &str, bootstrap_addr: &str, engine_id: &str) -> String {
    sent_params(
        true,
        Some(&kv_source(bootstrap_addr, engine_id)),
        transfer_id,
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn sent(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn booleans_read_as_pydantic_reads_them() {
        for raw in r#"true 1 1.0 "yes" "TRUE" "On" "y" "1" "y\u0065s""#.split(' ') {
            assert_eq!(flag_of(raw), Some(true), "{raw}");
        }
        for raw in r#"false 0 0.0 "no" "False" "off" "n" "0""#.split(' ') {
            assert_eq!(flag_of(raw), Some(false), "{raw}");
        }
        for raw in r#"null|2|"maybe"|"1.0"|" yes"|[]|{}|"""#.split('|') {
            assert_eq!(flag_of(raw), None, "{raw}");
        }
        let body = Body::parse(br#"{"stream": "Yes", "echo": 0, "n": null}"#).unwrap();
        assert_eq!(body.flag("stream"), Some(true));
        assert_eq!(body.flag("echo"), Some(false));
        assert_eq!(body.flag("n"), None);
        assert_eq!(body.flag("logprobs"), None);
    }

    #[test]
    fn prefill_body_changes_only_what_vllm_changes() {
        let bytes = br#"{"model":"m","prompt":"hi","stream":true,"max_tokens":50,"max_completion_tokens":50,
                 "stream_options":{"include_usage":true},"temperature":0.7,"extra_field":{"a":[1,2]}}"#;
        let body = Body::parse(bytes).unwrap();
        assert_eq!(body.get("stream").unwrap().get(), "true");
        assert_eq!(
            sent(&body.prefill(&prefill_params("xfer-1", false))),
            json!({"model":"m","prompt":"hi","stream":false,"max_tokens":1,"max_completion_tokens":1,
                   "temperature":0.7,"extra_field":{"a":[1,2]},"min_tokens":1,
                   "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-1"}})
        );
        // The client's own body is left as it was, for D.
        assert_eq!(
            sent(&body.decode("{}"))["stream_options"],
            json!({"include_usage": true})
        );
    }

    #[test]
    fn max_completion_tokens_is_added_only_when_present() {
        let body = Body::parse(br#"{"prompt":"hi","min_tokens":5,"stop_token_ids":[2]}"#).unwrap();
        assert!(body.get("stream").is_none());
        let sent = sent(&body.prefill("null"));
        assert_eq!(sent["max_tokens"], 1);
        // P cannot stop before its one token, whatever the client's own minimum.
        assert_eq!(sent["min_tokens"], 1);
        assert_eq!(sent["stop_token_ids"], json!([2]));
        assert_eq!(sent["stream"], false);
        assert!(sent.get("max_completion_tokens").is_none());
    }

    #[test]
    fn sent_params_are_written_as_kv_transfer_params_are() {
        let full = KvTransferParams {
            do_remote_prefill: true,
            remote_bootstrap_addr: Some("http://10.0.0.5:8998".into()),
            remote_engine_id: Some("engine \"0\"".into()),
            transfer_id: Some("xfer-3".into()),
            ..KvTransferParams::default()
        };
        let source = kv_source("http://10.0.0.5:8998", "engine \"0\"");
        assert_eq!(sent_params(true, Some(&source), "xfer-3"), raw_json(&full));
        let prefill = KvTransferParams {
            do_remote_decode: true,
            transfer_id: Some("xfer-4".into()),
            ..KvTransferParams::default()
        };
        assert_eq!(prefill_params("xfer-4", false), raw_json(&prefill));
    }

    #[test]
    fn sequential_prefill_params_carry_nixl_nulls() {
        assert_eq!(
            sent(prefill_params("xfer-2", true).as_bytes()),
            json!({"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-2",
                   "remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null})
        );
    }

    #[test]
    fn bodies_must_be_objects() {
        assert!(matches!(Body::parse(b"[1]"), Err(BodyError::NotObject)));
        assert!(matches!(Body::parse(b"{"), Err(BodyError::NotJson(_))));
        assert!(matches!(Body::parse(b"[1,"), Err(BodyError::NotJson(_))));
        assert!(matches!(
            Body::parse(b"\"text\""),
            Err(BodyError::NotObject)
        ));
    }

    #[test]
    fn other_fields_pass_through_as_sent() {
        let body = Body::parse(
            br#"{"prompt":"caf\u00e9","messages":[{"role":"user","content":"hi"}],"n":1.50,"max_tokens":9}"#,
        )
        .unwrap();
        let sent = String::from_utf8(body.decode(r#"{"a":1}"#)).unwrap();
        assert_eq!(
            sent,
            r#"{"max_tokens":9,"messages":[{"role":"user","content":"hi"}],"n":1.50,"prompt":"caf\u00e9","kv_transfer_params":{"a":1}}"#
        );
    }

    #[test]
    fn field_names_are_unescaped_once_and_escaped_again() {
        // An escaped name, a repeated one (the last wins) and an empty object.
        let body = Body::parse(br#"{"a\"b":1,"x":1,"x":2,"\u00e9":true,"c\\d\u0001":0}"#).unwrap();
        assert_eq!(body.get("a\"b").unwrap().get(), "1");
        assert_eq!(
            sent(&body.alone()),
            json!({"a\"b": 1, "x": 2, "\u{e9}": true, "c\\d\u{1}": 0})
        );
        assert_eq!(Body::parse(b"{}").unwrap().alone(), b"{}");
        let edited = Body::parse(br#"{"bootstrap_room":1,"kv_transfer_params":{}}"#).unwrap();
        assert_eq!(edited.alone(), b"{}");
    }
}
