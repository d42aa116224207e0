//! What the client has of a streamed answer that may go on elsewhere: the prompt's token ids,
//! the generated ones, how many of those the client has the text of, whether the answer
//! finished. D is asked for the token ids (vLLM's `return_token_ids`); they are taken out of
//! the events again unless the client asked for them itself.
//!
//! A token's text can come later than the token: the engine holds back an incomplete UTF-8
//! sequence (a character split across tokens) until it completes. The client has the text of
//! every token up to the last event that carried text, so the continuation starts after those
//! (`committed`); the tokens after it are generated again, with their text. An event of
//! several tokens with text may still hold back the last one's: until an event of one token
//! with text comes, the answer is not continued. A chat whose tokens came without any text
//! yet may be a reasoning parser's silent start: not continued either.
//!
//! After a migration the events come from the continuation, a completion of the prompt's
//! tokens plus the committed ones: each is written back in the answer's own shape (its id,
//! `created`, model, a chat chunk's `delta`), and its usage counts the whole answer.

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::events::{self, framed};
use super::scan::{scan, write_without, TextKey};

/// The shape of the answer's chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// `text_completion` chunks with a `text`.
    Completion,
    /// `chat.completion.chunk` chunks with a `delta`.
    Chat,
}

/// How the client asked for the answer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked {
    /// The chunks' shape.
    pub shape: Shape,
    /// Whether it asked for the token ids itself (`return_token_ids`).
    pub token_ids: bool,
    /// Whether it asked for a last chunk with the usage (`stream_options.include_usage`).
    pub usage: bool,
}

/// The answer's identity, from its first chunk: kept on every continued chunk.
#[derive(Debug, Deserialize)]
struct Head {
    id: Value,
    #[serde(default)]
    created: Value,
    #[serde(default)]
    model: Value,
}

/// The answer so far.
pub(crate) struct Progress {
    asked: Asked,
    prompt: Option<Vec<u32>>,
    generated: Vec<u32>,
    /// How many of `generated` the client has the text of.
    committed: usize,
    /// How many generated tokens the last continuation took as its prompt's.
    carried: usize,
    /// Whether the client may lack the text of the last committed token (it came in an event
    /// of several tokens).
    uncertain: bool,
    /// Ids the client has that the continuation generates again (when it asked for ids).
    resent: usize,
    finished: bool,
    usage_sent: bool,
    done: bool,
    head: Option<Head>,
    /// Why the answer cannot be continued exactly, once seen.
    unresumable: Option<&'static str>,
    /// Whether the events now come from a continuation.
    continued: bool,
}

/// What one event was.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Part of the answer (what the client gets of it, if anything, is written out).
    Relayed,
    /// D told an error mid-answer: the answer broke.
    Broke,
}

/// A continuation's request: the prompt it completes and how much of the answer is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Continuation {
    /// The prompt's token ids and the generated ones the client has the text of.
    pub prompt: Vec<u32>,
    /// How many generated tokens the client has (to take from `max_tokens`).
    pub generated: usize,
}

/// One chunk of a continuation (a completion's), the fields that are carried over.
#[derive(Debug, Default, Deserialize)]
struct ContinuedChunk {
    #[serde(default)]
    choices: Vec<ContinuedChoice>,
    usage: Option<Usage>,
    error: Option<Value>,
    object: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct ContinuedChoice {
    #[serde(default)]
    text: String,
    token_ids: Option<Vec<u32>>,
    finish_reason: Option<Value>,
    stop_reason: Option<Value>,
}

#[derive(Debug, Deserialize, Serialize)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
}

impl Progress {
    /// An answer not begun, asked for as `asked` says.
    pub(crate) fn new(asked: Asked) -> Self {
        Progress {
            asked,
            prompt: None,
            generated: Vec::new(),
            committed: 0,
            carried: 0,
            uncertain: false,
            resent: 0,
            finished: false,
            usage_sent: false,
            done: false,
            head: None,
            unresumable: None,
            continued: false,
        }
    }

    /// Whether the stream ended as it should (`[DONE]`).
    pub(super) fn done(&self) -> bool {
        self.done
    }

    /// Whether the events now come from a continuation.
    pub(super) fn continued(&self) -> bool {
        self.continued
    }

    /// Whether the answer's choice finished (so a break after it loses nothing).
    pub(super) fn finished(&self) -> bool {
        self.finished
    }

    /// How many tokens were generated so far (the client has the text of `committed` ones).
    pub(super) fn generated(&self) -> usize {
        self.generated.len()
    }

    /// Reads one whole event of the answer, writing what the client gets of it to `out`.
    pub(super) fn observe(&mut self, event: &[u8], out: &mut BytesMut) -> Step {
        let Some(data) = events::data(event) else {
            out.extend_from_slice(event);
            return Step::Relayed;
        };
        if data == b"[DONE]" {
            self.done = true;
            out.extend_from_slice(event);
            return Step::Relayed;
        }
        if self.continued {
            return self.continued_event(data, out);
        }
        let text = match self.asked.shape {
            Shape::Completion => TextKey::Text,
            Shape::Chat => TextKey::Content,
        };
        let scanned = scan(data, text, self.prompt.is_none(), &mut self.generated);
        if scanned.error {
            return Step::Broke;
        }
        if self.head.is_none() {
            self.head = head(data);
        }
        if self.prompt.is_none() {
            self.prompt = scanned.prompt_token_ids;
        }
        if scanned.token_ids.is_none() && scanned.text {
            self.unresumable = Some("the decode sent text without token ids");
        }
        if scanned.reasoning {
            self.unresumable = Some("the answer carries reasoning text");
        }
        self.progressed(
            scanned.text,
            scanned.finished,
            scanned.token_ids.unwrap_or(0),
        );
        self.usage_sent |= scanned.usage;
        match self.asked.token_ids {
            true => out.extend_from_slice(event),
            false => write_without(data, &scanned.id_fields, out),
        }
        Step::Relayed
    }

    /// Counts an event of `tokens` tokens, with `text` or not, `finished` or not.
    fn progressed(&mut self, text: bool, finished: bool, tokens: usize) {
        if text || finished {
            self.committed = self.generated.len();
            self.uncertain = text && tokens > 1 && !finished;
        }
        self.finished |= finished;
    }

    /// The continuation the answer needs now, or why it cannot go on exactly.
    pub(super) fn continuation(&self) -> Result<Continuation, &'static str> {
        if let Some(why) = self.unresumable {
            return Err(why);
        }
        let Some(prompt) = &self.prompt else {
            return Err("the decode did not send the prompt's token ids");
        };
        if self.head.is_none() {
            return Err("the answer broke before its first chunk");
        }
        if self.uncertain {
            return Err("its last event of several tokens may hold back a character's text");
        }
        let silent = self.generated.len() > self.committed && self.committed == 0;
        if silent && self.asked.shape == Shape::Chat {
            return Err("the chat's first tokens came without text (a parser's silent start?)");
        }
        let mut ids = Vec::with_capacity(prompt.len() + self.committed);
        ids.extend_from_slice(prompt);
        ids.extend_from_slice(&self.generated[..self.committed]);
        Ok(Continuation {
            prompt: ids,
            generated: self.committed,
        })
    }

    /// The answer goes on from `continuation`: its later tokens are generated again.
    pub(super) fn continue_from(&mut self, continuation: &Continuation) {
        self.resent = self.generated.len() - continuation.generated;
        self.generated.truncate(continuation.generated);
        self.carried = continuation.generated;
        self.continued = true;
    }

    /// The end of an answer whose choice finished before its stream broke: its usage when the
    /// client asked and has not had it, and `[DONE]`.
    pub(super) fn ending(&mut self) -> Bytes {
        let mut out = BytesMut::new();
        if self.asked.usage && !self.usage_sent {
            let prompt = self.prompt.as_ref().map_or(0, Vec::len);
            let usage = usage(prompt, self.generated.len());
            out.extend(framed(&self.chunk(Vec::new(), Some(usage))));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.done = true;
        out.freeze()
    }

    /// A continuation's event, written to `out` in the answer's shape.
    fn continued_event(&mut self, data: &[u8], out: &mut BytesMut) -> Step {
        let Ok(chunk) = serde_json::from_slice::<ContinuedChunk>(data) else {
            return Step::Broke;
        };
        if chunk.error.is_some() || chunk.object.as_deref() == Some("error") {
            return Step::Broke;
        }
        let usage = chunk.usage.map(|used| {
            let prompt = used.prompt_tokens.saturating_sub(self.carried);
            usage(prompt, used.completion_tokens + self.carried)
        });
        self.usage_sent |= usage.is_some();
        let mut choices = Vec::with_capacity(1);
        if let Some(choice) = chunk.choices.into_iter().next() {
            let finished = choice.finish_reason.as_ref().is_some_and(|r| !r.is_null());
            let had_ids = choice.token_ids.is_some();
            let ids = choice.token_ids.unwrap_or_default();
            if choice.text.is_empty() && ids.is_empty() && !finished {
                if let Some(usage) = usage {
                    out.extend(framed(&self.chunk(choices, Some(usage))));
                }
                return Step::Relayed;
            }
            if !had_ids && !choice.text.is_empty() {
                self.unresumable = Some("the decode sent text without token ids");
            }
            self.generated.extend_from_slice(&ids);
            self.progressed(!choice.text.is_empty(), finished, ids.len());
            // Ids the client already has, of tokens generated again, are not sent twice.
            let repeated = self.resent.min(ids.len());
            self.resent -= repeated;
            let sent = ids[repeated..].to_vec();
            choices.push(self.choice(choice.text, choice.finish_reason, choice.stop_reason, sent));
        }
        out.extend(framed(&self.chunk(choices, usage)));
        Step::Relayed
    }

    /// One choice in the answer's shape.
    fn choice(
        &self,
        text: String,
        finish_reason: Option<Value>,
        stop_reason: Option<Value>,
        ids: Vec<u32>,
    ) -> Value {
        let mut choice = Map::new();
        choice.insert("index".into(), json!(0));
        match self.asked.shape {
            Shape::Completion => choice.insert("text".into(), json!(text)),
            Shape::Chat => choice.insert("delta".into(), json!({ "content": text })),
        };
        choice.insert("logprobs".into(), Value::Null);
        choice.insert("finish_reason".into(), finish_reason.unwrap_or(Value::Null));
        choice.insert("stop_reason".into(), stop_reason.unwrap_or(Value::Null));
        if self.asked.token_ids {
            choice.insert("token_ids".into(), json!(ids));
        }
        Value::Object(choice)
    }

    /// A chunk of the answer with `choices` (and its `usage`), as JSON text.
    fn chunk(&self, choices: Vec<Value>, usage: Option<Value>) -> Vec<u8> {
        let object = match self.asked.shape {
            Shape::Completion => "text_completion",
            Shape::Chat => "chat.completion.chunk",
        };
        let (id, created, model) = match &self.head {
            Some(head) => (&head.id, &head.created, &head.model),
            None => (&Value::Null, &Value::Null, &Value::Null),
        };
        let mut chunk = json!({
            "id": id, "object": object, "created": created, "model": model, "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        serde_json::to_vec(&chunk).expect("a JSON value serializes into memory")
    }
}

/// The answer's identity from its first event's JSON: the fields before `choices` (vLLM writes
/// them first, and the choices may hold a long prompt's ids), else the whole event.
fn head(data: &[u8]) -> Option<Head> {
    let prefix = memchr::memmem::find(data, b",\"choices\":")
        .and_then(|at| serde_json::from_slice(&[&data[..at], b"}"].concat()).ok());
    prefix.or_else(|| serde_json::from_slice(data).ok())
}

/// OpenAI's usage object.
fn usage(prompt: usize, completion: usize) -> Value {
    serde_json::to_value(Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
    })
    .expect("a usage serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(data: &str) -> Bytes {
        Bytes::from(format!("data: {data}\n\n"))
    }

    /// What the client gets of the event of `data`.
    fn sent(progress: &mut Progress, data: &str) -> String {
        let mut out = BytesMut::new();
        let step = progress.observe(&event(data), &mut out);
        assert_eq!(step, Step::Relayed, "the answer broke");
        String::from_utf8(out.to_vec()).unwrap()
    }

    const ASKED: Asked = Asked {
        shape: Shape::Completion,
        token_ids: false,
        usage: true,
    };

    #[test]
    fn token_ids_are_followed_and_taken_out() {
        let mut progress = Progress::new(ASKED);
        let first = r#"{"id":"c1","created":5,"model":"m","choices":[{"index":0,"text":"a","prompt_token_ids":[1,2],"token_ids":[10]}]}"#;
        assert_eq!(
            sent(&mut progress, first),
            "data: {\"id\":\"c1\",\"created\":5,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n"
        );
        // A token whose text the engine holds back (half a character): not committed.
        let held = r#"{"id":"c1","choices":[{"index":0,"text":"","prompt_token_ids":null,"token_ids":[11]}]}"#;
        sent(&mut progress, held);
        assert_eq!(progress.generated(), 2);
        let continuation = progress.continuation().unwrap();
        assert_eq!(
            continuation,
            Continuation {
                prompt: vec![1, 2, 10],
                generated: 1
            }
        );
    }

    #[test]
    fn a_continuation_speaks_in_the_answers_shape() {
        let mut progress = Progress::new(Asked {
            shape: Shape::Chat,
            ..ASKED
        });
        let first = r#"{"id":"chat-1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[1,2]}"#;
        sent(&mut progress, first);
        let token =
            r#"{"id":"chat-1","choices":[{"index":0,"delta":{"content":"x"},"token_ids":[10]}]}"#;
        sent(&mut progress, token);
        let continuation = progress.continuation().unwrap();
        progress.continue_from(&continuation);
        let next = r#"{"id":"cmpl-9","object":"text_completion","created":9,"model":"m","choices":[{"index":0,"text":"y","finish_reason":"length","stop_reason":null,"token_ids":[11],"prompt_token_ids":[1,2,10]}]}"#;
        let chunk: Value = serde_json::from_str(
            sent(&mut progress, next)
                .strip_prefix("data: ")
                .unwrap()
                .trim(),
        )
        .unwrap();
        assert_eq!(chunk["id"], "chat-1");
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["choices"][0]["delta"]["content"], "y");
        assert_eq!(chunk["choices"][0]["finish_reason"], "length");
        assert!(chunk["choices"][0].get("token_ids").is_none());
        let usage = r#"{"id":"cmpl-9","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
        let chunk = sent(&mut progress, usage);
        assert!(
            chunk.contains(r#""usage":{"completion_tokens":2,"prompt_tokens":2,"total_tokens":4}"#),
            "{chunk}"
        );
    }

    #[test]
    fn answers_that_cannot_go_on_exactly_say_why() {
        let mut progress = Progress::new(ASKED);
        assert!(progress.continuation().is_err());
        let no_ids = r#"{"id":"c1","choices":[{"index":0,"text":"a"}]}"#;
        sent(&mut progress, no_ids);
        assert_eq!(
            progress.continuation(),
            Err("the decode sent text without token ids")
        );
        let error = event(r#"{"error":{"message":"x"}}"#);
        assert_eq!(progress.observe(&error, &mut BytesMut::new()), Step::Broke);
    }

    #[test]
    fn text_possibly_held_back_or_a_silent_chat_start_is_not_continued() {
        let mut progress = Progress::new(ASKED);
        let first = r#"{"id":"c1","choices":[{"index":0,"text":"a","prompt_token_ids":[1],"token_ids":[4,5]}]}"#;
        sent(&mut progress, first);
        assert!(progress.continuation().is_err(), "two tokens, one text");
        let next = r#"{"id":"c1","choices":[{"index":0,"text":"b","token_ids":[6]}]}"#;
        sent(&mut progress, next);
        assert_eq!(progress.continuation().unwrap().generated, 3);

        let mut chat = Progress::new(Asked {
            shape: Shape::Chat,
            ..ASKED
        });
        let role = r#"{"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[1]}"#;
        sent(&mut chat, role);
        let think = r#"{"id":"x","choices":[{"index":0,"delta":{},"token_ids":[9]}]}"#;
        sent(&mut chat, think);
        assert!(
            chat.continuation().is_err(),
            "a parser may have swallowed it"
        );
    }

    #[test]
    fn ids_the_client_has_are_not_sent_twice() {
        let mut progress = Progress::new(Asked {
            token_ids: true,
            ..ASKED
        });
        let first = r#"{"id":"c1","choices":[{"index":0,"text":"a","prompt_token_ids":[1],"token_ids":[4]}]}"#;
        sent(&mut progress, first);
        let held = r#"{"id":"c1","choices":[{"index":0,"text":"","token_ids":[5]}]}"#;
        sent(&mut progress, held);
        let continuation = progress.continuation().unwrap();
        progress.continue_from(&continuation);
        let again = r#"{"id":"n","choices":[{"index":0,"text":"bc","token_ids":[5,6]}]}"#;
        let chunk = sent(&mut progress, again);
        assert!(chunk.contains(r#""token_ids":[6]"#), "{chunk}");
        assert!(chunk.contains(r#""text":"bc""#), "{chunk}");
    }

    #[test]
    fn a_finished_answer_ends_with_its_usage() {
        let mut progress = Progress::new(ASKED);
        let last = r#"{"id":"c1","choices":[{"index":0,"text":"a","finish_reason":"stop","prompt_token_ids":[1],"token_ids":[4,5]}]}"#;
        sent(&mut progress, last);
        assert!(progress.finished());
        let ending = String::from_utf8(progress.ending().to_vec()).unwrap();
        assert!(ending.contains(r#""completion_tokens":2"#), "{ending}");
        assert!(ending.ends_with("data: [DONE]\n\n"));
    }
}
