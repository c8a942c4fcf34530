"""The demo corpus: this machine's Python standard library sources, split by file.

Every machine with Python has these files, so the demo checkpoint can be rebuilt offline anywhere.
The split is by whole file (no file contributes to two splits) and depends only on the sorted file
list and the seed: `heldout` is what the reported numbers are measured on, `valid` picks the best
checkpoint during training, `train` is everything else.
"""

from __future__ import annotations

import random
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "pydoc_data"}
MAX_FILE_BYTES = 400_000
GENERATED_MARKER = "generated from"  # gencodec.py charmap tables and similar machine-made files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[str]:
    """Sorted relative paths of the .py files under `root` worth learning from.

    Skips third-party and documentation folders, files that are not UTF-8 (the stdlib's encoding
    tests), very large files and machine-generated tables.
    """
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        text = read_source(root, rel.as_posix())
        if text is None or not text.strip() or GENERATED_MARKER in text[:1000].lower():
            continue
        files.append(rel.as_posix())
    return files


def read_source(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@dataclass(frozen=True)
class CorpusSplit:
    """Relative file paths of each split, each list sorted."""

    root: str
    python_version: str
    seed: int
    train: list[str]
    valid: list[str]
    heldout: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def split_files(
    root: Path, files: list[str], seed: int, heldout_fraction: float = 0.05, valid_fraction: float = 0.02
) -> CorpusSplit:
    """Shuffles the sorted file list with `random.Random(seed)` and cuts it into three splits."""
    if len(files) < 3:
        raise ValueError(f"need at least 3 files to split, got {len(files)}")
    shuffled = sorted(files)
    random.Random(seed).shuffle(shuffled)
    num_heldout = max(1, round(len(files) * heldout_fraction))
    num_valid = max(1, round(len(files) * valid_fraction))
    return CorpusSplit(
        root=str(root),
        python_version=".".join(map(str, sys.version_info[:3])),
        seed=seed,
        heldout=sorted(shuffled[:num_heldout]),
        valid=sorted(shuffled[num_heldout : num_heldout + num_valid]),
        train=sorted(shuffled[num_heldout + num_valid :]),
    )


def encode_files(tokenizer, root: Path, files: list[str], bos_id: int) -> np.ndarray:
    """Token ids of `files` as one uint16 stream, each file preceded by `bos_id`."""  # [num_tokens]
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ValueError("vocabulary too large for uint16 token files")
    texts = [read_source(root, rel) or "" for rel in files]
    pieces = [
        np.asarray([bos_id, *enc.ids], dtype=np.uint16)
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False)
    ]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
