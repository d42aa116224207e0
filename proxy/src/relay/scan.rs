//! Reading one event of a streamed answer without parsing it whole: the few fields migration
//! follows (the token ids, whether text came, the finish, an error), found by their keys.
//!
//! vLLM writes each chunk as compact JSON (pydantic's `model_dump_json`), as the sim engine
//! does. A key written with its quotes and colon, `"token_ids":`, cannot occur inside a string
//! value there, where every quote is escaped: so finding it finds the field. A chunk has one
//! choice (migration follows answers with `n` = 1 only).

use memchr::memmem;

/// What one event's data says.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Scanned {
    /// The generated token ids it carries (`token_ids`), when it carries a list.
    pub token_ids: Option<Vec<u32>>,
    /// The prompt's token ids (`prompt_token_ids`, on the first chunk), when it carries a list.
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

/// The fields of `data` (one event's JSON) that migration follows.
pub(super) fn scan(data: &[u8]) -> Scanned {
    Scanned {
        token_ids: value_of(data, b"\"token_ids\":").and_then(ids),
        prompt_token_ids: value_of(data, b"\"prompt_token_ids\":").and_then(ids),
        text: [&b"\"text\":"[..], b"\"content\":"]
            .iter()
            .any(|key| value_of(data, key).is_some_and(non_empty_string)),
        reasoning: [&b"\"reasoning\":"[..], b"\"reasoning_content\":"]
            .iter()
            .any(|key| value_of(data, key).is_some_and(non_empty_string)),
        finished: value_of(data, b"\"finish_reason\":").is_some_and(|v| !v.starts_with(b"null")),
        usage: value_of(data, b"\"usage\":").is_some_and(|v| v.starts_with(b"{")),
        error: data.starts_with(b"{\"error\"")
            || memmem::find(data, b"\"object\":\"error\"").is_some(),
    }
}

/// `data` without the fields named `keys` (each written as `"name":`), when it has any; their
/// values are `null` or a list of numbers.
pub(super) fn without(data: &[u8], keys: &[&[u8]]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for key in keys {
        let current = out.as_deref().unwrap_or(data);
        let Some(start) = memmem::find(current, key) else {
            continue;
        };
        let value = start + key.len();
        let Some(end) = value_end(&current[value..]).map(|len| value + len) else {
            continue;
        };
        // One comma goes with the field: the one before it, else the one after it.
        let (from, to) = if start > 0 && current[start - 1] == b',' {
            (start - 1, end)
        } else if current.get(end) == Some(&b',') {
            (start, end + 1)
        } else {
            (start, end)
        };
        let mut edited = Vec::with_capacity(current.len());
        edited.extend_from_slice(&current[..from]);
        edited.extend_from_slice(&current[to..]);
        out = Some(edited);
    }
    out
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

/// The list of token ids at the start of `value` (`None` for `null` or anything else).
fn ids(value: &[u8]) -> Option<Vec<u32>> {
    let list = value.strip_prefix(b"[")?;
    let end = memchr::memchr(b']', list)?;
    let list = list[..end].trim_ascii();
    if list.is_empty() {
        return Some(Vec::new());
    }
    list.split(|&b| b == b',')
        .map(|item| std::str::from_utf8(item.trim_ascii()).ok()?.parse().ok())
        .collect()
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
        let scanned = scan(COMPLETION);
        assert_eq!(scanned.token_ids, Some(vec![7]));
        assert_eq!(scanned.prompt_token_ids, Some(vec![1, 2, 3]));
        assert!(scanned.text && !scanned.finished && !scanned.usage && !scanned.error);
    }

    #[test]
    fn text_that_looks_like_a_key_is_not_one() {
        let scanned = scan(CHAT);
        assert_eq!(scanned.token_ids, Some(vec![5, 6]));
        assert!(scanned.text && scanned.finished && !scanned.reasoning);
    }

    #[test]
    fn empty_text_nulls_usage_and_errors_are_told() {
        let empty = br#"{"choices":[{"index":0,"delta":{"content":""},"token_ids":[],"finish_reason":null}]}"#;
        let scanned = scan(empty);
        assert_eq!(scanned.token_ids, Some(vec![]));
        assert!(!scanned.text && !scanned.finished);
        let usage = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":3}}"#;
        assert!(scan(usage).usage);
        assert!(!scan(br#"{"usage":null}"#).usage);
        assert!(scan(br#"{"error":{"message":"boom"}}"#).error);
        assert!(scan(br#"{"object":"error","message":"boom"}"#).error);
        assert!(scan(br#"{"choices":[{"delta":{"reasoning":"hmm"}}]}"#).reasoning);
        assert_eq!(scan(br#"{"token_ids":null}"#).token_ids, None);
    }

    #[test]
    fn fields_are_taken_out_with_their_comma() {
        let stripped = without(COMPLETION, &[b"\"prompt_token_ids\":", b"\"token_ids\":"]);
        assert_eq!(
            stripped.unwrap(),
            br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null}]}"#
        );
        let first = br#"{"token_ids":null,"text":"a"}"#;
        assert_eq!(
            without(first, &[b"\"token_ids\":"]).unwrap(),
            br#"{"text":"a"}"#
        );
        assert_eq!(without(br#"{"text":"a"}"#, &[b"\"token_ids\":"]), None);
    }
}
