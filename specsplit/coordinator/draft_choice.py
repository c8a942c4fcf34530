"""How many drafts each decoding request asks the drafter for, chosen every iteration: the scheduler's `DraftPolicy`.

`FixedDraftCount` gives every request its cap (the fixed k, `--no-adaptive`). `AdaptiveDraftCount` (adaptive
speculation, the default: `draft_policy`) chooses as below, from what it learned (step times, acceptance), which it
keeps from one scheduler to the next it is given to.

Its choice maximises the batch's expected emitted tokens per second in steady state (async scheduling: the drafts
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
as many tokens as one with). Then every uniform depth (each request d drafts, d = 0..k) whose token count was timed
fewer than `SWEEP_SAMPLES` times is asked for that often (`_sweep`): the cost of each depth is measured, not read off
a line between two far measurements (a GPU step is flat within a CUDA graph size and jumps at the next, so such a
line makes the depths between look dearer or cheaper than they are, and the ones that look dearer are never tried).
A choice made n times in a row for the same batch is then kept for min(n, KEEP) choices (`_kept_choice`): its inputs
move little between iterations, and choosing each time would put its host time on every step; a choice of no drafts
is kept longer (ZERO_KEEP), until a draft is verified. Every `EXPLORE_EVERY`-th choice (nobody drafting included)
explores for two iterations in a row, alternately one draft more for each request and a
shallower uniform depth (each request at most d drafts, d cycling below the deepest chosen): iteration times of more
and of fewer tokens and acceptance at deeper positions (or at all, after a run without drafts) stay measured, so the
choice follows a drafter whose acceptance changed and a step time measured once in a slow moment, either way. Between
those, every `RETIME_EVERY`-th choice runs again a close alternative timed before half the iterations recorded so far
(`_stale_close_alternative`), so that a slow start's prices are re-checked soon. After the server's first-position
acceptance rose (a drafter that got better: `draft_acceptance.py` tells the change), every `RETIME_EVERY`-th choice
explores one draft more each for a while (`_climb`), since the deeper depths were priced and counted before it.

Where a choice is made afresh, its costly part (the best rate's allocation, `best_allocation`) is computed while the
device runs the step before (`choose_ahead`, which the engines call once a step is on its way), from what was known
then.
"""

from __future__ import annotations

import abc
import operator
from dataclasses import dataclass, field

import numpy as np

from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.draft_acceptance import PositionCounts, ServerAcceptance
from specsplit.coordinator.step_cost import CostCurve, StepCostModel, bucket_of

EXPLORE_EVERY = 128
# Between those, every RETIME_EVERY choices: an alternative of the choice (one draft more each, or a shallower uniform
# depth) predicted within CLOSE of its rate whose steady run was last timed before half of the iterations recorded so
# far (or never) is run again (`_stale_close_alternative`). A price from a slow moment (clocks coming up, a busy host)
# would otherwise stand until the regular exploration reaches that depth; a close alternative costs little to time
# again.
RETIME_EVERY = 32
CLOSE = 1.15
MOVED = 0.2  # a rise of the server's first-position acceptance that starts a climb (`_climb`)
ZERO_KEEP = 16  # choices a choice of no drafts is kept while nothing it depends on changed
# Most choices a choice made again and again is kept for the same batch: choosing puts host time on the step's
# critical path, and a kept choice that is poor stays poor while it is kept. The value was chosen by measurement: the
# choice's share of a GPU step, and the simulated cells of tests/coordinator/test_draft_choice_simulated.py (which
# prices no host time), in which larger values kept a poor choice too long (docs/design.md §9, "Cost of the choice").
KEEP = 3
SWEEP_SAMPLES = 3  # iterations a never-timed depth is asked for (one time is too noisy to rank close depths)


class DraftPolicy(abc.ABC):
    """How many drafts each decoding request asks the drafter for (`choose`, every iteration), and what the choice
    learns from (`record_verified`, `record_iteration`; a policy that learns nothing keeps these no-ops). The
    scheduler calls every method, whichever the policy."""

    @abc.abstractmethod
    def choose(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None = None) -> list[int]:
        """Drafts to ask for, per decoding request, each at most its cap; `counts`: its acceptance per draft position;
        `remaining`: its tokens still to generate."""

    def choose_ahead(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None = None) -> None:
        """Prepares the next `choose` for this batch, while the device runs the current iteration."""
        return  # nothing to prepare

    def record_verified(self, counts: PositionCounts, num_drafts: int, num_accepted: int) -> None:
        """A request's verification of `num_drafts` drafts, the first `num_accepted` of them kept; `counts`: its
        acceptance per draft position."""
        return  # learns nothing

    def record_iteration(
        self,
        num_tokens: int,
        num_later_steps: int,
        seconds: float,
        later_steps_s: float | None,
        proposed: bool,
        propose_s: float | None,
        verified_depth: int,
    ) -> None:
        """A decode iteration's measured time (`StepCostModel.record`'s arguments)."""
        return  # learns nothing


class FixedDraftCount(DraftPolicy):
    """Every request asks for its cap (the fixed k: `--no-adaptive`, `num_speculative_tokens`); nothing is learned."""

    def choose(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None = None) -> list[int]:
        return list(caps)


def draft_policy(config: SchedulerConfig) -> DraftPolicy:
    """A new policy as `config` says: adaptive where it is on and requests may draft, else the fixed k."""
    if config.adaptive and config.num_speculative_tokens > 0:
        return AdaptiveDraftCount()
    return FixedDraftCount()


@dataclass(frozen=True)
class BatchChoice:
    """Draft counts chosen for a batch: its requests (their counts, by identity), their caps, and what was chosen."""

    caps: list[int]
    counts: list[PositionCounts]
    drafts: list[int]

    def is_for(self, caps: list[int], counts: list[PositionCounts]) -> bool:
        """The same requests (their counts, by identity) with the same caps."""
        return caps == self.caps and len(counts) == len(self.counts) and all(map(operator.is_, counts, self.counts))


@dataclass
class KeptChoice:
    """The last choice made afresh, kept for the same batch while it is young (`AdaptiveDraftCount._kept_choice`)."""

    choice: BatchChoice
    acceptance_version: int  # the server's acceptance it was made from (a choice of no drafts: kept while unchanged)
    repeats: int  # choices made afresh in a row before it that chose the same (it is kept for min(repeats, KEEP))
    age: int = 0  # choices that kept it so far

    def keeps(self, caps: list[int], counts: list[PositionCounts], acceptance_version: int) -> bool:
        """Whether the next choice for this batch keeps it."""
        if any(self.choice.drafts):
            stale = self.age + 1 >= min(self.repeats, KEEP)
        else:
            stale = self.acceptance_version != acceptance_version or self.age + 1 >= ZERO_KEEP
        return not stale and self.choice.is_for(caps, counts)


@dataclass
class ChoiceCounters:
    """Choices made (a sweep's are not counted: the exploration and re-timing run every so many), explorations
    (deeper and shallower in turn) and the climb after a change of the server's acceptance."""

    choices: int = 0
    explorations: int = 0
    low: float | None = None  # the server's first-position acceptance: its least since the last climb started
    climb_until: int = 0  # choices up to which every RETIME_EVERY-th explores deeper (after a rise)


@dataclass
class SweepProgress:
    """The sweep of uniform depths (`AdaptiveDraftCount._sweep`): iterations asked for per bucket of token counts, and
    the batches (size, deepest cap, least cap, caps' sum) with nothing left to sweep."""

    asked: dict[int, int] = field(default_factory=dict)
    done: set[tuple[int, int, int, int]] = field(default_factory=set)


class AdaptiveDraftCount(DraftPolicy):
    """Adaptive speculation (this module's docstring). What it learned, the step cost (`costs`) and the server's
    acceptance (`acceptance`), goes on with it to the next scheduler it is given to."""

    def __init__(self) -> None:
        self.costs = StepCostModel()
        self.acceptance = ServerAcceptance()
        self._counters = ChoiceCounters()
        self._swept = SweepProgress()
        self._kept: KeptChoice | None = None
        self._trial: BatchChoice | None = None  # a choice of a depth never run steadily, to repeat once
        self._ahead: BatchChoice | None = None  # the next best allocation, computed ahead (`choose_ahead`)
        self._none_last = False  # before a Propose's cost is known: the last choice was none (`_pair`)

    def _sweep(self, caps: list[int], num_reqs: int, max_cap: int) -> list[int] | None:
        """The uniform depth (every request that many drafts, at most its cap) whose token count was timed fewer than
        SWEEP_SAMPLES times, if any: asked for at most that often per bucket of token counts, so that the cost of
        every depth is measured rather than extrapolated (a GPU step's time is far from a line: flat, then a jump at
        each CUDA graph size)."""
        swept = self._swept
        batch = (num_reqs, max_cap, min(caps), sum(caps))  # (caps are mostly all k: then this is exact)
        if batch in swept.done:
            return None
        totals = num_reqs + np.minimum(np.arange(max_cap + 1)[:, None], np.array(caps)).sum(axis=1)
        for depth, total in enumerate(totals.tolist()):
            bucket = bucket_of(total)
            asked = swept.asked.get(bucket, 0)
            if asked < SWEEP_SAMPLES and self.costs.samples_at(total) < SWEEP_SAMPLES:
                swept.asked[bucket] = asked + 1
                return [min(depth, cap) for cap in caps]
        swept.done.add(batch)  # every depth of it swept (samples never decrease)
        return None

    @staticmethod
    def _sweeps_pay(remaining: list[int] | None, max_cap: int) -> bool:
        """Whether a batch with these tokens left may be swept: one whose requests have, on average, fewer tokens left
        than SWEEP_SAMPLES iterations at the deepest cap emit is ending, and a depth swept now prices batches to come
        while this one's last iterations run what the sweep asks instead of the best known choice (closed batches of
        short requests spent most of their tails sweeping the shrinking batch's new token counts, at no drafts)."""
        return not remaining or sum(remaining) >= SWEEP_SAMPLES * (max_cap + 1) * len(remaining)

    def record_verified(self, counts: PositionCounts, num_drafts: int, num_accepted: int) -> None:
        """A request's verification: its own counts and the server's."""
        if num_drafts > 0:
            counts.record(num_drafts, num_accepted)
            self.acceptance.record(num_drafts, num_accepted)

    def record_iteration(
        self,
        num_tokens: int,
        num_later_steps: int,
        seconds: float,
        later_steps_s: float | None,
        proposed: bool,
        propose_s: float | None,
        verified_depth: int,
    ) -> None:
        """A decode iteration's time, into the step cost; the server's acceptance told the iteration ended
        (`ServerAcceptance.end_iteration`: a change is looked for once per iteration)."""
        self.acceptance.end_iteration(verified_depth > 0)
        self.costs.record(num_tokens, num_later_steps, seconds, later_steps_s, proposed, propose_s, verified_depth)

    def choose_ahead(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None = None) -> None:
        """The best allocation (`best_allocation`, the choice's costly part) for this batch's next iteration, computed
        now: the engines call this while the device runs the current iteration, so that its host time (a few percent
        of a small batch's GPU step: docs/design.md §9, "Cost of the choice") leaves no GPU idle between two steps.
        The next `choose` takes it where it would compute the best allocation for the same requests with the same
        caps (a request that finished or arrived, or a cap cut near max_tokens, computes it afresh); everything else
        about the choice (kept choices, sweeps, trials, exploration) is decided there. It is computed from what was
        known one iteration earlier: the acceptance and time of the iteration still running are not in it, as they
        are not in a kept choice. Not computed where the next choice will keep the last one."""
        self._ahead = None
        max_cap = max(caps, default=0)
        if max_cap == 0 or not self.costs.ready or self.costs.propose_s is None or self._keeps(caps, counts):
            return
        self._ahead = BatchChoice(list(caps), list(counts), self._best(caps, counts, remaining))

    def choose(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None = None) -> list[int]:
        try:
            return self._choose(caps, counts, remaining)
        finally:
            self._ahead = None  # (made for this choice only)

    def _choose(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None) -> list[int]:
        num_reqs, max_cap = len(caps), max(caps, default=0)
        if max_cap == 0:
            return [0] * num_reqs
        if not self.costs.ready:
            return list(caps)
        if self.costs.propose_s is None:  # a Propose's cost: iterations with and without one, side by side
            return self._pair(caps)
        sweep = self._sweep(caps, num_reqs, max_cap) if self._sweeps_pay(remaining, max_cap) else None
        if sweep is not None:
            self._trial = None  # (a trial's second iteration must follow its first)
            return sweep
        chosen = self._repeated_trial(caps, counts)
        if chosen is None:
            chosen = self._kept_choice(caps, counts)
        if chosen is None:
            ahead = self._ahead
            if ahead is not None and ahead.is_for(caps, counts):
                chosen = list(ahead.drafts)  # computed while the last step ran
            else:
                chosen = self._best(caps, counts, remaining)
            self._trial = None
            later = max(chosen) - 1
            if later >= 0 and (bucket_of(num_reqs + sum(chosen)), later) not in self.costs.measured_runs:
                self._trial = BatchChoice(list(caps), list(counts), chosen)
            # Kept for the same batch (`_kept_choice`): a choice's inputs move little from one iteration to the
            # next, and choosing every iteration would put its host time on every step (docs/design.md §9, "Cost of
            # the choice").
            last = self._kept
            repeats = last.repeats + 1 if last is not None and last.choice.drafts == chosen else 0
            self._kept = KeptChoice(BatchChoice(list(caps), list(counts), chosen), self.acceptance.version, repeats)
        counters = self._counters
        counters.choices += 1
        # Every EXPLORE_EVERY choices (nobody drafting included: a drafter that got better is noticed so), twice in a
        # row, alternately: one draft more each, which measures more tokens and deeper positions, and a shallower
        # uniform depth (each request at most d drafts, d cycling through 0 .. the deepest chosen - 1). Both measure
        # that allocation's steady run again: a run measured in a slow moment is not kept for good, deeper or
        # shallower (nor, on a noisy host, a wrong choice of no drafts). Without the shallower ones, a depth whose
        # first runs were slow (the sweep runs depth 1 early, as the GPU's clocks come up) would never run again once
        # a deeper one was chosen, and a slower depth would stay chosen for good (docs/design.md §9, "Start, sweep
        # and exploration").
        # For EXPLORE_EVERY choices after the server's first-position acceptance rose by MOVED above its low since the
        # last climb, every RETIME_EVERY-th choice explores one draft more each: the deeper positions' counts and the
        # deeper depths' prices are from before the rise, maybe from another speed of the machine, and a depth at a
        # time every other exploration took hundreds of iterations to climb to where drafts pay (docs/design.md §9,
        # "A drafter whose acceptance changed").
        if counters.choices % RETIME_EVERY == 0:
            deeper = self._climb(chosen, caps)
            if deeper is not None:
                self._trial = BatchChoice(list(caps), list(counts), deeper)
                return deeper
        if counters.choices % RETIME_EVERY == 0 and counters.choices % EXPLORE_EVERY:
            explored = self._stale_close_alternative(chosen, caps, counts)
            if explored is not None:
                self._trial = BatchChoice(list(caps), list(counts), explored)
                return explored
        if counters.choices % EXPLORE_EVERY == 0:
            counters.explorations += 1
            deepest = max(chosen)
            deeper, *shallower = _alternatives(chosen, caps)
            if counters.explorations % 2 == 0 and deepest > 0:
                explored = shallower[(counters.explorations // 2) % deepest]
            else:
                explored = deeper
            self._trial = BatchChoice(list(caps), list(counts), explored)
            return explored
        return chosen

    def _pair(self, caps: list[int]) -> list[int]:
        """Before a Propose's cost is known: every request its cap until an iteration with a Propose was timed, then
        alternately none and the caps. An iteration that follows a choice of none verifies no drafts and, where the
        caps follow it, runs a Propose: beside the iterations that do neither, at the same token count, it prices the
        Propose. Choosing none from then on left that to the iteration right after the prefill, which with chunked
        prefill (a batch's prompts over several steps) shares its step with a prefill chunk and is not learned from:
        no Propose ran again, and no drafts stayed chosen for good."""
        if not self.costs.measured[1]:
            return list(caps)
        self._none_last = not self._none_last
        return [0] * len(caps) if self._none_last else list(caps)

    def _climb(self, chosen: list[int], caps: list[int]) -> list[int] | None:
        """One draft more each, while climbing after a rise of the server's acceptance; else None. The first reading
        only sets the low: the climb is for a drafter that got better, not for the first estimate."""
        counters = self._counters
        first, low = self.acceptance.means(1)[0], counters.low
        if low is not None and first > low + MOVED:
            counters.climb_until = counters.choices + EXPLORE_EVERY
            low = first
        counters.low = first if low is None else min(low, first)
        deeper = _alternatives(chosen, caps)[0]
        return deeper if counters.choices < counters.climb_until and deeper != chosen else None

    def _stale_close_alternative(
        self, chosen: list[int], caps: list[int], counts: list[PositionCounts]
    ) -> list[int] | None:
        """The alternative of `chosen` (one draft more each, or each shallower uniform depth) whose steady run was
        timed longest ago, among those timed before half of the iterations recorded so far (or never: the re-checks
        of one alternative grow ever rarer) and predicted within CLOSE of `chosen`'s rate; None if none is. Without
        it, a price from a slow start (the sweep times no drafts first) stands until the regular exploration reaches
        that alternative, and the choice drafts where no draft pays meanwhile (docs/design.md §9, "Timed again when
        stale and close")."""
        num_reqs, max_cap = len(chosen), max(caps, default=0)
        if max_cap == 0:
            return None
        costs = self.costs
        curve = costs.curve()
        gains = self.acceptance.gains(caps, counts, max_cap)
        taken = np.arange(max_cap)

        def rate(allocation: list[int]) -> float:
            drafts = sum(allocation)
            tokens = num_reqs + float((gains * (taken < np.array(allocation)[:, None])).sum())
            if drafts == 0:
                return tokens / curve.plain_s(num_reqs)
            return tokens / curve.iteration_s(num_reqs + drafts, max(allocation) - 1)

        alternatives = [a for a in _alternatives(chosen, caps) if a != chosen]  # (one more each: none past the caps)
        floor = rate(chosen) / CLOSE
        best, best_last = None, costs.num_samples // 2
        for allocation in alternatives:
            last = costs.last_timed(num_reqs + sum(allocation), max(allocation) - 1)
            if last < best_last and rate(allocation) >= floor:
                best, best_last = allocation, last
        return best

    def _repeated_trial(self, caps: list[int], counts: list[PositionCounts]) -> list[int] | None:
        """The last choice once more, if its (tokens, depth) was never run steadily and the batch is the same: the
        iteration that first proposes a new depth still verifies the previous choice's drafts, so only the second in
        a row shows what the choice costs (`StepCostModel.measured_runs`); else None."""
        trial, self._trial = self._trial, None
        if trial is None:
            return None
        return trial.drafts if trial.is_for(caps, counts) else None

    def _kept_choice(self, caps: list[int], counts: list[PositionCounts]) -> list[int] | None:
        """The last choice again, for the same requests and caps, if it was chosen n times in a row before and was made
        fewer than min(n, KEEP) choices ago (a choice that keeps changing is made afresh each time); a
        choice of no drafts fewer than ZERO_KEEP ago and only while no draft was verified since (nothing it
        depends on changes until then, but the step time of this batch and the tokens left: re-choosing it
        every time would cost a comparison of the batch's requests, not a choice). Else None (choose)."""
        if not self._keeps(caps, counts):
            return None
        self._kept.age += 1
        return list(self._kept.choice.drafts)

    def _keeps(self, caps: list[int], counts: list[PositionCounts]) -> bool:
        """Whether `_kept_choice` would keep the last choice for this batch now."""
        return self._kept is not None and self._kept.keeps(caps, counts, self.acceptance.version)

    def _best(self, caps: list[int], counts: list[PositionCounts], remaining: list[int] | None) -> list[int]:
        """`best_allocation` for this batch, as the step cost and the acceptance stand."""
        curve = self.costs.curve()
        return best_allocation(curve, self.acceptance.gains(caps, counts, max(caps)), caps, remaining)


def best_allocation(curve: CostCurve, gains: np.ndarray, caps: list[int], remaining: list[int] | None) -> list[int]:
    """The draft counts of the best rate (all 0 when no drafts pay): `gains` [num_reqs, max_cap] the marginal gains
    of each request's drafts (`ServerAcceptance.gains`), `curve` the iterations' predicted times, `remaining` each
    request's tokens still to generate."""
    num_reqs, max_cap = gains.shape
    # Every (request, draft) pair in falling order of gain weighted by the tokens the request has left (relative
    # to the batch's mean; to 1/100), then shallower first: each request's drafts come in order, so every prefix
    # is an allocation. Indices are depth * num_reqs + request (column-major: a stable sort keeps that tie order).
    weight = 1.0
    if remaining:
        weight = np.array(remaining, dtype=np.float64)[:, None] * (num_reqs / max(num_reqs, sum(remaining)))
    keys = -np.round(gains * weight, 2)
    if min(caps) < max_cap:
        keys[gains == 0] = np.inf  # past the request's cap: last, cut off
    keys = keys.T.ravel()
    order = keys.argsort(kind="stable")[: sum(caps)]
    depth_of, request_of = np.divmod(order, num_reqs)
    # The drafter's steps are a cost per depth, not per draft: for each depth D, every prefix of the order
    # restricted to drafts shallower than D (row D - 1), the rate of those ending at one of its drafts.
    shallower = depth_of[None, :] < np.arange(1, max_cap + 1)[:, None]  # [max_cap, len(order)]
    tokens = (shallower * gains.T.ravel()[order]).cumsum(axis=1)
    num_drafts = shallower.cumsum(axis=1)
    # Each prefix at its own depth (its deepest draft: a row's prefix need not reach the row's depth), so that an
    # allocation costs the same in every row it is in.
    later = np.maximum.accumulate(np.where(shallower, depth_of[None, :], 0), axis=1)
    totals = num_reqs + np.arange(len(order) + 1, dtype=np.float64)  # [0 .. every draft]
    seconds = curve.proposed_s_by_depth(totals, max_cap)[later, num_drafts]  # [L, drafts] → the prefixes'
    rates = np.where(shallower, (num_reqs + tokens) / seconds, -np.inf)
    best = int(rates.argmax())
    if rates.flat[best] <= num_reqs / curve.plain_s(num_reqs):  # (no drafts: no Propose)
        return [0] * num_reqs
    depth, end = divmod(best, len(order))
    taken = request_of[: end + 1][shallower[depth, : end + 1]]
    return np.bincount(taken, minlength=num_reqs).tolist()


def _alternatives(chosen: list[int], caps: list[int]) -> list[list[int]]:
    """What an exploration runs beside `chosen`: one draft more each (at most the cap), then each shallower uniform
    depth d = 0 .. the deepest chosen - 1 (each request at most d drafts)."""
    deeper = [min(n + 1, cap) for n, cap in zip(chosen, caps)]
    return [deeper] + [[min(n, d) for n in chosen] for d in range(max(chosen))]
