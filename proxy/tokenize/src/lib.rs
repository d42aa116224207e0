//! Tokenization identical to the engine's, in-process: a model's `tokenizer.json` through
//! Hugging Face's own `tokenizers` crate, and its chat template rendered as `transformers`
//! renders it (Jinja with `trim_blocks`, `lstrip_blocks`, `tojson` as Python's `json.dumps`,
//! `raise_exception`, Python string methods).
//!
//! The two requests an OpenAI server tokenizes are followed as vLLM follows them:
//! - a completion's `prompt` is encoded with the special tokens the tokenizer adds
//!   (`add_special_tokens` true unless the request says otherwise);
//! - a chat's `messages` are rendered with the chat template (with `add_generation_prompt`,
//!   `continue_final_message`, `tools`, `documents`, `chat_template_kwargs`), then encoded
//!   without adding special tokens (the template writes them).
//!
//! [`byte_level`] writes a tokenizer of one token per byte, for simulated engines and tests.

pub mod byte_level;
mod chat;
mod config;
mod json;

use std::path::Path;

pub use chat::ChatRequest;
use chat::ChatTemplate;
use config::TokenizerConfig;

/// Why a prompt could not be tokenized here (the engine's own `/tokenize` may still can).
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file of the tokenizer directory is missing or malformed.
    #[error("{path}: {reason}")]
    Load {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The model has no chat template, so chats cannot be rendered.
    #[error("the tokenizer has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)")]
    NoChatTemplate,
    /// The request is not one this tokenizer renders as the engine would.
    #[error("{0}")]
    Unsupported(String),
    /// The chat template failed on this request (or raised an exception itself).
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed on the text.
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// A model's tokenizer and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("chat_template", &self.chat.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// The tokenizer of a model directory (a Hugging Face snapshot): `tokenizer.json`, and the
    /// chat template from `chat_template.jinja` or `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizeError> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|err| TokenizeError::Load {
            path: path.display().to_string(),
            reason: err.to_string(),
        })?;
        let config = TokenizerConfig::read(dir)?;
        let chat = config
            .chat_template
            .clone()
            .map(|source| ChatTemplate::new(source, &config))
            .transpose()?;
        Ok(Tokenizer { inner, chat })
    }

    /// The token ids of `text`, with the special tokens the tokenizer adds (BOS...) when
    /// `add_special_tokens`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|err| TokenizeError::Encode(err.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text the chat template makes of `request`.
    pub fn render_chat(&self, request: &ChatRequest<'_>) -> Result<String, TokenizeError> {
        self.chat
            .as_ref()
            .ok_or(TokenizeError::NoChatTemplate)?
            .render(request)
    }

    /// The token ids of a chat, as the engine computes them: rendered, then encoded (special
    /// tokens added only when the request asks, `add_special_tokens`).
    pub fn encode_chat(&self, request: &ChatRequest<'_>) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(request)?;
        self.encode(&text, request.add_special_tokens)
    }
}

#[cfg(test)]
mod tests;
