"""Host time of adaptive speculation's choice per iteration, on CPU, without a model: what the coordinator's loop
spends in `StepCostModel.record` (one measured iteration) and `DraftChooser.choose` (the next choice, which builds the
cost curve anew after every record), as the scheduler calls them once per decode iteration.

The cost model is filled first as a long run fills it: every bucket of token counts up to the largest batch's
k + 1 tokens per request timed with and without a Propose, and `--runs` steady (T, L) runs (`measured_runs`, which
grow as the choice explores). Requests' acceptance counts come from `--alpha`.

    python benchmarks/chooser_host.py --batches 8 32 64 128 --k 5 --runs 60 400 --repeats 3

prints the median and range over the repeats of the milliseconds per iteration (record + choose) per cell.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specsplit.coordinator.draft_acceptance import PositionCounts
from specsplit.coordinator.draft_choice import DraftChooser


def staircase_s(num_tokens: int) -> float:
    """A verifier step's time, flat within a power-of-two size (the H200 fit's shape: 4.3 ms at 1, 8.2 ms at 256)."""
    size = 1 << max(0, int(num_tokens - 1).bit_length())
    return 0.0043 + 0.0039 * min(size, 256) / 256 + 0.00003 * max(0, size - 256)


def filled_chooser(batch: int, k: int, num_runs: int, alpha: float, seed: int = 0):
    chooser = DraftChooser()
    rng = np.random.default_rng(seed)
    later_s, propose_s = 0.0003, 0.001
    for tokens in range(1, batch * (k + 1) + 1):
        chooser.costs.record(tokens, 0, staircase_s(tokens), proposed=False)
        chooser.costs.record(tokens, 0, staircase_s(tokens) + propose_s, later_steps_s=0.0, propose_s=propose_s)
    # Steady runs spread over the token counts and depths a batch of `batch` reaches.
    for i in range(num_runs):
        later = i % k
        tokens = int(rng.integers(batch, batch * (later + 2) + 1))
        seconds = staircase_s(tokens) + propose_s + later * later_s
        chooser.costs.record(tokens, later, seconds, later_steps_s=later * later_s, verified_depth=later + 1)
    counts = [PositionCounts() for _ in range(batch)]
    for c in counts:
        for _ in range(16):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            chooser.record_verified(c, k, accepted)
    return chooser, counts


def ms_per_iteration(batch: int, k: int, num_runs: int, alpha: float, iterations: int) -> float:
    chooser, counts = filled_chooser(batch, k, num_runs, alpha)
    caps, remaining = [k] * batch, [256] * batch
    chosen = chooser.choose(caps, counts, remaining)
    t0 = time.perf_counter()
    for _ in range(iterations):
        tokens, later = batch + sum(chosen), max(chosen) - 1
        seconds = staircase_s(tokens) + 0.001 + max(later, 0) * 0.0003
        chooser.costs.record(tokens, max(later, 0), seconds, later_steps_s=max(later, 0) * 0.0003,
                             verified_depth=max(chosen))  # fmt: skip
        chosen = chooser.choose(caps, counts, remaining)
    return 1e3 * (time.perf_counter() - t0) / iterations


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64, 128])
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--runs", type=int, nargs="+", default=[60, 400], help="steady (T, L) runs recorded first")
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"record + choose, ms per iteration (median [min, max] of {args.repeats}), k {args.k}, alpha {args.alpha}")
    for num_runs in args.runs:
        for batch in args.batches:
            times = [
                ms_per_iteration(batch, args.k, num_runs, args.alpha, args.iterations) for _ in range(args.repeats)
            ]
            chooser, _ = filled_chooser(batch, args.k, num_runs, args.alpha)
            measured = len(chooser.costs.measured_runs)
            print(f"runs {num_runs:4d} ({measured:3d} distinct)  batch {batch:4d}:  {statistics.median(times):.3f} ms "
                  f"[{min(times):.3f}, {max(times):.3f}]")  # fmt: skip


if __name__ == "__main__":
    main()
