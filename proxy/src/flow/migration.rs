//! Migration: an answer whose decode fails mid-answer goes on on another decode, token for
//! token. This file decides which answers can (those whose continuation is exact), asks their
//! decode for the token ids it generates, and makes a continuation: a completion of the
//! prompt's token ids plus the generated ones the client has, with what remains of
//! `max_tokens`, placed and dispatched as a new request would be (fresh prefill included),
//! never on a decode that failed the answer. The relay ([`crate::relay::Relay`]) follows the
//! answer and calls the continuation when it breaks.

use std::sync::{Arc, LazyLock};
use std::time::Instant;

use axum::http::{HeaderMap, HeaderValue};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use pd_router::admission::RequestClass;
use pd_router::backend::Backend;
use pd_router::body::{flag_of, raw_json, Body, Edit, KV_TRANSFER_PARAMS};
use pd_router::tenants::charge::{output_limit, Api, COMPLETION_DEFAULT};
use serde_json::value::RawValue;

use super::failure::Refusal;
use super::{dispatch, placed_and_called, placement, Request, Started};
use crate::config::Mode;
use crate::error::ApiError;
use crate::metrics::{Break, Migrated, Outcome, RouteMetrics};
use crate::models::ModelHandles;
use crate::relay::{Asked, Continuation, Continuer, Failure, Resumed, Resumption, Shape};
use crate::route::Route;
use crate::state::{AppState, Shared};
use crate::trace::RequestTrace;

/// The body field that asks vLLM for the token ids of the prompt and of each chunk.
const RETURN_TOKEN_IDS: &str = "return_token_ids";

/// `true`, as raw JSON.
static TRUE: LazyLock<Box<RawValue>> =
    LazyLock::new(|| RawValue::from_string("true".to_owned()).expect("valid JSON"));

/// Fields whose continuation would not be the same answer: stop strings (the engine holds
/// back text that may begin one, so the client may lack text of tokens already generated),
/// penalties and bad words on the output's tokens (the continuation counts them as the
/// prompt's), an echo or suffix, several choices, guided decoding (the grammar's state would
/// start again), tools (their parser's state too), and a truncated prompt. (Log probabilities
/// are told by the shape: [`asks_logprobs`].)
const INEXACT: &[&str] = &[
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "bad_words",
    "echo",
    "suffix",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tools",
    "truncate_prompt_tokens",
];

/// Fields of a chat request a completion does not take.
const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "include_reasoning",
    "mm_processor_kwargs",
    "logprobs",
    "top_logprobs",
];

/// The content parts of a chat message that are not text: a continuation of the prompt's
/// token ids would lose what they hold.
const MEDIA_PARTS: &[&str] = &[
    "image_url",
    "input_audio",
    "audio_url",
    "video_url",
    "image_embeds",
    "image_pil",
    "input_image",
    "file",
];

/// How the client asked for its answer, when the answer can be continued exactly elsewhere;
/// `None` when it cannot (or migration is off). The decode is then asked for token ids.
pub(super) fn follow(state: &Shared, route: Route, body: &mut Body<'_>) -> Option<Asked> {
    if state.migration.limit == 0 || state.sidecar || state.mode == Mode::Sglang {
        return None;
    }
    let shape = match route {
        Route::Completions => Shape::Completion,
        Route::ChatCompletions => Shape::Chat,
        Route::Generate => return None,
    };
    if body.flag("stream") != Some(true) {
        return None;
    }
    let raw = |name: &str| body.get(name).map(|value| value.get().trim());
    let one = |name| raw(name).is_none_or(|value| matches!(value, "1" | "null"));
    if !one("n") || !one("best_of") || INEXACT.iter().any(|name| raw(name).is_some_and(is_set)) {
        return None;
    }
    if asks_logprobs(shape, raw("logprobs")) {
        return None;
    }
    match shape {
        Shape::Completion if !single_prompt(raw("prompt")?) => return None,
        // A reasoning parser's hidden reasoning streams nothing: it would look stalled.
        Shape::Chat if body.flag("include_reasoning") == Some(false) => return None,
        Shape::Chat if has_media(raw("messages")?) => return None,
        _ => {}
    }
    let options = raw("stream_options").and_then(|v| Body::parse(v.as_bytes()).ok());
    let option = |name| options.as_ref().and_then(|options| options.flag(name));
    if option("continuous_usage_stats") == Some(true) {
        return None;
    }
    let usage = option("include_usage") == Some(true);
    // A value the engine would refuse is left for it to refuse, not replaced.
    let token_ids = match (body.get(RETURN_TOKEN_IDS), body.flag(RETURN_TOKEN_IDS)) {
        (Some(raw), None) if raw.get().trim() != "null" => return None,
        (_, flag) => flag == Some(true),
    };
    if !token_ids {
        body.insert(RETURN_TOKEN_IDS, &TRUE);
    }
    Some(Asked {
        shape,
        token_ids,
        usage,
    })
}

/// Whether the request asks for log probabilities: a completion's `logprobs` (0 included: the
/// sampled token's), a chat's `logprobs` unless it is false (or `null`).
fn asks_logprobs(shape: Shape, logprobs: Option<&str>) -> bool {
    let set = logprobs.filter(|value| *value != "null");
    match shape {
        Shape::Completion => set.is_some(),
        Shape::Chat => set.is_some_and(|value| flag_of(value) != Some(false)),
    }
}

/// Whether chat `messages` (raw JSON) hold a content part that is not text.
fn has_media(messages: &str) -> bool {
    let bytes = messages.as_bytes();
    memchr::memmem::find_iter(bytes, b"\"type\"").any(|at| {
        let rest = bytes[at + 6..].trim_ascii_start();
        let Some(rest) = rest.strip_prefix(b":") else {
            return false;
        };
        let rest = rest.trim_ascii_start();
        MEDIA_PARTS.iter().any(|part| {
            rest.strip_prefix(b"\"")
                .and_then(|value| value.strip_prefix(part.as_bytes()))
                .is_some_and(|after| after.starts_with(b"\""))
        })
    })
}

/// Whether a field's raw value asks for something (not null, false, zero or empty).
fn is_set(value: &str) -> bool {
    !matches!(value, "null" | "false" | "0" | "0.0" | "\"\"" | "[]" | "{}")
}

/// Whether a completion's `prompt` is one prompt (text, or a list of token ids), not several.
fn single_prompt(prompt: &str) -> bool {
    match prompt.strip_prefix('[') {
        None => prompt.starts_with('"'),
        Some(list) => {
            let list = list.trim_start();
            list.starts_with(']') || list.starts_with(|c: char| c.is_ascii_digit())
        }
    }
}

/// The body of `continuation` of the answer to `original`: a completion of its token ids.
/// `context` is the model's context length, which bounds a chat that names no limit (a
/// completion that names none has vLLM's default of 16); without it, such a chat cannot be
/// continued (`None`).
pub(super) fn continuation_body(
    original: &Body<'_>,
    asked: Asked,
    continuation: &Continuation,
    context: Option<u64>,
) -> Option<Vec<u8>> {
    let number = |name: &str| original.number(name).map(|n| n.max(0.0) as u64);
    let api = match asked.shape {
        Shape::Completion => Api::Completions,
        Shape::Chat => Api::Chat,
    };
    let limit = output_limit(api, original).map(|(_, n)| n.max(0.0) as u64);
    let limit = match asked.shape {
        Shape::Completion => Some(limit.unwrap_or(COMPLETION_DEFAULT as u64)),
        Shape::Chat => limit,
    };
    let done = continuation.generated as u64;
    // What the chat had: the context left after its prompt.
    let limit = match limit {
        Some(limit) => limit,
        None => context?.saturating_sub(continuation.prompt.len() as u64 - done),
    };
    let prompt = raw_json(&continuation.prompt);
    let remaining = limit.saturating_sub(done).max(1).to_string();
    let min_tokens = number("min_tokens").map(|min| min.saturating_sub(done).to_string());
    let mut edits = vec![
        Edit::Set("prompt", &prompt),
        Edit::Set("max_tokens", &remaining),
        Edit::Set("stream", "true"),
        Edit::Set(RETURN_TOKEN_IDS, "true"),
        Edit::Remove("prompt_logprobs"),
        Edit::Remove(KV_TRANSFER_PARAMS),
        match asked.usage {
            true => Edit::Set("stream_options", r#"{"include_usage":true}"#),
            false => Edit::Remove("stream_options"),
        },
    ];
    if let Some(min_tokens) = &min_tokens {
        edits.push(Edit::Replace("min_tokens", min_tokens));
    }
    if asked.shape == Shape::Chat {
        edits.extend(CHAT_ONLY.iter().map(|name| Edit::Remove(name)));
    }
    Some(original.render(&edits))
}

/// The request, whose decode failed after its prefill answered (`refusal`), placed again with
/// a fresh prefill and never on a decode that failed it, within the migration limit, the
/// request's deadline and the retry budget; else (or with no other decode) the last decode's
/// failure is the answer. Returns the decodes that failed it too.
pub(super) async fn replace(
    request: &Request<'_>,
    raw: &Bytes,
    body: &Body<'_>,
    handles: &ModelHandles,
    trace: Option<&RequestTrace>,
    mut refusal: Refusal,
) -> Result<(Started, Vec<Arc<Backend>>), Refusal> {
    let state = request.state;
    let metrics = state.metrics.migrations();
    let since = Instant::now();
    let mut avoid: Vec<Arc<Backend>> = request.avoid.to_vec();
    while let Some(failed) = refusal.replaceable.take() {
        let refused = if avoid.len() as u32 >= state.migration.limit {
            Some(Migrated::Limit)
        } else if Instant::now() >= request.deadline {
            Some(Migrated::Deadline)
        } else if !state.router.may_retry("migration") {
            Some(Migrated::Budget)
        } else {
            None
        };
        if let Some(outcome) = refused {
            metrics.count(Break::Failed, outcome);
            return Err(refusal);
        }
        tracing::warn!(request_id = request.request_id.to_str().unwrap_or_default(), decode = failed.url(), "decode failed after its prefill answered; placing the request again with a fresh prefill");
        avoid.push(failed);
        let again = Request {
            avoid: &avoid,
            continued: true,
            metrics: request.metrics.clone(),
            ..*request
        };
        // With nowhere else to go, the decode's own failure is the answer.
        let Ok(placed) = placement::place(&again, raw, body, handles, trace).await else {
            metrics.count(Break::Failed, Migrated::Failed);
            return Err(refusal);
        };
        match dispatch::run(&again, body, placed, trace).await {
            Ok(started) => {
                metrics.resumed(Break::Failed, 0, since.elapsed());
                return Ok((started, avoid));
            }
            Err(next) if next.replaceable.is_some() => refusal = next,
            Err(next) => {
                metrics.count(Break::Failed, Migrated::Failed);
                return Err(next);
            }
        }
    }
    Err(refusal)
}

/// What a request's answer needs to be continued elsewhere: the request itself, owned.
pub(super) struct Migrator {
    state: AppState,
    headers: HeaderMap,
    request_id: HeaderValue,
    model: Option<String>,
    /// The client's body (its model's alias resolved).
    body: Bytes,
    deadline: Instant,
    class: RequestClass,
    metrics: Arc<RouteMetrics>,
    asked: Asked,
}

impl Migrator {
    /// The resumption of `request`'s answer (its body `body`), asked for as `asked` says;
    /// `failed`: the decodes that failed it before its answer began.
    pub(super) fn resumption(
        request: &Request<'_>,
        body: Bytes,
        asked: Asked,
        failed: Vec<Arc<Backend>>,
    ) -> Resumption {
        let state = request.state;
        let migrator = Migrator {
            state: state.clone(),
            headers: request.headers.clone(),
            request_id: request.request_id.clone(),
            model: request.model.map(str::to_owned),
            body,
            deadline: request.deadline,
            class: request.class.clone(),
            metrics: request.metrics.clone(),
            asked,
        };
        Resumption {
            asked,
            limit: state.migration.limit,
            stall: state.migration.stall,
            deadline: request.deadline,
            request_id: request.request_id.clone(),
            continuer: Box::new(Arc::new(migrator)),
            metrics: state.metrics.migrations().clone(),
            failed,
        }
    }

    /// Places and calls `continuation`, avoiding the decodes in `avoid` (and placed again
    /// should its decode fail after its prefill answered).
    async fn start_continuation(
        &self,
        continuation: Continuation,
        avoid: Vec<Arc<Backend>>,
    ) -> Result<Resumed, Failure> {
        let model = self.model.as_deref();
        let context = (avoid.iter().find_map(|decode| decode.context_length(model)))
            .or_else(|| self.state.pool().context_length(model));
        let unreadable = || broke_off("its body could not be read again");
        let original = Body::parse(&self.body).map_err(|_| unreadable())?;
        let made = continuation_body(&original, self.asked, &continuation, context);
        let bytes = Bytes::from(made.ok_or_else(|| {
            broke_off("the chat names no token limit and no decode's card gives the context length")
        })?);
        let body = Body::parse(&bytes).map_err(|_| unreadable())?;
        let request = Request {
            state: &self.state,
            route: Route::Completions,
            headers: &self.headers,
            request_id: &self.request_id,
            model: self.model.as_deref(),
            metrics: self.metrics.clone(),
            start: Instant::now(),
            deadline: self.deadline,
            class: &self.class,
            avoid: &avoid,
            continued: true,
        };
        let handles = self.state.model_metrics(request.model);
        let called = placed_and_called(&request, &bytes, &body, &handles, None).await;
        let (started, _) = called.map_err(|refusal| {
            broke_off(match refusal.outcome {
                Outcome::Unavailable | Outcome::ModelMismatch => "no other engine is ready",
                Outcome::Overloaded => "the other engines are saturated",
                Outcome::DecodeTimeout | Outcome::PrefillTimeout => "it did not start in time",
                _ => "its engines failed too",
            })
        })?;
        Ok(Resumed {
            decode: started.decode,
            call: started.decode_call,
            prefill: started.prefill,
        })
    }
}

impl Continuer for Arc<Migrator> {
    fn continue_answer(
        &self,
        continuation: Continuation,
        avoid: Vec<Arc<Backend>>,
    ) -> BoxFuture<'static, Result<Resumed, Failure>> {
        let migrator = self.clone();
        Box::pin(async move { migrator.start_continuation(continuation, avoid).await })
    }

    fn may_retry(&self) -> bool {
        self.state.router.may_retry("migration")
    }
}

/// What the client is told when its answer broke off and its continuation could not start.
fn broke_off(why: &str) -> Failure {
    let message = format!("decode's answer broke off and could not be continued: {why}");
    (ApiError::bad_gateway(message), Outcome::StreamError)
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    const ASKED: Asked = Asked {
        shape: Shape::Chat,
        token_ids: false,
        usage: true,
    };

    #[test]
    fn a_chat_goes_on_as_a_completion_of_its_tokens() {
        let original = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_completion_tokens":10,"min_tokens":4,"temperature":0,"seed":7,"kv_transfer_params":{"a":1}}"#;
        let body = Body::parse(original).unwrap();
        let continuation = Continuation {
            prompt: vec![1, 2, 3, 9],
            generated: 1,
        };
        let made: Value =
            serde_json::from_slice(&continuation_body(&body, ASKED, &continuation, None).unwrap())
                .unwrap();
        assert_eq!(made["prompt"], serde_json::json!([1, 2, 3, 9]));
        assert_eq!(made["max_tokens"], 9);
        assert_eq!(made["min_tokens"], 3);
        assert_eq!(made["seed"], 7);
        assert_eq!(made["temperature"], 0);
        assert_eq!(made["return_token_ids"], true);
        assert_eq!(made["stream_options"]["include_usage"], true);
        for gone in ["messages", "max_completion_tokens", "kv_transfer_params"] {
            assert!(made.get(gone).is_none(), "{gone}");
        }
    }

    #[test]
    fn a_completion_without_max_tokens_keeps_vllms_default() {
        let body = Body::parse(br#"{"prompt":"a","stream":true}"#).unwrap();
        let asked = Asked {
            shape: Shape::Completion,
            ..ASKED
        };
        let continuation = Continuation {
            prompt: vec![1, 5],
            generated: 5,
        };
        let made: Value =
            serde_json::from_slice(&continuation_body(&body, asked, &continuation, None).unwrap())
                .unwrap();
        assert_eq!(made["max_tokens"], 11);
    }

    #[test]
    fn a_chat_without_a_limit_gets_the_context_left() {
        let body = Body::parse(br#"{"messages":[],"stream":true}"#).unwrap();
        let continuation = Continuation {
            prompt: vec![7; 100],
            generated: 40,
        };
        assert_eq!(continuation_body(&body, ASKED, &continuation, None), None);
        let made = continuation_body(&body, ASKED, &continuation, Some(1000)).unwrap();
        let made: Value = serde_json::from_slice(&made).unwrap();
        // 60 prompt tokens: 940 for the whole answer, 40 of them done.
        assert_eq!(made["max_tokens"], 900);
    }

    #[test]
    fn media_and_log_probabilities_are_not_followed() {
        assert!(has_media(
            r#"[{"role":"user","content":[{"type": "image_url","image_url":{"url":"x"}}]}]"#
        ));
        assert!(!has_media(
            r#"[{"role":"user","content":[{"type":"text","text":"\"type\":\"image_url\""}]}]"#
        ));
        assert!(asks_logprobs(Shape::Completion, Some("0")));
        assert!(!asks_logprobs(Shape::Completion, Some("null")));
        assert!(!asks_logprobs(Shape::Chat, Some("false")));
        assert!(!asks_logprobs(Shape::Chat, Some(r#""no""#)));
        assert!(!asks_logprobs(Shape::Chat, Some("0")));
        assert!(!asks_logprobs(Shape::Chat, Some("null")));
        assert!(asks_logprobs(Shape::Chat, Some("true")));
        assert!(asks_logprobs(Shape::Chat, Some(r#""yes""#)));
    }

    #[test]
    fn only_single_prompts_are_followed() {
        assert!(single_prompt(r#""text""#));
        assert!(single_prompt("[1, 2]"));
        assert!(!single_prompt(r#"["a", "b"]"#));
        assert!(!single_prompt("[[1], [2]]"));
        assert!(is_set("[\"x\"]") && !is_set("null") && !is_set("0"));
    }
}
