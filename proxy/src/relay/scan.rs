//! Reading one event of a streamed answer without parsing it whole: the few fields migration
//! follows (the token ids, whether text came, the finish, an error), found by their keys, and
//! the token ids taken out again in one pass.
//!
//! vLLM writes each chunk as compact JSON (pydantic's `model_dump_json`), as the sim engine
//! does. A key written with its quotes and colon, `"token_ids":`, cannot occur inside a string
//! value there, where every quote is escaped: so finding it finds the field. A chunk has one
//! choice (migration follows answers with `n` = 1 only).

use std::ops::Range;

use memchr::memmem;

/// The key of the generated ids of a chunk.
const TOKEN_IDS: &[u8] = b"\"token_ids\":";
/// The key of the prompt's ids (on the first chunk).
const PROMPT_TOKEN_IDS: &[u8] = b"\"prompt_token_ids\":";

/// What one event's data says.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Scanned {
    /// How many generated token ids it carries (`token_ids`), when it carries a list.
    pub token_ids: Option<usize>,
    /// The prompt's token ids (`prompt_token_ids`), when asked for and it carries a list.
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Whether it carries text (`text` or `content` not empty).
    pub text: bool,
    /// Whether it carries reasoning text (a reasoning parser's `reasoning` or
    /// `reasoning_content`), which a continuation could not tell from the answer's text.
    pub reasoning: bool,
    /// Whether it ends the choice (`finish_reason` not null).
    pub finished: bool,
    /// Whether it carries the usage (`usage` not null).
    pub usage: bool,
    /// Whether it is an error event (`{"error": …}` or `"object":"error"`).
    pub error: bool,
}

/// The fields of `data` (one event's JSON) that migration follows; its generated ids are
/// added to `generated`, its prompt's ids read when `prompt` asks for them.
pub(super) fn scan(data: &[u8], prompt: bool, generated: &mut Vec<u32>) -> Scanned {
    let non_empty = |keys: [&[u8]; 2]| {
        keys.iter()
            .any(|key| value_of(data, key).is_some_and(non_empty_string))
    };
    Scanned {
        token_ids: value_of(data, TOKEN_IDS).and_then(|value| ids(value, generated)),
        prompt_token_ids: prompt
            .then(|| value_of(data, PROMPT_TOKEN_IDS))
            .flatten()
            .and_then(|value| {
                let mut prompt = Vec::new();
                ids(value, &mut prompt).map(|_| prompt)
            }),
        text: non_empty([b"\"text\":", b"\"content\":"]),
        reasoning: non_empty([b"\"reasoning\":", b"\"reasoning_content\":"]),
        finished: value_of(data, b"\"finish_reason\":").is_some_and(|v| !v.starts_with(b"null")),
        usage: value_of(data, b"\"usage\":").is_some_and(|v| v.starts_with(b"{")),
        error: data.starts_with(b"{\"error\"")
            || memmem::find(data, b"\"object\":\"error\"").is_some(),
    }
}

/// `data` framed as an SSE event without its token id fields (`token_ids`,
/// `prompt_token_ids`), when it has any: one copy.
pub(super) fn framed_without_ids(data: &[u8]) -> Option<Vec<u8>> {
    let mut cuts: Vec<Range<usize>> = [TOKEN_IDS, PROMPT_TOKEN_IDS]
        .iter()
        .filter_map(|key| field(data, key))
        .collect();
    if cuts.is_empty() {
        return None;
    }
    cuts.sort_by_key(|cut| cut.start);
    let mut event = Vec::with_capacity(data.len() + 8);
    event.extend_from_slice(b"data: ");
    let mut at = 0;
    for cut in cuts {
        event.extend_from_slice(&data[at..cut.start.max(at)]);
        at = at.max(cut.end);
    }
    event.extend_from_slice(&data[at..]);
    event.extend_from_slice(b"\n\n");
    Some(event)
}

/// Where the field `key` is in `data`, with one comma (the one before it, else the one after
/// it), when its value is `null` or a list of numbers.
fn field(data: &[u8], key: &[u8]) -> Option<Range<usize>> {
    let start = memmem::find(data, key)?;
    let value = start + key.len();
    let end = value + value_end(&data[value..])?;
    Some(if start > 0 && data[start - 1] == b',' {
        start - 1..end
    } else if data.get(end) == Some(&b',') {
        start..end + 1
    } else {
        start..end
    })
}

/// The text after `key` (whitespace skipped), when `data` has the key.
fn value_of<'d>(data: &'d [u8], key: &[u8]) -> Option<&'d [u8]> {
    let at = memmem::find(data, key)? + key.len();
    let rest = &data[at..];
    let skip = rest.iter().take_while(|b| b.is_ascii_whitespace()).count();
    Some(&rest[skip..])
}

/// The length of a `null` or a list of numbers at the start of `value`.
fn value_end(value: &[u8]) -> Option<usize> {
    if value.starts_with(b"null") {
        return Some(4);
    }
    if value.first() != Some(&b'[') {
        return None;
    }
    memchr::memchr(b']', value).map(|end| end + 1)
}

/// Adds the list of token ids at the start of `value` to `out`: how many (`None` for `null`,
/// anything else, or a list that is not of token ids, when nothing is added).
fn ids(value: &[u8], out: &mut Vec<u32>) -> Option<usize> {
    let list = value.strip_prefix(b"[")?;
    let list = list[..memchr::memchr(b']', list)?].trim_ascii();
    if list.is_empty() {
        return Some(0);
    }
    let before = out.len();
    for item in list.split(|&b| b == b',') {
        match std::str::from_utf8(item.trim_ascii())
            .ok()
            .and_then(|id| id.parse().ok())
        {
            Some(id) => out.push(id),
            None => {
                out.truncate(before);
                return None;
            }
        }
    }
    Some(out.len() - before)
}

/// Whether `value` starts a string that is not empty.
fn non_empty_string(value: &[u8]) -> bool {
    value.first() == Some(&b'"') && value.get(1).is_some_and(|&b| b != b'"')
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMPLETION: &[u8] = br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[1,2,3],"token_ids":[7]}]}"#;
    const CHAT: &[u8] = br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi \"token_ids\":[9]"},"logprobs":null,"finish_reason":"stop","token_ids":[5, 6]}]}"#;

    #[test]
    fn a_completion_chunk_is_read() {
        let mut generated = vec![4];
        let scanned = scan(COMPLETION, true, &mut generated);
        assert_eq!((scanned.token_ids, generated), (Some(1), vec![4, 7]));
        assert_eq!(scanned.prompt_token_ids, Some(vec![1, 2, 3]));
        assert!(scanned.text && !scanned.finished && !scanned.usage && !scanned.error);
        assert_eq!(
            scan(COMPLETION, false, &mut Vec::new()).prompt_token_ids,
            None
        );
    }

    #[test]
    fn text_that_looks_like_a_key_is_not_one() {
        let mut generated = Vec::new();
        let scanned = scan(CHAT, false, &mut generated);
        assert_eq!((scanned.token_ids, generated), (Some(2), vec![5, 6]));
        assert!(scanned.text && scanned.finished && !scanned.reasoning);
    }

    #[test]
    fn empty_text_nulls_usage_and_errors_are_told() {
        let empty = br#"{"choices":[{"index":0,"delta":{"content":""},"token_ids":[],"finish_reason":null}]}"#;
        let scanned = scan(empty, false, &mut Vec::new());
        assert_eq!(scanned.token_ids, Some(0));
        assert!(!scanned.text && !scanned.finished);
        let usage = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":3}}"#;
        let read = |data: &[u8]| scan(data, false, &mut Vec::new());
        assert!(read(usage).usage);
        assert!(!read(br#"{"usage":null}"#).usage);
        assert!(read(br#"{"error":{"message":"boom"}}"#).error);
        assert!(read(br#"{"object":"error","message":"boom"}"#).error);
        assert!(read(br#"{"choices":[{"delta":{"reasoning":"hmm"}}]}"#).reasoning);
        assert_eq!(read(br#"{"token_ids":null}"#).token_ids, None);
        let mut generated = vec![1];
        assert_eq!(
            scan(br#"{"token_ids":[2,"x"]}"#, false, &mut generated).token_ids,
            None
        );
        assert_eq!(generated, vec![1], "nothing of a bad list is kept");
    }

    #[test]
    fn fields_are_taken_out_with_their_comma() {
        let stripped = framed_without_ids(COMPLETION).unwrap();
        assert_eq!(
            stripped,
            [&b"data: "[..], br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null}]}"#, b"\n\n"].concat()
        );
        let first = br#"{"token_ids":null,"text":"a"}"#;
        assert_eq!(
            framed_without_ids(first).unwrap(),
            b"data: {\"text\":\"a\"}\n\n"
        );
        let chat =
            br#"{"id":"c","choices":[{"delta":{},"token_ids":[1]}],"prompt_token_ids":[1,2]}"#;
        assert_eq!(
            framed_without_ids(chat).unwrap(),
            b"data: {\"id\":\"c\",\"choices\":[{\"delta\":{}}]}\n\n"
        );
        assert_eq!(framed_without_ids(br#"{"text":"a"}"#), None);
    }
}
