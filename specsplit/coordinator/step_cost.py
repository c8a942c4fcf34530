"""The iteration's time as a function of what it runs, learned online from measured iterations.

An iteration (the coordinator's schedule → the verifier's answer → post_step, which with async scheduling also
covers the drafter's Propose whose drafts it verifies) takes

    time(T, P, L) = base(T) + P * propose + L * later_step

where T is the number of tokens the target runs (per decoding request its last token and its drafts), P whether a
Propose ran (none does when no request wants drafts) and L the drafter's MTP steps after step 0 (the largest draft
count asked for, minus one). `later_step` is the drafter's own report (its `later_steps_ns` over L). `base(T)` is
kept per bucket of T (buckets 1/16 of an octave wide; in each an exponential moving average of T and of the time
without L's steps, apart for iterations with and without a Propose). `propose`, the Propose's fixed cost (its step 0,
the hand-off, its hops), is measured apart where the engine can (the services: the Verify's wait for it) and else
learned where one bucket holds both kinds: the iterations that stop or start drafting put them side by side. The
curve is made nondecreasing in T and read between buckets by linear interpolation (`CostCurve` says how outside
them). Only decode iterations are recorded (prefill chunks cost differently per token).
"""

from __future__ import annotations

import bisect
import math

EMA = 0.25  # weight of a new measurement
BUCKETS_PER_OCTAVE = 16


class _Bucket:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = float(num_tokens)
        self.seconds = [0.0, 0.0]  # [without a Propose, with one]
        self.weight = [0.0, 0.0]  # samples (at most 1 / EMA: an EMA's effective number)

    def add(self, num_tokens: int, seconds: float, proposed: bool) -> None:
        self.num_tokens += EMA * (num_tokens - self.num_tokens)
        i = int(proposed)
        self.seconds[i] = seconds if not self.weight[i] else self.seconds[i] + EMA * (seconds - self.seconds[i])
        self.weight[i] = min(self.weight[i] + 1, 1 / EMA)


class StepCostModel:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._keys: list[int] = []  # sorted bucket ids
        self.later_step_s: float | None = None  # one MTP step after step 0, seconds
        self.propose_s: float | None = None  # a Propose's fixed cost, seconds
        self.measured = [False, False]  # iterations [without, with] a Propose recorded
        self.num_samples = 0
        self._curve: CostCurve | None = None  # the last curve, until the next record

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return int(math.floor(math.log2(max(1, num_tokens)) * BUCKETS_PER_OCTAVE))

    def record(
        self,
        num_tokens: int,
        num_later_steps: int,
        seconds: float,
        later_steps_s: float | None = None,
        proposed: bool = True,
        propose_s: float | None = None,
    ) -> None:
        """One decode iteration: `num_tokens` run by the target, `proposed` whether a Propose ran and
        `num_later_steps` its drafter steps after step 0, `seconds` its time; `later_steps_s`: the drafter's report
        of those steps' time, when it has one; `propose_s`: the Propose's fixed cost in it, when measured apart
        (the services: how long the Verify waited for it, less its later steps)."""
        self._curve = None
        if later_steps_s is not None and num_later_steps > 0:
            per_step = later_steps_s / num_later_steps
            self.later_step_s = (
                per_step if self.later_step_s is None else self.later_step_s + EMA * (per_step - self.later_step_s)
            )
        if num_tokens < 1 or seconds <= 0:
            return
        if num_later_steps > 0 and self.later_step_s is None:
            return  # no split of its time yet
        key = self._bucket(num_tokens)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(num_tokens)
            bisect.insort(self._keys, key)
        seconds -= num_later_steps * (self.later_step_s or 0.0)
        if proposed and propose_s is not None:  # measured apart: the rest is the step without a Propose
            propose_s = max(propose_s, 0.0)
            self.propose_s = (
                propose_s if self.propose_s is None else self.propose_s + EMA * (propose_s - self.propose_s)
            )
            seconds, proposed = seconds - propose_s, False
        bucket.add(num_tokens, max(seconds, 1e-6), proposed)
        self.measured[int(proposed)] = True
        if all(bucket.weight):  # both kinds side by side: the Propose's cost
            sample = max(bucket.seconds[1] - bucket.seconds[0], 0.0)
            self.propose_s = sample if self.propose_s is None else self.propose_s + EMA * (sample - self.propose_s)
        self.num_samples += 1

    @property
    def ready(self) -> bool:
        return bool(self._keys)

    def curve(self) -> CostCurve:
        """The model as it stands (call only when `ready`), for the predictions of one choice."""
        if self._curve is None:
            propose = self.propose_s or 0.0
            points = []
            for key in self._keys:
                b = self._buckets[key]
                base = b.seconds[0] if b.weight[0] else max(b.seconds[1] - propose, 1e-6)
                points.append((b.num_tokens, base, b.weight[0] + b.weight[1]))
            tokens, seconds = _nondecreasing(points)
            self._curve = CostCurve(tokens, seconds, propose, self.later_step_s or 0.0)
        return self._curve


def _nondecreasing(points: list[tuple[float, float, float]]) -> tuple[list[float], list[float]]:
    """The points' times made nondecreasing in T (pool adjacent violators, weighted by samples): a bucket measured
    once in a slow moment cannot make its token count look dearer than more tokens, and keep it from being tried.
    A pooled run of points is flat over the token counts it spans (both ends are returned)."""
    blocks: list[list[float]] = []  # [sum of w*time, sum of w, first T, last T]
    for t, v, n in points:
        blocks.append([n * v, float(n), t, t])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            blocks[-1] = [blocks[-1][0] + last[0], blocks[-1][1] + last[1], blocks[-1][2], last[3]]
    tokens, seconds = [], []
    for total, weight, first, last in blocks:
        for t in (first, last) if last > first else (first,):
            tokens.append(t)
            seconds.append(total / weight)
    return tokens, seconds


class CostCurve:
    """base(T) through measured points (T ascending), a Propose's fixed cost and one later drafter step's.

    Between points: linear. Below the first: its time (time does not fall with more tokens). Above the last: the
    chord from the first to the last point continued (0 slope with one point); optimistic, so a larger step gets
    tried, measured and, if dearer, corrected (the exploration of `draft_choice.py` makes sure it is)."""

    def __init__(self, tokens: list[float], seconds: list[float], propose_s: float, later_step_s: float):
        self.tokens, self.seconds, self.propose_s, self.later_step_s = tokens, seconds, propose_s, later_step_s
        span = tokens[-1] - tokens[0]
        self._slope = (seconds[-1] - seconds[0]) / span if span > 0 else 0.0

    def base_s(self, num_tokens: float) -> float:
        ts, vs = self.tokens, self.seconds
        i = bisect.bisect_left(ts, num_tokens)
        if i == len(ts):
            return vs[-1] + self._slope * (num_tokens - ts[-1])
        if i == 0:
            return vs[0]
        t0, t1 = ts[i - 1], ts[i]
        return vs[i - 1] + (vs[i] - vs[i - 1]) * (num_tokens - t0) / (t1 - t0)

    def iteration_s(self, num_tokens: float, num_later_steps: int, proposed: bool = True) -> float:
        """Predicted time of an iteration running `num_tokens`, with a Propose of `num_later_steps` drafter steps
        after step 0 or without one."""
        if not proposed:
            return self.base_s(num_tokens)
        return self.base_s(num_tokens) + self.propose_s + max(0, num_later_steps) * self.later_step_s
