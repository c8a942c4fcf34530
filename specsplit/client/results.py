"""What the client SDK returns: streamed deltas, whole results and speculative-decoding stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.proto import common_pb2, coordinator_pb2


@dataclass
class SpecStats:
    """Speculative-decoding statistics of one request (or of a server)."""

    num_drafts: int = 0  # verify iterations that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_iterations: int = 0
    draft_count_histogram: list[int] = field(default_factory=list)  # [d]: iterations that verified d drafts

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Counts one verify iteration: drafts verified, and how many of them were accepted."""
        self.num_iterations += 1
        _add_at(self.draft_count_histogram, num_draft_tokens, 1)
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        """Adds another request's counts to these."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_iterations += other.num_iterations
        for i, n in enumerate(other.accepted_per_position):
            _add_at(self.accepted_per_position, i, n)
        for d, n in enumerate(other.draft_count_histogram):
            _add_at(self.draft_count_histogram, d, n)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify iteration that carried drafts: accepted + 1."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_position]

    @classmethod
    def from_pb(cls, pb: common_pb2.SpecStats) -> SpecStats:
        return cls(
            pb.num_drafts,
            pb.num_draft_tokens,
            pb.num_accepted_tokens,
            list(pb.accepted_per_position),
            pb.num_iterations,
            list(pb.draft_count_histogram),
        )

    def to_pb(self) -> common_pb2.SpecStats:
        return common_pb2.SpecStats(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            accepted_per_position=self.accepted_per_position,
            num_iterations=self.num_iterations,
            draft_count_histogram=self.draft_count_histogram,
        )

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": self.accepted_per_position,
            "num_iterations": self.num_iterations,
            "draft_count_histogram": self.draft_count_histogram,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
        }


def _add_at(counts: list[int], index: int, n: int) -> None:
    if len(counts) <= index:
        counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += n


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probability of one emitted token and the most likely tokens at its position (raw logits:
    before temperature, penalties, top-k and top-p)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first

    @classmethod
    def from_pb(cls, token_id: int, pb: common_pb2.TokenLogprobs) -> TokenLogprobs:
        return cls(token_id, pb.logprob, tuple(zip(pb.top_token_ids, pb.top_logprobs, strict=True)))

    @classmethod
    def of_tokens(cls, token_ids, pbs) -> list[TokenLogprobs] | None:
        """One per token of `token_ids` from its message in `pbs`; None when there are none (not asked)."""
        return [cls.from_pb(t, pb) for t, pb in zip(token_ids, pbs)] if pbs else None

    def to_pb(self) -> common_pb2.TokenLogprobs:
        return common_pb2.TokenLogprobs(
            logprob=self.logprob, top_token_ids=[t for t, _ in self.top], top_logprobs=[lp for _, lp in self.top]
        )


@dataclass
class GenerationDelta:
    """One streamed message: new tokens and text; the last one has finish_reason and stats."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: SpecStats | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    index: int = 0  # which of the request's n completions
    cached_tokens: int = 0  # of prompt_tokens, those whose KV came from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids, when the request asked for logprobs


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]  # generated ids only
    text: str
    finish_reason: str
    stats: SpecStats
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids, when the request asked
    cached_tokens: int = 0  # of prompt_tokens, those whose KV came from the prefix cache

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
            },
            "stats": self.stats.to_dict(),
        }


def delta_from_pb(pb: coordinator_pb2.GenerateResponse) -> GenerationDelta:
    final = bool(pb.finish_reason)
    return GenerationDelta(
        request_id=pb.request_id,
        token_ids=list(pb.token_ids),
        text=pb.text,
        finish_reason=pb.finish_reason or None,
        stats=SpecStats.from_pb(pb.spec_stats) if final else None,
        prompt_tokens=pb.usage.prompt_tokens,
        completion_tokens=pb.usage.completion_tokens,
        index=pb.index,
        logprobs=TokenLogprobs.of_tokens(pb.token_ids, pb.logprobs),
        cached_tokens=pb.usage.cached_tokens,
    )


class Collector:
    """Accumulates deltas into a GenerationResult."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.last: GenerationDelta | None = None

    def add(self, d: GenerationDelta) -> None:
        self.token_ids.extend(d.token_ids)
        self.text.append(d.text)
        self.logprobs.extend(d.logprobs or ())
        self.last = d

    def result(self) -> GenerationResult:
        last = self.last
        if last is None or last.finish_reason is None:
            raise RuntimeError("stream ended without a finish reason")
        return GenerationResult(
            last.request_id,
            self.token_ids,
            "".join(self.text),
            last.finish_reason,
            last.stats or SpecStats(),
            last.prompt_tokens,
            last.completion_tokens,
            self.logprobs or None,
            last.cached_tokens,
        )
