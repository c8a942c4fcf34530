"""Adaptive speculation: how many drafts each decoding request asks the drafter for, chosen every iteration.

The choice maximises the batch's expected emitted tokens per second in steady state (async scheduling: the drafts
asked for now are verified next iteration, so an iteration's time is that of verifying them plus proposing):

    rate(s) = sum_r (1 + sum_{i < s_r} prod_{j <= i} a_rj) / time(n + sum_r s_r, max_r s_r - 1)

with a_rj request r's acceptance at draft position j (`draft_acceptance.py`: its own counts shrunk toward the
server's, scaled by how its position 0 compares) and time(T, L) the learned iteration time (`step_cost.py`; with no
drafts at all, no Propose either). The marginal gain of a request's (i+1)-th draft is prod_{j <= i} a_rj, which
falls with i, so taking drafts in falling order of gain is a valid allocation at every length. A drafter step costs
per depth, not per draft, so for each depth D (1..k) the prefixes of that order restricted to drafts shallower than
D are evaluated; the best rate wins, 0 drafts for everyone included. The order weighs gains by the tokens a request
has left (relative to the batch's mean): where gains are close, the requests behind get the drafts, since a batch
ends with its last request.

Before any iteration was timed each request gets its cap (the fixed k); then, until a Propose is priced, iterations
without drafts are tried beside those with (in one process the first one without verifies the drafts already held:
as many tokens as one with). Every
`EXPLORE_EVERY`-th choice (every 4 * `EXPLORE_EVERY`-th while nobody drafts) gives each request one draft more than
chosen: iteration times of more tokens and acceptance at deeper positions (or at all, after a run without drafts)
stay measured, so the choice follows a drafter whose acceptance changed and a step time measured once in a slow
moment.
"""

from __future__ import annotations

import itertools
import math

from specsplit.coordinator.draft_acceptance import PRIOR_WEIGHT, PositionCounts, ServerAcceptance
from specsplit.coordinator.step_cost import StepCostModel

EXPLORE_EVERY = 128
MAX_EVALUATIONS = 16  # rate evaluations per depth and choice (prefix lengths, evenly spaced)


class DraftChooser:
    def __init__(self) -> None:
        self.costs = StepCostModel()
        self.acceptance = ServerAcceptance()
        self._num_choices = 0

    def _order_by_gain(
        self, caps: list[int], counts: list[PositionCounts], max_cap: int, remaining: list[int] | None = None
    ) -> tuple[list[int], list[float]]:
        """Every (request, draft) pair in falling order of marginal gain weighted by the tokens the request has
        `remaining` (relative to the batch's mean: a batch finishes with its last request, so the ones behind come
        first), as indices r * max_cap + depth; and the (unweighted) gains by index."""
        prior = self.acceptance.means(max_cap)
        w = PRIOR_WEIGHT
        mean_remaining = max(1.0, sum(remaining) / len(remaining)) if remaining else 1.0
        gains: list[float] = []  # per request max_cap entries; 0 past its cap (sorted last, cut off)
        keys: list[float] = []
        for r, (cap, own) in enumerate(zip(caps, counts)):
            key = (own.version, self.acceptance.version, cap)
            if own.gains_cache[:1] != (key,):  # unchanged since the last choice (no drafts verified): kept
                mine, gain, reached, accepted = [], 1.0, own.reached, own.accepted
                num_own = len(reached)
                # a_rj = (accepted_rj + w * prior_rj) / (reached_rj + w): the request's counts shrunk toward a prior,
                # the server's acceptance at j scaled by how the request's position 0 compares with the server's
                # (deeper positions are reached rarely: a request that is often rejected at once is assumed to be
                # so further on as well).
                scale = 1.0
                for j in range(cap):
                    mean = min(1.0, prior[j] * scale)
                    a = (accepted[j] + w * mean) / (reached[j] + w) if j < num_own else mean
                    if j == 0 and prior[0] > 0:
                        scale = a / prior[0]
                    gain *= a
                    mine.append(gain)
                own.gains_cache = (key, mine)
            mine = own.gains_cache[1]
            gains.extend(mine)
            gains.extend([0.0] * (max_cap - cap))
            weight = remaining[r] / mean_remaining if remaining else 1.0
            # Sorted ascending: the larger gain weighted by the tokens the request has left (to 1/100) first, then the
            # shallower draft (so each request's drafts come in order: a valid allocation at every length).
            keys.extend(j * 1e-12 - round(g * weight, 2) for j, g in enumerate(mine))
            keys.extend([math.inf] * (max_cap - cap))
        return sorted(range(len(keys)), key=keys.__getitem__)[: sum(caps)], gains

    def record_verified(self, counts: PositionCounts, num_drafts: int, num_accepted: int) -> None:
        """A request's verification: its own counts and the server's."""
        if num_drafts > 0:
            counts.record(num_drafts, num_accepted)
            self.acceptance.record(num_drafts, num_accepted)

    def choose(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None = None) -> list[int]:
        """Drafts to ask for, per decoding request, each at most its cap; `remaining`: its tokens still to generate."""
        num_reqs, max_cap = len(caps), max(caps, default=0)
        if max_cap == 0:
            return [0] * num_reqs
        if not self.costs.ready:
            return list(caps)
        if self.costs.propose_s is None:  # a Propose's cost: iterations with and without one, side by side
            return [0] * num_reqs if self.costs.measured[1] else list(caps)
        curve = self.costs.curve()
        order, gains = self._order_by_gain(caps, counts, max_cap, remaining)
        # The drafter's steps are a cost per depth, not per draft: for each depth D, the prefixes of the order
        # restricted to drafts shallower than D; each evaluated evenly spaced and whole.
        best_rate, best = num_reqs / curve.iteration_s(num_reqs, 0, proposed=False), []
        for depth in range(1, max_cap + 1):
            sub = [i for i in order if i % max_cap < depth]
            tokens = list(itertools.accumulate(map(gains.__getitem__, sub)))
            lengths = set(range(len(sub), 0, -max(1, len(sub) // MAX_EVALUATIONS)))
            for m in lengths:
                rate = (num_reqs + tokens[m - 1]) / curve.iteration_s(num_reqs + m, depth - 1)
                if rate > best_rate:
                    best_rate, best = rate, sub[:m]
        chosen = [0] * num_reqs
        for index in best:
            chosen[index // max_cap] += 1
        self._num_choices += 1
        # One draft more each, every EXPLORE_EVERY choices (more rarely when nobody drafts: that exploration costs a
        # Propose): measures more tokens and deeper positions.
        if self._num_choices % (EXPLORE_EVERY if best else EXPLORE_EVERY * 4) == 0:
            return [min(n + 1, cap) for n, cap in zip(chosen, caps)]
        return chosen
