//! What P and D receive: the client's JSON body with the few fields vLLM's Mooncake proxy changes,
//! every other field passed through untouched.
//!
//! Only the top level of the body is parsed: each field's value is kept as its raw JSON text and
//! written back as is, so a long prompt or message list is copied, not rebuilt and re-escaped.

use std::collections::BTreeMap;

use pd_protocol::vllm::KvTransferParams;
use serde::de::IgnoredAny;
use serde_json::error::Category;
use serde_json::value::{to_raw_value, RawValue};
use serde_json::{Map, Value};

use crate::backend::Pair;

/// A client's request body: a JSON object, field by field (in key order, as `serde_json::Map`
/// writes them), each value as its raw JSON text.
pub type Body = BTreeMap<String, Box<RawValue>>;

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

/// Parses the client's body.
pub fn parse(bytes: &[u8]) -> Result<Body, BodyError> {
    serde_json::from_slice(bytes).map_err(|err| {
        if err.classify() != Category::Data {
            return BodyError::NotJson(err);
        }
        // Well-formed so far but not an object; still, broken JSON is told as such.
        match serde_json::from_slice::<IgnoredAny>(bytes) {
            Ok(_) => BodyError::NotObject,
            Err(err) => BodyError::NotJson(err),
        }
    })
}

/// Whether the client asked for a streamed (SSE) answer.
#[cfg(test)]
fn is_stream(body: &Body) -> bool {
    body.get("stream")
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or(false)
}

/// The raw JSON text of `value`.
fn raw(value: &impl serde::Serialize) -> Box<RawValue> {
    to_raw_value(value).expect("a JSON value serializes")
}

/// `kv_transfer_params` for P: compute the KV for a remote decoder.
pub fn prefill_params(transfer_id: &str, sequential: bool) -> Value {
    let mut params = KvTransferParams {
        do_remote_decode: true,
        do_remote_prefill: false,
        transfer_id: Some(transfer_id.to_owned()),
        ..KvTransferParams::default()
    };
    if sequential {
        // What vLLM's NIXL proxy sends P: the fields P fills in, as nulls.
        for field in [
            "remote_engine_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
        ] {
            params.extra.insert(field.to_owned(), Value::Null);
        }
    }
    serde_json::to_value(params).expect("KvTransferParams serializes")
}

/// `kv_transfer_params` for D in concurrent mode: pull the KV of `transfer_id` from `pair`.
pub fn decode_params(transfer_id: &str, pair: &Pair) -> Value {
    serde_json::to_value(KvTransferParams {
        do_remote_decode: false,
        do_remote_prefill: true,
        remote_bootstrap_addr: Some(pair.bootstrap_addr.to_string()),
        remote_engine_id: Some(pair.engine_id.to_string()),
        transfer_id: Some(transfer_id.to_owned()),
        extra: Map::new(),
    })
    .expect("KvTransferParams serializes")
}

/// D's body: the client's, with `kv_transfer_params` set to `params`.
pub fn decode_body(body: &mut Body, params: Value) -> Vec<u8> {
    body.insert(KV_TRANSFER_PARAMS.to_owned(), raw(&params));
    serde_json::to_vec(body).expect("a JSON map serializes")
}

/// The body of a request D serves alone (no P, no KV to pull): the client's, without any
/// transfer instructions a client may have sent (`kv_transfer_params`, SGLang's bootstrap
/// fields).
pub fn alone_body(body: &mut Body) -> Vec<u8> {
    for field in [
        KV_TRANSFER_PARAMS,
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    ] {
        body.remove(field);
    }
    serde_json::to_vec(body).expect("a JSON map serializes")
}

/// P's body, made by changing the client's in place: `stream: false`, `max_tokens: 1`,
/// `max_completion_tokens: 1` when present, no `stream_options`, and `kv_transfer_params` set to
/// `params`.
pub fn prefill_body(body: &mut Body, params: Value) -> Vec<u8> {
    body.insert("stream".to_owned(), raw(&false));
    body.insert("max_tokens".to_owned(), raw(&1));
    if let Some(value) = body.get_mut("max_completion_tokens") {
        *value = raw(&1);
    }
    body.remove("stream_options");
    body.insert(KV_TRANSFER_PARAMS.to_owned(), raw(&params));
    serde_json::to_vec(body).expect("a JSON map serializes")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn prefill_body_changes_only_what_vllm_changes() {
        let mut body = parse(
            br#"{"model":"m","prompt":"hi","stream":true,"max_tokens":50,"max_completion_tokens":50,
                 "stream_options":{"include_usage":true},"temperature":0.7,"extra_field":{"a":[1,2]}}"#,
        )
        .unwrap();
        assert!(is_stream(&body));
        let bytes = prefill_body(&mut body, prefill_params("xfer-1", false));
        let sent: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            sent,
            json!({"model":"m","prompt":"hi","stream":false,"max_tokens":1,"max_completion_tokens":1,
                   "temperature":0.7,"extra_field":{"a":[1,2]},
                   "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-1"}})
        );
    }

    #[test]
    fn max_completion_tokens_is_added_only_when_present() {
        let mut body = parse(br#"{"prompt":"hi"}"#).unwrap();
        assert!(!is_stream(&body));
        let sent: Value = serde_json::from_slice(&prefill_body(&mut body, Value::Null)).unwrap();
        assert_eq!(sent["max_tokens"], 1);
        assert!(sent.get("max_completion_tokens").is_none());
    }

    #[test]
    fn sequential_prefill_params_carry_nixl_nulls() {
        let params = prefill_params("xfer-2", true);
        assert_eq!(
            params,
            json!({"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-2",
                   "remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null})
        );
    }

    #[test]
    fn bodies_must_be_objects() {
        assert!(matches!(parse(b"[1]"), Err(BodyError::NotObject)));
        assert!(matches!(parse(b"{"), Err(BodyError::NotJson(_))));
        assert!(matches!(parse(b"[1,"), Err(BodyError::NotJson(_))));
        assert!(matches!(parse(b"\"text\""), Err(BodyError::NotObject)));
    }

    #[test]
    fn other_fields_pass_through_as_sent() {
        let mut body = parse(
            br#"{"prompt":"caf\u00e9","messages":[{"role":"user","content":"hi"}],"n":1.50,"max_tokens":9}"#,
        )
        .unwrap();
        let sent = String::from_utf8(decode_body(&mut body, json!({"a": 1}))).unwrap();
        assert_eq!(
            sent,
            r#"{"kv_transfer_params":{"a":1},"max_tokens":9,"messages":[{"role":"user","content":"hi"}],"n":1.50,"prompt":"caf\u00e9"}"#
        );
    }
}
