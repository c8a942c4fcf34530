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
measure it. Every `EXPLORE_EVERY`-th choice (every 4 * `EXPLORE_EVERY`-th while nobody drafts) gives each request
one draft more than chosen: iteration times of more tokens and acceptance at deeper positions (or at all, after a run
without drafts) stay measured, so the choice follows a drafter whose acceptance changed and a step time measured
once in a slow moment.
"""

from __future__ import annotations

import bisect
import itertools
import math

from specsplit.coordinator.draft_acceptance import PRIOR_WEIGHT, PositionCounts, ServerAcceptance
from specsplit.coordinator.step_cost import StepCostModel

EXPLORE_EVERY = 64
MAX_EVALUATIONS = 64  # rate evaluations per choice (prefix lengths, evenly spaced, plus the depth changes)


class DraftChooser:
    def __init__(self) -> None:
        self.costs = StepCostModel()
        self.acceptance = ServerAcceptance()
        self._num_choices = 0

    def _prefix_lengths_by_gain(self, caps: list[int], counts: list[PositionCounts], max_cap: int):
        """Every (request, draft) pair in falling order of marginal gain, as indices r * max_cap + depth; the expected
        tokens gained by each prefix of that order; and each prefix's deepest draft (1-based)."""
        prior = self.acceptance.means(max_cap)
        # a_rj = (accepted_rj + w * prior_j) / (reached_rj + w): the request's counts shrunk toward the server's.
        weighted = [PRIOR_WEIGHT * mean for mean in prior]
        neg_gains: list[float] = []  # per request max_cap entries; inf past its cap (sorted last, cut off)
        for cap, own in zip(caps, counts):
            key = (own.version, self.acceptance.version, cap)
            if own.gains_cache[:1] != (key,):  # unchanged since the last choice (no drafts verified): kept
                mine, gain, reached, accepted = [], 1.0, own.reached, own.accepted
                num_own = len(reached)
                for j in range(cap):
                    a = (accepted[j] + weighted[j]) / (reached[j] + PRIOR_WEIGHT) if j < num_own else prior[j]
                    gain *= a
                    mine.append(j * 1e-12 - gain)  # ties: the shallower draft first (a valid allocation)
                own.gains_cache = (key, mine)
            neg_gains.extend(own.gains_cache[1])
            neg_gains.extend([math.inf] * (max_cap - cap))
        order = sorted(range(len(neg_gains)), key=neg_gains.__getitem__)[: sum(caps)]
        tokens_gained = [-t for t in itertools.accumulate(map(neg_gains.__getitem__, order))]
        max_depth = list(itertools.accumulate([i % max_cap + 1 for i in order], max))
        return order, tokens_gained, max_depth

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
        order, tokens_gained, max_depth = self._prefix_lengths_by_gain(caps, counts, max_cap)
        # Prefix lengths evaluated: evenly spaced, the whole, and each one just before a draft adds a drafter step.
        num_gains = len(order)
        candidates = set(range(0, num_gains + 1, max(1, num_gains // MAX_EVALUATIONS)))
        candidates.add(num_gains)
        candidates.update(bisect.bisect_left(max_depth, depth) for depth in range(2, max_cap + 1))
        best_rate, best_len = num_reqs / curve.iteration_s(num_reqs, 0), 0
        for m in sorted(candidates):  # ties: fewer drafts
            if m:
                rate = (num_reqs + tokens_gained[m - 1]) / curve.iteration_s(num_reqs + m, max_depth[m - 1] - 1)
                if rate > best_rate:
                    best_rate, best_len = rate, m
        chosen = [0] * num_reqs
        for index in order[:best_len]:
            chosen[index // max_cap] += 1
        self._num_choices += 1
        # One draft more each, every EXPLORE_EVERY choices (more rarely when nobody drafts: that exploration costs a
        # Propose): measures more tokens and deeper positions.
        if self._num_choices % (EXPLORE_EVERY if best_len else EXPLORE_EVERY * 4) == 0:
            return [min(n + 1, cap) for n, cap in zip(chosen, caps)]
        return chosen
