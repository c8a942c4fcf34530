"""The VerifyResponse of one iteration: per request its sampled tokens, rejections and drafts run; and
the iteration's timing (the Propose's stamps are those of the Propose whose drafts it verified)."""

from __future__ import annotations

from specsplit.proto import verifier_pb2
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.runner import StepOutput


def verify_response(
    batch: InputBatch,
    step: StepOutput,
    proposal: Proposal,
    received_ns: int,
    unfilled: list[int] | None = None,  # per request: held-draft placeholders the step could not fill
) -> verifier_pb2.VerifyResponse:
    """The iteration's results per request (unfilled placeholders count as rejected) and its timing."""
    unfilled = unfilled or [0] * batch.num_reqs
    response = verifier_pb2.VerifyResponse(
        drafter_ok=proposal.ok,
        drafter_error=proposal.error,
        hidden_state_bytes=proposal.hidden_state_bytes,
        timing=verifier_pb2.VerifyTiming(
            prepare_ns=step.prepare_ns,
            forward_ns=step.forward_ns,
            sample_ns=step.sample_ns,
            propose_ns=proposal.propose_ns,
            received_ns=received_ns,
            propose_sent_ns=proposal.sent_ns,
            propose_received_ns=proposal.received_ns,
            drafter_received_ns=proposal.drafter_received_ns,
            drafter_replied_ns=proposal.drafter_replied_ns,
            step0_ns=proposal.step0_ns,
            later_steps_ns=proposal.later_steps_ns,
        ),
    )
    logprobs = step.logprobs
    add, sampled, rejected, drafts = (
        response.results.add,
        step.sampled_token_ids,
        step.num_rejected,
        batch.num_draft_tokens,
    )
    for i, rid in enumerate(batch.req_ids):
        result = add()  # fields set one by one: add(request_id=..., ...) costs several times more
        result.request_id = rid
        result.sampled_token_ids.extend(sampled[i])
        result.num_rejected = rejected[i] + unfilled[i]
        result.num_draft_tokens = drafts[i]
        if logprobs is not None and logprobs[i] is not None:
            result.logprobs.extend(logprobs[i])
    return response
