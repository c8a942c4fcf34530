"""The verifier's messages ↔ its dataclasses: a VerifyRequest into the step's `VerifyBatch`, a drafter's DraftProbs
into `DraftProbs`, and one step's outcome into the VerifyResponse (per request its sampled tokens, rejections and
drafts run; the iteration's timing, whose Propose stamps are those of the Propose whose drafts it verified)."""

from __future__ import annotations

import torch

from specsplit.client.errors import InvalidArgument
from specsplit.proto import common_pb2, drafter_pb2, verifier_pb2
from specsplit.transport.wire import tensor_from_proto
from specsplit.verifier.batch import DraftProbs, Sampling, VerifyBatch, VerifyItem
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.runner import StepOutput


def sampling_of(sp: common_pb2.SamplingParams) -> Sampling:
    return Sampling(
        temperature=sp.temperature,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k,
        seed=sp.seed if sp.HasField("seed") else None,
        coupled=sp.coupled,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else None,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        min_tokens=sp.min_tokens,
        end_token_ids=tuple(sp.end_token_ids),
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        grammar=sp.grammar or None,
    )


def draft_probs_of(pb: common_pb2.DraftProbs, request_id: str) -> DraftProbs:
    """Raises InvalidArgument naming the request for tensors of the wrong type or encoding."""
    try:
        ids = tensor_from_proto(pb.token_ids, expected_dtype=torch.int32)
        probs = tensor_from_proto(pb.probs, expected_dtype=torch.float32)
    except ValueError as err:
        raise InvalidArgument(f"request {request_id!r}: draft_probs: {err}") from err
    return DraftProbs(ids, probs)


def verify_batch(msg: verifier_pb2.VerifyRequest) -> VerifyBatch:
    items = []
    for r in msg.requests:
        probs = None
        if r.num_draft_tokens and r.HasField("draft_probs"):
            probs = draft_probs_of(r.draft_probs, r.request_id)
        items.append(
            VerifyItem(
                request_id=r.request_id,
                num_computed_tokens=r.num_computed_tokens,
                token_ids=list(r.token_ids),
                num_held_drafts=r.num_held_drafts,
                num_draft_tokens=r.num_draft_tokens,
                draft_probs=probs,
                sample=r.sample,
                next_token_id=r.next_token_id,
                sampling=sampling_of(r.sampling),
                num_spec_tokens=r.num_spec_tokens,
                num_prompt_tokens=r.num_prompt_tokens,
                cached_block_hashes=list(r.cached_block_hashes),
                drafter_block_hashes=list(r.drafter_block_hashes),
                cached_token_ids=list(r.cached_token_ids),
            )
        )
    return VerifyBatch(
        msg.iteration,
        items,
        list(msg.finished_request_ids),
        msg.coordinator_id,
        msg.reset_prefix_cache,
        [(b.request_id, b.block_index, b.block_hash, b.drafter_block_hash) for b in msg.registered_blocks],
        list(msg.evicted_block_hashes),
    )


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
            result.logprobs.extend(lp.to_pb() for lp in logprobs[i])
    return response


def merge_replica_drafts(proposal: Proposal, indices: list[int], resp: drafter_pb2.ProposeResponse) -> None:
    """A drafter replica's answer (for the batch's requests at `indices`) into the iteration's proposal."""
    for i, d in zip(indices, resp.drafts):
        proposal.drafts[i] = list(d.token_ids)
        proposal.draft_probs[i] = draft_probs_of(d.draft_probs, d.request_id) if d.HasField("draft_probs") else None
        if d.output_wanted:
            proposal.outputs_wanted.append(d.request_id)
