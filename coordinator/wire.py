"""Scheduler objects ↔ protobuf messages of the Verifier service (protobuf stays at the edge)."""

from __future__ import annotations

from coordinator.iteration import SchedulerOutput, VerifyResult
from protos import common_pb2, verifier_pb2


def verify_request(
    output: SchedulerOutput, coordinator_id: str, drafts_held: bool = False
) -> verifier_pb2.VerifyRequest:
    """`drafts_held`: async scheduling (the verifier keeps the next drafts; placeholders go as
    `num_held_drafts`)."""
    msg = verifier_pb2.VerifyRequest(
        iteration=output.iteration,
        finished_request_ids=output.finished_request_ids,
        coordinator_id=coordinator_id,
        micro_batch=output.micro_batch,
        drafts_held=drafts_held,
    )
    for item in output.scheduled:
        s = item.request.sampling
        held = item.num_draft_tokens if item.drafts_held else 0
        pb = msg.requests.add(
            request_id=item.request.request_id,
            num_computed_tokens=item.num_computed_tokens,
            token_ids=item.token_ids[: len(item.token_ids) - held],
            num_draft_tokens=item.num_draft_tokens - held,
            num_held_drafts=held,
            sample=item.sample,
            next_token_id=item.next_token_id,
            sampling=common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed),
            num_spec_tokens=item.num_spec_tokens,
        )
        if item.draft_probs is not None:
            pb.draft_probs.CopyFrom(item.draft_probs)
    return msg


def verify_results(response: verifier_pb2.VerifyResponse) -> list[VerifyResult]:
    return [
        VerifyResult(
            request_id=r.request_id,
            sampled_token_ids=list(r.sampled_token_ids),
            num_rejected=r.num_rejected,
            draft_token_ids=list(r.draft_token_ids),
            draft_probs=r.draft_probs if r.HasField("draft_probs") else None,
            num_draft_tokens=r.num_draft_tokens,
        )
        for r in response.results
    ]
