//! A streamed answer cut into whole server-sent events: the network splits an answer anywhere
//! (in the middle of an event, of a token's text, of a UTF-8 sequence), and an answer that may
//! be continued elsewhere is only relayed event by event, so that a break never leaves the
//! client half an event.

use bytes::{Bytes, BytesMut};
use memchr::memmem;

/// The end of an event: a blank line (vLLM and SGLang end each event with `\n\n`).
const END: &[u8] = b"\n\n";

/// The most bytes a partial event may hold; an event longer than this is not followed. The
/// first event carries the prompt's token ids (about 7 bytes a token): 8 MiB holds a prompt of
/// a million tokens.
pub(super) const MAX_EVENT: usize = 8 << 20;

/// The bytes of a stream that do not end an event yet.
#[derive(Default)]
pub(super) struct Events {
    partial: BytesMut,
}

/// An event outgrew [`MAX_EVENT`]: the bytes held so far, to be relayed as they are.
pub(super) struct Overflow(pub Bytes);

impl Events {
    /// Adds `chunk` to the stream: returns the events it ends, each with its blank line.
    pub(super) fn push(&mut self, chunk: Bytes) -> Result<Vec<Bytes>, Overflow> {
        let mut events = Vec::new();
        let mut rest = if self.partial.is_empty() {
            chunk
        } else {
            self.partial.extend_from_slice(&chunk);
            self.partial.split().freeze()
        };
        while let Some(at) = memmem::find(&rest, END) {
            events.push(rest.split_to(at + END.len()));
        }
        if rest.len() > MAX_EVENT {
            let mut held = BytesMut::new();
            for event in events {
                held.extend_from_slice(&event);
            }
            held.extend_from_slice(&rest);
            return Err(Overflow(held.freeze()));
        }
        self.partial.extend_from_slice(&rest);
        Ok(events)
    }

    /// Forgets a partial event (its stream broke: the client never sees it).
    pub(super) fn clear(&mut self) {
        self.partial.clear();
    }
}

/// The data of an SSE `event` (its `data: ` line's text), when it has one.
pub(super) fn data(event: &[u8]) -> Option<&[u8]> {
    let data = event.strip_prefix(b"data:")?;
    Some(data.strip_prefix(b" ").unwrap_or(data).trim_ascii_end())
}

/// `data` framed as one SSE event.
pub(super) fn framed(data: &[u8]) -> Vec<u8> {
    let mut event = Vec::with_capacity(data.len() + 8);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(data);
    event.extend_from_slice(END);
    event
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = "data: {\"text\":\"é\"}\n\ndata: [DONE]\n\n".as_bytes();
        for cut in 1..stream.len() {
            let mut events = Events::default();
            let mut out = Vec::new();
            for part in [&stream[..cut], &stream[cut..]] {
                out.extend(events.push(Bytes::copy_from_slice(part)).ok().unwrap());
            }
            assert_eq!(out.len(), 2, "cut at {cut}");
            assert_eq!(&out[0][..], "data: {\"text\":\"é\"}\n\n".as_bytes());
            assert_eq!(data(&out[1]), Some(&b"[DONE]"[..]));
        }
    }

    #[test]
    fn an_endless_event_is_given_up() {
        let mut events = Events::default();
        let big = Bytes::from(vec![b'x'; MAX_EVENT + 1]);
        let Err(Overflow(held)) = events.push(big) else {
            panic!("an event over the cap must overflow");
        };
        assert_eq!(held.len(), MAX_EVENT + 1);
    }
}
