"""Adaptive speculation: the chooser of per-request draft counts, its cost model and its acceptance estimates, and
the scheduler asking the drafter for the chosen counts."""

import math
import time

import numpy as np
import pytest

from specsplit.coordinator import draft_choice, step_cost
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.draft_acceptance import PositionCounts, ServerAcceptance
from specsplit.coordinator.draft_choice import (
    AdaptiveDraftCount,
    DraftPolicy,
    FixedDraftCount,
    best_allocation,
    draft_policy,
)
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from specsplit.coordinator.step_cost import StepCostModel, bucket_of
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
    chooser = AdaptiveDraftCount()
    assert chooser.choose([5, 3, 0], [PositionCounts()] * 3) == [5, 3, 0]


def test_low_acceptance_gets_no_drafts():
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.0001, [8, 16, 24, 32, 40, 48])  # every depth of batch 8 timed
    low = counts(0.05)
    assert chooser.choose([5] * 8, [low] * 8) == [0] * 8


def test_high_acceptance_and_cheap_tokens_get_the_maximum():
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.00001, [8, 16, 24, 32, 40, 48])
    high = counts(0.95)
    assert chooser.choose([5] * 8, [high] * 8) == [5] * 8


def test_mixed_batch_gets_per_request_counts():
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.0004, [16, 32, 48, 64, 80, 96])
    high, low = counts(0.9), counts(0.1)
    chosen = chooser.choose([5] * 16, [high] * 8 + [low] * 8)
    assert all(n >= 2 for n in chosen[:8]), chosen
    assert chosen[8:] == [0] * 8, chosen


def test_expensive_tokens_cut_the_draft_count():
    """At 0.6 acceptance, cheap tokens pay for every draft; tokens costing as much as the fixed part do not."""
    chooser = AdaptiveDraftCount()
    mid = counts(0.6)
    linear_costs(chooser.costs, 0.010, 0.00001, [32, 64, 96, 128, 160, 192])
    many = sum(chooser.choose([5] * 32, [mid] * 32))
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.0005, [32, 64, 96, 128, 160, 192])
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


def test_a_depth_run_steadily_costs_its_measured_time_not_the_sum():
    """The drafter reports its later steps as nearly free (0.1 ms) but an iteration of 4 of them takes 19 ms where one
    of 2 takes 12 at the same tokens: once run steadily (verifying as deep as it proposes), each costs what it took;
    a depth never run that way is priced by the sum, and one that changed depth (verified 3 drafts, proposes 5) is
    not kept whole."""
    model = StepCostModel()
    for _ in range(4):
        model.record(256, 2, 0.0120, later_steps_s=0.0002, verified_depth=3)
        model.record(256, 4, 0.0190, later_steps_s=0.0004, verified_depth=5)
        model.record(256, 4, 0.0300, later_steps_s=0.0004, verified_depth=3)  # a change of depth: not kept whole
    curve = model.curve()
    assert curve.iteration_s(256, 2) == pytest.approx(0.0120)
    assert curve.iteration_s(256, 4) == pytest.approx(0.0190)
    assert curve.iteration_s(250, 4) == pytest.approx(0.0190)  # 256's bucket
    summed = curve.base_s(256) + curve.propose_s + 3 * curve.later_step_s
    assert curve.iteration_s(256, 3) == pytest.approx(summed)
    by_depth = curve.proposed_s_by_depth(np.array([256.0, 100.0]), 5)  # [L 0..4, the two token counts]
    assert by_depth[4, 0] == pytest.approx(0.0190) and by_depth[2, 0] == pytest.approx(0.0120)
    assert by_depth[4, 1] == pytest.approx(curve.base_s(100) + curve.propose_s + 4 * curve.later_step_s)
    # Half the batch at 5 drafts, half at 1 (T 256, 4 later steps) against all at 3 (T 256, 2 later steps): at
    # acceptance 0.9 the first emits 2 % more tokens for 58 % more time.
    gains = ServerAcceptance().gains([5] * 64, [counts(0.9)] * 64, 5)
    assert best_allocation(curve, gains, [5] * 64, None) == [3] * 64


def test_after_one_steady_run_a_depth_costs_the_mean_of_its_time_and_the_sum():
    """One slow moment must not price a depth out for good (it would never be chosen, so never measured again)."""
    model = StepCostModel()
    model.record(512, 2, 0.0300, later_steps_s=0.0004, propose_s=0.001, verified_depth=1)  # not steady: the sum's
    model.record(512, 2, 0.0600, later_steps_s=0.0004, propose_s=0.001, verified_depth=3)  # steady, slow
    curve = model.curve()
    summed = curve.base_s(512) + curve.propose_s + 2 * curve.later_step_s
    assert curve.iteration_s(512, 2) == pytest.approx((0.0600 + summed) / 2)
    model.record(512, 2, 0.0300, later_steps_s=0.0004, propose_s=0.001, verified_depth=3)
    assert model.curve().iteration_s(512, 2) == pytest.approx(0.0300)  # two runs: their own time, the least recent


def test_a_steady_runs_time_is_the_least_of_its_recent_samples():
    """Noise only adds time: a depth measured in a slow moment costs its next good sample at once; a cost that really
    rose shows once every one of the last RUN_WINDOW samples did."""
    model = StepCostModel()
    for seconds in (0.013, 0.013, 0.010):  # two slow runs (clocks coming up), then a good one
        model.record(128, 0, seconds, propose_s=0.001, verified_depth=1)
    assert model.curve().iteration_s(128, 0) == pytest.approx(0.010)
    for _ in range(step_cost.RUN_WINDOW - 1):
        model.record(128, 0, 0.016, propose_s=0.001, verified_depth=1)
        assert model.curve().iteration_s(128, 0) == pytest.approx(0.010)  # the good one still among the recent
    model.record(128, 0, 0.016, propose_s=0.001, verified_depth=1)
    assert model.curve().iteration_s(128, 0) == pytest.approx(0.016)  # every recent sample rose: so did the cost


def test_exploration_goes_deeper_and_shallower_in_turn(monkeypatch):
    """Every EXPLORE_EVERY choices the choice is explored for two iterations, alternately one draft more each and a
    shallower uniform depth cycling below the deepest chosen, so that a depth measured once in a slow moment is
    measured again whichever side of the choice it lies. (The re-timing of stale close alternatives off: nothing
    is timed here, so every alternative would stay stale.)"""
    monkeypatch.setattr(draft_choice, "RETIME_EVERY", draft_choice.EXPLORE_EVERY)
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.0002, [8, 16, 24, 32, 40, 48])
    reqs = [counts(0.6) for _ in range(8)]
    steady = chooser.choose([5] * 8, reqs)  # (every depth of batch 8 timed: nothing to sweep)
    assert steady == [3] * 8
    explored = []
    for _ in range(draft_choice.EXPLORE_EVERY * 8):
        chosen = chooser.choose([5] * 8, reqs)
        if chosen != steady:
            explored.append(chosen)
    assert len(explored) == 16 and explored[0::2] == explored[1::2]  # each exploration twice in a row
    assert explored[0::4] == [[4] * 8] * 4  # one draft more
    assert [e[0] for e in explored[2::4]] == [1, 2, 0, 1] and all(len(set(e)) == 1 for e in explored[2::4])


def test_a_close_alternative_timed_before_half_the_recorded_iterations_is_timed_again():
    """Every RETIME_EVERY choices, the alternative of the choice (one draft more each, a shallower uniform depth)
    predicted within CLOSE of its rate whose steady run was timed longest ago, and before half of the iterations
    recorded so far, runs twice; one timed since is not run again, nor a far one however stale."""
    chooser = AdaptiveDraftCount()
    costs = chooser.costs
    linear_costs(costs, 0.010, 0.0002, [8, 16, 24, 32, 40, 48])
    reqs, caps = [counts(0.6) for _ in range(8)], [5] * 8
    assert chooser.choose(caps, reqs) == [3] * 8  # (every depth of batch 8 timed: nothing to sweep)

    def timed(depth: int) -> None:  # a steady run of every request at `depth` drafts
        tokens = 8 + 8 * depth
        seconds = 0.010 + 0.0002 * tokens
        if depth == 0:
            costs.record(tokens, 0, seconds, proposed=False, verified_depth=0)
        else:
            costs.record(tokens, depth - 1, seconds, later_steps_s=0.0, verified_depth=depth)

    for depth in (0, 1, 2, 4):  # no drafts timed first: the stalest, but 1.7x slower than 3 drafts each
        timed(depth)

    def explorations(n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            chosen = chooser.choose(caps, reqs)
            if chosen != [3] * 8:
                out.append(chosen)
            timed(max(chosen))  # every choice runs (steadily, as in a kept choice)
        return out

    # choices 2 .. 32: at the 32nd every alternative was timed since half the iterations recorded
    assert explorations(draft_choice.RETIME_EVERY - 1) == []
    for _ in range(100):
        timed(3)  # the choice runs on: the alternatives' timings grow old
    # choices 33 .. 65: at the 64th the stalest close alternative, twice in a row
    assert explorations(draft_choice.RETIME_EVERY + 1) == [[1] * 8, [1] * 8]
    assert explorations(draft_choice.RETIME_EVERY) == [[2] * 8, [2] * 8]  # 66 .. 97: then the next stalest


def test_a_depth_never_run_steadily_is_chosen_twice_in_a_row():
    """The iteration that first proposes a new depth verifies the previous choice's drafts: the choice is repeated
    once, for the same batch, so that the next iteration verifies and proposes it (a steady run, kept whole)."""

    def learned() -> AdaptiveDraftCount:
        chooser = AdaptiveDraftCount()
        for t in range(8, 49):  # every token count of batch 8 (a cap cut too): nothing to sweep
            for _ in range(3):
                chooser.costs.record(t, 0, 0.010 + 0.0001 * t, later_steps_s=0.0, proposed=False)
                chooser.costs.record(t, 0, 0.012 + 0.0001 * t, later_steps_s=0.0, propose_s=0.002)
        chooser.costs.record(16, 1, 0.0116 + 0.002 + 0.0002, later_steps_s=0.0002, propose_s=0.002)  # a later step
        return chooser

    chooser = learned()
    model = chooser.costs
    batch, caps = [counts(0.9) for _ in range(8)], [5] * 8
    first = chooser.choose(caps, batch)
    assert max(first) > 1 and (bucket_of(8 + sum(first)), max(first) - 1) not in model.measured_runs
    model.record(8 + sum(first), max(first) - 1, 1.0, later_steps_s=0.0, verified_depth=1)  # dear, not steady
    assert chooser.choose(caps, batch) == first  # repeated all the same, though it now looks dear
    assert chooser.choose(caps, batch) != first  # once only
    chooser = learned()
    first = chooser.choose(caps, batch)
    assert first[7] == 5  # (repeated, it would overrun the cut cap)
    cut = caps[:7] + [4]
    chosen = chooser.choose(cut, batch)  # the batch changed (a cap cut): chosen anew, not repeated
    assert chosen != first and all(n <= cap for n, cap in zip(chosen, cut))


def test_a_proposes_cost_is_learned_where_iterations_with_and_without_one_meet():
    chooser = AdaptiveDraftCount()
    model = chooser.costs
    for t in (8, 16, 32):
        model.record(t, 0, 0.010 + 0.0001 * t + (0.003 if t == 32 else 0.0), proposed=t == 32)
    model.record(16, 0, 0.0116 + 0.003)  # the first iteration of drafting again: verifies none, proposes
    model.record(24, 0, 0.0124, proposed=False)
    curve = model.curve()
    assert model.propose_s == pytest.approx(0.003)
    assert curve.iteration_s(16, 0, proposed=False) == pytest.approx(0.0116)
    assert curve.iteration_s(16, 0) == pytest.approx(0.0146)
    assert curve.base_s(32) == pytest.approx(0.0132)  # measured with a Propose only: less its cost
    for t in (8, 16, 24, 32):  # every depth of batch 8 timed often enough not to be swept
        for _ in range(2):
            model.record(t, 0, 0.010 + 0.0001 * t, proposed=False)
    assert model.propose_s == pytest.approx(0.003)
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
    chooser = AdaptiveDraftCount()
    chooser.costs.record(32, 0, 0.0103)  # batch 8 at k = 3, with a Propose
    high = counts(0.95)
    assert chooser.choose([3] * 8, [high] * 8) == [0] * 8  # the probe
    chooser.costs.record(32, 0, 0.0100, proposed=False)  # verifying the drafts held, no Propose
    assert chooser.costs.propose_s == pytest.approx(0.0003)
    # Then each depth whose token count was timed too rarely, SWEEP_SAMPLES times (batch 8 at k = 2 runs 24 tokens;
    # 32 has 2 samples), then the choice.
    chosen = [chooser.choose([3] * 8, [high] * 8) for _ in range(4 * draft_choice.SWEEP_SAMPLES)]
    sweeps = [[d] * 8 for d in (0, 1, 2) for _ in range(draft_choice.SWEEP_SAMPLES)] + [[3] * 8]
    assert chosen == sweeps + [[3] * 8] * (len(chosen) - len(sweeps))
    chooser = AdaptiveDraftCount()
    chooser.costs.record(8, 0, 0.0100, proposed=False)  # only iterations without one so far (no drafter, say)
    assert chooser.choose([3] * 8, [high] * 8) == [3] * 8  # then one with: the cap


def test_every_request_gets_one_draft_more_every_so_many_choices():
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.001, [4, 7, 10, 13, 16, 19])  # batch 4 (one with no drafts) at every depth
    low = counts(0.05)
    n = draft_choice.EXPLORE_EVERY  # nobody drafts, and they are explored as often (a drafter that got better)
    chosen = [chooser.choose([5, 5, 5, 0], [low] * 4) for _ in range(n)]
    assert chosen[:-1] == [[0] * 4] * (n - 1)
    assert chosen[-1] == [1, 1, 1, 0]
    assert chooser.choose([5, 5, 5, 0], [low] * 4) == [1, 1, 1, 0]  # twice: the second iteration is a steady run
    assert chooser.choose([5, 5, 5, 0], [low] * 4) == [0] * 4
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.00001, [8, 16, 23, 30, 37, 44])  # every depth timed
    chooser.costs.record(48, 1, 0.0115, later_steps_s=0.0015)  # drafter steps after step 0 cost 1.5 ms each
    caps, mid = [5, 1, 5, 5, 5, 5, 5, 5], counts(0.6)
    n = draft_choice.EXPLORE_EVERY
    chosen = [chooser.choose(caps, [mid] * 8) for _ in range(n)]
    assert 1 < max(chosen[0]) < 5, chosen[0]  # deep drafts do not pay for their drafter steps at 0.6
    assert chosen[-2] == chosen[0] and chosen[-1] == [min(c + 1, cap) for c, cap in zip(chosen[0], caps)]
    assert chooser.choose(caps, [mid] * 8) == chosen[-1]


def test_a_choice_of_no_drafts_is_kept_until_a_draft_is_verified_the_batch_changes_or_it_is_old():
    reqs = [counts(0.5) for _ in range(8)]

    def chooser_at_zero() -> AdaptiveDraftCount:
        chooser = AdaptiveDraftCount()
        linear_costs(chooser.costs, 0.010, 0.002, [8, 16, 24, 32])  # tokens dear: at acceptance 0.5 no draft pays
        assert chooser.choose([3] * 8, reqs) == [0] * 8
        for _ in range(8):
            linear_costs(chooser.costs, 0.010, 0.0, [8, 16, 24, 32])  # now free: drafts would pay ...
        return chooser

    chooser = chooser_at_zero()
    assert chooser.choose([3] * 8, reqs) == [0] * 8  # ... but no draft was verified and the batch is the same
    swapped = [*reqs[:7], counts(0.5)]  # one request finished, another took its place
    assert chooser.choose([3] * 8, swapped) == [3] * 8  # another batch: chosen
    chooser = chooser_at_zero()
    chosen = [chooser.choose([3] * 8, reqs) for _ in range(draft_choice.ZERO_KEEP)]
    assert chosen[:-1] == [[0] * 8] * (draft_choice.ZERO_KEEP - 1) and chosen[-1] == [3] * 8  # re-chosen when old
    chooser = chooser_at_zero()
    chooser.record_verified(PositionCounts(), 1, 1)  # a draft verified (an exploration's): re-chosen
    assert chooser.choose([3] * 8, reqs) == [3] * 8


def steady_at_five() -> AdaptiveDraftCount:
    """A chooser that gives a batch of 8 at acceptance 0.95 every request 5 drafts, and 2 each where they are rejected
    at once (`rejected_at_once`); every token count of batch 8 timed (nothing to sweep), 5 drafts each run steadily (no
    trial of it due)."""
    chooser = AdaptiveDraftCount()
    linear_costs(chooser.costs, 0.010, 0.0001, list(range(8, 49)))
    for _ in range(3):
        chooser.costs.record(48, 4, 0.0148, later_steps_s=0.0002, verified_depth=5)
    return chooser


def rejected_at_once(batch: list[PositionCounts]) -> None:
    """Each request's drafts from now on rejected at once, so often that its own counts outweigh the earlier ones."""
    for request in batch:
        for _ in range(2000):
            request.record(5, 0)


def test_a_choice_made_again_and_again_is_kept_as_many_times_as_it_was_made_in_a_row_up_to_keep():
    """Choosing every iteration put the choice's host time on every step (0.4 ms of 7.5 ms at batch 1 on the H200):
    a choice made n times in a row for the same batch is kept for min(n, KEEP) choices, whatever changed meanwhile;
    one that changes is made afresh every time, and another batch is chosen for at once. Seen here as the choices
    that still give every request 5 drafts after the batch's drafts turned out rejected at once (a choice made afresh
    then gives 2)."""
    assert draft_choice.KEEP == 3  # (the counts below)

    def kept_after(made: int) -> int:
        """Choices still at 5 drafts each once the batch's acceptance fell after `made` choices at 5 each."""
        chooser, high = steady_at_five(), [counts(0.95) for _ in range(8)]
        assert [chooser.choose([5] * 8, high) for _ in range(made)] == [[5] * 8] * made
        rejected_at_once(high)
        for kept in range(draft_choice.KEEP + 1):
            if chooser.choose([5] * 8, high) != [5] * 8:
                return kept
        raise AssertionError("kept longer than KEEP")

    # made at choices 1, 2, 3 (in a row: 0, 1, 2 before), 5 (kept once), 8 (kept twice), 11 (kept KEEP - 1 times)
    assert [kept_after(n) for n in range(1, 12)] == [0, 0, 1, 0, 2, 1, 0, 2, 1, 0, 2]
    chooser, high = steady_at_five(), [counts(0.95) for _ in range(8)]
    assert [chooser.choose([5] * 8, high) for _ in range(5)] == [[5] * 8] * 5  # (kept for the 2 choices after)
    other = [counts(0.95) for _ in range(8)]
    rejected_at_once(other)
    assert chooser.choose([5] * 8, other) == [2] * 8  # another batch: chosen at once


def test_a_token_count_costs_what_the_next_measured_bucket_costs():
    """The verifier's step is flat within a CUDA graph size and jumps at the next (powers of two): between two
    measurements a token count costs the larger one's, not a line's value."""
    model = StepCostModel()
    for tokens, seconds in ((32, 0.0066), (64, 0.0086), (128, 0.0150)):
        for _ in range(3):
            model.record(tokens, 0, seconds, proposed=False)
    assert bucket_of(62) == bucket_of(64) != bucket_of(65)  # a power of two tops its bucket
    curve = model.curve()
    assert curve.base_s(40) == pytest.approx(0.0086)  # a line would say 0.0071
    assert curve.base_s(64) == pytest.approx(0.0086) and curve.base_s(65) == pytest.approx(0.0150)
    assert curve.base_s(16) == pytest.approx(0.0066)  # below the first: its time
    assert curve.base_s_of(np.array([40.0, 65.0])).tolist() == pytest.approx([0.0086, 0.0150])


def test_a_buckets_first_samples_are_averaged():
    """A sweep times a depth 3 times; one of them in a slow moment weighs a third, not (an EMA's start) most."""
    model = StepCostModel()
    for seconds in (0.030, 0.010, 0.010):
        model.record(32, 0, seconds, proposed=False)
    assert model.curve().base_s(32) == pytest.approx(0.050 / 3)
    for _ in range(20):
        model.record(32, 0, 0.010, proposed=False)
    assert model.curve().base_s(32) == pytest.approx(0.010, rel=0.01)  # then an EMA: the old samples fade


def test_a_hiccup_is_left_out_and_a_first_sample_that_was_one_is_replaced():
    model = StepCostModel()
    for seconds in (0.010, 0.010, 0.500, 0.010):  # a compile in the third
        model.record(32, 0, seconds, proposed=False)
    assert model.curve().base_s(32) == pytest.approx(0.010)
    model.record(32, 0, 0.050, proposed=False)
    model.record(32, 0, 0.050, proposed=False)  # twice in a row: the cost rose, it is taken
    assert model.curve().base_s(32) > 0.015
    first = StepCostModel()
    for seconds in (0.500, 0.010, 0.010):  # the first was the hiccup: the average starts afresh at the second
        first.record(64, 0, seconds, proposed=False)
    assert first.curve().base_s(64) == pytest.approx(0.010)
    for later_steps_s in (0.480, 0.0018, 0.0018):  # the drafter's report of 4 later steps, the first with a compile
        first.record(64, 4, 0.020, later_steps_s=later_steps_s)
    assert first.later_step_s == pytest.approx(0.00045)


def _learned_at_batch_1(compile_s: float) -> AdaptiveDraftCount:
    """A chooser after its first iterations at batch 1, shaped after the H200's alpha 0.3 cell: 5 drafts (the cap)
    before any timing, the first of them with a compile of `compile_s`, then the sweep of depths 0..5."""
    chooser = AdaptiveDraftCount()
    for rep in range(2):
        extra = compile_s if rep == 0 else 0.0
        chooser.costs.record(6, 4, 0.0079 + extra, later_steps_s=0.0018 + extra, verified_depth=5)
    for depth in range(6):
        later = max(0, depth - 1) * 0.00045
        seconds = 0.0046 + (0.00075 + depth * 0.00015 + later if depth else 0.0)
        for _ in range(3):
            later_s = later if depth > 1 else None
            chooser.costs.record(1 + depth, max(0, depth - 1), seconds, later_s, depth > 0, None, depth)
        if depth == 0:
            chooser.costs.record(1, 0, 0.00535)  # the iteration that stops drafting proposes once more
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 6))
        accepted = next((i for i in range(n) if rng.random() >= 0.33), n)
        chooser.acceptance.record(n, accepted)
    return chooser


def test_a_compile_among_the_first_iterations_does_not_price_drafts_out(monkeypatch):
    """On the H200 the first iterations verifying 5 drafts took ~0.5 s (a kernel compiled at first use); taken in,
    the drafter's later-step estimate and, through the curve's pooling, the cost of a batch without drafts were
    pulled so far that 1 draft at acceptance 0.33 (8-12 % faster there) looked dear: adaptive drafted nothing. Both
    the hiccup rule and the price of no drafts by its own steady runs (`CostCurve.plain_s`) keep it out."""
    assert _learned_at_batch_1(0.0).choose([5], [PositionCounts()]) == [1]
    assert _learned_at_batch_1(0.48).choose([5], [PositionCounts()]) == [1]
    monkeypatch.setattr(step_cost, "HICCUP", float("inf"))  # every sample taken in
    unguarded = _learned_at_batch_1(0.48)
    curve = unguarded.costs.curve()
    # the compile pulls the later step up and the pooled base of 1 token down (which chose 0 drafts on the H200) ...
    assert unguarded.costs.later_step_s > 4 * 0.00045 and curve.base_s(1) < 0.5 * 0.0046
    # ... but no drafts cost what their steady runs took
    assert curve.plain_s(1) == pytest.approx(0.0046) and unguarded.choose([5], [PositionCounts()]) == [1]


def test_a_slow_measurement_cannot_make_fewer_tokens_dearer():
    model = StepCostModel()
    linear_costs(model, 0.010, 0.0001, [8, 16, 32])
    model.record(12, 0, 0.5)  # once, in a slow moment
    curve = model.curve()
    assert curve.base_s(12) <= curve.base_s(16) <= curve.base_s(32)


def test_request_estimate_shrinks_toward_the_server():
    chooser = AdaptiveDraftCount()
    for _ in range(100):
        chooser.acceptance.record(3, 1)  # position 0 always accepted, position 1 never
    prior = chooser.acceptance.means(4)
    assert prior[0] == pytest.approx(1.0, abs=0.02) and prior[1] == pytest.approx(0.0, abs=0.03)
    assert prior[2] == prior[3] == prior[1]  # deeper than reached: the deepest reached one's
    own = PositionCounts()
    for _ in range(40):
        own.record(2, 2)
    # a_j = (accepted_j + 8 prior_j') / (reached_j + 8), prior_j' = prior_j scaled by a_0 / prior_0 (at most 1).
    a0 = (40 + 8 * prior[0]) / 48
    scale = a0 / prior[0]
    a1 = (40 + 8 * min(1.0, prior[1] * scale)) / 48
    a2 = min(1.0, prior[2] * scale)
    (gains,) = chooser.acceptance.gains([3], [own], 3)
    assert gains == pytest.approx([a0, a0 * a1, a0 * a1 * a2])
    (fresh,) = chooser.acceptance.gains([3], [PositionCounts()], 3)
    assert fresh == pytest.approx([prior[0], prior[0] * prior[1], prior[0] * prior[1] * prior[2]])  # the server's


def test_a_rarely_reached_position_is_shrunk_toward_the_one_before_it():
    """At low acceptance position 2 is reached a few times: its estimate leans on position 1's, not on 0.5 (which
    made deep drafts look better than shallow ones, and asked for them)."""
    server = ServerAcceptance(half_life=math.inf)  # no decay: the counts as they are
    for i in range(200):
        server.record(3, 0 if i % 10 else 1)  # position 0 accepted 1 time in 10
    server.record(3, 2)  # position 0: 21 of 201; position 1: 1 of 21; position 2: 0 of 1
    means = server.means(3)
    assert means[0] == pytest.approx((21 + 2 * 0.5) / (201 + 2))
    assert means[1] == pytest.approx((1 + 2 * means[0]) / (21 + 2))
    assert means[2] == pytest.approx((0 + 2 * means[1]) / (1 + 2))
    assert means[2] < means[1] < means[0] < 0.5


def test_a_drafter_that_got_better_is_believed_after_a_few_verified_drafts():
    """A server that verified a thousand drafts at acceptance 0.02, then nothing for 64 iterations (nobody drafting):
    three accepted drafts make its recent window unlikely under 0.02 (`CHANGE_LLR`), and it goes on from that window;
    before, the thousand outweighed them (0.025 after the three). Without the idle iterations the recent window still
    holds the old rejections and the three are not enough."""
    for idle in (64, 0):
        server = ServerAcceptance()
        for i in range(1000):
            server.record(2, 1 if i % 50 == 0 else 0)
            server.end_iteration(verified=True)
        for _ in range(idle):
            server.end_iteration(verified=False)
        for _ in range(3):
            server.record(1, 1)
            server.end_iteration(verified=True)
        if idle:
            assert server.changes == 1 and server.means(2)[0] > 0.6
        else:
            assert server.changes == 0 and server.means(2)[0] < 0.03


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.6, 0.9])
def test_a_steady_acceptance_is_never_taken_for_a_change(alpha):
    """20,000 verifications of 3 drafts at a steady acceptance, 4 per iteration: the recent window's noise never passes
    CHANGE_LLR."""
    server, rng = ServerAcceptance(), np.random.default_rng(0)
    for i in range(20_000):
        accepted = 0
        while accepted < 3 and rng.random() < alpha:
            accepted += 1
        server.record(3, accepted)
        if i % 4 == 3:
            server.end_iteration(verified=True)
    assert server.changes == 0
    assert server.means(1)[0] == pytest.approx(alpha, abs=0.05)


def test_a_request_rejected_at_once_is_expected_to_be_further_on():
    """Position 0 is where a request's own evidence is; its deeper positions follow the server's, scaled by it."""
    chooser = AdaptiveDraftCount()
    for _ in range(200):
        chooser.acceptance.record(3, 3)  # the server's requests: all accepted
    low = PositionCounts()
    for _ in range(30):
        low.record(3, 0)  # this one: rejected at once
    (gains,) = chooser.acceptance.gains([3], [low], 3)
    assert gains[0] < 0.25 and gains[1] < gains[0] ** 2 * 1.01


def test_choice_cost_per_batch_size():
    """Not a timed assert: prints what one choice costs on the coordinator's loop at batch 1..128, k_max 5, each after
    an iteration's timing (the cost curve rebuilt, as on a server), with every depth timed (no sweep)."""
    line = []
    for batch in (1, 8, 32, 64, 128):
        chooser = AdaptiveDraftCount()
        costs = chooser.costs
        linear_costs(costs, 0.015, 0.00002, [batch * (d + 1) for d in range(6)])
        reqs = [counts(0.3 + 0.6 * (i % 7) / 6) for i in range(batch)]
        left = [20 + i % 5 for i in range(batch)]
        chosen = chooser.choose([5] * batch, reqs, left)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(20):
                costs.record(batch, 0, 0.015 + 0.00002 * batch, proposed=False)
                chooser.choose([5] * batch, reqs, left)
            best = min(best, (time.perf_counter() - t0) / 20)
        line.append(f"B {batch}: {best * 1e3:.3f} ms")
        assert 0 < sum(chosen) <= 5 * batch
    print("\nAdaptiveDraftCount.choose, k_max 5, after a timing each: " + ", ".join(line))


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
        for _ in range(30):  # (the first ones time every depth: draft_choice.SWEEP_SAMPLES each)
            out = s.schedule()
            res = [
                VerifyResult(x.request.request_id, [7], x.num_draft_tokens, x.num_draft_tokens) for x in out.scheduled
            ]
            s.update_from_output(out, res)
            s.record_iteration(out, 0.010 + 0.002 * out.num_scheduled_tokens, out.proposes, out.num_later_steps, 0.0)
        message = verify_request(s.schedule(), "c")
        assert [r.num_spec_tokens for r in message.requests] == ([0] * 4 if adaptive else [3] * 4)


def test_a_best_allocation_computed_ahead_is_taken_by_the_next_choice_of_the_same_batch_only(monkeypatch):
    """`choose_ahead` computes the best allocation for a batch while its step runs, from what is known then; the next
    `choose` of the same requests and caps takes it instead of computing it (here: every request 5 drafts, though
    its drafts were since rejected at once, which a choice made afresh gives 2 each); another batch (a cap cut,
    another request) computes it afresh; nothing is computed ahead where the next choice keeps the last one."""
    made = []
    real_best = draft_choice.best_allocation
    monkeypatch.setattr(draft_choice, "best_allocation", lambda *args: made.append(1) or real_best(*args))

    chooser, high = steady_at_five(), [counts(0.95) for _ in range(8)]
    chooser.choose_ahead([5] * 8, high, [100] * 8)
    assert len(made) == 1  # computed ahead
    rejected_at_once(high)  # (the step that ran meanwhile)
    assert chooser.choose([5] * 8, high, [99] * 8) == [5] * 8  # taken, not computed again
    assert len(made) == 1
    assert chooser.choose([5] * 8, high) == [2] * 8  # what was computed ahead serves one choice only

    chooser, high = steady_at_five(), [counts(0.95) for _ in range(8)]
    chooser.choose_ahead([5] * 8, high)
    rejected_at_once(high)
    assert chooser.choose([5] * 7 + [2], high) == [2] * 8  # a cap cut near max_tokens: computed afresh

    chooser, high = steady_at_five(), [counts(0.95) for _ in range(8)]
    chooser.choose_ahead([5] * 8, high)
    late = counts(0.95)
    rejected_at_once([late])
    other = [*high[:7], late]  # a request finished, another took its place
    assert chooser.choose([5] * 8, other) == [5] * 7 + [0]  # computed afresh: none for the one rejected at once

    chooser, high = steady_at_five(), [counts(0.95) for _ in range(8)]
    computed = []
    for _ in range(8):  # the same choice again and again: kept for a while (`KEEP`), then computed (ahead) again
        before = len(made)
        chooser.choose_ahead([5] * 8, high)
        assert chooser.choose([5] * 8, high) == [5] * 8
        computed.append(len(made) - before)
    assert computed == [1, 1, 1, 0, 1, 0, 0, 1]  # once (ahead) per choice made; for a kept one, not at all


def test_the_scheduler_takes_the_allocation_computed_while_the_step_ran(monkeypatch):
    """The engines call `Scheduler.choose_ahead` once a step is on its way: the next schedule of the same decoding
    batch takes the best allocation computed then (the chooser's costly part is then not between two steps); a batch
    that changed computes it at schedule."""
    cfg = SchedulerConfig(max_model_len=512, block_size=16, num_blocks=256, num_speculative_tokens=3, adaptive=True)
    chooser = AdaptiveDraftCount()
    s = Scheduler(cfg, [99], chooser)
    for i in range(3):
        s.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True)))
    for tokens in range(3, 17):  # every depth timed, with and without a Propose: choices are `best_allocation`'s
        chooser.costs.record(tokens, 0, 0.01 + 0.0001 * tokens, proposed=False)
        chooser.costs.record(tokens, 0, 0.011 + 0.0001 * tokens, propose_s=0.001)
    at_schedule, ahead = [], []
    real_best = draft_choice.best_allocation
    monkeypatch.setattr(
        draft_choice,
        "best_allocation",
        lambda curve, gains, *args: (
            (ahead if computing_ahead else at_schedule).append(len(gains)) or real_best(curve, gains, *args)
        ),
    )
    computing_ahead = False
    for step in range(16):
        if step == 8:  # a request arrives: the batch changes
            s.add_request(Request("r3", [4, 5], SamplingParams(max_tokens=60, ignore_eos=True)))
        out = s.schedule()
        computing_ahead = True
        s.choose_ahead(out)
        computing_ahead = False
        results = [
            VerifyResult(x.request.request_id, [7], x.num_draft_tokens, x.num_draft_tokens) for x in out.scheduled
        ]
        s.update_from_output(out, results)  # (every draft rejected: kept choices stay few)
    assert len(ahead) >= 4 and 4 in ahead  # computed while steps ran, for the new batch too
    assert at_schedule.count(3) <= 1 and at_schedule.count(4) <= 1  # at schedule: only where the batch changed


class RecordingPolicy(DraftPolicy):
    """Every request half its cap (rounded up); each call the scheduler makes, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def choose(self, caps, counts, remaining=None):
        self.calls.append(("choose", list(caps), list(counts), remaining))
        return [-(-cap // 2) for cap in caps]

    def choose_ahead(self, caps, counts, remaining=None):
        self.calls.append(("choose_ahead", list(caps), list(counts), remaining))

    def record_verified(self, counts, num_drafts, num_accepted):
        self.calls.append(("record_verified", counts, num_drafts, num_accepted))

    def record_iteration(self, *args):
        self.calls.append(("record_iteration", *args))


@pytest.mark.parametrize("adaptive", [True, False])
def test_the_scheduler_asks_its_policy_for_the_draft_counts_and_reports_to_it(adaptive):
    """The policy given to the scheduler (whatever `adaptive` says, which picks only the default one) chooses every
    sampling request's drafts, which the drafter is asked for on the wire; it hears of each request's verification
    and of every decode iteration's time (not a prefill's)."""
    cfg = SchedulerConfig(max_model_len=512, block_size=16, num_blocks=256, num_speculative_tokens=3, adaptive=adaptive)
    policy = RecordingPolicy()
    s = Scheduler(cfg, [99], policy)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    s.add_request(Request("b", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True, num_speculative_tokens=1)))
    a, b = s.requests["a"], s.requests["b"]
    verified = []
    for _ in range(3):
        out = s.schedule()
        assert [r.num_spec_tokens for r in verify_request(out, "c").requests] == [2, 1]  # half of 3 and of 1
        s.choose_ahead(out)
        results = [
            VerifyResult(x.request.request_id, [7], x.num_draft_tokens, x.num_draft_tokens) for x in out.scheduled
        ]
        s.update_from_output(out, results)
        s.record_iteration(out, 0.01, True, 1, 0.001, 0.002)
        verified.append([x.num_draft_tokens for x in out.scheduled])
    assert verified == [[0, 0], [2, 1], [2, 1]]
    kinds = [call[0] for call in policy.calls]
    per_step = ["choose", "choose_ahead", "record_verified", "record_verified"]
    assert kinds == per_step + [*per_step, "record_iteration"] * 2  # (the first step prefills: not recorded)
    assert policy.calls[0] == ("choose", [3, 1], [a.position_counts, b.position_counts], [50, 50])
    assert policy.calls[1] == ("choose_ahead", [3, 1], [a.position_counts, b.position_counts], [50, 50])
    assert policy.calls[6:9] == [
        ("record_verified", a.position_counts, 2, 0),
        ("record_verified", b.position_counts, 1, 0),
        ("record_iteration", 5, 1, 0.01, 0.001, True, 0.002, 2),  # 2 tokens + 3 drafts, the deepest 2
    ]


def test_fixed_draft_count_gives_every_request_its_cap_and_learns_nothing():
    policy, request = FixedDraftCount(), counts(0.0)
    for _ in range(50):  # iterations and verifications that make an adaptive choice stop drafting
        policy.record_iteration(8, 0, 0.010, None, False, None, 0)
        policy.record_iteration(32, 2, 0.100, 0.001, True, 0.001, 3)
        policy.record_verified(request, 3, 0)
    policy.choose_ahead([5, 3, 0], [request] * 3)
    assert policy.choose([5, 3, 0], [request] * 3) == [5, 3, 0]
    assert request == counts(0.0)  # the request's own counts untouched


def test_the_default_policy_follows_the_config():
    """The default (`serve`'s, `up`'s, the LLM's): every request its k; `adaptive` with drafts: adaptive speculation;
    no drafts: every request its k (none)."""
    config = dict(max_model_len=512, block_size=16, num_blocks=256)
    assert type(draft_policy(SchedulerConfig(**config))) is FixedDraftCount
    assert type(draft_policy(SchedulerConfig(**config, adaptive=True))) is AdaptiveDraftCount
    assert type(draft_policy(SchedulerConfig(**config, adaptive=True, num_speculative_tokens=0))) is FixedDraftCount


def test_what_the_adaptive_choice_learned_goes_on_with_it_to_the_next_scheduler():
    """As `specsplit.LLM` does from one generate() to the next: a scheduler given the policy another one taught (drafts
    always rejected, tokens dear) asks for no drafts from its first choice, where a new policy gives every request its
    cap until it has timed an iteration."""
    cfg = SchedulerConfig(max_model_len=512, block_size=16, num_blocks=256, num_speculative_tokens=3, adaptive=True)

    def run(s: Scheduler, iterations: int) -> list[list[int]]:
        for i in range(4):
            s.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)))
        asked = []
        for _ in range(iterations):
            out = s.schedule()
            asked.append([r.num_spec_tokens for r in verify_request(out, "c").requests])
            res = [
                VerifyResult(x.request.request_id, [7], x.num_draft_tokens, x.num_draft_tokens) for x in out.scheduled
            ]
            s.update_from_output(out, res)
            s.record_iteration(out, 0.010 + 0.002 * out.num_scheduled_tokens, out.proposes, out.num_later_steps, 0.0)
        for i in range(4):
            s.finish_request(f"r{i}", "abort")
        return asked

    policy = AdaptiveDraftCount()
    assert run(Scheduler(cfg, [99], policy), 30)[-1] == [0] * 4
    assert run(Scheduler(cfg, [99], policy), 1) == [[0] * 4]
    assert run(Scheduler(cfg, [99]), 1) == [[3] * 4]
