"""Sparse draft distributions in a VerifyRequest: laid out as one batch q, and every bad tensor or value
refused with INVALID_ARGUMENT naming the request (tensors as the message is converted, `wire.verify_batch`; values
once for the whole batch, as it is built)."""

import math

import pytest
import torch

from specsplit.client.errors import InvalidArgument
from specsplit.proto import common_pb2, verifier_pb2
from specsplit.transport.wire import tensor_to_proto
from specsplit.verifier.input_batch import build_input_batch
from specsplit.verifier.wire import verify_batch

VOCAB = 50


def request(msg, rid, drafts, q=None):
    """A decode request with `drafts`; q = (ids, probs) as nested lists, or None (greedy drafts)."""
    r = msg.requests.add(
        request_id=rid,
        token_ids=[7, *drafts],
        num_draft_tokens=len(drafts),
        sample=True,
        sampling=common_pb2.SamplingParams(temperature=0.0 if q is None else 1.0),
    )
    if q is not None:
        r.draft_probs.token_ids.CopyFrom(tensor_to_proto(torch.tensor(q[0], dtype=torch.int32)))
        r.draft_probs.probs.CopyFrom(tensor_to_proto(torch.tensor(q[1], dtype=torch.float32)))


def build(msg):
    return build_input_batch(verify_batch(msg), vocab_size=VOCAB, max_model_len=64, num_cached_tokens=lambda rid: 0)


def test_batch_q_pads_to_the_widest_request_and_makes_greedy_drafts_one_hot():
    msg = verifier_pb2.VerifyRequest(iteration=1)
    request(msg, "a", [3, 4], ([[3, 9, 1], [4, 2, -1]], [[0.5, 0.3, 0.2], [0.9, 0.1, 0.0]]))
    request(msg, "b", [5])  # greedy drafts: no q
    request(msg, "c", [6], ([[6, 8]], [[0.6, 0.4]]))
    q = build(msg).draft_probs
    assert q.ids.tolist() == [[3, 9, 1], [4, 2, -1], [5, -1, -1], [6, 8, -1]]
    expected = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.1, 0.0], [1.0, 0, 0], [0.6, 0.4, 0]])
    torch.testing.assert_close(q.probs, expected)


def test_no_request_with_q_means_no_batch_q():
    msg = verifier_pb2.VerifyRequest(iteration=1)
    request(msg, "a", [3, 4])
    assert build(msg).draft_probs is None


@pytest.mark.parametrize(
    ("q", "message"),
    [
        (([[VOCAB]], [[1.0]]), "ids outside the vocabulary or non-finite probs"),
        (([[-2]], [[1.0]]), "ids outside the vocabulary or non-finite probs"),
        (([[6]], [[math.nan]]), "ids outside the vocabulary or non-finite probs"),
        (([[6]], [[math.inf]]), "ids outside the vocabulary or non-finite probs"),
        (([[6, 7]], [[1.2, -0.2]]), "negative probabilities"),
    ],
)
def test_bad_values_are_refused_naming_their_request(q, message):
    msg = verifier_pb2.VerifyRequest(iteration=1)
    request(msg, "good", [3, 4], ([[3], [4]], [[1.0], [1.0]]))
    request(msg, "greedy", [5])
    request(msg, "bad", [6], q)
    with pytest.raises(InvalidArgument, match=f"request 'bad': draft_probs has {message}"):
        build(msg)


def test_bad_shapes_are_refused():
    msg = verifier_pb2.VerifyRequest(iteration=1)
    request(msg, "short", [3, 4], ([[3]], [[1.0]]))  # one q row for two drafts
    with pytest.raises(InvalidArgument, match=r"request 'short': draft_probs must be two \[>= 2, K\] tensors"):
        build(msg)


@pytest.mark.parametrize(
    ("field", "tensor", "message"),
    [
        ("token_ids", torch.tensor([[6]], dtype=torch.int64), "tensor dtype is torch.int64, expected torch.int32"),
        ("probs", torch.tensor([[1.0]], dtype=torch.float16), "tensor dtype is torch.float16, expected torch.float32"),
        ("probs", None, "tensor data has 3 bytes, expected 4"),
    ],
)
def test_badly_encoded_tensors_are_refused_naming_their_request(field, tensor, message):
    msg = verifier_pb2.VerifyRequest(iteration=1)
    request(msg, "good", [3], ([[3]], [[1.0]]))
    request(msg, "bad", [6], ([[6]], [[1.0]]))
    bad = getattr(msg.requests[1].draft_probs, field)
    if tensor is None:
        bad.data = bad.data[:3]  # one float32 element's shape with 3 bytes of data
    else:
        bad.CopyFrom(tensor_to_proto(tensor))
    with pytest.raises(InvalidArgument, match=f"request 'bad': draft_probs: {message}"):
        verify_batch(msg)
