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
use crate::tenants::charge::{output_limit, Api};

/// A request field that cannot be right, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    /// The field (OpenAI's `param`).
    pub param: &'static str,
    /// What is wrong with it, for a person.
    pub message: String,
}

/// What a field's value must be. Numbers are read as the engines' OpenAI servers read them
/// (pydantic's lax mode): `"16"` and `16.0` are the whole number 16, `"0.5"` is 0.5.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// A boolean as pydantic reads one: `true`, `1`, `"yes"`... (see [`crate::body::flag_of`]).
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
    ("max_tokens", Expect::Integer(0)),
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

/// The most characters of a wrong value a refusal repeats.
const SHOWN_CHARS: usize = 40;

/// Checks `body` of a request to `api`; `context` tells the model's context length, when a
/// card gives it (asked only of a body that sets a token limit). SGLang's `/generate` and the
/// other APIs are left to the engines (their fields are their own).
pub fn check(
    body: &Body<'_>,
    api: Api,
    context: impl FnOnce() -> Option<u64>,
) -> Result<(), Invalid> {
    let required = match api {
        Api::Completions => ("prompt", "the text (or token ids) to complete"),
        Api::Chat => ("messages", "the conversation, a list of messages"),
        Api::Generate | Api::NoOutput | Api::Other => return Ok(()),
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
        check_field(body, "max_completion_tokens", Expect::Integer(0))?;
    }
    for (name, expect) in COMMON {
        check_field(body, name, expect)?;
    }
    let Some((param, tokens)) = output_limit(api, body) else {
        return Ok(());
    };
    // vLLM takes 0 from a completion that echoes its prompt (to score it, generating nothing).
    let echoed = api == Api::Completions && body.flag("echo") == Some(true);
    if tokens < 1.0 && !echoed {
        return Err(Invalid {
            param,
            message: format!(
                "`{param}` must be at least 1 (0 only for a completion that echoes its prompt)"
            ),
        });
    }
    match context() {
        Some(context) if tokens > context as f64 => Err(Invalid {
            param,
            message: format!(
                "`{param}` is {tokens}, more than the model's context length ({context} tokens, \
                 prompt included)"
            ),
        }),
        _ => Ok(()),
    }
}

/// Checks the field `name` against `expect`, from its raw JSON (numbers through
/// [`Body::number`]); only a list, or a value to quote in the refusal, is parsed.
fn check_field(body: &Body<'_>, name: &'static str, expect: Expect) -> Result<(), Invalid> {
    let Some(raw) = body.get(name).map(RawValue::get) else {
        return Ok(());
    };
    let fits = raw == "null"
        || match expect {
            Expect::Bool => body.flag(name).is_some(),
            Expect::Text => raw.starts_with('"'),
            Expect::Integer(low) => {
                (body.number(name)).is_some_and(|n| n.fract() == 0.0 && n >= low as f64)
            }
            Expect::Number {
                low,
                high,
                open_low,
            } => (body.number(name))
                .is_some_and(|n| n <= high && if open_low { n > low } else { n >= low }),
            Expect::Stop => {
                raw.starts_with('"')
                    || serde_json::from_str::<Vec<Value>>(raw)
                        .is_ok_and(|items| items.iter().all(Value::is_string))
            }
        };
    if fits {
        return Ok(());
    }
    let what = match expect {
        Expect::Bool => "true or false (or 1, 0, \"yes\", \"no\")".to_owned(),
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
        message: format!("`{name}` must be {what}, not {}", shown(raw)),
    })
}

/// A wrong value as a refusal repeats it: its JSON, cut short.
fn shown(raw: &str) -> String {
    match raw.char_indices().nth(SHOWN_CHARS) {
        Some((cut, _)) => format!("{}...", &raw[..cut]),
        None => raw.to_owned(),
    }
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
            (r#""max_tokens": "1.5""#, "max_tokens"),
            (r#""max_tokens": 1.5"#, "max_tokens"),
            (r#""max_tokens": -1"#, "max_tokens"),
            (r#""max_tokens": 0, "echo": false"#, "max_tokens"),
            (r#""n": 0"#, "n"),
            (r#""temperature": -0.1"#, "temperature"),
            (r#""temperature": "hot""#, "temperature"),
            (r#""top_p": 0"#, "top_p"),
            (r#""top_p": 1.01"#, "top_p"),
            (r#""presence_penalty": 3"#, "presence_penalty"),
            (r#""frequency_penalty": -2.5"#, "frequency_penalty"),
            (r#""stream": "maybe""#, "stream"),
            (r#""stream": 2"#, "stream"),
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
        // Read as vLLM reads them: numbers in strings, whole floats, 0 to echo a prompt.
        let lax = r#"{"prompt": "x", "max_tokens": true, "n": 2.0, "temperature": "0.5",
            "seed": "7", "top_p": " 1 ", "stream": "yes", "echo": true, "logprobs": false}"#;
        assert!(checked(Api::Completions, lax, Some(4096)).is_ok());
        for echo in ["true", "1", r#""yes""#] {
            let json = format!(r#"{{"prompt": "x", "max_tokens": 0, "echo": {echo}}}"#);
            assert!(
                checked(Api::Completions, &json, Some(4096)).is_ok(),
                "{json}"
            );
        }
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
        // A chat's limit is `max_completion_tokens or max_tokens`; a completion's `max_tokens`.
        let chat = r#"{"messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 0, "max_tokens": 9000}"#;
        assert_eq!(param(Api::Chat, chat), "max_tokens");
        let chat = r#"{"messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 10, "max_tokens": 9000}"#;
        assert!(checked(Api::Chat, chat, Some(4096)).is_ok());
        let completion = r#"{"prompt": "x", "max_completion_tokens": 9000}"#;
        assert!(checked(Api::Completions, completion, Some(4096)).is_ok());
        // A long wrong value is cut short in the answer.
        let long = format!(r#"{{"prompt": "x", "model": [{}1]}}"#, "1,".repeat(500));
        let message = checked(Api::Completions, &long, None).unwrap_err().message;
        assert!(message.len() < 100 && message.ends_with("..."), "{message}");
        let message = checked(Api::Completions, r#"{"prompt": "x", "top_p": 2}"#, None)
            .unwrap_err()
            .message;
        assert_eq!(
            message,
            "`top_p` must be a number over 0 and at most 1, not 2"
        );
    }
}
