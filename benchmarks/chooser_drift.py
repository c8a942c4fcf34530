"""How well adaptive speculation chooses while the machine's speed drifts, on the simulated H200 of
tests/coordinator/test_draft_choice_simulated.py (no model, no GPU; deterministic: one invocation is every invocation).

On the H200 the same target-only window at batch 128 ran 15-25 % apart from one round to the next, and on the 2-core
CPU machine every mode's rounds differ by up to 40 %: the chooser prices each allocation by what it took when it ran,
and allocations timed in different moments are compared as if the machine had one speed. Here the chooser sees every
iteration's time (and the drafter's report of its later steps) multiplied by a pace that changes over the iterations,
and each window is scored at the unscaled times: tokens/s of what it chose, not of how fast the machine was. Fixed k
does not depend on timings and is scored the same way. Per cell (the issue's grid with the ragged cost, the mixed
batch with the sum's and the ragged cost): adaptive's median and worst window over `--windows` windows, each over the
best fixed k's median, for `--offsets` starting points of the pace (one drift's phase decides much of a cell's result).

    python benchmarks/chooser_drift.py                         # --pace none, square 50 1.25, random 20 1.3
    python benchmarks/chooser_drift.py --pace square 50 1.25   # slow (x1.25) for 50 iterations in every 100

Paces: `none`; `square PERIOD SLOW` (PERIOD iterations at 1, PERIOD at SLOW, ...); `random PERIOD SLOW` (a new level
uniform in [1, SLOW] every PERIOD iterations, the same levels in every run).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specsplit.coordinator.draft_choice import DraftChooser  # noqa: E402
from tests.coordinator.test_draft_choice_simulated import K_MAX, LEARN, TIMED, tokens_per_s  # noqa: E402

CELLS = [([a] * b, True) for a in (0.3, 0.6, 0.9) for b in (1, 8, 32, 64, 128)]
CELLS += [([0.9, 0.2] * 16, False), ([0.9, 0.2] * 16, True)]


def pace_of(kind: str, period: int, slow: float, offset: int = 0):
    """A function of nothing returning the pace of the next iteration (its own iteration count, from `offset`)."""
    clock = itertools.count(offset)
    if kind == "none":
        return lambda: 1.0
    if kind == "square":
        return lambda: slow if (next(clock) // period) % 2 else 1.0
    return lambda: 1.0 + (slow - 1.0) * random.Random(next(clock) // period).random()


def best_fixed(alphas: list[float], ragged: bool) -> tuple[float, int]:
    """The best fixed k's median tokens/s over three windows, and that k."""
    timed = max(TIMED, 128 // len(alphas))
    fixed = {
        k: statistics.median(tokens_per_s(alphas, k, None, timed, seed, ragged) for seed in range(3))
        for k in range(K_MAX + 1)
    }
    best = max(fixed, key=fixed.get)
    return fixed[best], best


def adaptive_windows(alphas: list[float], ragged: bool, pace, windows: int) -> list[float]:
    """Adaptive's tokens/s in `windows` windows after its learning run, the machine drifting throughout."""
    timed = max(TIMED, 128 // len(alphas))
    chooser = DraftChooser()
    tokens_per_s(alphas, None, chooser, LEARN, seed=1, ragged_cost=ragged, pace=pace)
    return [tokens_per_s(alphas, None, chooser, timed, s, ragged, pace=pace) for s in range(windows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pace", nargs="+", action="append", metavar="KIND", help="none | square P S | random P S")
    p.add_argument("--windows", type=int, default=12)
    p.add_argument("--offsets", type=int, default=4, help="runs per cell, each starting the pace this far along")
    args = p.parse_args(argv)
    paces = args.pace or [["none"], ["square", "50", "1.25"], ["random", "20", "1.3"]]
    fixed = {i: best_fixed(alphas, ragged) for i, (alphas, ragged) in enumerate(CELLS)}
    for spec in paces:
        if spec != ["none"] and (len(spec) != 3 or spec[0] not in ("square", "random")):
            p.error(f"--pace {' '.join(spec)}: none, square PERIOD SLOW or random PERIOD SLOW")
        kind, period, slow = spec[0], int(spec[1]) if spec[1:] else 0, float(spec[2]) if spec[1:] else 1.0
        # the runs' starting points, spread over two periods (one cycle of the square drift)
        offsets = [2 * (o * period // args.offsets) for o in range(args.offsets)] if period else [0]
        print(f"\npace {' '.join(spec)}: adaptive / best fixed k, from pace offsets {offsets}: median (worst) window")
        medians, worsts = [], []
        for i, (alphas, ragged) in enumerate(CELLS):
            best_s, best = fixed[i]
            row = []
            for offset in offsets:
                ws = adaptive_windows(alphas, ragged, pace_of(kind, period, slow, offset), args.windows)
                medians.append(statistics.median(ws) / best_s)
                worsts.append(min(ws) / best_s)
                row.append(f"{medians[-1]:.3f} ({worsts[-1]:.3f})")
            name = f"alpha {alphas[0]}" if len(set(alphas)) == 1 else f"mixed {alphas[0]}/{alphas[1]}"
            print(f"  {name:>16} B {len(alphas):>3} {'ragged' if ragged else 'sum':>6} k{best}: " + "  ".join(row))
        print(
            f"  all: medians {min(medians):.3f}-{max(medians):.3f} (mean {statistics.mean(medians):.3f}, "
            f"{sum(m < 0.97 for m in medians)} of {len(medians)} below 0.97); worst windows {min(worsts):.3f}-"
            f"{max(worsts):.3f} (mean {statistics.mean(worsts):.3f}, {sum(w < 0.9 for w in worsts)} below 0.9)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
