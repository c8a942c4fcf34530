"""What one iteration carries between the scheduler, the wire and post_step: each request's share of
the iteration (`ScheduledRequest`), the iteration (`SchedulerOutput`), the verifier's result per request
(`VerifyResult`) and what post_step changed (`StepUpdate`). Pure Python, no protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.client.results import TokenLogprobs
from specsplit.coordinator.prefix_cache import CacheCommands
from specsplit.coordinator.request import Request

DRAFT_PLACEHOLDER = -1  # a draft the verifier holds (async scheduling): its id is known only there


@dataclass
class ScheduledRequest:
    """One request's share of an iteration."""

    request: Request
    num_computed_tokens: int  # position of token_ids[0]
    token_ids: list[int]  # prefill chunk, or [last token] + draft placeholders
    num_draft_tokens: int  # trailing draft placeholders in token_ids (the verifier fills them in)
    sample: bool  # False for a prefill chunk that is not the last
    next_token_id: int  # token after a non-final chunk (for the drafter's pairs); 0 otherwise
    num_spec_tokens: int  # drafts to propose after this step
    queue_time_ms: float | None = None  # set on a request's first admission
    # Prefix caching: on the step that admits it, the request starts on this many cached blocks (num_computed_tokens
    # is where they end); their hashes and drafter keys are `request.prefix`'s first ones.
    num_cached_blocks: int = 0

    @property
    def cached_prefix(self) -> tuple[list[bytes], list[bytes], list[int]]:
        """On the step that admits the request on cached blocks: their hashes, the drafter's keys of them and their
        tokens (empty otherwise)."""
        n = self.num_cached_blocks
        if not n:
            return [], [], []
        prefix = self.request.prefix
        return prefix.block_hashes[:n], prefix.drafter_keys[:n], self.request.all_token_ids[: self.num_computed_tokens]

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]


@dataclass
class SchedulerOutput:
    iteration: int
    scheduled: list[ScheduledRequest]
    finished_request_ids: list[str]  # free these on verifier and drafter before running
    num_preempted: int = 0
    cache_commands: CacheCommands = field(default_factory=CacheCommands)  # prefix caching, applied before the step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def proposes(self) -> bool:
        """Whether the iteration's Propose runs: not when every request samples and none wants drafts."""
        return not all(s.sample and not s.num_spec_tokens for s in self.scheduled)

    @property
    def num_later_steps(self) -> int:
        """The drafter's MTP steps after step 0 for this iteration's Propose: the largest draft count asked, - 1."""
        return max(max((s.num_spec_tokens for s in self.scheduled), default=0) - 1, 0)

    @property
    def scheduled_spec_decode_tokens(self) -> dict[str, list[int]]:
        return {s.request.request_id: s.draft_token_ids for s in self.scheduled if s.num_draft_tokens}


@dataclass
class VerifyResult:
    """What the verifier returned for one scheduled request."""

    request_id: str
    sampled_token_ids: list[int]
    num_rejected: int  # counts the placeholders the verifier could not fill as rejected
    num_draft_tokens: int = 0  # drafts the verifier ran: of the placeholders, those it had drafts for
    logprobs: list[TokenLogprobs] | None = None  # one per sampled token, when the request asked


@dataclass
class StepUpdate:
    """What post_step changed for one request (for streaming)."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked


@dataclass
class VerifierTiming:
    """Where the verifier's side of an iteration went (Unix ns stamps and durations in ns); the Propose's stamps are
    those of the Propose whose drafts the iteration verified (async scheduling). Zero where not measured."""

    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    propose_ns: int = 0
    received_ns: int = 0
    replied_ns: int = 0
    propose_sent_ns: int = 0
    propose_received_ns: int = 0
    drafter_received_ns: int = 0
    drafter_replied_ns: int = 0
    step0_ns: int = 0
    later_steps_ns: int = 0
    drafts_wait_ns: int = 0  # the step's wait for those drafts


@dataclass
class VerifyOutcome:
    """What the verifier's handle returned for one iteration."""

    results: list[VerifyResult]  # per scheduled request, in order
    drafter_ok: bool = True
    drafter_error: str = ""
    hidden_state_bytes: int = 0
    timing: VerifierTiming = field(default_factory=VerifierTiming)


@dataclass
class IterationTiming:
    """Where one iteration's time went, as the coordinator's loop stamped it (Unix ns), with the verifier's."""

    iteration: int
    batch_size: int
    num_draft_tokens: int
    schedule_start_ns: int
    verify_sent_ns: int
    verify_received_ns: int
    post_step_end_ns: int
    verifier: VerifierTiming
