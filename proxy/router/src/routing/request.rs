//! [`RequestInfo`]: what a policy may know of the request it places. Every field is read on
//! demand from the already parsed body, so policies that need none of it cost nothing.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::OnceLock;

use http::HeaderMap;
use serde_json::Value;

use crate::body::Body;
use crate::kv_events::Held;
use crate::kv_index::RequestKey;

use super::precise_prefix::{Choice, PickNote};
use super::queued_work::Pending;

/// How many characters of the prompt the prefix key covers.
pub const PREFIX_CHARS: usize = 256;

/// The request being placed: its body (top-level fields as raw JSON), headers and, when a
/// policy needs them, its token ids. The prompt's text, and which engines hold how much of it,
/// are found once, when a policy or rule first asks; the picks made on the engines' events are
/// noted here for the answer's `x-pd-route`.
pub struct RequestInfo<'a> {
    body: Option<&'a Body<'a>>,
    headers: Option<&'a HeaderMap>,
    tokens: Option<&'a [u32]>,
    adapter: Option<&'a str>,
    prompt: OnceLock<String>,
    cache_salt: OnceLock<Option<String>>,
    held: OnceLock<Vec<Held>>,
    /// The notes of the (prefill, decode) picks.
    pub(super) notes: [OnceLock<PickNote>; 2],
}

impl<'a> RequestInfo<'a> {
    /// The request with this body and these headers.
    pub fn new(body: &'a Body<'a>, headers: &'a HeaderMap) -> Self {
        RequestInfo {
            body: Some(body),
            headers: Some(headers),
            ..Self::empty()
        }
    }

    /// The same request with the token ids of its prompt.
    pub fn with_tokens(self, tokens: Option<&'a [u32]>) -> Self {
        RequestInfo { tokens, ..self }
    }

    /// The same request for LoRA adapter `adapter` (its KV blocks are the adapter's).
    pub fn with_adapter(self, adapter: Option<&'a str>) -> Self {
        RequestInfo { adapter, ..self }
    }

    /// A request nothing is known of.
    pub fn empty() -> Self {
        RequestInfo {
            body: None,
            headers: None,
            tokens: None,
            adapter: None,
            prompt: OnceLock::new(),
            cache_salt: OnceLock::new(),
            held: OnceLock::new(),
            notes: Default::default(),
        }
    }

    /// Whether the client asks for several samples of its prompt (`n` or `best_of` above 1,
    /// read as the engine reads numbers).
    pub fn samples_several(&self) -> bool {
        let Some(body) = self.body else { return false };
        ["n", "best_of"]
            .iter()
            .any(|name| body.number(name).is_some_and(|count| count > 1.0))
    }

    /// The prompt's token ids, when they were computed.
    pub fn tokens(&self) -> Option<&'a [u32]> {
        self.tokens
    }

    /// What names the request's KV blocks besides its tokens: its adapter and `cache_salt`.
    pub fn kv_key(&self) -> RequestKey<'_> {
        let salt = self
            .cache_salt
            .get_or_init(|| match self.field("cache_salt")? {
                Value::String(salt) => Some(salt),
                _ => None,
            });
        RequestKey {
            lora_name: self.adapter,
            cache_salt: salt.as_deref(),
        }
    }

    /// Which followed engines hold how much of the prompt, found by `find` on first use.
    pub fn held(&self, find: impl FnOnce() -> Vec<Held>) -> &[Held] {
        self.held.get_or_init(find)
    }

    /// The share of its prefill's queued work the prefill pick gave this request: the flow
    /// holds it until P's call ends.
    pub fn take_prefill_work(&self) -> Option<Pending> {
        let note = self.notes[Choice::Prefill as usize].get()?;
        crate::sync::lock(&note.pending).take()
    }

    /// The `x-pd-route` words of the picks made on the engines' events, e.g.
    /// `; prompt_tokens=512; prefill_pick=kv_hit; prefill_cached_tokens=480`.
    pub fn pick_notes(&self) -> String {
        let mut text = String::new();
        if let Some(tokens) = self.tokens {
            text.push_str(&format!("; prompt_tokens={}", tokens.len()));
        }
        for (choice, note) in ["prefill", "decode"].iter().zip(&self.notes) {
            if let Some(note) = note.get() {
                text.push_str(&format!(
                    "; {choice}_pick={}; {choice}_cached_tokens={}",
                    note.reason.as_str(),
                    note.cached_tokens
                ));
            }
        }
        text
    }

    fn field(&self, name: &str) -> Option<Value> {
        serde_json::from_str(self.body?.get(name)?.get()).ok()
    }

    /// The `model` asked for.
    pub fn model(&self) -> Option<String> {
        match self.field("model")? {
            Value::String(model) => Some(model),
            _ => None,
        }
    }

    /// The `user` field (OpenAI's end-user id), a natural session key.
    pub fn user(&self) -> Option<String> {
        match self.field("user")? {
            Value::String(user) => Some(user),
            _ => None,
        }
    }

    /// The session id as vLLM (0.33) reads it for its KV events, in its order: the body's
    /// `session_id`, the header `header` (vLLM's is `X-Session-ID`), `vllm_xargs.session_id`
    /// (each a non-empty string).
    pub fn session_id(&self, header: &str) -> Option<String> {
        let named = |value: Option<&Value>| match value {
            Some(Value::String(id)) if !id.is_empty() => Some(id.clone()),
            _ => None,
        };
        let from_header = || Some(self.header(header)?.to_owned()).filter(|id| !id.is_empty());
        named(self.field("session_id").as_ref())
            .or_else(from_header)
            .or_else(|| named(self.field("vllm_xargs")?.get("session_id")))
    }

    /// A request header, as text.
    pub fn header(&self, name: &str) -> Option<&'a str> {
        self.headers?.get(name)?.to_str().ok()
    }

    /// The prompt's text: `prompt` (a string, or the strings of a list), or the text of every
    /// `messages` entry's `content`, in order.
    pub fn prompt_text(&self) -> &str {
        self.prompt.get_or_init(|| self.gather_prompt())
    }

    fn gather_prompt(&self) -> String {
        fn text_of(value: &Value, out: &mut String) {
            match value {
                Value::String(text) => out.push_str(text),
                Value::Array(items) => items.iter().for_each(|item| text_of(item, out)),
                Value::Object(object) => {
                    for key in ["content", "text"] {
                        if let Some(inner) = object.get(key) {
                            text_of(inner, out);
                        }
                    }
                }
                _ => {}
            }
        }
        let mut text = String::new();
        if let Some(prompt) = self.field("prompt") {
            text_of(&prompt, &mut text);
        } else if let Some(messages) = self.field("messages") {
            text_of(&messages, &mut text);
        }
        text
    }

    /// How many tokens the prompt has: its token ids' count when known, else about a token
    /// per four bytes of its JSON (`prompt` or `messages`, read without parsing it).
    pub fn prompt_tokens_estimate(&self) -> usize {
        if let Some(tokens) = self.tokens {
            return tokens.len();
        }
        let raw = self
            .body
            .and_then(|body| body.get("prompt").or_else(|| body.get("messages")));
        raw.map_or(0, |raw| raw.get().len() / 4)
    }

    /// The prompt's length in characters.
    pub fn prompt_chars(&self) -> usize {
        self.prompt_text().chars().count()
    }

    /// A hash of the prompt's first [`PREFIX_CHARS`] characters: requests that share it likely
    /// share cached KV.
    pub fn prefix_key(&self) -> u64 {
        let text = self.prompt_text();
        let end = text
            .char_indices()
            .nth(PREFIX_CHARS)
            .map_or(text.len(), |(i, _)| i);
        let mut hasher = DefaultHasher::new();
        text[..end].hash(&mut hasher);
        hasher.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_from_the_body() {
        let body = crate::body::Body::parse(
            br#"{"model":"m","user":"u7","messages":[{"role":"system","content":"You are"},
                {"role":"user","content":[{"type":"text","text":" kind"}]}]}"#,
        )
        .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-session-id", "s1".parse().unwrap());
        let info = RequestInfo::new(&body, &headers);
        assert_eq!(info.model().as_deref(), Some("m"));
        assert_eq!(info.user().as_deref(), Some("u7"));
        assert_eq!(info.header("x-session-id"), Some("s1"));
        assert_eq!(info.session_id("x-session-id").as_deref(), Some("s1"));
        // vLLM's order: the body's field, the header, vllm_xargs.
        let none = HeaderMap::new();
        for (body, headers, id) in [
            (
                &br#"{"session_id":"b1","vllm_xargs":{"session_id":"x1"}}"#[..],
                &headers,
                Some("b1"),
            ),
            (
                br#"{"session_id":"","vllm_xargs":{"session_id":"x1"}}"#,
                &headers,
                Some("s1"),
            ),
            (
                br#"{"session_id":"","vllm_xargs":{"session_id":"x1"}}"#,
                &none,
                Some("x1"),
            ),
            (
                br#"{"session_id":7,"vllm_xargs":{"session_id":""}}"#,
                &none,
                None,
            ),
        ] {
            let body = crate::body::Body::parse(body).unwrap();
            let info = RequestInfo::new(&body, headers);
            assert_eq!(info.session_id("x-session-id").as_deref(), id);
        }
        assert_eq!(info.prompt_text(), "You are kind");
        assert_eq!(info.prompt_chars(), 12);
        let same = crate::body::Body::parse(br#"{"prompt":"You are kind"}"#).unwrap();
        assert_eq!(
            RequestInfo::new(&same, &headers).prefix_key(),
            info.prefix_key()
        );
        assert_eq!(RequestInfo::empty().model(), None);
    }
}
