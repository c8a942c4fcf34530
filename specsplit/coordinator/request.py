"""Request state held by the coordinator (pure Python, no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specsplit.client.results import SpecStats
from specsplit.coordinator.draft_acceptance import PositionCounts


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # The seed is the user's: verified by coupled sampling, so the tokens are target-only sampling with this seed
    # whatever the speculation (docs/architecture.md, "Seeded sampling"); False: a seed drawn per request.
    seeded: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # end generation like EOS (also with ignore_eos)
    # Applied by the verifier to the target's logits (specsplit/verifier/logits_processors.py), vLLM's semantics.
    repetition_penalty: float = 1.0  # on prompt and output tokens; 1 = off
    presence_penalty: float = 0.0  # on output tokens; 0 = off
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # output tokens before EOS or a stop token can be sampled
    logprobs: int | None = None  # None: none; N: the target's log-probability of each token and of the top N
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # None: the server's k
    # Structured output: the llguidance grammar the verifier masks the target's logits with (structured_output.py).
    grammar: str | None = None

    @property
    def coupled(self) -> bool:
        """Verified by coupled sampling: a seeded request that samples."""
        return self.seeded and self.temperature > 0

    def end_token_ids(self, eos_token_ids) -> tuple[int, ...]:
        """What min_tokens keeps from being sampled: the stop token ids and, unless ignore_eos, the model's EOS."""
        if not self.min_tokens:
            return ()
        return tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))))


@dataclass
class PrefixState:
    """A request's side of the prefix cache (`specsplit/coordinator/prefix_cache.py`)."""

    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks known so far, in order
    drafter_keys: list[bytes] = field(default_factory=list)  # the drafter's keys of those whose next token is known
    num_scanned_blocks: int = 0  # its leading blocks attached or offered for registration since its KV was last freed
    held: list[bytes] = field(default_factory=list)  # hashes of its blocks in the directory (attached or registered)


@dataclass
class Request:
    """One generation request.

    Invariant while decoding: `num_computed_tokens == num_tokens - 1` — every token but the
    last is in the verifier's KV cache. `spec_token_ids` stand for the drafts the previous iteration's
    propose left for this iteration to verify: placeholders (`DRAFT_PLACEHOLDER`), since the drafts
    themselves stay on the verifier (async scheduling); they are not part of `output_token_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stats: SpecStats = field(default_factory=SpecStats)
    position_counts: PositionCounts = field(default_factory=PositionCounts)  # drafts reached/accepted per position
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_kv_tokens: int = 0  # tokens the verifier's cache holds for it after the last step
    num_kv_reserved: int = 0  # while its iteration is in flight: tokens the cache holds after that step
    num_preemptions: int = 0
    finish_reason: str | None = None
    span: object | None = None  # the request's OpenTelemetry span (observability.py)
    admitted_time: float | None = None
    deadline: float | None = None  # time.monotonic() by which the client wants the answer
    prefix: PrefixState = field(default_factory=PrefixState)
    num_cached_tokens: int | None = None  # prompt tokens that came from the prefix cache at its first admission

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
