//! Rendering a chat with the model's template, as vLLM does before it tokenizes: the messages
//! are first normalised the way vLLM's chat parser hands them to `transformers` (each
//! message rebuilt from its known fields, text parts joined or kept as parts by the template's
//! content format, tool-call arguments decoded to objects, `developer` turned into `system`
//! when the template does not know it), then the template runs in a Jinja environment
//! configured as `transformers` configures its own.

use std::collections::BTreeMap;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use crate::config::TokenizerConfig;
use crate::{json, TokenizeError};

/// A chat request's fields that shape its prompt, as raw JSON where the request has JSON.
#[derive(Debug, Clone, Copy)]
pub struct ChatRequest<'a> {
    /// `messages`: the JSON array.
    pub messages: &'a str,
    /// `tools`, if any: a JSON array.
    pub tools: Option<&'a str>,
    /// `documents`, if any: a JSON array.
    pub documents: Option<&'a str>,
    /// `chat_template_kwargs`, if any: a JSON object of extra template variables.
    pub chat_template_kwargs: Option<&'a str>,
    /// `add_generation_prompt` (default true).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (default false): the prompt ends inside the last message.
    pub continue_final_message: bool,
    /// `add_special_tokens` (default false for chats: the template writes them).
    pub add_special_tokens: bool,
}

impl<'a> ChatRequest<'a> {
    /// A chat of `messages` with every option at vLLM's default.
    pub fn new(messages: &'a str) -> Self {
        ChatRequest {
            messages,
            tools: None,
            documents: None,
            chat_template_kwargs: None,
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
        }
    }
}

/// How a template reads a message's `content` (vLLM's "content format").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ContentFormat {
    /// A string: text parts are joined with newlines.
    String,
    /// A list of `{"type": "text", "text": ...}` parts the template loops over.
    OpenAi,
}

/// A model's compiled chat templates and the variables every render gets.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Template name -> how it reads content and whether it knows the developer role.
    names: BTreeMap<String, (ContentFormat, bool)>,
    special_tokens: Vec<(&'static str, Value)>,
}

impl ChatTemplate {
    /// The templates of `config`, compiled.
    pub fn new(
        templates: BTreeMap<String, String>,
        config: &TokenizerConfig,
    ) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let mut names = BTreeMap::new();
        for (name, source) in templates {
            let traits = (content_format(&source), knows_developer(&source));
            env.add_template_owned(name.clone(), source)
                .map_err(|err| TokenizeError::Template(err.to_string()))?;
            names.insert(name, traits);
        }
        let mut special_tokens: Vec<(&'static str, Value)> = (config.special_tokens.iter())
            .map(|(name, text)| (*name, Value::from(text.as_str())))
            .collect();
        special_tokens.push((
            "additional_special_tokens",
            Value::from(config.additional_special_tokens.clone()),
        ));
        Ok(ChatTemplate {
            env,
            names,
            special_tokens,
        })
    }

    /// The prompt `request` becomes.
    pub fn render(&self, request: &ChatRequest<'_>) -> Result<String, TokenizeError> {
        let name = match request.tools {
            Some(_) if self.names.contains_key("tool_use") => "tool_use",
            _ => "default",
        };
        let Some(&(format, developer)) = self.names.get(name) else {
            return Err(TokenizeError::NoChatTemplate);
        };
        let messages = messages(request.messages, format, developer)?;
        let last = messages.last().cloned();
        let mut context: Vec<(String, Value)> = (self.special_tokens.iter())
            .map(|(name, value)| ((*name).to_owned(), value.clone()))
            .collect();
        context.push(("messages".into(), Value::from(messages)));
        let optional = |raw: Option<&str>, field: &str| -> Result<Value, TokenizeError> {
            raw.map_or(Ok(Value::from(())), |raw| json::parse(raw, field))
        };
        context.push(("tools".into(), optional(request.tools, "tools")?));
        context.push((
            "documents".into(),
            optional(request.documents, "documents")?,
        ));
        let generation = request.add_generation_prompt && !request.continue_final_message;
        context.push(("add_generation_prompt".into(), Value::from(generation)));
        if let Some(raw) = request.chat_template_kwargs {
            let extra = json::parse(raw, "chat_template_kwargs")?;
            let keys = extra
                .try_iter()
                .map_err(|_| not_object("chat_template_kwargs"))?;
            for key in keys {
                let value = extra.get_item(&key).unwrap_or_default();
                context.push((key.to_string(), value));
            }
        }
        let template = self
            .env
            .get_template(name)
            .map_err(|err| TokenizeError::Template(err.to_string()))?;
        let rendered = template
            .render(Value::from_iter(context))
            .map_err(|err| TokenizeError::Template(err.to_string()))?;
        match last {
            Some(last) if request.continue_final_message => continue_final(rendered, &last),
            _ => Ok(rendered),
        }
    }
}

/// The messages as vLLM hands them to the template.
fn messages(
    raw: &str,
    format: ContentFormat,
    developer: bool,
) -> Result<Vec<Value>, TokenizeError> {
    let parsed = json::parse(raw, "messages")?;
    if parsed.kind() != ValueKind::Seq {
        return Err(TokenizeError::Unsupported(
            "`messages` is not a list".into(),
        ));
    }
    let list = parsed.try_iter().map_err(|_| not_object("messages"))?;
    list.map(|message| normalise(&message, format, developer))
        .collect()
}

fn normalise(
    message: &Value,
    format: ContentFormat,
    developer: bool,
) -> Result<Value, TokenizeError> {
    let field = |name: &str| {
        message
            .get_attr(name)
            .ok()
            .filter(|v| !v.is_undefined() && !v.is_none())
    };
    let role = field("role").ok_or_else(|| not_object("messages[].role"))?;
    let role = match role.as_str() {
        Some("developer") if !developer => Value::from("system"),
        _ => role,
    };
    let texts = texts(field("content"))?;
    let content = match (format, role.as_str()) {
        (ContentFormat::OpenAi, r) if r != Some("tool") => Value::from(
            texts
                .iter()
                .map(|text| {
                    Value::from_iter([
                        ("type", Value::from("text")),
                        ("text", Value::from(text.as_str())),
                    ])
                })
                .collect::<Vec<_>>(),
        ),
        _ => Value::from(texts.join("\n")),
    };
    let mut out = vec![("role", role.clone()), ("content", content)];
    match role.as_str() {
        Some("assistant") => {
            if let Some(calls) = field("tool_calls").map(tool_calls).transpose()? {
                if !calls.is_empty() {
                    out.push(("tool_calls", Value::from(calls)));
                }
            }
            if let Some(reasoning) = field("reasoning") {
                out.push(("reasoning", reasoning.clone()));
                out.push(("reasoning_content", reasoning));
            }
        }
        Some("tool") => {
            if let Some(id) = field("tool_call_id") {
                out.push(("tool_call_id", id));
            }
        }
        _ => {}
    }
    if let Some(name) = field("name").filter(|n| n.as_str().is_some()) {
        out.push(("name", name));
    }
    Ok(Value::from_iter(out))
}

/// A message's text parts: a string is one; a list holds strings and `text` parts; anything
/// else (images, audio...) is not rendered here.
fn texts(content: Option<Value>) -> Result<Vec<String>, TokenizeError> {
    let Some(content) = content else {
        return Ok(Vec::new());
    };
    if let Some(text) = content.as_str() {
        return Ok(vec![text.to_owned()]);
    }
    let parts = content
        .try_iter()
        .map_err(|_| not_object("messages[].content"))?;
    parts
        .map(|part| {
            if let Some(text) = part.as_str() {
                return Ok(text.to_owned());
            }
            let kind = part.get_attr("type").ok();
            match (kind.as_ref().and_then(Value::as_str), part.get_attr("text")) {
                (Some("text"), Ok(text)) if text.as_str().is_some() => Ok(text.to_string()),
                _ => Err(TokenizeError::Unsupported(format!(
                    "a content part of type {} is not rendered in the proxy",
                    kind.map_or("?".into(), |k| k.to_string())
                ))),
            }
        })
        .collect()
}

/// An assistant's tool calls with each `function.arguments` decoded to an object, as vLLM
/// decodes them (`{}` when empty, malformed or not an object).
fn tool_calls(calls: Value) -> Result<Vec<Value>, TokenizeError> {
    let list = calls.try_iter().map_err(|_| not_object("tool_calls"))?;
    list.map(|call| {
        let function = call
            .get_attr("function")
            .map_err(|_| not_object("tool_calls[].function"))?;
        let arguments = function.get_attr("arguments").unwrap_or_default();
        let decoded = match arguments.as_str() {
            Some("") => Value::from_iter(Vec::<(String, Value)>::new()),
            Some(text) => json::parse(text, "arguments").unwrap_or_default(),
            None => arguments,
        };
        let decoded = if decoded.kind() == ValueKind::Map {
            decoded
        } else {
            Value::from_iter(Vec::<(String, Value)>::new())
        };
        let function = json::with_field(&function, "arguments", decoded);
        Ok(json::with_field(&call, "function", function))
    })
    .collect()
}

/// `rendered` cut right after the last message's text, as `transformers` does for
/// `continue_final_message`.
fn continue_final(rendered: String, last: &Value) -> Result<String, TokenizeError> {
    let content = last.get_attr("content").unwrap_or_default();
    let text = match content.as_str() {
        Some(text) => text.to_owned(),
        None => (content.try_iter().ok())
            .and_then(|parts| {
                parts
                    .filter_map(|p| p.get_attr("text").ok()?.as_str().map(str::to_owned))
                    .last()
            })
            .unwrap_or_default(),
    };
    let stripped = text.trim();
    let Some(at) = rendered.rfind(stripped) else {
        return Err(TokenizeError::Template(
            "continue_final_message: the final message is not in the rendered prompt".into(),
        ));
    };
    let end = if rendered[at..].starts_with(text.as_str()) {
        at + text.len()
    } else {
        at + stripped.len()
    };
    Ok(rendered[..end].to_owned())
}

/// vLLM's detection, by the template's text: a `for` loop over a message's `content` (or a
/// variable named `content`) means the template reads parts.
fn content_format(source: &str) -> ContentFormat {
    let loops_over_content = source.split("{%").skip(1).any(|tag| {
        let tag = tag.split("%}").next().unwrap_or("");
        let tag = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let Some(rest) = tag.strip_prefix("for ") else {
            return false;
        };
        let Some((_, iterated)) = rest.split_once(" in ") else {
            return false;
        };
        let iterated = iterated.split(['|', '(']).next().unwrap_or("");
        let iterated = iterated.split(" if ").next().unwrap_or("").trim();
        iterated == "content"
            || ["['content']", "[\"content\"]", ".content"]
                .iter()
                .any(|access| iterated.ends_with(access))
    });
    if loops_over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

fn knows_developer(source: &str) -> bool {
    source.contains("\"developer\"") || source.contains("'developer'")
}

fn not_object(field: &str) -> TokenizeError {
    TokenizeError::Unsupported(format!("`{field}` is not of the shape OpenAI defines"))
}

/// `tojson` as `transformers` defines it: Python's `json.dumps` with `ensure_ascii=False`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    json::dumps(&value, indent)
        .map(Value::from_safe_string)
        .map_err(|err| Error::new(ErrorKind::InvalidOperation, err.to_string()))
}

/// `raise_exception(message)`: the template refuses the chat.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time now, as Python's `datetime.now().strftime`.
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = jiff::Zoned::now();
    Ok(Value::from(now.strftime(&format).to_string()))
}
