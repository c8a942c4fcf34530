"""Adaptive speculation against every fixed k: steady-state decode speed over a forced-acceptance x batch-size grid.

Per cell (alpha, batch B) each mode runs a steady-state window (benchmarks/lib/adaptive_window.py): B requests prefilled
together (untimed), --warm-iterations decode iterations (untimed), then --iterations decode iterations timed
(more at a small batch: at least --request-iterations requests x iterations); no request finishes and no prefill
runs inside the window. The modes:
    target_only  no drafter (also what fixed k = 0 is: no Propose runs when no request wants drafts)
    k1 .. kN     every request gets k drafts each iteration (`--no-adaptive`)
    adaptive     each request's draft count chosen per iteration, at most max(--ks) (the default)
The modes are interleaved in --rounds rounds (A B C ... then B C ... A: the order rotates, so no mode always runs
first or right after another), and each mode's tokens/s is the median over its rounds, printed with the min-max, so
that a ratio can be read against the noise. Adaptive learns first, in an untimed run of --learn-iterations decode
iterations from a fresh state; every round's adaptive window goes on from where the one before left it, as a server
goes on learning (a copy of the learned state per round, as before 2026-12-02, replayed the same first-time trials
and exploration steps in every round's window). After round 1 a fixed k slower than --prune x the round's fastest
mode is not run again (it cannot be the best fixed k; its one value is kept and marked). The mixed cell gives half
the requests one acceptance and half another (--mixed 0.9 0.2 at each of --mixed-batches). Every output is checked
against the target-only greedy output (lossless); a mismatch fails the run after printing.

Why this method (the one before it, 4 waves of 32-token requests per slot, each mode once, measured noise of +-10 %
on the H200, as large as the effects): one run per mode put drift (GPU clocks, the host) into the comparison;
requests finishing and slots refilling put prefill chunks into decode iterations, synchronized in target-only (every
request ends together, one batched prefill) and scattered in speculative modes (a prefill chunk in many iterations);
adaptive learned inside its timed run; the garbage collector ran at random.

Where: `--where in-process` runs the modes on the in-process engine (the services' scheduler, verifier worker
and drafter runner in one process, no gRPC), the model built once, each cell learning afresh; the expected time is
printed before the grid (from the target-only step measured at batch 1 and at the largest batch, linear in tokens).
`--where services` runs the same cells and modes, in the same rounds, through the three services as `specsplit up`
runs them (co-located drafter; `ServicesBench`): two sets up at once, `--no-adaptive` for target_only and the fixed
k and one `--adaptive`, each run a closed batch of B requests of --new-tokens (64: requests as short as
users send), the adaptive set learning across cells as a server does (--learn-runs untimed batches before each
cell). The default runs both, one after the other, and prints each cell's ratios side by side.

    # H200, 7B shape, random weights: the default grid in one process (about 6 minutes), then through the services;
    # subsets with --alphas / --batches
    python benchmarks/adaptive.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16
    # CPU, the demo checkpoint, batch 1 and 8
    OMP_NUM_THREADS=1 python benchmarks/adaptive.py --batches 1 8 --mixed-batches 8 --ks 1 2 3
    # the services alone at a few cells
    python benchmarks/adaptive.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16 \
        --where services --alphas 0.3 0.9 --batches 8 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.e2e import PROMPT_LEN, check_lossless, make_prompts  # noqa: E402
from benchmarks.lib.adaptive_window import (  # noqa: E402
    Window,
    cuda_sync,
    horizon,
    prefill_iterations,
    run_window,
    window_token_budget,
)
from benchmarks.lib.e2e_modes import InProcessEngine, RunResult, run_services, step_token_budget  # noqa: E402
from benchmarks.lib.forced_acceptance import ForcedAcceptanceRunner, Oracle  # noqa: E402
from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.coordinator.draft_choice import AdaptiveDraftCount, DraftPolicy  # noqa: E402


@dataclasses.dataclass
class Cell:
    name: str  # "alpha=0.6" or "mixed 0.9/0.2"
    batch: int
    alphas: list[float]  # per prompt of the oracle


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "demo", help="checkpoint directory")
    where.add_argument("--shape", choices=sorted(SHAPES), help="a model shape from benchmarks/lib/shapes.py")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.6, 0.9], help="forced acceptance per cell")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="fixed k to compare (k > 0)")
    p.add_argument("--mixed", type=float, nargs=2, default=[0.9, 0.2], help="the mixed cell's two acceptances")
    p.add_argument("--mixed-batches", type=int, nargs="*", default=[32], help="batch sizes of the mixed cell")
    p.add_argument("--rounds", type=int, default=3, help="timed windows per mode and cell, modes interleaved")
    p.add_argument("--iterations", type=int, default=32, help="decode iterations timed per window (at least)")
    p.add_argument(
        "--request-iterations",
        type=int,
        default=128,
        help="at least this many request-iterations per timed window: a small batch runs more iterations",
    )
    p.add_argument("--warm-iterations", type=int, default=8, help="decode iterations before the timed ones")
    p.add_argument("--learn-iterations", type=int, default=64, help="adaptive's untimed learning run per cell")
    p.add_argument(
        "--prune",
        type=float,
        default=0.85,
        help="after round 1 drop a fixed k below this x the fastest (0: never; for noise of more than a few percent)",
    )
    p.add_argument(
        "--where",
        nargs="+",
        choices=["in-process", "services"],
        default=["in-process", "services"],
        help="the in-process engine's steady-state windows, the services' closed batches, or both (in that order)",
    )
    p.add_argument("--new-tokens", type=int, default=64, help="services: tokens per request (a closed batch)")
    p.add_argument(
        "--learn-runs", type=int, default=2, help="services: untimed batches the adaptive set serves before a cell"
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks of 16 tokens (default: what the longest run needs)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the forced-acceptance coin")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: $OUT/adaptive.json when set)")
    args = p.parse_args(argv)
    if args.shape and args.load_format != "dummy":
        p.error("--shape has no weights: add --load-format dummy")
    if any(k < 1 for k in args.ks) or not all(0.0 <= a <= 1.0 for a in [*args.alphas, *args.mixed]):
        p.error("--ks must be >= 1 (k = 0 is target_only) and every alpha in [0, 1]")
    if args.new_tokens < 1 or args.learn_runs < 0:
        p.error("--new-tokens must be >= 1 and --learn-runs >= 0")
    if args.rounds < 1 or args.iterations < 1 or args.warm_iterations < 0 or args.learn_iterations < 0:
        p.error("--rounds and --iterations must be >= 1, --warm-iterations and --learn-iterations >= 0")
    if any(b < 1 for b in [*args.batches, *args.mixed_batches]):
        p.error("batch sizes must be >= 1")
    return args


def cells(args: argparse.Namespace) -> list[Cell]:
    max_batch = max([*args.batches, *args.mixed_batches])
    out = [Cell(f"alpha={a}", b, [a] * max_batch) for a in args.alphas for b in args.batches]
    hi, lo = args.mixed
    mixed = [hi if i % 2 == 0 else lo for i in range(max_batch)]
    out += [Cell(f"mixed {hi}/{lo}", b, mixed) for b in args.mixed_batches]
    return out


def timed_iterations(args: argparse.Namespace, batch: int) -> int:
    """A window's timed iterations: a batch of 1 draws its acceptance from few positions per iteration, so it runs
    longer (its steps are the cheapest)."""
    return max(args.iterations, -(-args.request_iterations // batch))


def window_budget(args: argparse.Namespace) -> int:
    """The in-process engine's token budget per step (`window_token_budget` of the grid's largest batch)."""
    return window_token_budget(max([*args.batches, *args.mixed_batches]), max(args.ks))


def max_tokens(args: argparse.Namespace, batch: int) -> int:
    """Each request's max_tokens in a cell of `batch`: more than its windows can emit."""
    max_k = max(args.ks)
    prefill = prefill_iterations(batch, PROMPT_LEN, window_budget(args), max_k)
    return horizon(args.warm_iterations, max(timed_iterations(args, batch), args.learn_iterations), max_k, prefill)


def prompt_lengths(args: argparse.Namespace) -> list[int]:
    """Per prompt, the tokens its reference needs: prompt i is in the cells of batch > i, the smallest of which runs
    the longest windows."""
    lengths: list[int] = []
    for batch in sorted({*args.batches, *args.mixed_batches}):
        lengths += [max_tokens(args, batch)] * (batch - len(lengths))
    return lengths


def kv_blocks(args: argparse.Namespace) -> int:
    """KV blocks of 16 tokens for every prompt at its reference's length at once (more than any window holds)."""
    return sum(-(-(PROMPT_LEN + n + max(args.ks) + 1) // 16) for n in prompt_lengths(args)) + 16


def reference_outputs(engine: InProcessEngine, prompts: list[list[int]], args: argparse.Namespace) -> list[list[int]]:
    """Target-only greedy continuations (the lossless check's and the forced acceptance's oracle), each as long as the
    longest window that uses its prompt needs (a batch of 1 needs many tokens of prompt 0 only)."""
    lengths = prompt_lengths(args)
    out: list[list[int]] = []
    while len(out) < len(lengths):  # one generate() per run of prompts of one length
        end = len(out) + 1
        while end < len(lengths) and lengths[end] == lengths[len(out)]:
            end += 1
        out += engine.run(prompts[len(out) : end], lengths[len(out)], 0).outputs
    return out


def mode_k(mode: str, max_k: int) -> int:
    return 0 if mode == "target_only" else max_k if mode == "adaptive" else int(mode[1:])


class Bench:
    def __init__(self, engine: InProcessEngine, prompts: list[list[int]], reference: list[list[int]], args):
        self.engine, self.prompts, self.reference, self.args = engine, prompts, reference, args
        self.oracle = Oracle([p + o for p, o in zip(prompts, reference)], engine.target.config.vocab_size)
        self.base_config = engine.llm.scheduler_config
        self.max_k = max(args.ks)
        self.sync = cuda_sync(args.device)
        self.failures: list[str] = []
        self._num_runs = 0

    def window(self, cell: Cell, mode: str, chooser: DraftPolicy | None, timed: int, warm: int) -> Window:
        k = mode_k(mode, self.max_k)
        config = dataclasses.replace(self.base_config, adaptive=mode == "adaptive", max_num_seqs=cell.batch)
        llm = self.engine.llm
        llm.drafter.runner = ForcedAcceptanceRunner(self.engine.drafter, self.oracle, cell.alphas, self.args.seed)
        llm.step.use_drafter(llm.drafter if k > 0 else None)
        self._num_runs += 1
        result = asyncio.run(
            run_window(
                llm.step,
                config,
                llm.eos_token_ids,
                self.prompts[: cell.batch],
                k,
                chooser,
                warm,
                timed,
                max_tokens(self.args, cell.batch),
                self.sync,
                tag=f"r{self._num_runs}",
            )
        )
        for i, (got, want) in enumerate(zip(result.outputs, self.reference)):
            if got != want[: len(got)]:
                first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
                self.failures.append(f"{cell.name} batch {cell.batch} {mode}: prompt {i} differs at token {first}")
        return result

    def cell(self, cell: Cell, modes: list[str]) -> dict:
        """Adaptive learns first in an untimed window from a fresh chooser, which every round's window goes on
        from."""
        args = self.args
        learned = AdaptiveDraftCount()

        def learn() -> None:
            if args.learn_iterations:
                self.window(cell, "adaptive", learned, args.learn_iterations, 0)

        def run(mode: str) -> Window:
            chooser = learned if mode == "adaptive" else None
            return self.window(cell, mode, chooser, timed_iterations(args, cell.batch), args.warm_iterations)

        return measure_cell(cell, modes, args, learn, run)


def measure_cell(cell: Cell, modes: list[str], args, learn: Callable[[], None], run: Callable[[str], Run]) -> dict:
    """A cell's row, measured alike in one process and through the services: `learn()` (adaptive's untimed start),
    then --rounds rounds of `run(mode)` (one timed measurement) over the modes still in the running, the order
    rotating; after round 1 a fixed k slower than --prune x the round's fastest mode is not run again."""
    learn()
    windows: dict[str, list[Run]] = {m: [] for m in modes}
    active = list(modes)
    for r in range(args.rounds):
        shift = r % len(active)
        for mode in active[shift:] + active[:shift]:
            windows[mode].append(run(mode))
        if r == 0 and args.prune > 0 and args.rounds > 1:
            fastest = max(w[0].tokens_per_s for w in windows.values())
            active = [
                m
                for m in active
                if m in ("target_only", "adaptive") or windows[m][0].tokens_per_s >= args.prune * fastest
            ]
    row: dict = {"cell": cell.name, "batch": cell.batch, "tokens_per_s": {}, "range": {}, "rounds": {}}
    for mode, ws in windows.items():
        speeds = [w.tokens_per_s for w in ws]
        row["rounds"][mode] = speeds
        row["tokens_per_s"][mode] = statistics.median(speeds)
        row["range"][mode] = [min(speeds), max(speeds)]
    row["mean_drafts"] = {m: statistics.mean(w.drafts_per_request for w in ws) for m, ws in windows.items()}
    if isinstance(windows["adaptive"][0], Window):  # the chooser's host time: measured in one process only
        row["choose_ms_per_iteration"] = statistics.median(w.choose_ms_per_iteration for w in windows["adaptive"])
        row["ahead_ms_per_iteration"] = statistics.median(w.ahead_ms_per_iteration for w in windows["adaptive"])
    hist: list[int] = []
    for w in windows["adaptive"]:
        for d, n in enumerate(w.draft_count_histogram):
            hist.extend([0] * (d + 1 - len(hist)))
            hist[d] += n
    row["adaptive_draft_count_histogram"] = hist
    return ratios(row)


def ratios(row: dict) -> dict:
    speeds = row["tokens_per_s"]
    fixed = {m: v for m, v in speeds.items() if m != "adaptive"}
    row["best_fixed"] = max(fixed, key=fixed.get)
    row["adaptive_vs_best_fixed"] = speeds["adaptive"] / fixed[row["best_fixed"]]
    row["adaptive_vs_target_only"] = speeds["adaptive"] / speeds["target_only"]
    ranges = row.get("range")
    if ranges:  # the largest (max - min) / median of the modes the ratios compare
        compared = {"adaptive", "target_only", row["best_fixed"]}
        row["spread"] = max((ranges[m][1] - ranges[m][0]) / speeds[m] for m in compared)
    return row


def estimate_seconds(
    args,
    cells_: list[Cell],
    modes: list[str],
    step_1: float,
    step_max: float,
    max_batch: int,
    prefill_per_request: float,
) -> float:
    """The grid's time from the target-only step at batch 1 and the largest batch (linear in the tokens a step
    runs, k + 1 per request) and the prefill's time per request; pruning not counted."""
    slope = (step_max - step_1) / max(1, max_batch - 1)
    total = 0.0
    for cell in cells_:
        for mode in modes:
            k = mode_k(mode, max(args.ks))
            step = step_1 + slope * (cell.batch * (k + 1) - 1)
            iterations = args.rounds * (args.warm_iterations + timed_iterations(args, cell.batch))
            runs = args.rounds + (mode == "adaptive" and args.learn_iterations > 0)
            if mode == "adaptive":
                iterations += args.learn_iterations
            total += iterations * step + runs * cell.batch * prefill_per_request
    return total


@dataclasses.dataclass
class ServicesRun:
    """One timed closed batch through the services, read as `measure_cell` reads a window."""

    result: RunResult
    tokens: int  # the batch's: B x --new-tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.result.seconds

    @property
    def drafts_per_request(self) -> float:
        """Drafts verified per request and iteration."""
        return self.result.stats.num_draft_tokens / max(1, self.result.stats.num_iterations)

    @property
    def draft_count_histogram(self) -> list[int]:
        return list(self.result.stats.draft_count_histogram)


Run = Window | ServicesRun


class ServicesBench:
    """The grid through the three services as `specsplit up` runs them (co-located drafter, a forced-acceptance
    drafter in place of `serve drafter`): two sets up at once, one started `--no-adaptive` for target_only and the
    fixed k (each request asks for its k) and one `--adaptive` (up to max(--ks)), so that a cell's modes
    interleave between them as in one process (run one after the other, the two sets' order moved speeds by
    5-10 %). A run is a closed batch: B concurrent requests of --new-tokens each, timed from their release to the
    last answer. The adaptive set learns as a server does, across cells: before a cell's rounds it serves
    --learn-runs untimed batches of the cell. Every cell's acceptance pattern (`Cell.alphas`) has prompts of its own
    (a group of the largest batch's size), whose requests name their oracle sequences (`first_index`): one drafter
    serves every cell."""

    def __init__(self, args, model: Path, work: Path, grid: list[Cell], vocab_size: int):
        from specsplit.cli.launcher import LocalCluster

        self.args, self.max_k, self.vocab_size = args, max(args.ks), vocab_size
        self.max_batch = max([*args.batches, *args.mixed_batches])
        self.groups: dict[tuple[float, ...], int] = {}
        for cell in grid:
            self.groups.setdefault(tuple(cell.alphas), len(self.groups))
        self.prompts = make_prompts(model, self.max_batch * len(self.groups), vocab_size)
        alphas = [a for group in self.groups for a in group]
        self.oracle_path = work / "oracle.json"
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        forced = ["-m", "benchmarks.lib.forced_drafter", "--oracle", str(self.oracle_path), "--seed", str(args.seed)]
        forced += ["--alpha", *map(str, alphas)]
        scheduling = ["--max-num-seqs", str(self.max_batch)]
        scheduling += ["--max-num-batched-tokens", str(step_token_budget(self.max_batch, self.max_k))]
        blocks = ["--num-blocks", str(args.num_blocks)]
        self.clusters: dict[str, LocalCluster] = {}
        self._stack = contextlib.ExitStack()
        for name, extra in (("fixed", ["--no-adaptive"]), ("adaptive", ["--adaptive"])):
            cluster = LocalCluster(
                str(model),
                num_speculative_tokens=self.max_k,
                device=args.device,
                dtype=args.dtype,
                log_dir=work / f"logs-{name}",
                load_format=args.load_format,
                role_commands={"drafter": [sys.executable, *forced]},
                env=env,
                coordinator_args=[*scheduling, *extra],
                verifier_args=blocks,
                drafter_args=blocks,
            )
            self.clusters[name] = self._stack.enter_context(cluster)
        self.failures: list[str] = []

    def close(self) -> None:
        self._stack.close()

    def write_oracle(self) -> None:
        """Target-only greedy continuations of every prompt (the fixed set, k 0, the largest batch at a time), past
        what a run emits by the drafts of its last iteration: the oracle, which the drafters read once it exists."""
        n = self.args.new_tokens + self.max_k + 1
        fixed = self.clusters["fixed"].address
        sequences = []
        for first in range(0, len(self.prompts), self.max_batch):
            prompts = self.prompts[first : first + self.max_batch]
            sequences += [p + o for p, o in zip(prompts, run_services(fixed, prompts, n, 0).outputs)]
        partial = self.oracle_path.with_suffix(".partial")
        Oracle(sequences, self.vocab_size).save(partial)
        os.replace(partial, self.oracle_path)  # whole, at once: a drafter may look for it at any moment

    def _run(self, cell: Cell, mode: str) -> ServicesRun:
        k = mode_k(mode, self.max_k)
        cluster = self.clusters["adaptive" if mode == "adaptive" else "fixed"]
        first = self.groups[tuple(cell.alphas)] * self.max_batch
        prompts = self.prompts[first : first + cell.batch]
        result = run_services(cluster.address, prompts, self.args.new_tokens, k, first_index=first)
        return ServicesRun(result, cell.batch * self.args.new_tokens)

    def cell(self, cell: Cell, modes: list[str]) -> dict:
        runs: list[tuple[str, ServicesRun]] = []

        def learn() -> None:
            for _ in range(self.args.learn_runs):
                self._run(cell, "adaptive")

        def run(mode: str) -> ServicesRun:
            runs.append((mode, self._run(cell, mode)))
            return runs[-1][1]

        row = measure_cell(cell, modes, self.args, learn, run)
        row["acceptance"] = {}  # accepted / verified drafts per mode: the forced acceptance, as the services saw it
        for mode in modes:
            stats = [r.result.stats for m, r in runs if m == mode]
            drafted = sum(s.num_draft_tokens for s in stats)
            if drafted:
                row["acceptance"][mode] = sum(s.num_accepted_tokens for s in stats) / drafted
        # Lossless: every run's output is the cell's first target-only run's (the same batch through the same set).
        reference = next(r.result.outputs for m, r in runs if m == "target_only")
        for mode, r in runs:
            check_lossless(f"services {cell.name} batch {cell.batch} {mode}", [r.result], reference, self.failures)
        return row


def fmt_range(row: dict, mode: str) -> str:
    lo, hi = row["range"][mode]
    mark = "*" if len(row["rounds"][mode]) == 1 and len(row["rounds"]["adaptive"]) > 1 else ""
    return f"{row['tokens_per_s'][mode]:.0f} [{lo:.0f}-{hi:.0f}]{mark}"


def print_table(rows: list[dict], modes: list[str]) -> None:
    ranged = "range" in rows[0]
    width = 22 if ranged else 12
    print("\ntokens/s per mode" + (": median [min-max] over the rounds (* one round: pruned)" if ranged else ""))
    print(f"{'cell':<16}{'B':>5}" + "".join(f"{m:>{width}}" for m in modes))
    for r in rows:
        cols = [fmt_range(r, m) if ranged else f"{r['tokens_per_s'][m]:.1f}" for m in modes]
        print(f"{r['cell']:<16}{r['batch']:>5}" + "".join(f"{c:>{width}}" for c in cols))
    print("\nadapt/best and adapt/t-o: ratios of medians; spread: the largest (max - min) / median of adaptive,")
    print("target_only and the best fixed k (a ratio closer to 1 than that is inside the noise); drafts/it: adaptive's")
    print("mean drafts verified per request and iteration; choose ms: the chooser's host time per iteration between")
    print("steps (in schedule), ahead ms: while the device runs a step (choose_ahead)")
    head = f"{'cell':<16}{'B':>5}{'best fixed':>12}{'adapt/best':>11}{'adapt/t-o':>10}{'spread':>8}{'drafts/it':>10}"
    print(head + f"{'choose ms':>10}{'ahead ms':>9}")
    for r in rows:
        spread = f"{r['spread']:>8.3f}" if "spread" in r else f"{'':>8}"
        line = f"{r['cell']:<16}{r['batch']:>5}{r['best_fixed']:>12}{r['adaptive_vs_best_fixed']:>11.3f}"
        line += f"{r['adaptive_vs_target_only']:>10.3f}{spread}{r['mean_drafts']['adaptive']:>10.2f}"
        choose = f"{r['choose_ms_per_iteration']:>10.3f}" if "choose_ms_per_iteration" in r else ""
        if "ahead_ms_per_iteration" in r:
            choose += f"{r['ahead_ms_per_iteration']:>9.3f}"
        print(line + choose)
    worst_best = min(r["adaptive_vs_best_fixed"] for r in rows)
    worst_to = min(r["adaptive_vs_target_only"] for r in rows)
    print(f"\nworst cell: adaptive / best fixed {worst_best:.3f}, adaptive / target_only {worst_to:.3f}")


def calibrate(bench: Bench, max_batch: int) -> tuple[float, float, float]:
    """The target-only step at batch 1 and at `max_batch` (seconds per iteration) and the prefill per request, from
    two short windows (which also warm the engine up)."""
    steps = []
    prefill = 0.0
    for batch in (1, max_batch):
        w = bench.window(Cell("calibration", batch, [0.0] * max_batch), "target_only", None, 8, 2)
        steps.append(w.seconds / w.num_iterations)
        prefill = w.prefill_seconds / batch
    return steps[0], steps[1], prefill


def services_blocks(args: argparse.Namespace) -> int:
    """KV blocks of 16 tokens for each set of services: the largest batch at its longest (the oracle's run)."""
    per_request = -(-(PROMPT_LEN + args.new_tokens + 2 * max(args.ks) + 2) // 16)
    return max([*args.batches, *args.mixed_batches]) * per_request + 16


def in_process_rows(args, model: Path, grid: list[Cell], modes: list[str], t_begin: float):
    max_batch = max([*args.batches, *args.mixed_batches])
    engine = InProcessEngine(
        str(model),
        args.device,
        getattr(torch, args.dtype),
        args.load_format,
        args.num_blocks or kv_blocks(args),
        max_batch,
        max(args.ks),
        max_num_batched_tokens=window_budget(args),
    )
    prompts = make_prompts(model, max_batch, engine.target.config.vocab_size)
    reference = reference_outputs(engine, prompts, args)
    bench = Bench(engine, prompts, reference, args)
    gc.collect()
    gc.freeze()  # what exists now (the model, the engine) is never collected: each window's collection is short
    step_1, step_max, prefill = calibrate(bench, max_batch)
    expected = estimate_seconds(args, grid, modes, step_1, step_max, max_batch, prefill)
    print(
        f"target-only step {step_1 * 1e3:.2f} ms at B=1, {step_max * 1e3:.2f} ms at B={max_batch}; "
        f"{len(grid)} cells x {len(modes)} modes x {args.rounds} rounds: expected about {expected:.0f} s "
        f"(less what pruning saves), set-up {time.monotonic() - t_begin:.0f} s",
        flush=True,
    )
    rows = [announce("one process", bench.cell(cell, modes)) for cell in grid]
    gc.unfreeze()
    return rows, bench.failures


def services_rows(args, model: Path, work: Path, grid: list[Cell], modes: list[str]):
    config = json.loads((model / "config.json").read_text())
    vocab_size = config.get("vocab_size") or config["text_config"]["vocab_size"]
    args.num_blocks = args.num_blocks or services_blocks(args)
    services = ServicesBench(args, model, work, grid, vocab_size)
    try:
        services.write_oracle()
        rows = [announce("services", services.cell(cell, modes)) for cell in grid]
    finally:
        services.close()
    return rows, services.failures


def announce(where: str, row: dict) -> dict:
    row["where"] = where
    print(
        f"{where}: {row['cell']} B={row['batch']}: adaptive {fmt_range(row, 'adaptive')} tok/s, "
        f"/best fixed ({row['best_fixed']}) {row['adaptive_vs_best_fixed']:.3f}, "
        f"/target_only {row['adaptive_vs_target_only']:.3f}, spread {row['spread']:.3f}, "
        f"drafts/it {row['mean_drafts']['adaptive']:.2f}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specsplit-adaptive-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    grid = cells(args)
    modes = ["target_only", *[f"k{k}" for k in args.ks], "adaptive"]
    rows: list[dict] = []
    failures: list[str] = []
    what = f"{args.shape or model.name} ({args.load_format} weights), {args.device} {args.dtype}"
    if "in-process" in args.where:
        got, failed = in_process_rows(args, model, grid, modes, t_begin)
        rows, failures = rows + got, failures + failed
        print(
            f"\nadaptive speculation, one process: {what}; per window {args.warm_iterations} + "
            f"max({args.iterations}, {args.request_iterations} / B) timed decode iterations, {args.rounds} rounds; "
            f"{time.monotonic() - t_begin:.0f} s"
        )
        print_table(got, modes)
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the services load the model themselves
    if "services" in args.where:
        t_services = time.monotonic()
        got, failed = services_rows(args, model, work, grid, modes)
        rows, failures = rows + got, failures + failed
        print(
            f"\nadaptive speculation through the services (co-located, as `specsplit up`): {what}; closed batches of "
            f"{args.new_tokens} new tokens, {args.rounds} rounds; {time.monotonic() - t_services:.0f} s"
        )
        print_table(got, modes)
    if len(args.where) > 1:
        print_side_by_side(rows)
    out = args.out or (Path(os.environ["OUT"]) / "adaptive.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
        print(f"results: {out}")
    for failure in failures:
        print(f"LOSSLESS FAILURE: {failure}")
    return 1 if failures else 0


def print_side_by_side(rows: list[dict]) -> None:
    """Each cell's ratios in one process and through the services, one line."""
    by_cell: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        by_cell.setdefault((r["cell"], r["batch"]), {})[r["where"]] = r
    print("\nadaptive / best fixed k and adaptive / target_only, one process | services")
    print(f"{'cell':<16}{'B':>5}{'adapt/best':>22}{'adapt/t-o':>22}")
    for (cell, batch), where in by_cell.items():
        cols = []
        for key in ("adaptive_vs_best_fixed", "adaptive_vs_target_only"):
            pair = [f"{where[w][key]:.3f}" if w in where else "-" for w in ("one process", "services")]
            cols.append(" | ".join(pair))
        print(f"{cell:<16}{batch:>5}{cols[0]:>22}{cols[1]:>22}")


if __name__ == "__main__":
    sys.exit(main())
