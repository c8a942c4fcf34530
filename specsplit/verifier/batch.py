"""What the verifier's step takes: the iteration's batch as the coordinator scheduled it (`VerifyBatch`), each
request's share (`VerifyItem`), its sampling (`Sampling`) and the q of sampled drafts (`DraftProbs`). Plain
dataclasses: the servicer converts the VerifyRequest message into them (`wire.py`), one process builds them from the
scheduler's output (`specsplit/engine/local.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sampling:
    """What the verifier applies of a request's sampling (temperature 0: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: unseeded
    coupled: bool = False  # verified by coupled sampling (the seed is the user's: specsplit/kernels/reference.py)
    repetition_penalty: float | None = None  # None: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_token_ids: tuple[int, ...] = ()  # kept from being sampled before min_tokens
    logprobs: int | None = None  # top log-probabilities per emitted token; None: none asked
    grammar: str | None = None  # structured output: the llguidance grammar its rows are masked with (`grammar.py`)


@dataclass
class DraftProbs:
    """q of a request's sampled drafts, sparse: the top tokens of each draft position and their probabilities."""

    token_ids: torch.Tensor  # [num_drafts, K] integer
    probs: torch.Tensor  # [num_drafts, K] float32


@dataclass
class VerifyItem:
    """One request's share of an iteration."""

    request_id: str
    num_computed_tokens: int  # position of token_ids[0]
    token_ids: list[int]  # prefill chunk, or [last token] (+ drafts)
    num_held_drafts: int = 0  # drafts to take from the held ones (async scheduling)
    num_draft_tokens: int = 0  # trailing drafts in token_ids
    draft_probs: DraftProbs | None = None
    sample: bool = True  # False for a prefill chunk that is not the last
    next_token_id: int = 0  # the token after a non-final chunk
    sampling: Sampling = field(default_factory=Sampling)
    num_spec_tokens: int = 0  # drafts to propose after this step
    num_prompt_tokens: int = 0
    # Prefix caching, on the step that admits the request on cached blocks: their hashes (the request's first blocks),
    # the drafter's keys of them, and their tokens (num_computed_tokens of them).
    cached_block_hashes: list[bytes] = field(default_factory=list)
    drafter_block_hashes: list[bytes] = field(default_factory=list)
    cached_token_ids: list[int] = field(default_factory=list)


@dataclass
class VerifyBatch:
    iteration: int
    requests: list[VerifyItem]
    finished_request_ids: list[str] = field(default_factory=list)  # freed before the step
    coordinator_id: str = ""
    # Prefix caching, applied before the step in this order: forget every cached block, register blocks (request id,
    # block index, block hash, drafter key), free the finished requests, evict blocks by hash.
    reset_prefix_cache: bool = False
    registered_blocks: list[tuple[str, int, bytes, bytes]] = field(default_factory=list)
    evicted_block_hashes: list[bytes] = field(default_factory=list)


class CachedPrefixes:
    """Prefix caching, a drafter handle's side: the requests the verifier started on cached blocks whose drafter has
    not heard of them yet, each with the drafter's keys of those blocks and the position they end at
    (`VerifierWorker.start_cached`). A request's keys go with its next Propose, where its rows start at that position
    (elsewhere the drafter could not start on them: they are dropped)."""

    def __init__(self):
        self._pending: dict[str, tuple[list[bytes], int]] = {}

    def add(self, prefixes: dict[str, tuple[list[bytes], int]]) -> None:
        self._pending.update(prefixes)

    def take(self, request_id: str, start_position: int) -> list[bytes]:
        if not self._pending:
            return []
        keys, end = self._pending.pop(request_id, ((), -1))
        return list(keys) if end == start_position else []

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._pending.pop(rid, None)

    def clear(self) -> None:
        self._pending.clear()
