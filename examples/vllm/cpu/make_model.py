"""Make the tiny model the real-engine cluster and tests serve: no model hub is needed.

    python make_model.py OUT_DIR

writes a Hugging Face model folder: a small Llama-architecture config, random float32 weights
drawn from a fixed seed (safetensors), and a byte-level BPE tokenizer trained here on a fixed
text, with a chat template. The same versions of torch, transformers and tokenizers write the
same files, so greedy decoding gives the same tokens on every run: what the tests compare a
P/D answer against is one engine's answer on the same weights.

The output is made once per run folder (the caller decides where); it takes a few seconds.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 0
VOCAB_SIZE = 512
# Small enough to run on two cores in milliseconds per token; heads of 64 so every CPU
# attention backend of vLLM takes it.
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=1024,
)
# Random weights with the usual 0.02 spread give nearly flat logits, where float noise between
# two batch shapes could flip a greedy pick; a wider spread makes the picks decisive.
INIT_RANGE = 0.3

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"]

# The tokenizer's training text: fixed, so its merges are too.
CORPUS = """\
Prefill computes the key and value cache of the whole prompt in one pass; decode then produces
one token at a time from that cache. Disaggregated serving runs the two phases on separate
engines, and moves the cache from the prefill engine to the decode engine over a transfer
engine. The bootstrap server tells the decode workers where the prefill workers listen, and the
proxy sends each request to a prefill and a decode at the same time.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. Explain why the sky is blue, in one sentence. Write a short poem about the sea.
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " user assistant system
"""


def make_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **SHAPE,
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: make_model.py OUT_DIR")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    make_model(out, tokenizer)
    # generation_config.json from save_pretrained may carry sampling defaults; vLLM applies a
    # model's generation config, so pin greedy decoding's only requirement: none.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id})
    )
    print(out)


if __name__ == "__main__":
    main()
