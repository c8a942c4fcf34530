"""Structured output in the end-to-end benchmark (`benchmarks/e2e.py --structured json`): the response format every
constrained request carries, the tokenizer the grammar masks run over on a random-weight shape, and the check that
constrained outputs follow the format.

A shape ships no tokenizer of its model's vocabulary (`benchmarks/lib/shapes.py` copies the demo's 4096 ids), and a
grammar's masks cost what the vocabulary makes them cost. `write_tokenizer` writes the synthetic byte-level vocabulary
of `benchmarks/structured_output.py` (151,936 ids, or the model's vocabulary where that is smaller; id 0 its EOS) as
the checkpoint's tokenizer files, where the verifier's and the drafter's `Grammars` load it (`AutoTokenizer`, then
`llguidance.hf.from_tokenizer`) and the coordinator detokenizes with it. It is a byte-level BPE without merges that
looks every pre-tokenized word up whole: each id decodes to its bytes, which is all the masks read; the benchmark
sends token ids, so how text would be encoded does not matter.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.structured_output import SCHEMA, VOCAB, SyntheticTokenizer

# --structured's response formats, in the SDK's `structured_output=` shape. The JSON schema is the one whose masks
# benchmarks/structured_output.py times; its strings and integer have no length bound but the name's, so random
# weights seldom close the object within a benchmark's new tokens: outputs end at max_tokens ('length'), following
# the grammar, and tokens/s counts the same new tokens constrained and unconstrained.
SPECS = {"json": {"json": SCHEMA}}
EOS = "<|endoftext|>"  # id 0's name: Qwen2's EOS, which its tokenizer class would add as a token of its own if absent


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the ByteLevel pre-tokenizer's and decoder's): byte -> the character standing
    for it in a vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


def write_tokenizer(path: str | Path, model_vocab_size: int) -> SyntheticTokenizer:
    """Writes tokenizer.json and tokenizer_config.json of the synthetic vocabulary (min(VOCAB, model_vocab_size) ids)
    into the checkpoint directory `path`, replacing those there; returns the tokenizer."""
    tok = SyntheticTokenizer(min(VOCAB, model_vocab_size))
    chars = _byte_chars()
    vocab = {EOS: 0} | {"".join(chars[b] for b in token): i for i, token in enumerate(tok.tokens) if i}
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 0,
                "content": EOS,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": [],
        },
    }
    path = Path(path)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


class OutputCheck:
    """Checks outputs against `SPECS[kind]` over the tokenizer of the checkpoint at `tokenizer_dir`, as the coordinator
    compiles it (`specsplit/coordinator/structured_output.py`): every token up to the first EOS must be one the grammar
    allows, and an output that reached the EOS must be a complete JSON text."""

    def __init__(self, tokenizer_dir: str | Path, kind: str):
        import llguidance
        import llguidance.hf
        from transformers import AutoTokenizer

        from specsplit.client.sdk import structured_output_pb
        from specsplit.coordinator.structured_output import compile_grammar

        hf = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        self.tokenizer = llguidance.hf.from_tokenizer(hf)
        self.grammar = compile_grammar(structured_output_pb(SPECS[kind]))
        self.kind = kind

    def problems(self, name: str, outputs: list[list[int]]) -> tuple[list[str], int]:
        """(what is wrong, one line per output; how many outputs reached the EOS)."""
        import llguidance

        eos, problems, finished = set(self.tokenizer.eos_tokens), [], 0
        for i, output in enumerate(outputs):
            end = next((j for j, t in enumerate(output) if t in eos), None)
            ids = output if end is None else output[:end]
            matcher = llguidance.LLMatcher(self.tokenizer, self.grammar)
            taken = matcher.try_consume_tokens(ids)
            if taken != len(ids):
                problems.append(f"{name}: prompt {i}: token {taken} of its output is not one its {self.kind} allows")
            elif end is not None:
                finished += 1
                try:
                    json.loads(self.tokenizer.decode_bytes(ids))
                except ValueError as err:
                    problems.append(f"{name}: prompt {i}: its output ended but is no JSON text: {err}")
        return problems, finished
