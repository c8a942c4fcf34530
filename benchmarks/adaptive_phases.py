"""Where a decode iteration's time goes per allocation of drafts: fixed k, adaptive, and forced allocations.

benchmarks/adaptive.py shows adaptive slower than a fixed k whose allocation it nearly matches (alpha 0.9: at batch 1
it verifies k 5's drafts in 96 % of iterations and runs 0.91-0.94x k 5; at batch 64 it gives half the requests 1 draft
and half 5 and runs 0.71x k 3). This runs one cell's steady-state windows (benchmarks/lib/adaptive_window.py) on the
in-process engine and prints, per mode, tokens/s and the mean of each phase of `EngineCore.step`'s IterationTiming
(schedule, the verifier's prepare / forward / sample, the drafter's Propose with its step 0 and later steps, post
step), so that a ratio of speeds can be read as the phase that differs; with more than one round, each round's row
too (on the H200 target-only's rounds at batch 128 ranged over 15-25 % for the same tokens: which phase moves). Modes:

    target_only, k1 .. k5   every request k drafts (`--no-adaptive`)
    adaptive                learned first in an untimed window, then on from round to round, as benchmarks/adaptive.py
    split:A/B               forced: even requests A drafts, odd ones B, every iteration (a fixed allocation through the
                            chooser's seat, to price a ragged batch against the uniform one of the same tokens)

    python benchmarks/adaptive_phases.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16 \
        --alpha 0.9 --batch 64 --modes k3 k5 split:1/5 adaptive
    # benchmarks/adaptive.py's mixed cell (even requests 0.9, odd ones 0.2) instead of one alpha
    OMP_NUM_THREADS=1 python benchmarks/adaptive_phases.py --mixed 0.9 0.2 --batch 8 --modes target_only k1 k3 adaptive
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.adaptive import Bench, Cell, kv_blocks, reference_outputs, window_budget  # noqa: E402
from benchmarks.e2e import make_prompts  # noqa: E402
from benchmarks.lib.e2e_modes import InProcessEngine  # noqa: E402
from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.coordinator.draft_choice import DraftChooser  # noqa: E402

PHASES = (
    "schedule",
    "verify",
    "prepare",
    "forward",
    "sample",
    "propose",
    "step0",
    "later_steps",
    "post_step",
    "iteration",
)


class ForcedChoice(DraftChooser):
    """Every decoding request gets `counts[i % len(counts)]` drafts (at most its cap)."""

    def __init__(self, counts: list[int]):
        super().__init__()
        self.counts = counts

    def _choose(self, caps, counts, remaining=None):
        return [min(cap, self.counts[i % len(self.counts)]) for i, cap in enumerate(caps)]


def print_costs(chooser: DraftChooser) -> None:
    """What the adaptive chooser learned by the end (its untimed window, then its rounds): the Propose's and a later
    step's cost, the step time per bucket of tokens without and with a Propose (the sum's base), and the steady runs'
    prices (without drafts, then per (tokens, L))."""
    costs = chooser.costs
    fmt = lambda s: "-" if s is None else f"{s * 1e3:.3f}"  # noqa: E731
    print(f"learned: propose {fmt(costs.propose_s)} ms, later step {fmt(costs.later_step_s)} ms")
    for key in costs._keys:  # noqa: SLF001 - a diagnostic's view of the model
        b = costs._buckets[key]  # noqa: SLF001
        print(
            f"  tokens {b.num_tokens:7.1f}: without a Propose {fmt(b.seconds[0]) if b.weight[0] else '-':>8} ms "
            f"(x{b.weight[0]:.0f}), with {fmt(b.seconds[1]) if b.weight[1] else '-':>8} ms (x{b.weight[1]:.0f})"
        )
    for _, run in sorted(costs.plain_runs.items()):
        print(f"  steady run: tokens {run.num_tokens:7.1f}, no drafts: {fmt(run.floor)} ms (x{run.weight[1]:.0f})")
    for (_, later), run in sorted(costs.measured_runs.items()):
        print(f"  steady run: tokens {run.num_tokens:7.1f}, L {later}: {fmt(run.floor)} ms (x{run.weight[1]:.0f})")
    acceptance = ", ".join(f"{a:.2f}" for a in chooser.acceptance.means(5))
    print(f"  server acceptance per position: {acceptance}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "demo")
    where.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument(
        "--mixed",
        type=float,
        nargs=2,
        default=None,
        metavar=("HI", "LO"),
        help="benchmarks/adaptive.py's mixed cell instead of --alpha: even requests HI, odd ones LO",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=["k3", "k5", "split:1/5", "adaptive"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ks = [int(m[1:]) for m in args.modes if m.startswith("k")]
    ks += [int(c) for m in args.modes if m.startswith("split:") for c in m[6:].split("/")]
    # what Bench reads from benchmarks/adaptive.py's arguments
    args.ks = sorted({*ks, 5 if "adaptive" in args.modes else 1})
    args.batches, args.mixed_batches, args.request_iterations = [args.batch], [], 0
    args.warm_iterations, args.learn_iterations = 8, 64
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="specsplit-phases-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    max_k = max(args.ks)
    engine = InProcessEngine(
        str(model),
        args.device,
        getattr(torch, args.dtype),
        args.load_format,
        kv_blocks(args),
        args.batch,
        max_k,
        max_num_batched_tokens=window_budget(args),
    )
    prompts = make_prompts(model, args.batch, engine.target.config.vocab_size)
    bench = Bench(engine, prompts, reference_outputs(engine, prompts, args), args)
    if args.mixed:
        hi, lo = args.mixed
        cell = Cell(f"mixed {hi}/{lo}", args.batch, [hi if i % 2 == 0 else lo for i in range(args.batch)])
    else:
        cell = Cell(f"alpha={args.alpha}", args.batch, [args.alpha] * args.batch)
    core = engine.llm.core
    timings: list = []
    step = core.step

    def timed_step(scheduler):
        updates, timing = step(scheduler)
        timings.append(timing)
        return updates, timing

    core.step = timed_step
    learned = DraftChooser()
    bench.window(cell, "adaptive", learned, 64, 0)
    gc.collect()
    gc.freeze()
    results: dict[str, list] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]:
            if mode == "adaptive":  # goes on learning from round to round, as in benchmarks/adaptive.py
                bench_mode, chooser = "adaptive", learned
            elif mode.startswith("split:"):
                bench_mode, chooser = "adaptive", ForcedChoice([int(c) for c in mode[6:].split("/")])
            else:
                bench_mode, chooser = mode, None
            timings.clear()
            w = bench.window(cell, bench_mode, chooser, args.iterations, 8)
            steady = timings[-args.iterations - 1 : -1] if len(timings) > args.iterations else timings
            results[mode].append((w, steady))
    print(f"\n{args.shape or model.name}, {args.device} {args.dtype}, {cell.name}, batch {args.batch}")
    print("ms per iteration, the timed windows' mean: median over rounds, then each round; tokens/s median [min-max]")
    print(f"{'mode':>12} {'tok/s':>18} {'drafts':>6} " + " ".join(f"{p:>10}" for p in PHASES))
    for mode, runs in results.items():
        speeds = [w.tokens_per_s for w, _ in runs]
        row = []
        for phase in PHASES:
            per_round = [statistics.mean(getattr(t, f"{phase}_ns") for t in steady) / 1e6 for _, steady in runs]
            row.append(statistics.median(per_round))
        drafts = statistics.mean(w.drafts_per_request for w, _ in runs)
        speed = f"{statistics.median(speeds):.0f} [{min(speeds):.0f}-{max(speeds):.0f}]"
        print(f"{mode:>12} {speed:>18} {drafts:>6.2f} " + " ".join(f"{v:>10.3f}" for v in row))
        if len(runs) > 1:  # which phase moves when a round runs slower (the same tokens in every round)
            for r, (w, steady) in enumerate(runs):
                phases = [statistics.mean(getattr(t, f"{phase}_ns") for t in steady) / 1e6 for phase in PHASES]
                round_ = f"round {r + 1}"
                print(
                    f"{round_:>12} {w.tokens_per_s:>18.0f} {w.drafts_per_request:>6.2f} "
                    + " ".join(f"{v:>10.3f}" for v in phases)
                )
        hist = [0] * 8
        for w, _ in runs:
            for d, n in enumerate(w.draft_count_histogram):
                hist[d] += n
        print(f"{'':>12} draft counts verified: {hist[: max_k + 1]}")
        emitted = sum(w.tokens for w, _ in runs) / sum(w.num_iterations for w, _ in runs)
        print(f"{'':>12} tokens emitted per iteration: {emitted:.2f}")
    if "adaptive" in args.modes:
        print_costs(learned)
    print(f"failures: {bench.failures}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
