"""The draft vocabulary: the N target ids the MTP head's LM head projects onto, instead of every id.

An MTP step of a 7B-class model reads the whole LM head (152,064 x 3,584 bf16: 1.09 GB of the 1.56 GB the step
reads) to pick one draft per row. With a draft vocabulary the head's matmul reads N rows (`MTPModule.draft_head`,
filled from the checkpoint's head): a step's logits are [T, N], column c scoring target id `ids[c]`, and each draft
(the argmax, or the sample from q: `sampling.py`) maps back to its target id on the device at once. Verification is
unchanged: the verifier scores every draft against the target's full distribution, so output stays lossless (greedy
equal to target-only; sampled output distributed as target-only's, q having support on the N ids only). What the
vocabulary costs is acceptance: a token outside it is never drafted (docs/performance.md, "Draft vocabulary").

Which N ids:
- at start, a seed order of every id, most likely first: the ids of `--draft-vocab-file` (one per line, most
  frequent first), then the checkpoint's own order (`checkpoint_order`: its tokenizer's added tokens, the byte-level
  alphabet, then every merged token by its merge rank: BPE learns its merges most frequent first);
- online: the drafter counts the tokens it is given (the x_{p+1} of every Propose: prompts and every token the
  target emitted) and, every N counted tokens, ranks the ids by count (ties by the seed order) on a worker thread;
  the first Propose after the ranking is done installs the new top N (`swap`), between two Proposes: the new head
  rows and ids are copied on the device's stream behind the last step that used the old ones, so nothing waits and
  no step sees half of each (Proposes run one at a time, and a Propose's drafts are target ids before it returns).
Counts live in the drafter's memory: a restarted drafter starts again from the seed order (drafts may be worse for a
while, output never changes).

Tensor-parallel drafters keep the full vocabulary: their head is split by vocabulary rows over the ranks, and the
rows of a draft set would have to be gathered across them (refused with a clear error).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specsplit.client.errors import UsageError
from specsplit.models.mtp import MTPModule
from specsplit.models.parallel import tp_size

log = logging.getLogger(__name__)


class DraftVocabulary:
    """The draft ids of an MTP module (`ids`, [N] int64 on its device: column -> target id) and the counts that
    choose them. Attaches a head of N rows to the module (`MTPModule.draft_head`), which its steps' logits then use:
    build it before the runner captures CUDA graphs."""

    def __init__(self, mtp: MTPModule, size: int, seed_order: np.ndarray):
        vocab = mtp.config.vocab_size
        if not 0 < size < vocab:
            raise UsageError(f"--draft-vocab-size {size}: must be between 1 and the vocabulary's {vocab - 1}")
        if tp_size() > 1:
            raise UsageError("--draft-vocab-size needs a drafter on one rank (its head is split by vocabulary rows)")
        if not np.array_equal(np.sort(seed_order), np.arange(vocab)):
            raise ValueError("the seed order must list every id of the vocabulary once")
        full = mtp.shared_head.head.weight  # [V, H]
        self.size, self.vocab_size, self._full = size, vocab, full
        self.ids = torch.zeros(size, dtype=torch.int64, device=full.device)
        head = nn.Linear(full.shape[1], size, bias=False, device=full.device, dtype=full.dtype)
        head.weight.requires_grad_(False)
        mtp.draft_head = head
        self._head = head
        # Ties in the ranking go by the seed order: prior[id] = V - 1 - its place in it.
        self._prior = np.empty(vocab, dtype=np.int64)
        self._prior[seed_order] = np.arange(vocab - 1, -1, -1, dtype=np.int64)
        self._counts = np.zeros(vocab, dtype=np.int64)
        self._member = np.zeros(vocab, dtype=bool)  # in the installed set
        self._host_ids = np.empty(0, dtype=np.int64)
        self._since = 0  # tokens counted since the last ranking started
        self.counted = self.covered = 0  # tokens counted since the last swap, and those in the set
        self.swaps = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft-vocab")
        self._ranking: Future | None = None
        self._install(np.sort(seed_order[:size]))

    def observe(self, token_ids: list[int]) -> None:
        """Counts tokens the drafter was given; every `size` of them starts a ranking (at most one at a time)."""
        if not token_ids:
            return
        tokens = np.asarray(token_ids, dtype=np.int64)
        tokens = tokens[(tokens >= 0) & (tokens < self.vocab_size)]
        np.add.at(self._counts, tokens, 1)
        self.counted += len(tokens)
        self.covered += int(self._member[tokens].sum())
        self._since += len(tokens)
        if self._since >= self.size and self._ranking is None:
            self._since = 0
            self._ranking = self._pool.submit(self._rank, self._counts.copy())

    def swap(self, wait: bool = False) -> bool:
        """Installs the last ranking's set if it is done (`wait`: once it is) and differs from the installed one;
        whether it did. Called between Proposes."""
        ranking = self._ranking
        if ranking is None or not (wait or ranking.done()):
            return False
        self._ranking = None
        ids = ranking.result()
        if np.array_equal(ids, self._host_ids):
            return False
        if self.counted:
            log.info(
                "draft vocabulary: swap %d; %.1f %% of the %d tokens since the last one were in the set",
                self.swaps + 1,
                100 * self.covered / self.counted,
                self.counted,
            )
        self._install(ids)
        self.swaps += 1
        return True

    def _rank(self, counts: np.ndarray) -> np.ndarray:
        """The `size` ids of the highest counts, ties by the seed order; ascending."""
        score = counts * self.vocab_size + self._prior
        return np.sort(np.argpartition(-score, self.size - 1)[: self.size])

    @torch.inference_mode()
    def _install(self, ids: np.ndarray) -> None:
        """The head rows and ids of `ids` copied into place on the device's stream, without a wait."""
        host = torch.from_numpy(ids)
        if self.ids.is_cuda:
            host = host.pin_memory()
        device_ids = host.to(self.ids.device, non_blocking=True)
        torch.index_select(self._full, 0, device_ids, out=self._head.weight)
        self.ids.copy_(device_ids)
        self._member[self._host_ids] = False
        self._member[ids] = True
        self._host_ids = ids
        self.counted = self.covered = 0


def draft_vocabulary(
    mtp: MTPModule, size: int, tokenizer_dir: str | Path | None, vocab_file: str | Path | None = None
) -> DraftVocabulary | None:
    """The drafter's draft vocabulary of `size` ids seeded from `vocab_file` and the checkpoint (`seed_order`); None
    (the full vocabulary) for size 0 or a size not smaller than the vocabulary."""
    vocab = mtp.config.vocab_size
    if size < 0:
        raise UsageError(f"--draft-vocab-size {size}: must be 0 (the full vocabulary) or more")
    if size == 0 or size >= vocab:
        if vocab_file is not None:
            raise UsageError("--draft-vocab-file needs a --draft-vocab-size smaller than the vocabulary")
        return None
    return DraftVocabulary(mtp, size, seed_order(vocab, tokenizer_dir, vocab_file))


def seed_order(vocab_size: int, tokenizer_dir: str | Path | None, vocab_file: str | Path | None = None) -> np.ndarray:
    """Every id once, most likely first: the ids `vocab_file` lists, in its order, then the rest in the checkpoint's
    order."""
    order = checkpoint_order(vocab_size, tokenizer_dir)
    if vocab_file is None:
        return order
    listed = file_ids(vocab_file, vocab_size)
    rest = np.ones(vocab_size, dtype=bool)
    rest[listed] = False
    return np.concatenate([listed, order[rest[order]]])


def file_ids(path: str | Path, vocab_size: int) -> np.ndarray:
    """The token ids a draft vocabulary file lists (whitespace-separated integers, or a JSON list of them), first
    occurrences in order; UsageError naming what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--draft-vocab-file {path}: {e.strerror or e}") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [int(v) for v in text.split()]
    except ValueError as e:
        raise UsageError(f"--draft-vocab-file {path}: not token ids ({e})") from None
    if not values or not all(isinstance(v, int) and 0 <= v < vocab_size for v in values):
        bad = next((v for v in values if not (isinstance(v, int) and 0 <= v < vocab_size)), None)
        what = "lists no id" if not values else f"{bad!r} is not an id below the vocabulary's {vocab_size}"
        raise UsageError(f"--draft-vocab-file {path}: {what}")
    return np.asarray(list(dict.fromkeys(values)), dtype=np.int64)


def checkpoint_order(vocab_size: int, tokenizer_dir: str | Path | None) -> np.ndarray:
    """Every id once, as the checkpoint's BPE tokenizer (tokenizer.json) ranks them: added tokens, then the tokens no
    merge makes (the byte-level alphabet) by id, then each merged token by its merge's rank, then ids the tokenizer
    lacks (a vocabulary padded past it). Without a BPE tokenizer.json: ids ascending."""
    path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir is not None else None
    if path is None or not path.is_file():
        return np.arange(vocab_size, dtype=np.int64)
    spec = json.loads(path.read_text())
    model = spec.get("model") or {}
    vocab: dict[str, int] = model.get("vocab") or {}
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return np.arange(vocab_size, dtype=np.int64)
    added = [t["id"] for t in spec.get("added_tokens") or []]
    merged: dict[int, int] = {}  # id -> rank of the merge that makes it
    for rank, merge in enumerate(model.get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        token = vocab.get(left + right)
        if token is not None:
            merged.setdefault(token, rank)
    alphabet = sorted(i for i in vocab.values() if i not in merged)
    ranked = [*added, *alphabet, *sorted(merged, key=merged.__getitem__)]
    ids = [i for i in dict.fromkeys(ranked) if 0 <= i < vocab_size]
    seen = np.zeros(vocab_size, dtype=bool)
    seen[ids] = True
    return np.concatenate([np.asarray(ids, dtype=np.int64), np.flatnonzero(~seen)])
