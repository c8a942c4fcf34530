"""Prepared training data: tokenizer + split + token streams in one folder, and random batches.

`prepare_data` is the only step that reads the standard library; everything after it reads the
folder, so the folder can be carried to a machine with another Python (the GPU box) and give the same
training data there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from specsplit.training.corpus import encode_files, list_source_files, read_source, split_files
from specsplit.training.tokenizer import EOS_ID, save_tokenizer, train_tokenizer

SPLITS = ("train", "valid", "heldout")


@dataclass(frozen=True)
class DataParams:
    seed: int
    vocab_size: int
    heldout_fraction: float = 0.05
    valid_fraction: float = 0.02
    max_files: int | None = None  # a prefix of the sorted file list, for quick tests


@dataclass
class PreparedData:
    data_dir: Path
    split: dict  # CorpusSplit.to_dict() plus "params"
    tokens: dict[str, np.ndarray]  # split name -> [num_tokens] uint16


def prepare_data(data_dir: Path, params: DataParams, root: Path, log=print) -> PreparedData:
    """Loads `data_dir` if it was prepared with the same params, else builds it from `root`."""
    split_path = data_dir / "split.json"
    if split_path.exists():
        split = json.loads(split_path.read_text())
        if split.get("params") == params.__dict__:
            log(f"data: reusing {data_dir}")
            return load_data(data_dir)
    log(f"data: listing .py files under {root}")
    files = list_source_files(root)[: params.max_files]
    corpus = split_files(root, files, params.seed, params.heldout_fraction, params.valid_fraction)
    log(f"data: {len(corpus.train)} train / {len(corpus.valid)} valid / {len(corpus.heldout)} held-out files")
    tokenizer = train_tokenizer((read_source(root, rel) or "" for rel in corpus.train), params.vocab_size)
    data_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, data_dir)
    for name in SPLITS:
        np.save(data_dir / f"{name}.npy", encode_files(tokenizer, root, getattr(corpus, name), EOS_ID))
    split_path.write_text(json.dumps({**corpus.to_dict(), "params": params.__dict__}, indent=1))
    data = load_data(data_dir)
    log("data: tokens " + ", ".join(f"{k} {len(v):,}" for k, v in data.tokens.items()))
    return data


def load_data(data_dir: Path) -> PreparedData:
    split = json.loads((data_dir / "split.json").read_text())
    tokens = {name: np.load(data_dir / f"{name}.npy") for name in SPLITS}
    return PreparedData(data_dir=data_dir, split=split, tokens=tokens)


def load_tokenizer(data_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(data_dir / "tokenizer.json"))


class RandomWindows:
    """Batches of `seq_len + 1` consecutive tokens at uniformly random starts, from a seeded generator."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"{len(tokens)} tokens cannot fill a window of {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1)

    def next_batch(self) -> torch.Tensor:
        """-> [batch_size, seq_len + 1] int64 token ids."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size, 1), generator=self.generator)
        return self.tokens[starts + self.offsets]


def fixed_windows(tokens: np.ndarray, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of `seq_len + 1` tokens from the start: [num_windows, seq_len + 1]."""
    usable = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    num_windows = max(1, (usable - 1) // seq_len)
    num_windows = min(num_windows, (len(tokens) - 1) // seq_len)
    ids = torch.from_numpy(tokens[: num_windows * seq_len + 1].astype(np.int64))
    return torch.stack([ids[i * seq_len : (i + 1) * seq_len + 1] for i in range(num_windows)])
