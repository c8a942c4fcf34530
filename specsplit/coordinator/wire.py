"""Scheduler objects ↔ protobuf messages of the Verifier service (protobuf stays at the edge)."""

from __future__ import annotations

import dataclasses

from specsplit.client.results import TokenLogprobs
from specsplit.coordinator.iteration import (
    IterationTiming,
    SchedulerOutput,
    VerifierTiming,
    VerifyOutcome,
    VerifyResult,
)
from specsplit.coordinator.request import SamplingParams
from specsplit.proto import common_pb2, coordinator_pb2, verifier_pb2


def verify_request(
    output: SchedulerOutput, coordinator_id: str, eos_token_ids: frozenset[int] = frozenset()
) -> verifier_pb2.VerifyRequest:
    """The iteration's message; draft placeholders go as `num_held_drafts` (the verifier holds the drafts).
    `eos_token_ids`: the model's, which min_tokens keeps from being sampled (with each request's stop_token_ids)."""
    commands = output.cache_commands
    msg = verifier_pb2.VerifyRequest(
        iteration=output.iteration,
        finished_request_ids=output.finished_request_ids,
        coordinator_id=coordinator_id,
        reset_prefix_cache=commands.reset,
        evicted_block_hashes=commands.evicted,
    )
    for rid, index, block_hash, drafter_key in commands.registered:
        msg.registered_blocks.add(
            request_id=rid, block_index=index, block_hash=block_hash, drafter_block_hash=drafter_key
        )
    for item in output.scheduled:
        s = item.request.sampling
        held = item.num_draft_tokens
        r = msg.requests.add(
            request_id=item.request.request_id,
            num_computed_tokens=item.num_computed_tokens,
            token_ids=item.token_ids[: len(item.token_ids) - held],
            num_held_drafts=held,
            sample=item.sample,
            next_token_id=item.next_token_id,
            sampling=_sampling(s, eos_token_ids),
            num_spec_tokens=item.num_spec_tokens,
            num_prompt_tokens=len(item.request.prompt_token_ids),
        )
        if item.num_cached_blocks:
            hashes, keys, tokens = item.cached_prefix
            r.cached_block_hashes.extend(hashes)
            r.drafter_block_hashes.extend(keys)
            r.cached_token_ids.extend(tokens)
    return msg


def _sampling(s: SamplingParams, eos_token_ids: frozenset[int]) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, coupled=s.coupled
    )
    if s.repetition_penalty != 1.0:
        pb.repetition_penalty = s.repetition_penalty
    pb.presence_penalty, pb.frequency_penalty = s.presence_penalty, s.frequency_penalty
    if s.min_tokens:
        pb.min_tokens = s.min_tokens
        pb.end_token_ids.extend(s.end_token_ids(eos_token_ids))
    if s.logprobs is not None:
        pb.logprobs = s.logprobs
    if s.grammar is not None:
        pb.grammar = s.grammar
    return pb


def verify_results(response: verifier_pb2.VerifyResponse) -> list[VerifyResult]:
    return [
        VerifyResult(
            request_id=r.request_id,
            sampled_token_ids=list(r.sampled_token_ids),
            num_rejected=r.num_rejected,
            num_draft_tokens=r.num_draft_tokens,
            logprobs=TokenLogprobs.of_tokens(r.sampled_token_ids, r.logprobs),
        )
        for r in response.results
    ]


_TIMING_FIELDS = [f.name for f in dataclasses.fields(VerifierTiming)]


def verify_outcome(response: verifier_pb2.VerifyResponse) -> VerifyOutcome:
    t = response.timing
    return VerifyOutcome(
        verify_results(response),
        response.drafter_ok,
        response.drafter_error,
        response.hidden_state_bytes,
        VerifierTiming(**{name: getattr(t, name) for name in _TIMING_FIELDS}),
    )


def iteration_timing_pb(t: IterationTiming) -> coordinator_pb2.IterationTiming:
    """GetStats' form of an iteration's timing."""
    fields = dataclasses.asdict(t)
    return coordinator_pb2.IterationTiming(**fields | {"verifier": verifier_pb2.VerifyTiming(**fields["verifier"])})
