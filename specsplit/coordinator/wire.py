"""Scheduler objects ↔ protobuf messages of the Verifier service (protobuf stays at the edge)."""

from __future__ import annotations

from specsplit.coordinator.iteration import SchedulerOutput, VerifyResult
from specsplit.proto import common_pb2, verifier_pb2


def verify_request(output: SchedulerOutput, coordinator_id: str) -> verifier_pb2.VerifyRequest:
    """The iteration's message; draft placeholders go as `num_held_drafts` (the verifier holds the drafts)."""
    msg = verifier_pb2.VerifyRequest(
        iteration=output.iteration,
        finished_request_ids=output.finished_request_ids,
        coordinator_id=coordinator_id,
    )
    for item in output.scheduled:
        s = item.request.sampling
        held = item.num_draft_tokens
        msg.requests.add(
            request_id=item.request.request_id,
            num_computed_tokens=item.num_computed_tokens,
            token_ids=item.token_ids[: len(item.token_ids) - held],
            num_held_drafts=held,
            sample=item.sample,
            next_token_id=item.next_token_id,
            sampling=common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed),
            num_spec_tokens=item.num_spec_tokens,
        )
    return msg


def verify_results(response: verifier_pb2.VerifyResponse) -> list[VerifyResult]:
    return [
        VerifyResult(
            request_id=r.request_id,
            sampled_token_ids=list(r.sampled_token_ids),
            num_rejected=r.num_rejected,
            num_draft_tokens=r.num_draft_tokens,
        )
        for r in response.results
    ]
