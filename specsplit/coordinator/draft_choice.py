"""Adaptive speculation: how many drafts each decoding request asks the drafter for, chosen every iteration.

The choice maximises the batch's expected emitted tokens per second in steady state (async scheduling: the drafts
asked for now are verified next iteration, so an iteration's time is that of verifying them plus proposing):

    rate(s) = sum_r (1 + sum_{i < s_r} prod_{j <= i} a_rj) / time(n + sum_r s_r, max_r s_r - 1)

with a_rj request r's acceptance at draft position j (`draft_acceptance.py`, its own counts shrunk toward the
server's) and time(T, L) the learned iteration time (`step_cost.py`). The marginal gain of a request's (i+1)-th
draft is prod_{j <= i} a_rj, which falls with i, so taking drafts in falling order of gain is a valid allocation at
every length; the choice is the prefix of that order with the best rate (0 drafts for everyone when that wins).

Before any iteration was timed each request gets its cap (the fixed k). When no measured iteration ran anywhere near
as few tokens as one without drafts (the first ones ran the fixed k), one iteration without drafts is tried, to
measure it. After `EXPLORE_EVERY` iterations in a row without drafts, every request gets one draft for one iteration,
so the acceptance estimates follow a drafter whose acceptance changed.
"""

from __future__ import annotations

import itertools

from specsplit.coordinator.draft_acceptance import PositionCounts, ServerAcceptance, request_acceptance
from specsplit.coordinator.step_cost import StepCostModel

EXPLORE_EVERY = 64
MAX_EVALUATIONS = 64  # rate evaluations per choice (prefix lengths, evenly spaced, plus the depth changes)


class DraftChooser:
    def __init__(self) -> None:
        self.costs = StepCostModel()
        self.acceptance = ServerAcceptance()
        self._iterations_without_drafts = 0

    def record_verified(self, counts: PositionCounts, num_drafts: int, num_accepted: int) -> None:
        """A request's verification: its own counts and the server's."""
        if num_drafts > 0:
            counts.record(num_drafts, num_accepted)
            self.acceptance.record(num_drafts, num_accepted)

    def choose(self, caps: list[int], counts: list[PositionCounts]) -> list[int]:
        """Drafts to ask for, per decoding request, each at most its cap."""
        num_reqs, max_cap = len(caps), max(caps, default=0)
        if max_cap == 0:
            return [0] * num_reqs
        if not self.costs.ready:
            return list(caps)
        curve = self.costs.curve()
        if 2 * num_reqs <= curve.min_tokens:
            return [0] * num_reqs  # measure an iteration without drafts
        prior = self.acceptance.means(max_cap)
        gains = []  # (-gain, depth, request)
        for r, (cap, request_counts) in enumerate(zip(caps, counts)):
            if cap:
                acceptance = request_acceptance(request_counts, prior[:cap])
                for depth, gain in enumerate(itertools.accumulate(acceptance, lambda a, b: a * b)):
                    gains.append((-gain, depth, r))
        gains.sort()
        num_gains = len(gains)
        stride = max(1, num_gains // MAX_EVALUATIONS)
        best_rate, best_len = num_reqs / curve.iteration_s(num_reqs, 0), 0
        tokens, max_depth = float(num_reqs), 0
        for m, (neg_gain, depth, _) in enumerate(gains, 1):
            tokens -= neg_gain
            max_depth = max(max_depth, depth + 1)
            # Evaluated evenly, and where the next draft would add a drafter step (that step's cost starts there).
            if m % stride and m != num_gains and gains[m][1] < max_depth:
                continue
            rate = tokens / curve.iteration_s(num_reqs + m, max_depth - 1)
            if rate > best_rate:
                best_rate, best_len = rate, m
        chosen = [0] * num_reqs
        for _, _, r in gains[:best_len]:
            chosen[r] += 1
        if best_len:
            self._iterations_without_drafts = 0
            return chosen
        self._iterations_without_drafts += 1
        if self._iterations_without_drafts >= EXPLORE_EVERY:
            self._iterations_without_drafts = 0
            return [min(1, cap) for cap in caps]
        return chosen
