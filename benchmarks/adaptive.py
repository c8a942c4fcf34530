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

All modes run in one process on the in-process engine (the services' scheduler, verifier worker and drafter runner,
no gRPC), the model built once; each cell learns afresh. The expected time is printed before the grid (from the
target-only step measured at batch 1 and at the largest batch, linear in tokens). `--services` runs the
uniform-alpha cells through the three services instead, as closed batches of --new-tokens (B concurrent clients;
`specsplit up`'s colocated LocalCluster with a forced-acceptance drafter; one timed run per mode after a warm-up).

    # H200, 7B shape, random weights: the default grid (about 6 minutes); subsets with --alphas / --batches
    python benchmarks/adaptive.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16
    # CPU, the demo checkpoint, batch 1 and 8
    OMP_NUM_THREADS=1 python benchmarks/adaptive.py --batches 1 8 --mixed-batches 8 --ks 1 2 3
    # the services at a few cells
    python benchmarks/adaptive.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16 \
        --services --alphas 0.3 0.9 --batches 8 64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
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
from benchmarks.lib.e2e_modes import InProcessEngine, step_token_budget  # noqa: E402
from benchmarks.lib.forced_acceptance import ForcedAcceptanceRunner, Oracle  # noqa: E402
from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.coordinator.draft_choice import AdaptiveDraftCount, DraftPolicy  # noqa: E402

WARM_UP_TOKENS = 16  # the services' warm-up


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
    p.add_argument("--services", action="store_true", help="the uniform cells through the three services")
    p.add_argument("--new-tokens", type=int, default=32, help="--services: tokens per request (closed batch)")
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
        args = self.args
        learned = AdaptiveDraftCount()
        if args.learn_iterations:
            self.window(cell, "adaptive", learned, args.learn_iterations, 0)
        windows: dict[str, list[Window]] = {m: [] for m in modes}
        active = list(modes)
        for r in range(args.rounds):
            shift = r % len(active)
            for mode in active[shift:] + active[:shift]:
                chooser = learned if mode == "adaptive" else None  # (goes on learning from round to round)
                timed = timed_iterations(args, cell.batch)
                windows[mode].append(self.window(cell, mode, chooser, timed, args.warm_iterations))
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


def services_rows(args, model: Path, work: Path, prompts, reference, oracle: Oracle, modes: list[str]) -> list[dict]:
    """The uniform cells through the services: per alpha a fixed-k cluster, then an adaptive one."""
    from benchmarks.lib.e2e_modes import run_services
    from specsplit.cli.launcher import LocalCluster

    oracle.save(work / "oracle.json")
    max_k, max_batch = max(args.ks), max(args.batches)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    rows = {
        (a, b): {"cell": f"alpha={a}", "batch": b, "tokens_per_s": {}, "mean_drafts": {}}
        for a in args.alphas
        for b in args.batches
    }
    failures: list[str] = []
    for alpha in args.alphas:
        forced = ["-m", "benchmarks.lib.forced_drafter", "--alpha", str(alpha), "--oracle", str(work / "oracle.json")]
        for adaptive in (False, True):
            scheduling = [
                "--max-num-seqs",
                str(max_batch),
                "--max-num-batched-tokens",
                str(step_token_budget(max_batch, max_k)),
            ]
            with LocalCluster(
                str(model),
                num_speculative_tokens=max_k,
                device=args.device,
                dtype=args.dtype,
                log_dir=work / f"logs-{alpha}-{'adaptive' if adaptive else 'fixed'}",
                load_format=args.load_format,
                role_commands={"drafter": [sys.executable, *forced, "--seed", str(args.seed)]},
                env=env,
                coordinator_args=scheduling if adaptive else [*scheduling, "--no-adaptive"],
                verifier_args=["--num-blocks", str(args.num_blocks)],
                drafter_args=["--num-blocks", str(args.num_blocks)],
            ) as cluster:
                for batch in args.batches:
                    row = rows[alpha, batch]
                    for mode in ["adaptive"] if adaptive else modes[:-1]:
                        k = 0 if mode == "target_only" else max_k if mode == "adaptive" else int(mode[1:])
                        warm_up = args.new_tokens if adaptive else min(WARM_UP_TOKENS, args.new_tokens)
                        run_services(cluster.address, prompts[:batch], warm_up, k)
                        result = run_services(cluster.address, prompts[:batch], args.new_tokens, k)
                        check_lossless(f"services alpha={alpha} batch {batch} {mode}", [result], reference, failures)
                        row["tokens_per_s"][mode] = batch * args.new_tokens / result.seconds
                        row["mean_drafts"][mode] = result.stats.num_draft_tokens / max(1, result.stats.num_iterations)
                        if adaptive:
                            row["adaptive_draft_count_histogram"] = result.stats.draft_count_histogram
                        print(
                            f"services alpha={alpha} B={batch} {mode}: {row['tokens_per_s'][mode]:.1f} tok/s",
                            flush=True,
                        )
    for failure in failures:
        print(f"LOSSLESS FAILURE: {failure}")
    return [ratios(r) for r in rows.values()], failures


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_blocks is None:
        args.num_blocks = 4096 if args.services else kv_blocks(args)
    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specsplit-adaptive-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    max_k = max(args.ks)
    max_batch = max([*args.batches, *args.mixed_batches])
    engine = InProcessEngine(
        str(model),
        args.device,
        getattr(torch, args.dtype),
        args.load_format,
        args.num_blocks,
        max_batch,
        max_k,
        max_num_batched_tokens=None if args.services else window_budget(args),
    )
    prompts = make_prompts(model, max_batch, engine.target.config.vocab_size)
    modes = ["target_only", *[f"k{k}" for k in args.ks], "adaptive"]
    if args.services:
        reference = engine.run(prompts, args.new_tokens, 0).outputs  # target-only greedy: the lossless oracle
        oracle = Oracle([p + o for p, o in zip(prompts, reference)], engine.target.config.vocab_size)
        del engine  # the services load the model themselves
        rows, failures = services_rows(args, model, work, prompts, reference, oracle, modes)
        what = f"{args.shape or model.name} ({args.load_format} weights), {args.device} {args.dtype}"
        print(f"\nadaptive speculation: {what}, three services (colocated), closed batches of {args.new_tokens} tokens")
    else:
        reference = reference_outputs(engine, prompts, args)
        bench = Bench(engine, prompts, reference, args)
        grid = cells(args)
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
        rows, failures = [], bench.failures
        for cell in grid:
            t_cell = time.monotonic()
            rows.append(bench.cell(cell, modes))
            r = rows[-1]
            print(
                f"{r['cell']} B={r['batch']}: adaptive {fmt_range(r, 'adaptive')} tok/s, "
                f"/best fixed ({r['best_fixed']}) {r['adaptive_vs_best_fixed']:.3f}, "
                f"/target_only {r['adaptive_vs_target_only']:.3f}, spread {r['spread']:.3f}, "
                f"drafts/it {r['mean_drafts']['adaptive']:.2f} ({time.monotonic() - t_cell:.0f} s)",
                flush=True,
            )
        what = f"{args.shape or model.name} ({args.load_format} weights), {args.device} {args.dtype}, one process"
        print(
            f"\nadaptive speculation: {what}; per window {args.warm_iterations} + max({args.iterations}, "
            f"{args.request_iterations} / B) timed decode iterations, {args.rounds} rounds; "
            f"{time.monotonic() - t_begin:.0f} s"
        )
    print_table(rows, modes)
    out = args.out or (Path(os.environ["OUT"]) / "adaptive.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
        print(f"results: {out}")
    for failure in failures:
        print(f"LOSSLESS FAILURE: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
