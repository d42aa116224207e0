//! The prompt's token ids, as the engine computes them: a model's tokenizer (`--tokenizer DIR`)
//! or, without one, `pd_tokenize`'s byte-level tokenizer (one token per byte), so that the
//! prompt sizes, the prefix cache and the KV events name the token ids a proxy computes with
//! the same tokenizer. Completions, chats and SGLang's `/generate` are read as vLLM and SGLang
//! read them, and `POST /tokenize` answers as vLLM's does.

use std::path::Path;

use pd_tokenize::{ChatRequest, Tokenizer};
use serde_json::Value;

use super::api::Api;

/// The tokenizer of `dir`, or the byte-level one (written to a temporary directory and loaded
/// from it) without a directory.
pub fn load(dir: Option<&Path>) -> Result<Tokenizer, String> {
    let loaded = match dir {
        Some(dir) => Tokenizer::from_dir(dir),
        None => {
            let temp = tempfile::tempdir().map_err(|e| format!("a temporary directory: {e}"))?;
            pd_tokenize::byte_level::write(temp.path())
                .map_err(|e| format!("writing the byte-level tokenizer: {e}"))?;
            Tokenizer::from_dir(temp.path())
        }
    };
    loaded.map_err(|err| format!("--tokenizer: {err}"))
}

/// An optional boolean field, `default` when absent or null.
fn flag(body: &Value, field: &str, default: bool) -> Result<bool, String> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(value) => value
            .as_bool()
            .ok_or_else(|| format!("`{field}` must be a boolean")),
    }
}

/// A list of token ids, or `None` when `value` is not one.
fn token_ids(value: &Value) -> Option<Vec<u32>> {
    value
        .as_array()?
        .iter()
        .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

/// `field`'s text encoded (special tokens added unless `add_special_tokens` says otherwise),
/// or its token ids as given when `ids_allowed`.
fn text_or_ids(
    tokenizer: &Tokenizer,
    body: &Value,
    field: &str,
    ids_allowed: bool,
) -> Result<Vec<u32>, String> {
    let value = body
        .get(field)
        .ok_or_else(|| format!("missing field `{field}`"))?;
    if let Some(text) = value.as_str() {
        let add_special_tokens = flag(body, "add_special_tokens", true)?;
        return tokenizer
            .encode(text, add_special_tokens)
            .map_err(|err| format!("`{field}`: {err}"));
    }
    match ids_allowed.then(|| token_ids(value)).flatten() {
        Some(ids) => Ok(ids),
        None if ids_allowed => Err(format!("`{field}` must be a string or a list of token ids")),
        None => Err(format!("`{field}` must be a string")),
    }
}

/// A chat's token ids: its template rendered with the request's `messages`, `tools`,
/// `documents`, `chat_template_kwargs`, `add_generation_prompt` (default true),
/// `continue_final_message` and `add_special_tokens` (default false), then encoded.
fn chat(tokenizer: &Tokenizer, body: &Value) -> Result<Vec<u32>, String> {
    let json_of = |field: &str, fits: fn(&Value) -> bool, what: &str| match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) if fits(value) => Ok(Some(value.to_string())),
        Some(_) => Err(format!("`{field}` must be {what}")),
    };
    let messages = json_of("messages", Value::is_array, "a list of messages")?
        .ok_or("missing field `messages`")?;
    let tools = json_of("tools", Value::is_array, "a list")?;
    let documents = json_of("documents", Value::is_array, "a list")?;
    let kwargs = json_of("chat_template_kwargs", Value::is_object, "an object")?;
    let mut request = ChatRequest::new(&messages);
    request.tools = tools.as_deref();
    request.documents = documents.as_deref();
    request.chat_template_kwargs = kwargs.as_deref();
    request.add_generation_prompt = flag(body, "add_generation_prompt", true)?;
    request.continue_final_message = flag(body, "continue_final_message", false)?;
    request.add_special_tokens = flag(body, "add_special_tokens", false)?;
    if request.add_generation_prompt && request.continue_final_message {
        return Err(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.".into(),
        );
    }
    tokenizer
        .encode_chat(&request)
        .map_err(|err| format!("`messages`: {err}"))
}

/// The prompt's token ids of a request on `api`, the field at fault named in the error:
/// a completion's `prompt` (a string, or token ids used as given), a chat's `messages`, or
/// `/generate`'s `input_ids` (as given) else `text`.
pub fn prompt_ids(tokenizer: &Tokenizer, api: Api, body: &Value) -> Result<Vec<u32>, String> {
    let ids = match api {
        Api::Completions => text_or_ids(tokenizer, body, "prompt", true)?,
        Api::Chat => chat(tokenizer, body)?,
        Api::Generate => match body.get("input_ids") {
            Some(ids) if !ids.is_null() => {
                token_ids(ids).ok_or("`input_ids` must be a list of token ids")?
            }
            _ => text_or_ids(tokenizer, body, "text", false)?,
        },
    };
    if ids.is_empty() {
        return Err("the prompt cannot be empty".into());
    }
    Ok(ids)
}

/// The token ids `POST /tokenize` answers for `body`: its `prompt` (a string) encoded, or its
/// `messages` rendered as a chat's.
pub fn tokenize_ids(tokenizer: &Tokenizer, body: &Value) -> Result<Vec<u32>, String> {
    match (body.get("prompt"), body.get("messages")) {
        (Some(_), _) => text_or_ids(tokenizer, body, "prompt", false),
        (None, Some(_)) => chat(tokenizer, body),
        (None, None) => Err("missing field `prompt` or `messages`".into()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn bytes(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    #[test]
    fn prompts_become_token_ids() {
        let tokenizer = load(None).unwrap();
        let ids = |api, body| prompt_ids(&tokenizer, api, &body);
        assert_eq!(
            ids(Api::Completions, json!({"prompt": "a b"})),
            Ok(bytes("a b"))
        );
        assert_eq!(
            ids(Api::Completions, json!({"prompt": [5, 7]})),
            Ok(vec![5, 7])
        );
        assert_eq!(
            ids(Api::Generate, json!({"input_ids": [9], "text": "x"})),
            Ok(vec![9])
        );
        assert_eq!(ids(Api::Generate, json!({"text": "hi"})), Ok(bytes("hi")));
        let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(
            ids(Api::Chat, chat),
            Ok(bytes("<|user|>hi<|end|><|assistant|>"))
        );
        let cont = json!({"messages": [{"role": "user", "content": "hi"}],
                          "add_generation_prompt": false});
        assert_eq!(ids(Api::Chat, cont), Ok(bytes("<|user|>hi<|end|>")));
        for (api, body, field) in [
            (Api::Completions, json!({"max_tokens": 1}), "prompt"),
            (Api::Completions, json!({"prompt": [-1]}), "prompt"),
            (
                Api::Completions,
                json!({"prompt": "x", "add_special_tokens": 1}),
                "add_special_tokens",
            ),
            (Api::Chat, json!({"messages": "x"}), "messages"),
            (Api::Chat, json!({"messages": [], "tools": {}}), "tools"),
            (Api::Generate, json!({"input_ids": "x"}), "input_ids"),
            (Api::Completions, json!({"prompt": ""}), "empty"),
        ] {
            let err = ids(api, body.clone()).unwrap_err();
            assert!(err.contains(field), "{body}: {err}");
        }
    }

    #[test]
    fn tokenize_takes_a_prompt_or_messages() {
        let tokenizer = load(None).unwrap();
        let ids = |body: Value| tokenize_ids(&tokenizer, &body);
        assert_eq!(ids(json!({"prompt": "ab"})), Ok(bytes("ab")));
        let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(ids(chat), Ok(bytes("<|user|>hi<|end|><|assistant|>")));
        assert!(ids(json!({"prompt": [1]}))
            .unwrap_err()
            .contains("`prompt`"));
        assert!(ids(json!({"model": "m"})).unwrap_err().contains("`prompt`"));
    }
}
