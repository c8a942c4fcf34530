"""specsplit.verifier.propose_request: one builder for both kinds of Propose. A device hand-off's items are the
finished step's for the same requests but for their rows: a row count in place of next tokens and rejections (the
device has those); both carry what the drafter reads of a request's sampling and nothing else."""

import torch

from specsplit.proto import common_pb2, drafter_pb2
from specsplit.verifier.batch import Sampling
from specsplit.verifier.propose_request import build_propose

REQS = (["greedy", "seeded", "unseeded"], [4, 9, 2], [3, 2, 1])  # request ids, start positions, drafts wanted
SAMPLING = [
    Sampling(top_p=0.5, seed=5, presence_penalty=0.5, end_token_ids=(0, 1)),
    Sampling(temperature=0.7, top_k=4, seed=11, coupled=True, min_tokens=3, end_token_ids=(0, 1)),
    Sampling(temperature=0.5),
]
NEXT_TOKENS, REJECTED = [[7], [8, 9], [1, 2, 3]], [0, 1, 2]


def _without(item: drafter_pb2.ProposeItem, *fields: str) -> drafter_pb2.ProposeItem:
    copy = drafter_pb2.ProposeItem()
    copy.CopyFrom(item)
    for name in fields:
        copy.ClearField(name)
    return copy


def test_a_hand_off_has_the_finished_steps_items_but_for_their_rows():
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)
    host = build_propose(3, *REQS, SAMPLING, hidden, next_token_ids=NEXT_TOKENS, num_rejected=REJECTED)
    sampled, num_sampled = torch.zeros(3, 4, dtype=torch.int64), torch.ones(3, dtype=torch.int64)
    rows = [len(t) for t in NEXT_TOKENS]
    device = build_propose(3, *REQS, SAMPLING, hidden, num_rows=rows, sampled=sampled, num_sampled=num_sampled)

    assert host.row_offsets == device.row_offsets == [0, 1, 3, 6]
    assert [list(i.next_token_ids) for i in host.items] == NEXT_TOKENS
    assert [i.num_rejected for i in host.items] == REJECTED and all(i.num_rows == 0 for i in host.items)
    assert [i.num_rows for i in device.items] == rows
    assert all(not i.next_token_ids and i.num_rejected == 0 for i in device.items)
    for h, d in zip(host.items, device.items, strict=True):
        assert _without(h, "next_token_ids", "num_rejected") == _without(d, "num_rows")
    assert [(i.request_id, i.start_position, i.num_spec_tokens) for i in host.items] == list(zip(*REQS))
    assert host.sampled is None and device.sampled is sampled and device.num_sampled is num_sampled
    assert host.hidden_states is hidden and device.hidden_states is hidden


def test_only_a_sampled_requests_temperature_and_seed_reach_the_drafter():
    plan = build_propose(1, *REQS, SAMPLING, torch.zeros(6, 2), next_token_ids=NEXT_TOKENS, num_rejected=REJECTED)
    greedy, seeded, unseeded = plan.items
    assert not greedy.HasField("sampling")  # temperature 0: its seed and penalties are the verifier's alone
    assert seeded.sampling == common_pb2.SamplingParams(temperature=0.7, seed=11, coupled=True)
    assert unseeded.sampling == common_pb2.SamplingParams(temperature=0.5) and not unseeded.sampling.HasField("seed")


def test_a_constrained_requests_grammar_and_output_reach_the_drafter():
    """Structured output: the drafter masks its drafts with the request's grammar after its output, which the step
    sends (`StepOutput.grammar_outputs`); a request without a grammar sends neither."""
    sampling = [Sampling(), Sampling(temperature=0.7, seed=11, grammar="start: /[a-z]+/"), Sampling(temperature=0.5)]
    plan = build_propose(
        1, *REQS, sampling, torch.zeros(6, 2), next_token_ids=NEXT_TOKENS, num_rejected=REJECTED,
        grammar_outputs={1: [4, 5, 8, 9]},
    )  # fmt: skip
    greedy, constrained, plain = plan.items
    assert constrained.sampling.grammar == "start: /[a-z]+/" and list(constrained.output_token_ids) == [4, 5, 8, 9]
    assert not greedy.output_token_ids and not plain.output_token_ids and not plain.sampling.grammar
