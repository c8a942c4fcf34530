"""A small byte-level BPE tokenizer for tiny test checkpoints, trained offline on a fixed text.

Every byte is in the alphabet, so any text encodes and decodes losslessly; the vocabulary has exactly
the requested size (merges learnt from the text, then unused filler specials if the text runs out).
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Fixed text (kept in the source so every machine and Python version trains the same tokenizer).
_TRAINING_TEXT = """\
Speculative decoding lets a small draft propose several tokens that the large target model then
verifies in a single forward pass. Every accepted draft token is a token the target did not have
to generate one step at a time, and a rejected one costs only the work already spent on it.
The multi-token prediction head reads the hidden state of the target at one position and the
embedding of the next token, and predicts the token after that. The verifier keeps the output
distribution of the target exactly: with greedy decoding the text is identical to plain decoding.

def greet(name):
    return f"Hello, {name}!"


for i in range(10):
    print(greet("world"), i)

class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output_token_ids = []

The quick brown fox jumps over the lazy dog. Once upon a time there was a little model that
wanted to write poems, stories and programs. It read the manual, the tests and the source.
"""


def training_text() -> list[str]:
    return _TRAINING_TEXT.split("\n\n")


def write_tiny_tokenizer(path: pathlib.Path, vocab_size: int, model_max_length: int) -> None:
    """Writes tokenizer.json + tokenizer_config.json (loadable by transformers.AutoTokenizer)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} for a byte-level tokenizer, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    filler = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<|extra_{i}|>" for i in range(filler)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
