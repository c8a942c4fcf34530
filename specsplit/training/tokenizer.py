"""Byte-level BPE tokenizer for the demo checkpoint, built with the `tokenizers` library.

Byte-level means every string round-trips exactly (no unknown token), which matters for source code:
indentation and newlines are tokens like any other. One special token, `<|endoftext|>`, starts every
document and ends generation (bos = eos), and encoding with special tokens prepends it, as Llama's
tokenizers do; `<|pad|>` pads and never appears in training data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EOS_ID = 0
PAD_ID = 1


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learns byte-level BPE merges from `texts`; ids 0 and 1 are the special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID or tokenizer.token_to_id(PAD_TOKEN) != PAD_ID:
        raise RuntimeError("special tokens did not get ids 0 and 1")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOS_TOKEN} $A", pair=f"{EOS_TOKEN} $A {EOS_TOKEN} $B", special_tokens=[(EOS_TOKEN, EOS_ID)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json so that `AutoTokenizer.from_pretrained` loads it."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(str(out_dir))
    # The generic class name loads in transformers 4.x as well as 5.x (where it means TokenizersBackend).
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
