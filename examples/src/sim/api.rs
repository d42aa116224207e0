//! The request fields the simulator reads and the response shapes it writes: OpenAI's
//! completions and chat completions, and SGLang's native `/generate`; whole or as Server-Sent
//! Events chunks.

use std::sync::Arc;

use pd_tokenize::Tokenizer;
use serde_json::{json, Value};

use super::kv::Generator;
use super::lora::Adapter;
use super::prefix_cache::PromptBlocks;
use super::tokens::prompt_ids;

/// Which route a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
    /// SGLang's `POST /generate` (`text`, `sampling_params.max_new_tokens`).
    Generate,
}

/// What the simulator needs from a request body.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// The request's `model` (none: the base model).
    pub model: Option<String>,
    /// The LoRA adapter that `model` names (set by the engine once it checked the model).
    pub lora: Option<Arc<Adapter>>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// The dp rank serving it (set by the dialect; 0 until then).
    pub dp: u32,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Whether to answer with SSE chunks.
    pub stream: bool,
    /// Whether the last SSE chunk before `[DONE]` carries usage.
    pub include_usage: bool,
    /// Whether the answer carries token ids (vLLM's `return_token_ids`): the prompt's
    /// (`prompt_token_ids`, whole or on the first chunk) and the generated ones (`token_ids`).
    pub return_token_ids: bool,
    /// Token ids that end the answer when generated (`stop_token_ids`; SGLang's
    /// `sampling_params.stop_token_ids`), as EOS does.
    pub stop_token_ids: Vec<u32>,
    /// Tokens generated before a stop token may end the answer (`min_tokens`; SGLang's
    /// `sampling_params.min_new_tokens`).
    pub min_tokens: u32,
}

/// Why an answer ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// At its token limit.
    Length,
    /// On a stop token.
    Stop,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn reason(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Stop => "stop",
        }
    }
}

impl Prompt {
    /// The prompt as the prefix cache names its blocks.
    pub fn blocks(&self) -> PromptBlocks<'_> {
        PromptBlocks {
            tokens: &self.tokens,
            lora: self.lora.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
        }
    }

    /// The prompt's token count.
    pub fn token_count(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// How many tokens the answer has and why it ends: at `max_tokens`, or on the first of
    /// `stop_token_ids` generated once `min_tokens` tokens exist (that token counted in the
    /// usage, its text not shown), as vLLM ends one: the stop test runs before the length test.
    pub fn planned(&self) -> (u32, Finish) {
        if self.stop_token_ids.is_empty() {
            return (self.max_tokens, Finish::Length);
        }
        let mut generator = Generator::new(&self.tokens);
        for made in 1..=self.max_tokens {
            let (id, _) = generator.next_token();
            if made > self.min_tokens && self.stop_token_ids.contains(&id) {
                return (made, Finish::Stop);
            }
        }
        (self.max_tokens, Finish::Length)
    }
}

/// The default number of tokens to generate when the request does not say.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// An optional string field.
fn string(body: &Value, field: &str) -> Result<Option<String>, String> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{field}` must be a string")),
    }
}

/// Reads the prompt (tokenized by `tokenizer`), the model asked for and the generation settings
/// of a request, naming the field that is wrong.
pub fn parse_prompt(api: Api, body: &Value, tokenizer: &Tokenizer) -> Result<Prompt, String> {
    let tokens = prompt_ids(tokenizer, api, body)?;
    let model = string(body, "model")?;
    let cache_salt = string(body, "cache_salt")?;
    let limit = |field: &str| -> Result<Option<u32>, String> {
        match body.pointer(&format!("/{}", field.replace('.', "/"))) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|n| (1..=1_000_000).contains(n))
                .map(|n| Some(n as u32))
                .ok_or_else(|| format!("`{field}` must be an integer from 1 to 1000000")),
        }
    };
    let max_tokens = match api {
        Api::Generate => limit("sampling_params.max_new_tokens")?,
        Api::Completions | Api::Chat => limit("max_completion_tokens")?.or(limit("max_tokens")?),
    }
    .unwrap_or(DEFAULT_MAX_TOKENS);
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or("`stream` must be a boolean")?,
    };
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let return_token_ids = match body.get("return_token_ids") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or("`return_token_ids` must be a boolean")?,
    };
    let (stops, least) = match api {
        Api::Generate => (
            "sampling_params.stop_token_ids",
            "sampling_params.min_new_tokens",
        ),
        Api::Completions | Api::Chat => ("stop_token_ids", "min_tokens"),
    };
    let field = |name: &str| body.pointer(&format!("/{}", name.replace('.', "/")));
    let stop_token_ids = match field(stops) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ids)) => ids
            .iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("`{stops}` must be a list of token ids"))?,
        Some(_) => return Err(format!("`{stops}` must be a list of token ids")),
    };
    let min_tokens = match field(least) {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n <= max_tokens)
            .ok_or_else(|| format!("`{least}` must be an integer from 0 to the token limit"))?,
    };
    Ok(Prompt {
        tokens,
        model,
        lora: None,
        cache_salt,
        dp: 0,
        max_tokens,
        stream,
        include_usage,
        return_token_ids,
        stop_token_ids,
        min_tokens,
    })
}

/// Identity of one response: the id, creation time and model shared by all its chunks.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// The response id (`cmpl-…` or `chatcmpl-…`).
    pub id: String,
    /// Seconds since the epoch.
    pub created: u64,
    /// The model name.
    pub model: String,
    /// The route.
    pub api: Api,
}

impl ResponseMeta {
    /// Fresh metadata for one response.
    pub fn new(api: Api, model: &str) -> Self {
        let prefix = match api {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
            Api::Generate => "gen",
        };
        ResponseMeta {
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: model.to_owned(),
            api,
        }
    }

    fn usage(prompt_tokens: u32, completion_tokens: u32) -> Value {
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        })
    }

    /// A whole (non-streamed) response that ended for `finish`.
    pub fn full(
        &self,
        text: &str,
        (prompt_tokens, completion_tokens): (u32, u32),
        finish: Finish,
        kv: Value,
    ) -> Value {
        if self.api == Api::Generate {
            return self.generated(text, prompt_tokens, completion_tokens, Some(finish));
        }
        let reason = finish.reason();
        let (object, choice) = match self.api {
            Api::Completions => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason}),
            ),
            Api::Chat | Api::Generate => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": reason}),
            ),
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice],
            "usage": Self::usage(prompt_tokens, completion_tokens),
            "kv_transfer_params": kv,
        })
    }

    /// SGLang's `/generate` answer, whole or one streamed event: the text so far (SGLang streams
    /// the whole text each time) and the finish reason once `finished`.
    pub fn generated(
        &self,
        text: &str,
        prompt_tokens: u32,
        completion_tokens: u32,
        finished: Option<Finish>,
    ) -> Value {
        let finish_reason = match finished {
            Some(Finish::Length) => json!({"type": "length", "length": completion_tokens}),
            Some(Finish::Stop) => json!({"type": "stop"}),
            None => Value::Null,
        };
        json!({"text": text, "meta_info": {
            "id": self.id, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "finish_reason": finish_reason,
        }})
    }

    /// One OpenAI SSE chunk carrying `piece` (or, with `finish`, the closing chunk).
    pub fn chunk(&self, piece: Option<&str>, first: bool, finish: Option<Finish>) -> Value {
        let finish_reason = finish.map_or(Value::Null, |finish| json!(finish.reason()));
        let (object, choice) = match self.api {
            Api::Completions => (
                "text_completion",
                json!({"index": 0, "text": piece.unwrap_or(""), "logprobs": null, "finish_reason": finish_reason}),
            ),
            Api::Chat | Api::Generate => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(piece) = piece {
                    delta.insert("content".into(), json!(piece));
                }
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}),
                )
            }
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
    }

    /// The usage-only chunk sent last when `stream_options.include_usage` is set.
    pub fn usage_chunk(&self, prompt_tokens: u32, completion_tokens: u32) -> Value {
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat | Api::Generate => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": Self::usage(prompt_tokens, completion_tokens)})
    }
}

/// `answer` (a whole answer or a chunk) with token ids in its choice, as vLLM's
/// `return_token_ids` puts them: the generated ones, and the prompt's when given.
pub fn with_token_ids(mut answer: Value, generated: &[u32], prompt: Option<&[u32]>) -> Value {
    if let Some(choice) = answer
        .pointer_mut("/choices/0")
        .and_then(Value::as_object_mut)
    {
        choice.insert("token_ids".into(), json!(generated));
        choice.insert("prompt_token_ids".into(), json!(prompt));
    }
    answer
}

/// Frames a JSON value as one SSE event.
pub fn sse_event(value: &Value) -> bytes::Bytes {
    bytes::Bytes::from(format!("data: {value}\n\n"))
}

/// The SSE end-of-stream marker.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_and_limits_are_read() {
        let tokenizer = crate::sim::tokens::load(None).unwrap();
        let parse = |api, body: Value| parse_prompt(api, &body, &tokenizer);
        let body = json!({"prompt": "a b c", "max_tokens": 4, "stream": true,
                          "stream_options": {"include_usage": true}});
        let prompt = parse(Api::Completions, body).unwrap();
        assert_eq!(
            (prompt.max_tokens, prompt.stream, prompt.include_usage),
            (4, true, true)
        );
        assert_eq!(prompt.token_count(), 5, "one token per byte");
        let chat = json!({"messages": [{"role": "user", "content": "hi there"}], "max_completion_tokens": 2});
        assert_eq!(parse(Api::Chat, chat).unwrap().max_tokens, 2);
        assert!(parse(Api::Completions, json!({"max_tokens": 1}))
            .unwrap_err()
            .contains("prompt"));
        assert!(
            parse(Api::Completions, json!({"prompt": "x", "max_tokens": 0}))
                .unwrap_err()
                .contains("max_tokens")
        );
        let generate = json!({"text": "a b", "sampling_params": {"max_new_tokens": 3}});
        let prompt = parse(Api::Generate, generate).unwrap();
        assert_eq!((prompt.token_count(), prompt.max_tokens), (3, 3));
        assert!(parse(
            Api::Generate,
            json!({"text": "x", "sampling_params": {"max_new_tokens": -1}})
        )
        .unwrap_err()
        .contains("sampling_params.max_new_tokens"));
        // The model and the salt are strings.
        let adapted = json!({"prompt": "x", "model": "ad", "cache_salt": "s"});
        let prompt = parse(Api::Completions, adapted).unwrap();
        assert_eq!(prompt.model.as_deref(), Some("ad"));
        assert_eq!(prompt.cache_salt.as_deref(), Some("s"));
        let base = parse(Api::Completions, json!({"prompt": "x"})).unwrap();
        assert_eq!(base.model, None);
        assert!(parse(Api::Completions, json!({"prompt": "x", "model": 1}))
            .unwrap_err()
            .contains("model"));
        assert!(
            parse(Api::Completions, json!({"prompt": "x", "cache_salt": 1}))
                .unwrap_err()
                .contains("cache_salt")
        );
    }

    #[test]
    fn a_stop_token_ends_the_answer_once_min_tokens_exist() {
        let tokenizer = crate::sim::tokens::load(None).unwrap();
        let body = json!({"prompt": "a b c", "max_tokens": 4});
        let mut prompt = parse_prompt(Api::Completions, &body, &tokenizer).unwrap();
        assert_eq!(prompt.planned(), (4, Finish::Length));
        let (first, _) = Generator::new(&prompt.tokens).next_token();
        prompt.stop_token_ids = vec![first];
        assert_eq!(prompt.planned(), (1, Finish::Stop));
        // min_tokens masks the stop token as vLLM's does: the first token is not a stop then.
        prompt.min_tokens = 1;
        assert_ne!(prompt.planned(), (1, Finish::Stop));
        let read = json!({"prompt": "x", "max_tokens": 2, "stop_token_ids": [7], "min_tokens": 1});
        let read = parse_prompt(Api::Completions, &read, &tokenizer).unwrap();
        assert_eq!((read.stop_token_ids, read.min_tokens), (vec![7], 1));
        for (bad, field) in [
            (
                json!({"prompt": "x", "stop_token_ids": [-1]}),
                "stop_token_ids",
            ),
            (
                json!({"prompt": "x", "max_tokens": 2, "min_tokens": 3}),
                "min_tokens",
            ),
            (
                json!({"text": "x", "sampling_params": {"stop_token_ids": "1"}}),
                "sampling_params.stop_token_ids",
            ),
        ] {
            let api = if bad.get("text").is_some() {
                Api::Generate
            } else {
                Api::Completions
            };
            assert!(parse_prompt(api, &bad, &tokenizer)
                .unwrap_err()
                .contains(field));
        }
    }

    #[test]
    fn chunks_have_the_openai_shape() {
        let meta = ResponseMeta::new(Api::Chat, "m");
        let first = meta.chunk(Some("Hi"), true, None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(
            first["choices"][0]["delta"],
            json!({"role": "assistant", "content": "Hi"})
        );
        let last = meta.chunk(None, false, Some(Finish::Length));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        let text =
            ResponseMeta::new(Api::Completions, "m").full("x", (2, 1), Finish::Stop, Value::Null);
        assert_eq!(text["choices"][0]["finish_reason"], "stop");
        assert_eq!(text["usage"]["total_tokens"], 3);
        assert_eq!(text["choices"][0]["text"], "x");
    }
}
