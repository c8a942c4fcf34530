"""The drafter's answer: drafts per request in request order, q (ids and probabilities) for sampled
drafts only, and the step times."""

import torch

from specsplit.drafter.runner import ProposeItem, ProposeOutput
from specsplit.drafter.servicer import propose_response
from specsplit.transport.wire import tensor_from_proto


def test_drafts_in_request_order_with_q_for_sampled_requests_only():
    items = [ProposeItem("a", 0, [1], 2), ProposeItem("b", 0, [1], 3, 0.7), ProposeItem("c", 0, [1], 1, 0.5)]
    q_b = (torch.arange(6).view(3, 2), torch.rand(3, 2, dtype=torch.float64))
    q_c = (torch.tensor([[9, 8]]), torch.tensor([[0.25, 0.75]]))
    out = ProposeOutput([[1, 2], [3, 4, 5], [6]], (10, 15, 19), [None, q_b, q_c])
    response = propose_response(items, out, received_ns=7)
    assert (response.received_ns, response.step0_ns, response.later_steps_ns) == (7, 5, 4)
    assert [(d.request_id, list(d.token_ids)) for d in response.drafts] == [("a", [1, 2]), ("b", [3, 4, 5]), ("c", [6])]
    assert not response.drafts[0].HasField("draft_probs")
    for d, (ids, probs) in zip(response.drafts[1:], [q_b, q_c]):
        got_ids = tensor_from_proto(d.draft_probs.token_ids, expected_dtype=torch.int32)
        got_probs = tensor_from_proto(d.draft_probs.probs, expected_dtype=torch.float32)
        assert torch.equal(got_ids, ids.to(torch.int32)) and torch.equal(got_probs, probs.to(torch.float32))


def test_a_request_whose_output_the_drafter_lacked_asks_for_the_whole_of_it():
    items = [ProposeItem("a", 0, [1], 1, grammar="g"), ProposeItem("b", 0, [1], 1, grammar="g", output_offset=4)]
    out = ProposeOutput([[1], [2]], (0, 0, 0), outputs_wanted=[1])
    assert [d.output_wanted for d in propose_response(items, out, received_ns=0).drafts] == [False, True]
