"""The verifier's messages and its dataclasses (`specsplit/verifier/wire.py`): a VerifyRequest becomes the step's
VerifyBatch field for field (unset optional sampling fields read as off, set zeros kept), a drafter's answer is merged
with its q decoded, and a step's outcome becomes the VerifyResponse (logprobs included, unfilled placeholders counted
as rejected)."""

from types import SimpleNamespace

import pytest
import torch

from specsplit.client.results import TokenLogprobs
from specsplit.proto import common_pb2, drafter_pb2, verifier_pb2
from specsplit.transport.wire import tensor_to_proto
from specsplit.verifier.batch import Sampling, VerifyBatch, VerifyItem
from specsplit.verifier.input_batch import build_input_batch
from specsplit.verifier.logits_processors import LogitsOptions
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.runner import StepOutput
from specsplit.verifier.wire import merge_replica_drafts, sampling_of, verify_batch, verify_response

IDS = [[3, 9], [4, 2]]
PROBS = [[0.75, 0.25], [0.5, 0.5]]


def q_message() -> common_pb2.DraftProbs:
    return common_pb2.DraftProbs(
        token_ids=tensor_to_proto(torch.tensor(IDS, dtype=torch.int32)),
        probs=tensor_to_proto(torch.tensor(PROBS, dtype=torch.float32)),
    )


def test_a_verify_request_becomes_the_steps_batch_field_for_field():
    sampling = common_pb2.SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=11, repetition_penalty=1.3, presence_penalty=0.5,
        frequency_penalty=-0.25, min_tokens=4, end_token_ids=[1, 2], logprobs=3, coupled=True,
    )  # fmt: skip
    msg = verifier_pb2.VerifyRequest(iteration=7, coordinator_id="c1", finished_request_ids=["old"])
    msg.requests.add(
        request_id="a", num_computed_tokens=6, token_ids=[1, 3, 4], num_draft_tokens=2, sample=True,
        sampling=sampling, num_spec_tokens=3, draft_probs=q_message(), num_prompt_tokens=5,
    )  # fmt: skip
    msg.requests.add(request_id="b", token_ids=[8, 9], next_token_id=10, num_held_drafts=0)
    msg.requests.add(request_id="c", num_computed_tokens=2, token_ids=[5], sample=True, num_held_drafts=2)
    got = verify_batch(msg)
    a_q = got.requests[0].draft_probs
    assert a_q.token_ids.tolist() == IDS and a_q.probs.tolist() == PROBS
    got.requests[0].draft_probs = None  # tensors compared above
    assert got == VerifyBatch(
        iteration=7,
        coordinator_id="c1",
        finished_request_ids=["old"],
        requests=[
            VerifyItem(
                "a", 6, [1, 3, 4], num_draft_tokens=2, sample=True, num_spec_tokens=3, num_prompt_tokens=5,
                sampling=Sampling(
                    temperature=pytest.approx(0.7), top_p=pytest.approx(0.9), top_k=5, seed=11, coupled=True,
                    repetition_penalty=pytest.approx(1.3), presence_penalty=0.5, frequency_penalty=-0.25,
                    min_tokens=4, end_token_ids=(1, 2), logprobs=3,
                ),
            ),
            VerifyItem("b", 0, [8, 9], sample=False, next_token_id=10),
            VerifyItem("c", 2, [5], sample=True, num_held_drafts=2),
        ],
    )  # fmt: skip


def test_unset_sampling_fields_read_as_off_and_set_zeros_are_kept():
    assert sampling_of(common_pb2.SamplingParams()) == Sampling()
    zeros = common_pb2.SamplingParams(top_p=1.0, seed=0, repetition_penalty=1.0, logprobs=0)
    assert sampling_of(zeros) == Sampling(seed=0, repetition_penalty=1.0, logprobs=0)
    # logprobs=0 asks for the emitted token's own log-probability; unset asks for nothing.
    assert LogitsOptions.of(sampling_of(common_pb2.SamplingParams(logprobs=0))).logprobs == 0
    assert LogitsOptions.of(sampling_of(common_pb2.SamplingParams())) is None
    # A sampled request with top_p unset filters nothing: the sampler may skip its top-k / top-p pass.
    msg = verifier_pb2.VerifyRequest(iteration=1)
    msg.requests.add(
        request_id="r", token_ids=[5, 6], num_draft_tokens=1, sample=True,
        sampling=common_pb2.SamplingParams(temperature=0.7),
    )  # fmt: skip
    batch = build_input_batch(verify_batch(msg), vocab_size=100, max_model_len=64, num_cached_tokens=lambda rid: 0)
    assert not batch.all_greedy and not batch.any_filter and batch.top_p.tolist() == [1.0]


def test_q_of_a_request_without_drafts_is_not_read():
    """The coordinator may trim a request's drafts to none: its q is then neither decoded nor refused."""
    msg = verifier_pb2.VerifyRequest(iteration=1)
    r = msg.requests.add(request_id="a", token_ids=[5], sample=True)
    r.draft_probs.token_ids.shape.extend([1, 1])  # no dtype, no data: refused wherever it is decoded
    assert verify_batch(msg).requests[0].draft_probs is None


def test_a_replicas_drafts_go_to_their_requests_with_q_decoded():
    proposal = Proposal(True, [[], [], []], draft_probs=[None] * 3)
    resp = drafter_pb2.ProposeResponse(
        drafts=[
            drafter_pb2.Drafts(request_id="c", token_ids=[3, 4], draft_probs=q_message()),
            drafter_pb2.Drafts(request_id="a", token_ids=[7]),
        ]
    )
    merge_replica_drafts(proposal, [2, 0], resp)
    assert proposal.drafts == [[7], [], [3, 4]]
    q = proposal.draft_probs[2]
    assert q.token_ids.tolist() == IDS and q.probs.tolist() == PROBS
    assert proposal.draft_probs[0] is None and proposal.draft_probs[1] is None


def test_a_steps_outcome_becomes_the_response():
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b"], num_draft_tokens=[2, 0])
    logprobs = [[TokenLogprobs(4, -0.5, ((4, -0.5), (9, -1.25))), TokenLogprobs(5, -0.25)], None]
    step = StepOutput([[4, 5], [6]], [1, 0], [0, 0], [[], []], torch.zeros(0, 2), (10, 11, 13, 16), logprobs)
    proposal = Proposal(False, [[], []], "drafter down", 64, propose_ns=5, sent_ns=20, received_ns=30)
    response = verify_response(batch, step, proposal, received_ns=9, unfilled=[0, 3])
    a, b = response.results
    assert (a.request_id, list(a.sampled_token_ids), a.num_rejected, a.num_draft_tokens) == ("a", [4, 5], 1, 2)
    assert (b.request_id, list(b.sampled_token_ids), b.num_rejected, b.num_draft_tokens) == ("b", [6], 3, 0)
    assert [lp.logprob for lp in a.logprobs] == [-0.5, -0.25] and not b.logprobs
    assert list(a.logprobs[0].top_token_ids) == [4, 9] and list(a.logprobs[0].top_logprobs) == [-0.5, -1.25]
    assert not a.logprobs[1].top_token_ids
    assert (response.drafter_ok, response.drafter_error, response.hidden_state_bytes) == (False, "drafter down", 64)
    t = response.timing
    assert (t.prepare_ns, t.forward_ns, t.sample_ns, t.received_ns) == (1, 2, 3, 9)
    assert (t.propose_ns, t.propose_sent_ns, t.propose_received_ns) == (5, 20, 30)
