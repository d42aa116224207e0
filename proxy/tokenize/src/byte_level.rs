//! A tokenizer of one token per byte (token id = byte value, no merges) with a small chat
//! template, written as a model directory: what simulated engines and tests tokenize with, so
//! that their KV events name the same token ids the proxy computes.

use std::io;
use std::path::Path;

use serde_json::{json, Map, Value};

/// The chat template written beside it: `<|role|>content<|end|>` per message, then
/// `<|assistant|>` when a generation prompt is asked for.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}<|{{ message['role'] }}|>\
{{ message['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`.
pub fn write(dir: &Path) -> io::Result<()> {
    let vocab: Map<String, Value> = (0..=255u8)
        .map(|byte| (byte_char(byte).to_string(), json!(byte)))
        .collect();
    let level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": level,
        "post_processor": null,
        "decoder": level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []},
    });
    let config = json!({"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>"});
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string())?;
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string())
}

/// GPT-2's printable stand-in for a byte, as byte-level pre-tokenizers write it.
fn byte_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + shifted).expect("below 0x200")
}
