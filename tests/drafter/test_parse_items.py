"""The drafter's ProposeRequest validation: items as the runner wants them, or INVALID_ARGUMENT naming
the first bad field of the first bad item."""

import math

import pytest

from specsplit.client.errors import InvalidArgument
from specsplit.drafter.runner import ProposeItem
from specsplit.drafter.servicer import parse_items
from specsplit.proto import common_pb2, drafter_pb2

VOCAB = 100
BS = 4  # the MTP cache's block size


def _item(**kw) -> drafter_pb2.ProposeItem:
    base = dict(request_id="a", start_position=3, next_token_ids=[1, 2], num_rejected=1, num_spec_tokens=3)
    return drafter_pb2.ProposeItem(**{**base, **kw})


def test_items_keep_request_order_and_fields():
    sampling = common_pb2.SamplingParams(temperature=0.5, seed=2**64 - 1)
    sampled = _item(request_id="b", next_token_ids=[99], sampling=sampling)
    items = parse_items(drafter_pb2.ProposeRequest(requests=[_item(), sampled]), VOCAB, BS)
    assert items == [ProposeItem("a", 3, [1, 2], 3), ProposeItem("b", 3, [99], 3, 0.5, 2**63 - 1)]


def test_a_constrained_item_carries_its_grammar_and_output():
    sampling = common_pb2.SamplingParams(temperature=0.5, seed=3, coupled=True, grammar="start: /[a-z]+/")
    item = _item(sampling=sampling, output_token_ids=[5, 6, 7], output_offset=9)
    (parsed,) = parse_items(drafter_pb2.ProposeRequest(requests=[item]), VOCAB, BS)
    assert parsed == ProposeItem(
        "a", 3, [1, 2], 3, 0.5, 3, coupled=True, grammar="start: /[a-z]+/", output=[5, 6, 7], output_offset=9
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(request_id=""), "empty or repeated request_id ''"),
        (dict(request_id="a"), "empty or repeated request_id 'a'"),
        (dict(start_position=-1), "request 'x': negative start_position -1"),
        (dict(next_token_ids=[]), "request 'x': no next_token_ids"),
        (dict(next_token_ids=[5, VOCAB]), f"request 'x': token id outside the vocabulary \\[0, {VOCAB}\\)"),
        (dict(next_token_ids=[-1, 5]), "token id outside the vocabulary"),
        (dict(num_rejected=65), "request 'x': num_rejected 65 not in \\[0, 64\\]"),
        (dict(num_spec_tokens=-1), "request 'x': num_spec_tokens -1 not in \\[0, 64\\]"),
        (dict(sampling=common_pb2.SamplingParams(temperature=-0.5)), "request 'x': temperature -0.5 not in"),
        (dict(sampling=common_pb2.SamplingParams(temperature=math.nan)), "request 'x': temperature nan not in"),
        (dict(output_offset=-2), "request 'x': negative output_offset -2"),
        (dict(start_position=-1, num_rejected=65), "negative start_position"),  # the first check that fails
    ],
)
def test_a_bad_item_is_refused_naming_its_first_bad_field(bad, message):
    msg = drafter_pb2.ProposeRequest(requests=[_item(), _item(**{"request_id": "x", **bad})])
    with pytest.raises(InvalidArgument, match=message):
        parse_items(msg, VOCAB, BS)


def _device_request(*items, width: int = 4) -> drafter_pb2.ProposeRequest:
    msg = drafter_pb2.ProposeRequest(requests=list(items))
    msg.hidden_states_handle.tokens_on_device = True
    msg.hidden_states_handle.token_width = width
    return msg


def _device_item(**kw) -> drafter_pb2.ProposeItem:
    base = dict(request_id="a", start_position=3, num_spec_tokens=3, num_rows=4)
    return drafter_pb2.ProposeItem(**{**base, **kw})


def test_device_hand_off_items_carry_rows_and_no_tokens():
    items = parse_items(_device_request(_device_item(), _device_item(request_id="b", num_rows=2)), VOCAB, BS)
    assert items == [ProposeItem("a", 3, [], 3, num_rows=4), ProposeItem("b", 3, [], 3, num_rows=2)]


def test_a_constrained_device_hand_off_item_carries_its_grammar_and_output_before_the_step():
    sampling = common_pb2.SamplingParams(grammar="start: /[a-z]+/")
    (item,) = parse_items(_device_request(_device_item(sampling=sampling, output_token_ids=[5, 6])), VOCAB, BS)
    assert item == ProposeItem("a", 3, [], 3, num_rows=4, grammar="start: /[a-z]+/", output=[5, 6])


def test_num_rows_without_a_device_hand_off_is_refused():
    with pytest.raises(InvalidArgument, match="request 'a': num_rows 2 without a device hand-off"):
        parse_items(drafter_pb2.ProposeRequest(requests=[_item(num_rows=2)]), VOCAB, BS)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(next_token_ids=[1]), "a device hand-off's item has .* no next_token_ids"),
        (dict(num_rejected=1), "no num_rejected"),
        (dict(start_position=-2), "start_position >= 0"),
        (dict(num_rows=0), "num_rows 0 not in \\[1, token_width 4\\]"),
        (dict(num_rows=5), "num_rows 5 not in \\[1, token_width 4\\]"),
        (dict(num_spec_tokens=65), "num_spec_tokens 65 not in \\[0, 64\\]"),
        (dict(sampling=common_pb2.SamplingParams(temperature=-1.0)), "temperature -1.0 not in"),
        (dict(request_id="a"), "empty or repeated request_id 'a'"),
    ],
)
def test_a_bad_device_hand_off_item_is_refused(bad, message):
    msg = _device_request(_device_item(), _device_item(**{"request_id": "x", **bad}))
    with pytest.raises(InvalidArgument, match=message):
        parse_items(msg, VOCAB, BS)


def test_a_device_hand_off_item_with_a_negative_output_offset_is_refused():
    with pytest.raises(InvalidArgument, match="request 'a': negative output_offset -1"):
        parse_items(_device_request(_device_item(output_offset=-1)), VOCAB, BS)
