"""The iteration's time as a function of what it runs, learned online from measured iterations.

An iteration (the coordinator's schedule → the verifier's answer → post_step, which with async scheduling also
covers the drafter's Propose whose drafts it verifies) takes

    time(T, P, L) = base(T) + P * propose + L * later_step

where T is the number of tokens the target runs (per decoding request its last token and its drafts), P whether a
Propose ran (none does when no request wants drafts) and L the drafter's MTP steps after step 0 (the largest draft
count asked for, minus one). `later_step` is the drafter's own report (its `later_steps_ns` over L). `base(T)` is
kept per bucket of T (buckets 1/16 of an octave wide, each topped by a power of two where the verifier's CUDA graph
sizes jump; in each an exponential moving average of T and of the time without L's steps, apart for iterations with
and without a Propose). `propose`, the Propose's fixed cost (its step 0,
the hand-off, its hops), is measured apart where the engine can (the services: the Verify's wait for it) and else
learned where one bucket holds both kinds: the iterations that stop or start drafting put them side by side. The
curve is made nondecreasing in T and read as a staircase: a token count costs what the next measured bucket at or
above it costs (`CostCurve`; a step's time jumps at a graph size and is flat until the next, so a line between two
measurements would make the token counts between them look cheaper than they are). Only decode iterations are
recorded (prefill chunks cost differently per token). Every estimate leaves hiccups out (`HICCUP`).

The sum is a guess where nothing closer is known, not a law: an iteration with a Propose is also kept whole, per
bucket of T and L (`measured_runs`), and once a (T, L) was run steadily (verifying as deep as it proposes), its own
time is what it costs (the least of its recent samples, `_Run`). The drafter's report of its later steps can miss
part of their cost, and a batch whose requests verify different draft counts can cost more than its T says (it can
run as long as its deepest request's depth: docs/design.md §9, "What was run steadily costs what it took"): the sum
cannot see either, so a chooser that trusts it picks such a batch again and again, and only its measured time shows
what it costs. A (T, L) never run is priced by the sum, tried when it looks best, and then known.
"""

from __future__ import annotations

import bisect
import collections
import math

import numpy as np

EMA = 0.25  # weight of a new measurement
BUCKETS_PER_OCTAVE = 16
RUN_SAMPLES = 2  # steady runs of a (T, L) after which their time alone prices it (after one: its mean with the sum)
RUN_WINDOW = 4  # a steady run's time: the least of its last this many samples (`_Run`)
# A sample this many times its estimate's value is a hiccup (a kernel compiled at first use, a pause), not what the
# step costs, and is left out unless the sample before it was one too (a cost that really rose stays high). A kernel
# compiled at the first iteration of a new depth makes that iteration many times a step's time; taken in, it pulls the
# learned cost of a batch without drafts down to where no draft pays (docs/design.md §9, "Cost").
HICCUP = 4.0


def is_hiccup(sample: float, estimate: float | None, previous_was: bool) -> bool:
    """Whether `sample` is left out of an estimate that stands at `estimate` (None: no estimate yet)."""
    return estimate is not None and sample > HICCUP * estimate and not previous_was


class _Bucket:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = float(num_tokens)
        self.seconds = [0.0, 0.0]  # [without a Propose, with one]
        self.weight = [0.0, 0.0]  # samples (at most 1 / EMA: an EMA's effective number)
        self.hiccup = [False, False]  # the last sample was left out

    def add(self, num_tokens: int, seconds: float, proposed: bool) -> None:
        """The mean of the first 1 / EMA samples, then an EMA: the first sample (a sweep's, maybe in a slow moment)
        weighs no more than the later ones. A hiccup (`is_hiccup`) is left out; while the first 1 / EMA samples are
        averaged, a sample HICCUP times below their mean starts it afresh (the first one was the hiccup)."""
        i = int(proposed)
        estimate = self.seconds[i] if self.weight[i] else None
        self.hiccup[i] = is_hiccup(seconds, estimate, self.hiccup[i])
        if self.hiccup[i]:
            return
        if estimate is not None and seconds * HICCUP < estimate and self.weight[i] < 1 / EMA:
            self.weight[i] = 0.0
        self.num_tokens += EMA * (num_tokens - self.num_tokens)
        self.weight[i] = min(self.weight[i] + 1, 1 / EMA)
        self.seconds[i] += (seconds - self.seconds[i]) / self.weight[i]


class _Run(_Bucket):
    """A (bucket of T, L) run steadily, or a bucket of T run steadily without drafts (`StepCostModel.plain_runs`): its
    time is the least of its last RUN_WINDOW samples (`floor`, kept in the with-a-Propose slot); `last` is the model's
    sample count at its last sample (how long ago it was timed: `AdaptiveDraftCount`'s re-timing). A step's time
    only gains from noise (a host hiccup, clocks still coming up), and a depth the choice has left is measured again
    only now and then (an exploration): an average would keep the slow moment of its first runs for thousands of
    choices, and a slower depth would stay chosen (docs/design.md §9, "What was run steadily costs what it took"). The
    least of a few recent samples forgets a slow moment at the first good sample, and still shows a cost that rose
    once every recent sample did."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(num_tokens)
        self.recent: collections.deque[float] = collections.deque(maxlen=RUN_WINDOW)
        self.last = -1

    def add(self, num_tokens: int, seconds: float, sample_index: int) -> None:
        super().add(num_tokens, seconds, True)
        if not self.hiccup[1]:
            self.recent.append(seconds)
            self.last = sample_index

    @property
    def floor(self) -> float:
        return min(self.recent) if self.recent else self.seconds[1]


class StepCostModel:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._keys: list[int] = []  # sorted bucket ids
        self._later = _Bucket(0)  # one MTP step after step 0 (`later_step_s`), from the drafter's reports
        self.propose_s: float | None = None  # a Propose's fixed cost, seconds
        self.measured = [False, False]  # iterations [without, with] a Propose recorded
        self.num_samples = 0
        self.measured_runs: dict[tuple[int, int], _Run] = {}  # (bucket of T, L) → whole iterations with a Propose
        # bucket of T → iterations that verified no drafts and proposed none: what no drafts costs, priced as a steady
        # run with drafts is (`CostCurve.plain_s`), so that the two compare alike.
        self.plain_runs: dict[int, _Run] = {}
        # The same runs per L as the curve reads them, (buckets, seconds, samples) ascending; rebuilt per L only when
        # one of its runs changed (a curve is built after every recorded iteration, on the coordinator's loop).
        self._runs_by_depth: dict[int, dict[int, _Run]] = {}
        self._run_arrays: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._stale_depths: set[int] = set()
        self._curve: CostCurve | None = None  # the last curve, until the next record

    @property
    def later_step_s(self) -> float | None:
        """One MTP step after step 0, seconds (None: never reported)."""
        return self._later.seconds[0] if self._later.weight[0] else None

    def samples_at(self, num_tokens: int) -> float:
        """How many iterations of `num_tokens` tokens (their bucket) were timed (at most 2 / EMA: an EMA's effective
        number, with and without a Propose)."""
        bucket = self._buckets.get(bucket_of(num_tokens))
        return sum(bucket.weight) if bucket is not None else 0.0

    def record(
        self,
        num_tokens: int,
        num_later_steps: int,
        seconds: float,
        later_steps_s: float | None = None,
        proposed: bool = True,
        propose_s: float | None = None,
        verified_depth: int | None = None,
    ) -> None:
        """One decode iteration: `num_tokens` run by the target, `proposed` whether a Propose ran and
        `num_later_steps` its drafter steps after step 0, `seconds` its time; `later_steps_s`: the drafter's report
        of those steps' time, when it has one; `propose_s`: the Propose's fixed cost in it, when measured apart
        (the services: how long the Verify waited for it, less its later steps); `verified_depth`: the most drafts
        a request verified in it. An iteration is kept whole (`measured_runs`) only where it verified as deep as it
        proposes (verified_depth = L + 1), as every iteration of a steady choice does: one that changes the depth
        verifies one choice's batch and proposes another's."""
        self._curve = None
        if later_steps_s is not None and num_later_steps > 0:
            per_step = later_steps_s / num_later_steps
            self._later.add(0, per_step, False)
        if num_tokens < 1 or seconds <= 0:
            return
        if num_later_steps > 0 and self.later_step_s is None:
            return  # no split of its time yet
        key = bucket_of(num_tokens)
        if proposed and verified_depth == num_later_steps + 1:
            run = self.measured_runs.get((key, num_later_steps))
            if run is None:
                run = self.measured_runs[(key, num_later_steps)] = _Run(num_tokens)
                self._runs_by_depth.setdefault(num_later_steps, {})[key] = run
            run.add(num_tokens, seconds, self.num_samples)
            self._stale_depths.add(num_later_steps)
        elif not proposed and verified_depth == 0:
            self.plain_runs.setdefault(key, _Run(num_tokens)).add(num_tokens, seconds, self.num_samples)
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

    def last_timed(self, num_tokens: int, num_later_steps: int) -> int:
        """When a steady run of `num_tokens` with a Propose of `num_later_steps` drafter steps after step 0 (-1:
        without drafts) was last timed, as the count of iterations recorded before it (-1: never)."""
        key = bucket_of(num_tokens)
        run = self.plain_runs.get(key) if num_later_steps < 0 else self.measured_runs.get((key, num_later_steps))
        return -1 if run is None else run.last

    def curve(self) -> CostCurve:
        """The model as it stands (call only when `ready`), for the predictions of one choice."""
        if self._curve is None:
            propose = self.propose_s or 0.0
            points = []
            for key in self._keys:
                b = self._buckets[key]
                base = b.seconds[0] if b.weight[0] else max(b.seconds[1] - propose, 1e-6)
                points.append((base, b.weight[0] + b.weight[1]))
            seconds = _nondecreasing(points)
            tokens = [self._buckets[key].num_tokens for key in self._keys]
            for later in self._stale_depths:
                runs = sorted(self._runs_by_depth[later].items())
                self._run_arrays[later] = (
                    np.array([key for key, _ in runs], dtype=np.float64),
                    np.array([run.floor for _, run in runs]),
                    np.array([run.weight[1] for _, run in runs]),
                )
            self._stale_depths.clear()
            plain = {key: (run.floor, run.weight[1]) for key, run in self.plain_runs.items()}
            self._curve = CostCurve(
                list(self._keys), tokens, seconds, propose, self.later_step_s or 0.0, dict(self._run_arrays), plain
            )
        return self._curve


def bucket_of(num_tokens: float) -> int:
    """The bucket of a token count: (2^((b-1)/16), 2^(b/16)], so that every power of two tops a bucket (the verifier's
    CUDA graphs run a step in the smallest power-of-two size that holds it: a bucket never straddles two sizes)."""
    return math.ceil(math.log2(max(1.0, num_tokens)) * BUCKETS_PER_OCTAVE - 1e-9)


def _buckets_of(num_tokens: np.ndarray) -> np.ndarray:
    """`bucket_of` of every element (as floats)."""
    return np.ceil(np.log2(np.maximum(num_tokens, 1.0)) * BUCKETS_PER_OCTAVE - 1e-9)


def _nondecreasing(points: list[tuple[float, float]]) -> list[float]:
    """The points' times (with their sample weights) made nondecreasing (pool adjacent violators, weighted by
    samples): a bucket measured once in a slow moment cannot make its token count look dearer than more tokens, and
    keep it from being tried. Each point gets its pooled run's mean."""
    blocks: list[list[float]] = []  # [sum of w*time, sum of w, number of points]
    for v, n in points:
        blocks.append([n * v, float(n), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            blocks[-1] = [blocks[-1][0] + last[0], blocks[-1][1] + last[1], blocks[-1][2] + last[2]]
    return [total / weight for total, weight, count in blocks for _ in range(int(count))]


class CostCurve:
    """base(T) through measured buckets (ascending), a Propose's fixed cost and one later drafter step's.

    A token count costs what the first measured bucket at or above it costs: a staircase through the measurements,
    as the verifier's step is (flat within a CUDA graph's size, a jump to the next), and never below what a larger
    measured step costs; between measurements it is dear rather than cheap, and what is chosen gets measured. Below
    the first: its time. Above the last: the chord from the first to the last point continued (0 slope with one
    point); optimistic, so a larger step gets tried, measured and, if dearer, corrected.

    An iteration with a Propose costs its measured time where its (bucket of T, L) was run (`runs`), else the sum;
    after a single run, the mean of the two (one slow moment must not keep a depth from being chosen again, and so
    from ever being measured again; a cost the sum misses by far still shows)."""

    def __init__(
        self,
        keys: list[int],
        tokens: list[float],
        seconds: list[float],
        propose_s: float,
        later_step_s: float,
        runs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,  # L → (buckets, seconds, samples)
        plain: dict[int, tuple[float, float]] | None = None,  # bucket → (seconds, samples), steady without drafts
    ):
        self.keys, self.tokens, self.seconds = keys, tokens, seconds
        self.runs = runs or {}  # each L's measured runs, by ascending bucket
        self.plain = plain or {}
        self._keys, self._seconds = np.array(keys, dtype=np.float64), np.array(seconds)
        self.propose_s, self.later_step_s = propose_s, later_step_s
        span = tokens[-1] - tokens[0]
        self._slope = (seconds[-1] - seconds[0]) / span if span > 0 else 0.0

    def base_s(self, num_tokens: float) -> float:
        i = bisect.bisect_left(self.keys, bucket_of(num_tokens))
        if i == len(self.keys):
            return self.seconds[-1] + self._slope * (num_tokens - self.tokens[-1])
        return self.seconds[i]

    def base_s_of(self, num_tokens: np.ndarray) -> np.ndarray:
        """`base_s` of every element."""
        keys = _buckets_of(num_tokens)
        index = np.searchsorted(self._keys, keys)
        above = index == len(self.keys)
        out = self._seconds[np.minimum(index, len(self.keys) - 1)]
        if above.any():
            out = np.where(above, out + self._slope * (num_tokens - self.tokens[-1]), out)
        return out

    def proposed_s_by_depth(self, num_tokens: np.ndarray, num_depths: int) -> np.ndarray:
        """[num_depths, len(num_tokens)]: predicted time of iterations running each of `num_tokens` with a Propose
        of L = 0 .. num_depths - 1 drafter steps after step 0: measured where that (bucket, L) was run, else the sum."""
        summed = self.base_s_of(num_tokens) + self.propose_s + np.arange(num_depths)[:, None] * self.later_step_s
        buckets = _buckets_of(num_tokens)
        for later, (keys, run_s, samples) in self.runs.items():
            if later < num_depths:
                index = np.minimum(np.searchsorted(keys, buckets), len(keys) - 1)
                measured = np.where(samples[index] >= RUN_SAMPLES, run_s[index], (run_s[index] + summed[later]) / 2)
                summed[later] = np.where(keys[index] == buckets, measured, summed[later])
        return summed

    def plain_s(self, num_tokens: float) -> float:
        """Predicted time of an iteration running `num_tokens` without drafts: where that bucket was run so steadily,
        what it took (the least of its recent samples; after a single run, its mean with `base_s`), as a steady run
        with drafts is priced; else `base_s`. A mean of every sample instead would hold a slow moment's price of no
        drafts against the least of the drafting runs' recent samples, and one new sample would barely move it."""
        base = self.base_s(num_tokens)
        run = self.plain.get(bucket_of(num_tokens))
        if run is None:
            return base
        floor, samples = run
        return floor if samples >= RUN_SAMPLES else (floor + base) / 2

    def iteration_s(self, num_tokens: float, num_later_steps: int, proposed: bool = True) -> float:
        """Predicted time of an iteration running `num_tokens`, with a Propose of `num_later_steps` drafter steps
        after step 0 or without one."""
        if not proposed:
            return self.plain_s(num_tokens)
        later = max(0, num_later_steps)
        return float(self.proposed_s_by_depth(np.array([float(num_tokens)]), later + 1)[later, 0])
