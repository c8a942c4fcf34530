"""DrafterChannel.device_plan: a launched step's Propose as a device hand-off (sent before the step
finishes). Only where the transport takes hand-offs and every request is a greedy decode step that
wants drafts; its items carry their row counts and start positions, its tokens stay on the device."""

import types

import pytest
import torch
from opentelemetry import trace

from specsplit.models.loader import load_target
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.transport.base import HiddenStatesSender
from specsplit.verifier.batch import Sampling, VerifyBatch, VerifyItem
from specsplit.verifier.channels import make_channel
from specsplit.verifier.drafter_channel import PendingPropose
from specsplit.verifier.input_batch import build_input_batch
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.runner import VerifierRunner
from specsplit.verifier.step import HeldStep, VerifierStep
from tests.fixtures.tiny import write_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 3]


class HandOffSender(HiddenStatesSender):
    name = "cuda_ipc"
    device_hand_off = True

    def __init__(self, open_for_rows: int = 64):
        self.open_for_rows = open_for_rows

    def needs_open(self, hidden_states):
        return hidden_states.shape[0] > self.open_for_rows


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model = load_target(write_tiny_checkpoint(tmp_path_factory.mktemp("v") / "m", architecture="qwen3", seed=3))
    runner = VerifierRunner(model, model.make_kv_cache(64, 4), sampler_backend="reference")
    for rid in "ab":  # both prompts prefilled: the next steps are decode steps
        runner.step(batch(runner, [(rid, 0, PROMPT, 0, True, 2)]))
    return runner


def batch(runner, reqs, temperature: float = 0.0):
    items = [
        VerifyItem(
            request_id=rid,
            num_computed_tokens=computed,
            token_ids=list(tokens),
            num_draft_tokens=drafts,
            sample=sample,
            next_token_id=0 if sample else tokens[-1],
            sampling=Sampling(temperature=temperature),
            num_spec_tokens=spec,
        )
        for rid, computed, tokens, drafts, sample, spec in reqs
    ]
    msg = VerifyBatch(iteration=1, requests=items)
    return build_input_batch(
        msg, vocab_size=runner.model.config.vocab_size, max_model_len=256, num_cached_tokens=runner.kv_cache.num_tokens
    )


def plan_of(runner, reqs, sender=None, temperature: float = 0.0):
    client = make_channel("127.0.0.1:1", transport=sender or HandOffSender())
    launched = runner.launch(batch(runner, reqs, temperature))
    sampling = [Sampling(temperature=temperature)] * len(reqs)
    try:
        return launched, client.device_plan(7, launched, sampling)
    finally:
        runner.finish(launched)
        runner.free([r[0] for r in reqs])  # the module's requests start again from their prompts
        for rid in "ab":
            runner.step(batch(runner, [(rid, 0, PROMPT, 0, True, 2)]))


def test_greedy_decode_steps_go_as_a_device_hand_off(runner):
    n = len(PROMPT)
    launched, plan = plan_of(runner, [("a", n, [1, 2, 3], 2, True, 2), ("b", n, [4, 5], 1, True, 3)])
    assert plan is not None and plan.iteration == 7
    assert [(i.request_id, i.start_position, i.num_rows, i.num_spec_tokens) for i in plan.items] == [
        ("a", n, 3, 2),
        ("b", n, 2, 3),
    ]
    assert all(not i.next_token_ids and i.num_rejected == 0 for i in plan.items)
    assert plan.row_offsets == [0, 3, 5]
    assert plan.sampled is launched.sampled and plan.num_sampled is launched.num_sampled
    assert torch.equal(plan.hidden_states, launched.hidden[:5])


@pytest.mark.parametrize(
    "reqs, sender, temperature",
    [
        ([("a", 6, [1, 2, 3], 2, True, 2)], HandOffSender(), 0.8),  # sampled drafts
        ([("a", 6, [1, 2, 3], 2, True, 0)], HandOffSender(), 0.0),  # no drafts wanted
        ([("a", 6, [1, 2, 3], 2, True, 2), ("c", 0, PROMPT, 0, True, 2)], HandOffSender(), 0.0),  # a prefill
        ([("a", 6, [1, 2, 3], 2, True, 2)], HandOffSender(open_for_rows=2), 0.0),  # the slots must grow first
        ([("a", 6, [1, 2, 3], 2, True, 2)], type("Off", (HandOffSender,), {"device_hand_off": False})(), 0.0),
    ],
    ids=["sampled", "no-drafts-wanted", "with-a-prefill", "transport-must-reopen", "transport-without-hand-off"],
)
def test_other_steps_wait_for_their_tokens_on_the_host(runner, reqs, sender, temperature):
    _, plan = plan_of(runner, reqs, sender, temperature)
    assert plan is None


def test_a_hand_off_answered_before_its_step_finished_is_held_once_it_has():
    """The device hand-off's Propose goes before the step finishes: an answer (or a failed send) that
    comes first is held back until the step's output exists, then kept exactly once."""
    kept = []
    worker = types.SimpleNamespace(keep=lambda batch, step, drafts, *_: kept.append((batch, step, drafts)))
    step = VerifierStep(worker, make_channel("127.0.0.1:1", transport=HandOffSender()))
    held = HeldStep("batch")
    pending = types.SimpleNamespace(context=held, proposal=types.SimpleNamespace(drafts=[[4, 5]], draft_probs=None))
    step._keep_answered(pending)
    assert kept == [] and held.answered is pending
    assert held.finished("step", step._keep_answered) == "step"
    assert kept == [("batch", "step", [[4, 5]])]
    later = HeldStep("batch 2", "step 2")  # the host path: the step is there when the answer comes
    step._keep_answered(types.SimpleNamespace(context=later, proposal=pending.proposal))
    assert kept[-1] == ("batch 2", "step 2", [[4, 5]])


def test_finishing_without_rows_gives_the_same_tokens_and_queues_no_row_copy(runner):
    """A device hand-off finishes its step without the drafter's rows (it sent them already): the same
    sampled tokens and counts as the whole step, and an empty view of the step's hidden states."""
    n = len(PROMPT)
    reqs = [("a", n, [1, 2, 3], 2, True, 2), ("b", n, [4, 5], 1, True, 3)]
    launched = runner.launch(batch(runner, reqs))
    lean = runner.finish(launched, with_rows=False)
    whole = runner.finish(launched)
    assert lean.sampled_token_ids == whole.sampled_token_ids and lean.num_rejected == whole.num_rejected
    assert lean.next_token_ids == whole.next_token_ids and lean.start_positions == whole.start_positions
    assert lean.hidden_states.shape == (0, launched.hidden.shape[1])
    assert lean.hidden_states.untyped_storage().data_ptr() == launched.hidden.untyped_storage().data_ptr()
    assert whole.hidden_states.shape[0] == sum(len(t) for t in whole.next_token_ids)
    runner.free(["a", "b"])
    for rid in "ab":
        runner.step(batch(runner, [(rid, 0, PROMPT, 0, True, 2)]))


def test_a_propose_message_is_built_once_and_carries_only_what_the_drafter_reads():
    """The first message of every request is the plan's own ProposeRequest (no per-item copies), with the frees;
    a later one (another replica's share, a retry) is a copy. Items carry a sampled request's temperature and seed
    and nothing of a greedy one's sampling (penalties and end tokens are the verifier's)."""
    client = make_channel("127.0.0.1:1")
    batch = types.SimpleNamespace(req_ids=["g", "s"], num_spec_tokens=[3, 2])
    step = types.SimpleNamespace(
        start_positions=[4, 9],
        next_token_ids=[[7], [8, 9]],
        num_rejected=[0, 1],
        hidden_states=torch.zeros(3, 2),
        grammar_outputs=None,
        sampled_token_ids=[[7], [8, 9]],
    )
    sampling = [
        Sampling(temperature=0.0, top_p=0.5, seed=5, end_token_ids=(0, 1), presence_penalty=0.5),
        Sampling(temperature=0.7, top_k=4, seed=11, end_token_ids=(0, 1), min_tokens=3),
    ]
    plan = client.build_request(3, batch, step, sampling)
    assert plan.row_offsets == [0, 1, 3]
    first = plan.message([0, 1], ["done"])
    assert first.iteration == 3 and list(first.finished_request_ids) == ["done"]
    g, s = first.requests
    assert (g.request_id, g.start_position, list(g.next_token_ids), g.num_rejected, g.num_spec_tokens) == (
        "g", 4, [7], 0, 3
    )  # fmt: skip
    assert not g.HasField("sampling")
    assert s.sampling == common_pb2.SamplingParams(temperature=0.7, seed=11) and list(s.next_token_ids) == [8, 9]
    again = plan.message([0, 1], [])
    assert again is not first and list(again.requests) == list(first.requests) and not again.finished_request_ids
    assert [r.request_id for r in plan.message([1], []).requests] == ["s"]


def test_a_constrained_step_goes_as_a_hand_off_with_its_grammar_and_output_before_the_step(runner):
    """Structured output: the drafter masks its drafts after the request's output, which ends before the step here
    (the step has not finished when its hand-off is sent); the drafter adds the step's tokens from the device."""
    n, grammar = len(PROMPT), "start: /[a-z]+/"
    client = make_channel("127.0.0.1:1", transport=HandOffSender())
    launched = runner.launch(batch(runner, [("a", n, [1, 2, 3], 2, True, 2), ("b", n, [4, 5], 1, True, 3)]))
    launched.grammar_outputs = {1: [9, 10]}  # the worker's: b is constrained, its output before this step
    sampling = [Sampling(), Sampling(grammar=grammar)]
    try:
        plan = client.device_plan(7, launched, sampling)
    finally:
        runner.finish(launched)
        runner.free(["a", "b"])
        for rid in "ab":
            runner.step(batch(runner, [(rid, 0, PROMPT, 0, True, 2)]))
    assert plan is not None
    a, b = plan.items
    assert b.sampling.grammar == grammar and list(b.output_token_ids) == [9, 10] and b.num_rows == 2
    assert not a.sampling.grammar and not a.output_token_ids


def test_a_constrained_requests_proposes_carry_the_output_past_what_its_drafter_followed():
    """Each Propose of a constrained request carries its output past what its earlier Proposes carried
    (`output_offset`): the first all of it, the next the steps' tokens since (a hand-off's before its step, whose tokens
    the drafter reads from the device and the next Propose carries again for the drafter to compare). After a failed
    Propose, a drafter that asked for the whole output, or a free, the next one carries the whole output again."""
    client = make_channel("127.0.0.1:1")
    batch_ = types.SimpleNamespace(req_ids=["c", "u"], num_spec_tokens=[3, 3])
    sampling = [Sampling(grammar="start: /[a-z]+/"), Sampling()]

    def propose(output: list[int], step_tokens: list[int]) -> drafter_pb2.ProposeItem:
        step = types.SimpleNamespace(
            start_positions=[4, 4],
            next_token_ids=[step_tokens, [1]],
            num_rejected=[0, 0],
            hidden_states=torch.zeros(len(step_tokens) + 1, 2),
            grammar_outputs={0: output},
            sampled_token_ids=[step_tokens, [1]],
        )
        plan = client.build_request(1, batch_, step, sampling)
        assert plan.constrained == ["c"] and not plan.items[1].output_token_ids
        return plan.items[0]

    def answered(ok: bool, wanted: list[str] = ()) -> None:
        pending = PendingPropose(None, 2, 0, trace.INVALID_SPAN, lambda p: None, constrained=["c"])
        client.answered(pending, Proposal(ok, [[], []], outputs_wanted=list(wanted)))

    def carried(item: drafter_pb2.ProposeItem) -> tuple[int, list[int]]:
        return item.output_offset, list(item.output_token_ids)

    assert carried(propose([5, 6], [7])) == (0, [5, 6, 7])
    answered(True)
    assert carried(propose([5, 6, 7], [8, 9])) == (3, [8, 9])
    answered(True)
    assert carried(propose([5, 6, 7, 8, 9], [10])) == (5, [10])
    answered(False)  # a failed Propose: the drafter may not have followed it
    assert carried(propose([5, 6, 7, 8, 9, 10], [11])) == (0, [5, 6, 7, 8, 9, 10, 11])
    answered(True, wanted=["c"])  # the drafter lacked it (restarted, another replica)
    assert carried(propose([5, 6, 7, 8, 9, 10, 11], [12])) == (0, [5, 6, 7, 8, 9, 10, 11, 12])
    answered(True)
    client.free(["c"])
    assert carried(propose([1], [2])) == (0, [1, 2])  # a new request of that id


def test_a_hand_offs_output_ends_before_its_step_and_the_next_propose_carries_the_step_again(runner):
    """A device hand-off carries the output before its step (the drafter reads the step's tokens on the device);
    what it carried is where the next Propose starts, so that one carries the hand-off step's tokens again, which the
    drafter compares with those it read."""
    n, grammar = len(PROMPT), "start: /[a-z]+/"
    client = make_channel("127.0.0.1:1", transport=HandOffSender())
    launched = runner.launch(batch(runner, [("b", n, [4, 5], 1, True, 3)]))
    launched.grammar_outputs = {0: [9, 10]}
    try:
        plan = client.device_plan(7, launched, [Sampling(grammar=grammar)])
    finally:
        runner.finish(launched)
        runner.free(["b"])
        runner.step(batch(runner, [("b", 0, PROMPT, 0, True, 2)]))
    (item,) = plan.items
    assert (item.output_offset, list(item.output_token_ids)) == (0, [9, 10])
    step = types.SimpleNamespace(
        start_positions=[n],
        next_token_ids=[[3]],
        num_rejected=[0],
        hidden_states=torch.zeros(1, 2),
        grammar_outputs={0: [9, 10, 11, 12]},  # the hand-off step emitted 11, 12
        sampled_token_ids=[[3]],
    )
    (item,) = client.build_request(
        8, types.SimpleNamespace(req_ids=["b"], num_spec_tokens=[1]), step, [Sampling(grammar=grammar)]
    ).items
    assert (item.output_offset, list(item.output_token_ids)) == (2, [11, 12, 3])
