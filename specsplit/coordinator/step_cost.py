"""The iteration's time as a function of what it runs, learned online from measured iterations.

An iteration (the coordinator's schedule → the verifier's answer → post_step, which with async scheduling also
covers the drafter's Propose whose drafts it verifies) takes

    time(T, L) = base(T) + L * later_step

where T is the number of tokens the target runs (per decoding request its last token and its drafts) and L the
drafter's MTP steps after step 0 (the largest draft count asked for, minus one). `later_step` is the drafter's own
report (its `later_steps_ns` over L). `base(T)`, the verifier's step, the drafter's step 0 over the iteration's
rows and the hops, is what remains; it is kept per bucket of T (buckets 1/16 of an octave wide, an exponential
moving average of T and of the time in each), made nondecreasing in T, and read between buckets by linear
interpolation. Below the smallest
bucket it is that bucket's time (an upper bound: time does not fall with more tokens), above the largest it grows in
proportion to T (as if compute-bound; pessimistic, so speculating past what was measured must pay for it).
Only decode iterations are recorded (prefill chunks cost differently per token).
"""

from __future__ import annotations

import bisect
import math

EMA = 0.25  # weight of a new measurement
BUCKETS_PER_OCTAVE = 16


class StepCostModel:
    def __init__(self) -> None:
        self._buckets: dict[int, list[float]] = {}  # bucket -> [mean T, mean base time in s, samples]
        self._keys: list[int] = []  # sorted bucket ids
        self.later_step_s: float | None = None  # one MTP step after step 0, seconds
        self.num_samples = 0
        self._curve: CostCurve | None = None  # the last curve, until the next record

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return int(math.floor(math.log2(max(1, num_tokens)) * BUCKETS_PER_OCTAVE))

    def record(self, num_tokens: int, num_later_steps: int, seconds: float, later_steps_s: float | None = None) -> None:
        """One decode iteration: `num_tokens` run by the target, `num_later_steps` drafter steps after step 0,
        `seconds` its time; `later_steps_s`: the drafter's report of those steps' time, when it has one."""
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
        base = max(seconds - num_later_steps * (self.later_step_s or 0.0), 1e-6)
        key = self._bucket(num_tokens)
        entry = self._buckets.get(key)
        if entry is None:
            self._buckets[key] = [float(num_tokens), base, 1]
            bisect.insort(self._keys, key)
        else:
            entry[0] += EMA * (num_tokens - entry[0])
            entry[1] += EMA * (base - entry[1])
            entry[2] = min(entry[2] + 1, 1 / EMA)  # as weight: an EMA's effective number of samples
        self.num_samples += 1

    @property
    def ready(self) -> bool:
        return bool(self._keys)

    def curve(self) -> CostCurve:
        """The model as it stands (call only when `ready`), for the predictions of one choice."""
        if self._curve is None:
            tokens, seconds = _nondecreasing([self._buckets[k] for k in self._keys])
            self._curve = CostCurve(tokens, seconds, self.later_step_s or 0.0)
        return self._curve


def _nondecreasing(points: list[list[float]]) -> tuple[list[float], list[float]]:
    """The points' times made nondecreasing in T (pool adjacent violators, weighted by samples): a bucket measured
    once in a slow moment cannot make its token count look dearer than more tokens, and keep it from being tried."""
    blocks: list[list[float]] = []  # [sum of w*T, sum of w*time, sum of w]
    for t, v, n in points:
        blocks.append([n * t, n * v, float(n)])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            last = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1], last)]
    return [b[0] / b[2] for b in blocks], [b[1] / b[2] for b in blocks]


class CostCurve:
    """base(T) through measured points (T ascending), and the cost of one later drafter step."""

    def __init__(self, tokens: list[float], seconds: list[float], later_step_s: float):
        self.tokens, self.seconds, self.later_step_s = tokens, seconds, later_step_s

    @property
    def min_tokens(self) -> float:
        return self.tokens[0]

    def base_s(self, num_tokens: float) -> float:
        ts, vs = self.tokens, self.seconds
        i = bisect.bisect_left(ts, num_tokens)
        if i == len(ts):  # above everything measured: in proportion to T
            return vs[-1] * num_tokens / ts[-1]
        if i == 0:  # below everything measured: the smallest measurement
            return vs[0]
        t0, t1 = ts[i - 1], ts[i]
        return vs[i - 1] + (vs[i] - vs[i - 1]) * (num_tokens - t0) / (t1 - t0)

    def iteration_s(self, num_tokens: float, num_later_steps: int) -> float:
        """Predicted time of an iteration running `num_tokens` with `num_later_steps` drafter steps after step 0."""
        return self.base_s(num_tokens) + max(0, num_later_steps) * self.later_step_s
