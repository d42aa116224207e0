//! `tokenizer_config.json` (and `chat_template.jinja`): the chat templates and the special
//! tokens a template may name (`bos_token`, `eos_token`...), read as `transformers` reads them.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::TokenizeError;

/// The special tokens `transformers` hands to every chat template.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// What a chat template needs of the tokenizer's configuration.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    /// The chat templates by name: `default` and any other (`tool_use`...).
    pub chat_template: Option<BTreeMap<String, String>>,
    /// The special tokens by name (`bos_token` -> `<s>`), as text.
    pub special_tokens: BTreeMap<&'static str, String>,
    /// `additional_special_tokens`, as text.
    pub additional_special_tokens: Vec<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

impl TokenizerConfig {
    /// The configuration in `dir`; none of its files is required.
    pub fn read(dir: &Path) -> Result<Self, TokenizeError> {
        let path = dir.join("tokenizer_config.json");
        let json: Value = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|err| load(&path, err))?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(err) => return Err(load(&path, err)),
        };
        let mut chat_template = match json.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(field) => Some(templates(
                TemplateField::deserialize(field).map_err(|err| load(&path, err))?,
            )),
        };
        let file = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&file) {
            Ok(default) => {
                let mut named = chat_template.unwrap_or_default();
                named.insert("default".to_owned(), default);
                chat_template = Some(named);
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => return Err(load(&file, err)),
        }
        let special_tokens = SPECIAL_TOKENS
            .into_iter()
            .filter_map(|name| Some((name, token_text(json.get(name)?)?)))
            .collect();
        let additional_special_tokens = match json.get("additional_special_tokens") {
            Some(Value::Array(tokens)) => tokens.iter().filter_map(token_text).collect(),
            _ => Vec::new(),
        };
        Ok(TokenizerConfig {
            chat_template,
            special_tokens,
            additional_special_tokens,
        })
    }
}

/// A special token's text: a string, or an added token's `content`.
fn token_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Object(token) => token.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn templates(field: TemplateField) -> BTreeMap<String, String> {
    match field {
        TemplateField::One(default) => BTreeMap::from([("default".to_owned(), default)]),
        TemplateField::Named(list) => list.into_iter().map(|t| (t.name, t.template)).collect(),
    }
}

fn load(path: &Path, err: impl std::fmt::Display) -> TokenizeError {
    TokenizeError::Load {
        path: path.display().to_string(),
        reason: err.to_string(),
    }
}
