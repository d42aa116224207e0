//! Reading one event of a streamed answer without parsing it whole: the few fields migration
//! follows (the token ids, whether text came, the finish, an error), found by their keys, and
//! the token ids taken out again in one copy.
//!
//! vLLM writes each chunk as compact JSON (pydantic's `model_dump_json`), as the sim engine
//! does. A key written with its quotes and colon, `"token_ids":`, cannot occur inside a string
//! value there, where every quote is escaped: so finding it finds the field. A chunk has one
//! choice (migration follows answers with `n` = 1 only). Every event of every followed answer
//! is read here, so each key is searched once, with a searcher built once.

use std::ops::Range;
use std::sync::LazyLock;

use bytes::BytesMut;
use memchr::memmem::Finder;

/// The searchers of the keys read.
struct Keys {
    token_ids: Finder<'static>,
    prompt_token_ids: Finder<'static>,
    text: Finder<'static>,
    content: Finder<'static>,
    reasoning: Finder<'static>,
    finish_reason: Finder<'static>,
    usage: Finder<'static>,
    object_error: Finder<'static>,
}

static KEYS: LazyLock<Keys> = LazyLock::new(|| Keys {
    token_ids: Finder::new(b"\"token_ids\":"),
    prompt_token_ids: Finder::new(b"\"prompt_token_ids\":"),
    text: Finder::new(b"\"text\":"),
    content: Finder::new(b"\"content\":"),
    // `reasoning` and `reasoning_content` alike.
    reasoning: Finder::new(b"\"reasoning"),
    finish_reason: Finder::new(b"\"finish_reason\":"),
    usage: Finder::new(b"\"usage\":"),
    object_error: Finder::new(b"\"object\":\"error\""),
});

/// Where the text of a chunk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TextKey {
    /// A completion's `text`.
    Text,
    /// A chat's `delta.content`.
    Content,
}

/// What one event's data says.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Scanned {
    /// How many generated token ids it carries (`token_ids`), when it carries a list.
    pub token_ids: Option<usize>,
    /// The prompt's token ids (`prompt_token_ids`), when asked for and it carries a list.
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Whether it carries text (not empty).
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
    /// Where its token id fields are (`token_ids`, `prompt_token_ids`), each with one comma.
    pub id_fields: [Option<Range<usize>>; 2],
}

/// The fields of `data` (one event's JSON) that migration follows, its text under `text`; its
/// generated ids are added to `generated`, its prompt's ids read when `prompt` asks for them.
pub(super) fn scan(data: &[u8], text: TextKey, prompt: bool, generated: &mut Vec<u32>) -> Scanned {
    let keys = &*KEYS;
    let ids_at = field(data, &keys.token_ids);
    let prompt_at = field(data, &keys.prompt_token_ids);
    let token_ids = (ids_at.as_ref()).and_then(|(_, value)| ids(&data[value.clone()], generated));
    let prompt_token_ids = (prompt_at.as_ref().filter(|_| prompt)).and_then(|(_, value)| {
        let mut prompt = Vec::new();
        ids(&data[value.clone()], &mut prompt).map(|_| prompt)
    });
    let text_key = match text {
        TextKey::Text => &keys.text,
        TextKey::Content => &keys.content,
    };
    Scanned {
        token_ids,
        prompt_token_ids,
        text: value_of(data, text_key).is_some_and(non_empty_string),
        reasoning: reasoning(data),
        finished: value_of(data, &keys.finish_reason).is_some_and(|v| !v.starts_with(b"null")),
        usage: value_of(data, &keys.usage).is_some_and(|v| v.starts_with(b"{")),
        error: data.starts_with(b"{\"error\"") || keys.object_error.find(data).is_some(),
        id_fields: [
            ids_at.map(|(field, _)| field),
            prompt_at.map(|(field, _)| field),
        ],
    }
}

/// Writes `data` to `out` framed as an SSE event, without the `fields` [`scan`] found.
pub(super) fn write_without(data: &[u8], fields: &[Option<Range<usize>>; 2], out: &mut BytesMut) {
    let mut cuts = [fields[0].clone(), fields[1].clone()];
    cuts.sort_by_key(|cut| cut.as_ref().map(|cut| cut.start));
    out.reserve(data.len() + 8);
    out.extend_from_slice(b"data: ");
    let mut at = 0;
    for cut in cuts.iter().flatten() {
        out.extend_from_slice(&data[at..cut.start.max(at)]);
        at = at.max(cut.end);
    }
    out.extend_from_slice(&data[at..]);
    out.extend_from_slice(b"\n\n");
}

/// Where the field `key` finds is in `data`, with one comma (the one before it, else the one
/// after it), and where its value is, when its value is `null` or a list of numbers.
fn field(data: &[u8], key: &Finder<'_>) -> Option<(Range<usize>, Range<usize>)> {
    let start = key.find(data)?;
    let value = start + key.needle().len();
    let end = value + value_end(&data[value..])?;
    let field = if start > 0 && data[start - 1] == b',' {
        start - 1..end
    } else if data.get(end) == Some(&b',') {
        start..end + 1
    } else {
        start..end
    };
    Some((field, value..end))
}

/// Whether `data` has reasoning text: a `reasoning` or `reasoning_content` string not empty.
fn reasoning(data: &[u8]) -> bool {
    let Some(at) = KEYS.reasoning.find(data) else {
        return false;
    };
    let rest = &data[at + b"\"reasoning".len()..];
    let rest = rest.strip_prefix(b"_content").unwrap_or(rest);
    rest.strip_prefix(b"\":")
        .is_some_and(|value| non_empty_string(value.trim_ascii_start()))
}

/// The text after the key `key` finds (whitespace skipped), when `data` has the key.
fn value_of<'d>(data: &'d [u8], key: &Finder<'_>) -> Option<&'d [u8]> {
    let at = key.find(data)? + key.needle().len();
    Some(data[at..].trim_ascii_start())
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

/// Adds the list of token ids `value` is to `out`: how many (`None` for `null`, or a list
/// that is not of token ids, when nothing is added).
fn ids(value: &[u8], out: &mut Vec<u32>) -> Option<usize> {
    let list = value.strip_prefix(b"[")?.strip_suffix(b"]")?.trim_ascii();
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

    fn read(data: &[u8]) -> Scanned {
        scan(data, TextKey::Content, false, &mut Vec::new())
    }

    #[test]
    fn a_completion_chunk_is_read() {
        let mut generated = vec![4];
        let scanned = scan(COMPLETION, TextKey::Text, true, &mut generated);
        assert_eq!((scanned.token_ids, generated), (Some(1), vec![4, 7]));
        assert_eq!(scanned.prompt_token_ids, Some(vec![1, 2, 3]));
        assert!(scanned.text && !scanned.finished && !scanned.usage && !scanned.error);
        let later = scan(COMPLETION, TextKey::Text, false, &mut Vec::new());
        assert_eq!(later.prompt_token_ids, None);
        assert!(!scan(COMPLETION, TextKey::Content, false, &mut Vec::new()).text);
    }

    #[test]
    fn text_that_looks_like_a_key_is_not_one() {
        let mut generated = Vec::new();
        let scanned = scan(CHAT, TextKey::Content, false, &mut generated);
        assert_eq!((scanned.token_ids, generated), (Some(2), vec![5, 6]));
        assert!(scanned.text && scanned.finished && !scanned.reasoning);
    }

    #[test]
    fn empty_text_nulls_usage_reasoning_and_errors_are_told() {
        let empty = br#"{"choices":[{"index":0,"delta":{"content":""},"token_ids":[],"finish_reason":null}]}"#;
        let scanned = read(empty);
        assert_eq!(scanned.token_ids, Some(0));
        assert!(!scanned.text && !scanned.finished);
        assert!(read(br#"{"id":"x","choices":[],"usage":{"prompt_tokens":3}}"#).usage);
        assert!(!read(br#"{"usage":null}"#).usage);
        assert!(read(br#"{"error":{"message":"boom"}}"#).error);
        assert!(read(br#"{"object":"error","message":"boom"}"#).error);
        assert!(read(br#"{"choices":[{"delta":{"reasoning":"hmm"}}]}"#).reasoning);
        assert!(read(br#"{"choices":[{"delta":{"reasoning_content": "hmm"}}]}"#).reasoning);
        assert!(!read(br#"{"choices":[{"delta":{"reasoning":null}}]}"#).reasoning);
        assert_eq!(read(br#"{"token_ids":null}"#).token_ids, None);
        let mut generated = vec![1];
        let bad = scan(
            br#"{"token_ids":[2,"x"]}"#,
            TextKey::Text,
            false,
            &mut generated,
        );
        assert_eq!(bad.token_ids, None);
        assert_eq!(generated, vec![1], "nothing of a bad list is kept");
    }

    #[test]
    fn fields_are_taken_out_with_their_comma() {
        let strip = |data: &[u8]| {
            let mut out = BytesMut::new();
            write_without(data, &read(data).id_fields, &mut out);
            out.to_vec()
        };
        assert_eq!(
            strip(COMPLETION),
            [&b"data: "[..], br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null}]}"#, b"\n\n"].concat()
        );
        let first = br#"{"token_ids":null,"text":"a"}"#;
        assert_eq!(strip(first), b"data: {\"text\":\"a\"}\n\n");
        let chat =
            br#"{"id":"c","choices":[{"delta":{},"token_ids":[1]}],"prompt_token_ids":[1,2]}"#;
        assert_eq!(
            strip(chat),
            b"data: {\"id\":\"c\",\"choices\":[{\"delta\":{}}]}\n\n"
        );
        let both_null = br#"{"token_ids":null,"prompt_token_ids":null}"#;
        assert_eq!(strip(both_null), b"data: {}\n\n");
        assert_eq!(strip(br#"{"text":"a"}"#), b"data: {\"text\":\"a\"}\n\n");
    }
}
