//! What a front door can tell is wrong with a request before any engine sees it: a required
//! field missing, a common sampling field of the wrong type or out of its range, more tokens
//! asked for than the model's context holds.
//!
//! The engines refuse these too, but each in its own words, and P and D, called at once, race
//! to answer first: the same mistake came back one way or another from run to run. Checked
//! here, it gets one answer, the same every time, naming the field. Only what every engine
//! refuses is checked (vLLM's and SGLang's OpenAI servers agree on these); anything else goes
//! through to the engines untouched.

use serde_json::value::RawValue;
use serde_json::Value;

use crate::body::Body;
use crate::tenants::charge::Api;

/// A request field that cannot be right, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    /// The field (OpenAI's `param`).
    pub param: &'static str,
    /// What is wrong with it, for a person.
    pub message: String,
}

/// What a field's value must be.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Bool,
    Text,
    /// A whole number, at least this.
    Integer(i64),
    /// A number within these bounds (inclusive; the lower one exclusive when `open_low`).
    Number {
        low: f64,
        high: f64,
        open_low: bool,
    },
    /// A string, or a list of strings.
    Stop,
}

/// The common fields of `/v1/completions` and `/v1/chat/completions`, checked when present and
/// not `null`.
const COMMON: [(&str, Expect); 10] = [
    ("model", Expect::Text),
    ("stream", Expect::Bool),
    ("max_tokens", Expect::Integer(1)),
    ("n", Expect::Integer(1)),
    ("seed", Expect::Integer(i64::MIN)),
    ("stop", Expect::Stop),
    (
        "temperature",
        Expect::Number {
            low: 0.0,
            high: f64::MAX,
            open_low: false,
        },
    ),
    (
        "top_p",
        Expect::Number {
            low: 0.0,
            high: 1.0,
            open_low: true,
        },
    ),
    (
        "presence_penalty",
        Expect::Number {
            low: -2.0,
            high: 2.0,
            open_low: false,
        },
    ),
    (
        "frequency_penalty",
        Expect::Number {
            low: -2.0,
            high: 2.0,
            open_low: false,
        },
    ),
];

/// Checks `body` of a request to `api`; `context` tells the model's context length, when a
/// card gives it (asked only of a body that sets a token limit). SGLang's `/generate` is left
/// to the engines (its fields are its own).
pub fn check(
    body: &Body<'_>,
    api: Api,
    context: impl FnOnce() -> Option<u64>,
) -> Result<(), Invalid> {
    let required = match api {
        Api::Completions => ("prompt", "the text (or token ids) to complete"),
        Api::Chat => ("messages", "the conversation, a list of messages"),
        Api::Generate => return Ok(()),
    };
    let present = |name: &str| body.get(name).is_some_and(|raw| raw.get() != "null");
    // vLLM also completes prompts given as embeddings.
    let embedded = api == Api::Completions && present("prompt_embeds");
    if !present(required.0) && !embedded {
        return Err(Invalid {
            param: required.0,
            message: format!("`{}` is required: {}", required.0, required.1),
        });
    }
    if api == Api::Chat {
        // Read from its text, not parsed: a conversation may be long.
        let listed = body.get("messages").map(|raw| raw.get().trim());
        let non_empty = listed
            .and_then(|text| text.strip_prefix('['))
            .is_some_and(|rest| !rest.trim_start().starts_with(']'));
        if !non_empty {
            return Err(Invalid {
                param: "messages",
                message: "`messages` must be a non-empty list of messages".to_owned(),
            });
        }
        check_field(body, "max_completion_tokens", Expect::Integer(1))?;
    }
    for (name, expect) in COMMON {
        check_field(body, name, expect)?;
    }
    let asked = ["max_tokens", "max_completion_tokens"]
        .iter()
        .filter_map(|name| Some((*name, parse(body.get(name))?.as_u64()?)))
        .max_by_key(|(_, tokens)| *tokens);
    if let Some((name, tokens, context)) =
        asked.and_then(|(name, tokens)| Some((name, tokens, context()?)))
    {
        if tokens > context {
            return Err(Invalid {
                param: if name == "max_tokens" {
                    "max_tokens"
                } else {
                    "max_completion_tokens"
                },
                message: format!(
                    "`{name}` is {tokens}, more than the model's context length ({context} \
                     tokens, prompt included)"
                ),
            });
        }
    }
    Ok(())
}

fn parse(raw: Option<&RawValue>) -> Option<Value> {
    serde_json::from_str(raw?.get()).ok()
}

fn check_field(body: &Body<'_>, name: &'static str, expect: Expect) -> Result<(), Invalid> {
    let Some(value) = parse(body.get(name)) else {
        return Ok(());
    };
    if value.is_null() {
        return Ok(());
    }
    let fits = match expect {
        Expect::Bool => value.is_boolean(),
        Expect::Text => value.is_string(),
        Expect::Integer(low) => value.as_i64().is_some_and(|n| n >= low),
        Expect::Number {
            low,
            high,
            open_low,
        } => value
            .as_f64()
            .is_some_and(|n| n <= high && if open_low { n > low } else { n >= low }),
        Expect::Stop => {
            value.is_string()
                || value
                    .as_array()
                    .is_some_and(|items| items.iter().all(Value::is_string))
        }
    };
    if fits {
        return Ok(());
    }
    let what = match expect {
        Expect::Bool => "true or false".to_owned(),
        Expect::Text => "a string".to_owned(),
        Expect::Integer(i64::MIN) => "a whole number".to_owned(),
        Expect::Integer(low) => format!("a whole number, at least {low}"),
        Expect::Number {
            low,
            high,
            open_low,
        } if high == f64::MAX => format!(
            "a number, at least {low}{}",
            if open_low { " (exclusive)" } else { "" }
        ),
        Expect::Number {
            low,
            high,
            open_low,
        } => format!(
            "a number {} {low} and at most {high}",
            if open_low { "over" } else { "at least" }
        ),
        Expect::Stop => "a string or a list of strings".to_owned(),
    };
    Err(Invalid {
        param: name,
        message: format!("`{name}` must be {what}, not {value}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checked(api: Api, json: &str, context: Option<u64>) -> Result<(), Invalid> {
        let body = Body::parse(json.as_bytes()).unwrap();
        check(&body, api, || context)
    }

    fn param(api: Api, json: &str) -> &'static str {
        checked(api, json, Some(4096)).unwrap_err().param
    }

    #[test]
    fn required_fields_by_endpoint() {
        assert!(checked(Api::Completions, r#"{"prompt": "hi"}"#, None).is_ok());
        assert!(checked(Api::Completions, r#"{"prompt_embeds": "AAAA"}"#, None).is_ok());
        assert_eq!(param(Api::Completions, r#"{"model": "m"}"#), "prompt");
        assert_eq!(param(Api::Completions, r#"{"prompt": null}"#), "prompt");
        assert_eq!(param(Api::Chat, r#"{"prompt": "hi"}"#), "messages");
        assert_eq!(param(Api::Chat, r#"{"messages": []}"#), "messages");
        assert_eq!(param(Api::Chat, r#"{"messages": "hi"}"#), "messages");
        assert_eq!(param(Api::Chat, r#"{"messages": [ ] }"#), "messages");
        assert!(checked(
            Api::Chat,
            r#"{"messages": [ {"role": "user", "content": "x"} ]}"#,
            None
        )
        .is_ok());
        // The context length is asked for only when a token limit is set.
        let body = Body::parse(br#"{"prompt": "x"}"#).unwrap();
        assert!(check(&body, Api::Completions, || unreachable!()).is_ok());
        assert!(checked(
            Api::Chat,
            r#"{"messages": [{"role": "user", "content": "x"}]}"#,
            None
        )
        .is_ok());
        // SGLang's /generate is its own.
        assert!(checked(Api::Generate, r#"{}"#, None).is_ok());
    }

    #[test]
    fn common_fields_by_type_and_range() {
        let bad = [
            (r#""max_tokens": 0"#, "max_tokens"),
            (r#""max_tokens": "16""#, "max_tokens"),
            (r#""max_tokens": 1.5"#, "max_tokens"),
            (r#""n": 0"#, "n"),
            (r#""temperature": -0.1"#, "temperature"),
            (r#""temperature": "hot""#, "temperature"),
            (r#""top_p": 0"#, "top_p"),
            (r#""top_p": 1.01"#, "top_p"),
            (r#""presence_penalty": 3"#, "presence_penalty"),
            (r#""frequency_penalty": -2.5"#, "frequency_penalty"),
            (r#""stream": "yes""#, "stream"),
            (r#""stop": [1]"#, "stop"),
            (r#""model": 7"#, "model"),
            (r#""seed": 1.5"#, "seed"),
            (r#""max_tokens": 5000"#, "max_tokens"),
        ];
        for (field, name) in bad {
            let json = format!(r#"{{"prompt": "x", {field}}}"#);
            assert_eq!(param(Api::Completions, &json), name, "{json}");
        }
        let fine = r#"{"prompt": "x", "max_tokens": 4096, "n": 2, "temperature": 0, "top_p": 1,
            "presence_penalty": -2, "stream": true, "stop": ["a", "b"], "seed": -3, "model": null}"#;
        assert!(checked(Api::Completions, fine, Some(4096)).is_ok());
        // Without a card, no bound on the tokens.
        assert!(checked(
            Api::Completions,
            r#"{"prompt": "x", "max_tokens": 100000}"#,
            None
        )
        .is_ok());
        let chat =
            r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9000}"#;
        assert_eq!(param(Api::Chat, chat), "max_completion_tokens");
        let message = checked(Api::Completions, r#"{"prompt": "x", "top_p": 2}"#, None)
            .unwrap_err()
            .message;
        assert_eq!(
            message,
            "`top_p` must be a number over 0 and at most 1, not 2"
        );
    }
}
