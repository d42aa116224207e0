//! A trace request's prompt as text that shares exactly what the trace says is shared: each
//! block id becomes the same 512 lowercase letters wherever it appears (drawn from the id
//! alone), the last block cut to the prompt's length. Every tokenizer on the bench's path is
//! byte-level (one token a byte, `pd_tokenize::byte_level`: the sims, pd-proxy, the peers'
//! character trees), so two requests whose first k ids are equal share their first 512·k
//! tokens exactly and no more (ids differ: their letters differ at once, almost surely).

use super::trace::TraceRequest;

/// The prompt of `request`: `input` bytes, block `i` the letters of `blocks[i]`. A request
/// without block ids (Azure's traces) gets letters of its own (`unique`, e.g. its index), so it
/// shares nothing.
pub fn prompt(request: &TraceRequest, block_tokens: u32, unique: u64) -> String {
    let block = block_tokens.max(1) as usize;
    let input = request.input as usize;
    let mut text = String::with_capacity(input);
    let mut ids = request.blocks.iter().copied();
    let mut own = unique.wrapping_mul(0xd6e8_feb8_6659_fd93) | 1 << 63;
    while text.len() < input {
        let id = ids.next().unwrap_or_else(|| {
            own = own.wrapping_add(1);
            own
        });
        let take = block.min(input - text.len());
        text.extend(letters(id).take(take));
    }
    text
}

/// The letters of block `id`: a splitmix64 stream seeded by it, 26 letters a draw.
fn letters(id: u64) -> impl Iterator<Item = char> {
    let mut state = id ^ 0x9e37_79b9_7f4a_7c15;
    std::iter::repeat_with(move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        char::from(b'a' + ((z ^ (z >> 31)) % 26) as u8)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn request(input: u32, blocks: &[u64]) -> TraceRequest {
        TraceRequest {
            at: Duration::ZERO,
            input,
            output: 1,
            blocks: blocks.to_vec(),
        }
    }

    fn shared(a: &str, b: &str) -> usize {
        a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn shared_ids_are_shared_tokens_exactly() {
        let a = prompt(&request(1300, &[1, 2, 3]), 512, 0);
        let b = prompt(&request(1100, &[1, 2, 7]), 512, 1);
        let c = prompt(&request(600, &[9, 2]), 512, 2);
        assert_eq!((a.len(), b.len(), c.len()), (1300, 1100, 600));
        assert!(a.bytes().all(|b| b.is_ascii_lowercase()));
        // Two ids in common: 1024 tokens, then different letters within a few.
        let common = shared(&a, &b);
        assert!((1024..1030).contains(&common), "{common}");
        assert!(shared(&a, &c) < 5);
        // The same id is the same block wherever it stands (c's is cut to its 600 bytes).
        assert_eq!(&a[512..600], &c[512..]);
    }

    #[test]
    fn requests_without_ids_share_nothing() {
        let a = prompt(&request(2000, &[]), 512, 0);
        let b = prompt(&request(2000, &[]), 512, 1);
        assert_eq!(a.len(), 2000);
        assert!(shared(&a, &b) < 5);
    }
}
