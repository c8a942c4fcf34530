"""Coordinator configuration, built once from the command line and passed down by constructor."""

from __future__ import annotations

from dataclasses import dataclass

# The verifier's limit on drafts per request (kernels.types.MAX_DRAFTS_PER_REQUEST; this package has no torch).
MAX_SPECULATIVE_TOKENS = 31


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits the scheduler enforces each iteration.

    `max_model_len`, `block_size` and `num_blocks` come from the verifier's ModelInfo (the
    verifier owns the KV cache; the coordinator does its block accounting).
    """

    max_model_len: int
    block_size: int
    num_blocks: int
    num_speculative_tokens: int = 3  # adaptive: the most drafts a request gets; else every request's k
    adaptive: bool = False  # each request's draft count chosen per iteration (draft_choice.py); off: every request k
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_waiting: int = 1024
    enable_prefix_caching: bool = True  # full blocks of verified tokens reused across requests (prefix_cache.py)

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}]")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
            raise ValueError("max_num_batched_tokens must be at least num_speculative_tokens + 1")
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("block_size and num_blocks must be >= 1")
