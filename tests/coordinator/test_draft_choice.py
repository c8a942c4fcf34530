"""Adaptive speculation: the chooser of per-request draft counts, its cost model and its acceptance estimates, and
the scheduler asking the drafter for the chosen counts."""

import time

import pytest

from specsplit.coordinator import draft_choice
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.draft_acceptance import PositionCounts
from specsplit.coordinator.draft_choice import DraftChooser
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from specsplit.coordinator.step_cost import StepCostModel
from specsplit.coordinator.wire import verify_request


def linear_costs(
    model: StepCostModel, fixed_s: float, per_token_s: float, tokens: list[int], propose_s: float = 0.0
) -> None:
    """Iterations with and without a Propose (costing `propose_s`) at each token count."""
    for t in tokens:
        for _ in range(3):
            model.record(t, 0, fixed_s + per_token_s * t, proposed=False)
            model.record(t, 0, fixed_s + per_token_s * t + propose_s)


def counts(acceptance: float, positions: int = 5, n: int = 200) -> PositionCounts:
    """A request's counts: each position reached n times, accepted `acceptance` of them."""
    return PositionCounts([n] * positions, [round(n * acceptance)] * positions)


def test_before_any_timing_every_request_gets_its_cap():
    chooser = DraftChooser()
    assert chooser.choose([5, 3, 0], [PositionCounts()] * 3) == [5, 3, 0]


def test_low_acceptance_gets_no_drafts():
    chooser = DraftChooser()
    linear_costs(chooser.costs, 0.010, 0.0001, [8, 16, 24, 48])
    low = counts(0.05)
    assert chooser.choose([5] * 8, [low] * 8) == [0] * 8


def test_high_acceptance_and_cheap_tokens_get_the_maximum():
    chooser = DraftChooser()
    linear_costs(chooser.costs, 0.010, 0.00001, [8, 16, 32, 48])
    high = counts(0.95)
    assert chooser.choose([5] * 8, [high] * 8) == [5] * 8


def test_mixed_batch_gets_per_request_counts():
    chooser = DraftChooser()
    linear_costs(chooser.costs, 0.010, 0.0004, [16, 32, 64, 96])
    high, low = counts(0.9), counts(0.1)
    chosen = chooser.choose([5] * 16, [high] * 8 + [low] * 8)
    assert all(n >= 2 for n in chosen[:8]), chosen
    assert chosen[8:] == [0] * 8, chosen


def test_expensive_tokens_cut_the_draft_count():
    """At 0.6 acceptance, cheap tokens pay for every draft; tokens costing as much as the fixed part do not."""
    chooser = DraftChooser()
    mid = counts(0.6)
    linear_costs(chooser.costs, 0.010, 0.00001, [32, 64, 128, 192])
    many = sum(chooser.choose([5] * 32, [mid] * 32))
    chooser = DraftChooser()
    linear_costs(chooser.costs, 0.010, 0.0005, [32, 64, 128, 192])
    few = sum(chooser.choose([5] * 32, [mid] * 32))
    assert many == 5 * 32 and few < 32


def test_cost_model_learns_a_linear_cost():
    model = StepCostModel()
    for step in range(400):
        tokens, later = 8 + (step * 37) % 40, step % 5
        model.record(tokens, later, 0.004 + 0.0002 * tokens + 0.0005 * later, later_steps_s=0.0005 * later)
    curve = model.curve()
    assert curve.later_step_s == pytest.approx(0.0005)
    for tokens in (8, 20, 33, 47):
        for later in (0, 2, 4):
            assert curve.iteration_s(tokens, later) == pytest.approx(0.004 + 0.0002 * tokens + 0.0005 * later, 0.02)
    # Outside what was measured: flat below, in proportion to T above.
    assert curve.base_s(2) == pytest.approx(curve.base_s(8))
    assert curve.base_s(94) == pytest.approx(0.004 + 0.0002 * 94, 0.02)  # above: the line continued


def test_a_proposes_cost_is_learned_where_iterations_with_and_without_one_meet():
    model = StepCostModel()
    for t in (8, 16, 32):
        model.record(t, 0, 0.010 + 0.0001 * t + (0.003 if t == 32 else 0.0), proposed=t == 32)
    model.record(16, 0, 0.0116 + 0.003)  # the first iteration of drafting again: verifies none, proposes
    curve = model.curve()
    assert model.propose_s == pytest.approx(0.003)
    assert curve.iteration_s(16, 0, proposed=False) == pytest.approx(0.0116)
    assert curve.iteration_s(16, 0) == pytest.approx(0.0146)
    assert curve.base_s(32) == pytest.approx(0.0132)  # measured with a Propose only: less its cost
    chooser = DraftChooser()
    chooser.costs = model
    # At acceptance 0.3 one draft each gains 30 % more tokens for 2 % more tokens run, but the Propose costs 26 %.
    assert chooser.choose([3] * 8, [counts(0.3)] * 8) == [0] * 8
    assert chooser.choose([3] * 8, [counts(0.9)] * 8) != [0] * 8


def test_a_proposes_cost_measured_apart_is_taken_as_it_is():
    model = StepCostModel()
    model.record(48, 2, 0.0130, later_steps_s=0.001, propose_s=0.0015)  # the services' wait for the Propose, less
    assert model.propose_s == pytest.approx(0.0015)  # its later steps
    curve = model.curve()
    assert curve.iteration_s(48, 2, proposed=False) == pytest.approx(0.0130 - 0.001 - 0.0015)
    assert curve.iteration_s(48, 2) == pytest.approx(0.0130)


def test_iterations_without_drafts_are_tried_until_a_proposes_cost_is_known():
    chooser = DraftChooser()
    chooser.costs.record(32, 0, 0.0103)  # batch 8 at k = 3, with a Propose
    high = counts(0.95)
    assert chooser.choose([3] * 8, [high] * 8) == [0] * 8  # the probe
    chooser.costs.record(32, 0, 0.0100, proposed=False)  # verifying the drafts held, no Propose
    assert chooser.costs.propose_s == pytest.approx(0.0003)
    assert chooser.choose([3] * 8, [high] * 8) == [3] * 8
    chooser = DraftChooser()
    chooser.costs.record(8, 0, 0.0100, proposed=False)  # only iterations without one so far (no drafter, say)
    assert chooser.choose([3] * 8, [high] * 8) == [3] * 8  # then one with: the cap


def test_every_request_gets_one_draft_more_every_so_many_choices():
    chooser = DraftChooser()
    linear_costs(chooser.costs, 0.010, 0.001, [4, 8, 24])
    low = counts(0.05)
    n = 4 * draft_choice.EXPLORE_EVERY  # nobody drafts: the rarer exploration
    chosen = [chooser.choose([5, 5, 5, 0], [low] * 4) for _ in range(n)]
    assert chosen[:-1] == [[0] * 4] * (n - 1)
    assert chosen[-1] == [1, 1, 1, 0]
    chooser = DraftChooser()
    linear_costs(chooser.costs, 0.010, 0.00001, [8, 16, 32, 48])
    chooser.costs.record(48, 1, 0.0115, later_steps_s=0.0015)  # drafter steps after step 0 cost 1.5 ms each
    caps, mid = [5, 1, 5, 5, 5, 5, 5, 5], counts(0.6)
    n = draft_choice.EXPLORE_EVERY
    chosen = [chooser.choose(caps, [mid] * 8) for _ in range(n)]
    assert 1 < max(chosen[0]) < 5, chosen[0]  # deep drafts do not pay for their drafter steps at 0.6
    assert chosen[-2] == chosen[0] and chosen[-1] == [min(c + 1, cap) for c, cap in zip(chosen[0], caps)]


def test_a_slow_measurement_cannot_make_fewer_tokens_dearer():
    model = StepCostModel()
    linear_costs(model, 0.010, 0.0001, [8, 16, 32])
    model.record(12, 0, 0.5)  # once, in a slow moment
    curve = model.curve()
    assert curve.base_s(12) <= curve.base_s(16) <= curve.base_s(32)


def test_request_estimate_shrinks_toward_the_server():
    chooser = DraftChooser()
    for _ in range(100):
        chooser.acceptance.record(3, 1)  # position 0 always accepted, position 1 never
    prior = chooser.acceptance.means(4)
    assert prior[0] == pytest.approx(1.0, abs=0.02) and prior[1] == pytest.approx(0.0, abs=0.02)
    assert prior[2] == prior[3] == prior[1]  # deeper than reached: the deepest reached one's
    own = PositionCounts()
    for _ in range(40):
        own.record(2, 2)
    # a_j = (accepted_j + 8 prior_j') / (reached_j + 8), prior_j' = prior_j scaled by a_0 / prior_0 (at most 1).
    a0 = (40 + 8 * prior[0]) / 48
    scale = a0 / prior[0]
    a1 = (40 + 8 * min(1.0, prior[1] * scale)) / 48
    a2 = min(1.0, prior[2] * scale)
    order, gains = chooser._order_by_gain([3], [own], 3)
    assert order == [0, 1, 2]
    assert gains == pytest.approx([a0, a0 * a1, a0 * a1 * a2])
    _, fresh = chooser._order_by_gain([3], [PositionCounts()], 3)
    assert fresh == pytest.approx([prior[0], prior[0] * prior[1], prior[0] * prior[1] * prior[2]])  # the server's


def test_a_request_rejected_at_once_is_expected_to_be_further_on():
    """Position 0 is where a request's own evidence is; its deeper positions follow the server's, scaled by it."""
    chooser = DraftChooser()
    for _ in range(200):
        chooser.acceptance.record(3, 3)  # the server's requests: all accepted
    low = PositionCounts()
    for _ in range(30):
        low.record(3, 0)  # this one: rejected at once
    _, gains = chooser._order_by_gain([3], [low], 3)
    assert gains[0] < 0.25 and gains[1] < gains[0] ** 2 * 1.01


def test_choice_cost_at_batch_128():
    """Not a timed assert: prints what one choice costs on the coordinator's loop at batch 128, k_max 5."""
    chooser = DraftChooser()
    linear_costs(chooser.costs, 0.015, 0.00002, [128, 256, 384, 512, 640, 768])
    reqs = [counts(0.3 + 0.6 * (i % 7) / 6) for i in range(128)]
    chooser.choose([5] * 128, reqs)
    t0 = time.perf_counter()
    for _ in range(20):
        chosen = chooser.choose([5] * 128, reqs)
    print(f"\nDraftChooser.choose at batch 128, k_max 5: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms")
    assert 0 < sum(chosen) <= 5 * 128


def test_scheduler_asks_the_drafter_for_the_chosen_count():
    """Requests whose drafts are always rejected, iterations timed as if tokens were costly: after a few iterations
    the scheduler asks the drafter for no drafts (num_spec_tokens 0 on the wire); with --no-adaptive it keeps k."""
    for adaptive in (True, False):
        cfg = SchedulerConfig(
            max_model_len=512,
            block_size=16,
            num_blocks=256,
            num_speculative_tokens=3,
            max_num_batched_tokens=64,
            adaptive=adaptive,
        )
        s = Scheduler(cfg, [99])
        for i in range(4):
            s.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)))
        for _ in range(12):
            out = s.schedule()
            res = [
                VerifyResult(x.request.request_id, [7], x.num_draft_tokens, x.num_draft_tokens) for x in out.scheduled
            ]
            s.update_from_output(out, res)
            s.record_iteration(out, 0.010 + 0.002 * out.num_scheduled_tokens, out.proposes, out.num_later_steps, 0.0)
        message = verify_request(s.schedule(), "c")
        assert [r.num_spec_tokens for r in message.requests] == ([0] * 4 if adaptive else [3] * 4)
