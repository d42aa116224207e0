//! The prompt's token ids, as the engine computes them, for the policies that route on the
//! engines' KV caches (`precise_prefix`): in-process from the model's tokenizer and chat
//! template (`--tokenizer DIR`, through `pd_tokenize`), else by asking an engine's own
//! `POST /tokenize` (bounded by `--tokenize-timeout`). Token ids the client sent (a completion's
//! `prompt` as ids, SGLang's `input_ids`) are taken as they are. A batch is routed by its first
//! prompt.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pd_tokenize::{ChatRequest, TokenizeError, Tokenizer};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::backend::Backend;
use crate::body::Body;
use crate::metrics::TokenizeMetrics;

/// Which prompt a body carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// A completion's `prompt` (or SGLang's `text` or `input_ids`).
    Completion,
    /// A chat's `messages`.
    Chat,
}

/// Where token ids come from.
pub struct PromptTokens {
    local: Option<Arc<Tokenizer>>,
    client: reqwest::Client,
    timeout: Duration,
    metrics: TokenizeMetrics,
}

/// A completion's `prompt` (or SGLang's `text`/`input_ids`), in each shape OpenAI allows.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    Batch(Vec<Vec<u32>>),
}

/// What the engine's `/tokenize` answers.
#[derive(Deserialize)]
struct Tokenized {
    tokens: Vec<u32>,
}

/// Prompts of this many bytes or more are tokenized on a blocking thread: a 2,048-token prompt
/// takes 0.4 to 2.4 ms here, far too long to hold a runtime thread that serves other requests.
const BLOCKING_BYTES: usize = 2048;

/// How a request's tokens are found.
enum Plan<'a> {
    /// The client sent them.
    Given(Vec<u32>),
    /// A text, encoded with or without the tokenizer's special tokens.
    Text(String, bool),
    /// A chat, rendered with the template.
    Chat(ChatRequest<'a>),
}

impl PromptTokens {
    /// Tokenizing with the model in `dir` when given (loaded now: a broken tokenizer stops the
    /// proxy at start), else through the engines.
    pub fn new(
        dir: Option<&Path>,
        client: reqwest::Client,
        timeout: Duration,
        metrics: TokenizeMetrics,
    ) -> Result<Self, TokenizeError> {
        let local = dir.map(Tokenizer::from_dir).transpose()?.map(Arc::new);
        Ok(PromptTokens {
            local,
            client,
            timeout,
            metrics,
        })
    }

    /// The token ids of `body`'s prompt of `kind` (`body` parsed from `raw`), or `None` when
    /// they cannot be known here (counted, and logged at debug level): `engine` is asked when
    /// there is no local tokenizer.
    pub async fn of(
        &self,
        kind: PromptKind,
        raw: &Bytes,
        body: &Body<'_>,
        engine: Option<&Backend>,
    ) -> Option<Vec<u32>> {
        let started = Instant::now();
        let plan = match plan(kind, body) {
            Ok(plan) => plan,
            Err(err) => {
                tracing::debug!(%err, "the prompt's tokens are not known: routed without them");
                self.metrics.failed("request");
                return None;
            }
        };
        if let Plan::Given(ids) = plan {
            return Some(ids);
        }
        let (source, tokens) = match &self.local {
            Some(tokenizer) if plan.bytes() < BLOCKING_BYTES => ("local", local(tokenizer, &plan)),
            Some(tokenizer) => {
                let blocking = off_the_runtime(tokenizer.clone(), kind, raw.clone());
                ("local", blocking.await)
            }
            None => ("engine", self.remote(kind, body, engine).await),
        };
        match tokens {
            Ok(tokens) => {
                self.metrics.took(source, started.elapsed());
                Some(tokens)
            }
            Err(err) => {
                tracing::debug!(%err, source, "the prompt could not be tokenized: routed without its tokens");
                self.metrics.failed(source);
                None
            }
        }
    }

    /// Asks `engine`'s `POST /tokenize` with the request's own prompt fields.
    async fn remote(
        &self,
        kind: PromptKind,
        body: &Body<'_>,
        engine: Option<&Backend>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let engine = engine.ok_or_else(|| unsupported("no engine to ask"))?;
        let fields: &[&str] = match kind {
            PromptKind::Chat => &CHAT_FIELDS,
            PromptKind::Completion => &["model", "prompt", "add_special_tokens"],
        };
        let mut request = String::from("{");
        for (name, value) in fields.iter().filter_map(|f| Some((f, body.get(f)?))) {
            if request.len() > 1 {
                request.push(',');
            }
            request.push_str(&format!("{name:?}:{}", value.get()));
        }
        request.push('}');
        let answer = async {
            let response = self
                .client
                .post(format!("{}/tokenize", engine.url()))
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(request)
                .timeout(self.timeout)
                .send()
                .await?
                .error_for_status()?;
            response.json::<Tokenized>().await
        };
        answer
            .await
            .map(|answer| answer.tokens)
            .map_err(|err| TokenizeError::Encode(format!("{}/tokenize: {err}", engine.url())))
    }
}

/// The fields of a chat request that shape its prompt.
const CHAT_FIELDS: [&str; 8] = [
    "model",
    "messages",
    "tools",
    "documents",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
];

fn plan<'a>(kind: PromptKind, body: &Body<'a>) -> Result<Plan<'a>, TokenizeError> {
    // Booleans as the engine reads them (`1`, `"yes"`...).
    let flag = |name: &str, default: bool| -> Result<bool, TokenizeError> {
        body.get(name).map_or(Ok(default), |_| {
            (body.flag(name)).ok_or_else(|| unsupported(&format!("`{name}` is not a boolean")))
        })
    };
    let raw = |name: &str| body.get(name).map(RawValue::get);
    match kind {
        PromptKind::Chat => {
            if raw("chat_template").is_some() {
                return Err(unsupported("a request's own chat_template"));
            }
            let messages = raw("messages").ok_or_else(|| unsupported("no `messages`"))?;
            Ok(Plan::Chat(ChatRequest {
                messages,
                tools: raw("tools").filter(|t| *t != "null"),
                documents: raw("documents").filter(|t| *t != "null"),
                chat_template_kwargs: raw("chat_template_kwargs").filter(|t| *t != "null"),
                add_generation_prompt: flag("add_generation_prompt", true)?,
                continue_final_message: flag("continue_final_message", false)?,
                add_special_tokens: flag("add_special_tokens", false)?,
            }))
        }
        PromptKind::Completion => {
            let field = ["input_ids", "prompt", "text"]
                .into_iter()
                .find_map(|name| body.get(name))
                .ok_or_else(|| unsupported("no `prompt`"))?;
            let prompt: PromptField = serde_json::from_str(field.get())
                .map_err(|_| unsupported("`prompt` is neither text nor token ids"))?;
            let special = flag("add_special_tokens", true)?;
            match prompt {
                PromptField::Text(text) => Ok(Plan::Text(text, special)),
                PromptField::Ids(ids) => Ok(Plan::Given(ids)),
                PromptField::Texts(texts) => texts
                    .into_iter()
                    .next()
                    .map(|text| Plan::Text(text, special))
                    .ok_or_else(|| unsupported("an empty `prompt` list")),
                PromptField::Batch(batch) => batch
                    .into_iter()
                    .next()
                    .map(Plan::Given)
                    .ok_or_else(|| unsupported("an empty `prompt` list")),
            }
        }
    }
}

impl Plan<'_> {
    /// The size of the text to tokenize.
    fn bytes(&self) -> usize {
        match self {
            Plan::Given(_) => 0,
            Plan::Text(text, _) => text.len(),
            Plan::Chat(chat) => chat.messages.len() + chat.tools.map_or(0, str::len),
        }
    }
}

/// [`local`] on a blocking thread, for the body in `raw` (parsed again there: the bytes are
/// shared, the top level is cheap to read).
async fn off_the_runtime(
    tokenizer: Arc<Tokenizer>,
    kind: PromptKind,
    raw: Bytes,
) -> Result<Vec<u32>, TokenizeError> {
    let run = move || {
        let body = Body::parse(&raw).map_err(|err| unsupported(&err.to_string()))?;
        local(&tokenizer, &plan(kind, &body)?)
    };
    tokio::task::spawn_blocking(run)
        .await
        .unwrap_or_else(|err| Err(TokenizeError::Encode(err.to_string())))
}

fn local(tokenizer: &Tokenizer, plan: &Plan<'_>) -> Result<Vec<u32>, TokenizeError> {
    match plan {
        Plan::Given(ids) => Ok(ids.clone()),
        Plan::Text(text, special) => tokenizer.encode(text, *special),
        Plan::Chat(chat) => tokenizer.encode_chat(chat),
    }
}

fn unsupported(what: &str) -> TokenizeError {
    TokenizeError::Unsupported(what.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chats_options_are_read_as_the_engine_reads_booleans() {
        let body = br#"{"messages": [], "add_generation_prompt": "no",
            "continue_final_message": 1, "add_special_tokens": "TRUE"}"#;
        let body = Body::parse(body).unwrap();
        let Ok(Plan::Chat(chat)) = plan(PromptKind::Chat, &body) else {
            panic!("not planned as a chat");
        };
        assert!(!chat.add_generation_prompt);
        assert!(chat.continue_final_message);
        assert!(chat.add_special_tokens);
        let body = Body::parse(br#"{"messages": [], "add_generation_prompt": "maybe"}"#).unwrap();
        assert!(plan(PromptKind::Chat, &body).is_err());
        let body = Body::parse(br#"{"prompt": "x", "add_special_tokens": 0}"#).unwrap();
        assert!(matches!(
            plan(PromptKind::Completion, &body),
            Ok(Plan::Text(_, false))
        ));
    }
}
