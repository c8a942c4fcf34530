"""Launch-shape tuning of the Triton rejection sampler on one CUDA GPU (modes: sweep, grid).

- ``sweep``: per shape (vocab, batch, k, mode), the time of candidate launch shapes
  (``specsplit/kernels/triton_rejection_launch.py``), and a suggested ``LAUNCH_TABLE`` for ``default_launch``.
- ``grid``: for large random batches, per shape the time of a fixed set of stats launches, each with and
  without the race in the stats kernel (one-hot and sparse), beside the default launch. ``LARGE_BATCH_TABLE``
  and the race-in-stats bounds are read from its output.

    cd benchmarks && PYTHONPATH=.. python3 rejection_tuning.py sweep --quick --out sweep.json
    cd benchmarks && PYTHONPATH=.. python3 rejection_tuning.py grid --out grid.json
    cd benchmarks && TRITON_INTERPRET=1 PYTHONPATH=.. python3 rejection_tuning.py sweep --device cpu --tiny --out s.json
    cd benchmarks && TRITON_INTERPRET=1 PYTHONPATH=.. python3 rejection_tuning.py grid --device cpu --tiny --out g.json

Inputs are ``rejection_sampler.py``'s. Time: ``triton.testing.do_bench_cudagraph`` (replays of a CUDA graph,
GPU work only, median, ``--rep`` ms per candidate); with ``--device cpu`` (Triton's interpreter, a smoke run)
one plain call, which measures nothing. Every candidate's tokens are checked before it is timed; a mismatch
(or an error) is printed with !!!, the candidate is not timed, and the run exits 1. Compilation would dominate
(each kernel's chunk, tile, warps and q mode, per vocab and k, is one compilation of ~1 s), so ``--jobs``
processes first run every candidate once on a batch-1 input, filling Triton's on-disk cache, and the timing
loop only loads binaries.

sweep. Shapes: vocab {151936, 32000} x batch {1, 8, 64, 256} x k {1, 3, 5} x mode {greedy, one_hot, dense,
sparse}; ``--quick``: vocab 151936, batch {1, 64, 256}, k 3. The two kernels are tuned one after the other
(their cross product is too large): the stats kernel's (chunk, tile, warps) with the race kernel at the
default, then the race kernel's with the shape's best stats launch; greedy shapes launch no race. Each
candidate's tokens must equal the default launch's on the same inputs. Suggested table: per mode class
(greedy, random) and batch, the stats launch, then the race launch, with the least mean time relative to each
shape's best; then that launch and the default are timed again on every shape. A bucket covers the batch
sizes up to the one measured. Random batches of more than ``SMALL_BATCH`` requests get no suggestion:
``LARGE_BATCH_TABLE`` is keyed per mode by logits (rows x vocab), which a batch size alone does not pin down;
the grid sets it. Duration on an H200 (estimated, not yet measured): ``--quick`` (12 shapes, 12 + 12
candidates, 75 compilations, 288 timings) about 1 minute: ~20 s compiling, ~30 s timing (up to 2.5 minutes if
the worker processes fail and the kernels compile one by one); the full sweep (96 shapes, 24 + 36 candidates,
~650 compilations, ~5200 timings) about 8 minutes, or half that per vocabulary (``--vocab 151936``, then
``--vocab 32000``).

grid. Shapes: vocab {32000, 151936} x batch {64, 256} x k {1, 3, 5} x mode {greedy, one_hot, dense, sparse},
and one-hot drafts accepted with probability 0.8 at k 3. Unlike the sweep it also flips ``race_in_stats`` and
keeps each launch's race kernel at the default, so that the table can be keyed by logits (rows x vocab) rather
than by batch. Every candidate's tokens are compared with the torch reference's. About 1 minute on an H200.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, astuple, dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
import triton
import triton.testing
from rejection_sampler import MODES, make_inputs  # benchmarks/ is on sys.path when run as a script

from specsplit.kernels import rejection_sample
from specsplit.kernels.triton_rejection import rejection_sample_triton
from specsplit.kernels.triton_rejection_launch import SMALL_BATCH, Launch, default_launch

KernelShape = tuple[int, int, int]  # one kernel's (chunk, block_v, warps)


# --- shared by both modes -------------------------------------------------------------------------------------


def stats_of(launch: Launch) -> KernelShape:
    return launch.stats_chunk, launch.stats_block_v, launch.stats_warps


def race_of(launch: Launch) -> KernelShape:
    return launch.race_chunk, launch.race_block_v, launch.race_warps


def with_stats(launch: Launch, shape: KernelShape) -> Launch:
    return replace(launch, stats_chunk=shape[0], stats_block_v=shape[1], stats_warps=shape[2])


def with_race(launch: Launch, shape: KernelShape) -> Launch:
    return replace(launch, race_chunk=shape[0], race_block_v=shape[1], race_warps=shape[2])


def shape_default(vocab: int, batch: int, k: int, mode: str) -> Launch:
    return default_launch(batch, batch * (k + 1), vocab, mode).fit(vocab)


def difference(out, expected, against: str = "the default launch's") -> str:
    """'' when the outputs are equal, else which requests differ."""
    rows = (out.sampled != expected.sampled).any(1) | (out.num_sampled != expected.num_sampled)
    rows |= out.num_rejected != expected.num_rejected
    bad = rows.nonzero().flatten().tolist()
    return f"tokens differ from {against} in requests {bad[:8]} ({len(bad)} in all)" if bad else ""


def timer(device: str, rep: int):
    """µs per call: CUDA graph replays on a GPU; one plain call in the interpreter (a smoke run)."""

    def gpu_us(fn) -> float:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3

    def cpu_us(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    return gpu_us if device == "cuda" else cpu_us


@lru_cache(maxsize=4)
def _compile_inputs(vocab: int, k: int, mode: str, device: str) -> dict:
    return make_inputs(vocab, 1, k, mode, device)


def compile_once(task: tuple[int, int, str, str, Launch]) -> str:
    """Runs one launch once (in a worker process): its kernels land in Triton's on-disk cache."""
    vocab, k, mode, device, launch = task
    try:
        rejection_sample_triton(**_compile_inputs(vocab, k, mode, device), launch=launch)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as err:
        return repr(err)[:400]
    return ""


def precompile(waves: list[list[tuple]], jobs: int) -> None:
    """Runs every ``compile_once`` task, ``jobs`` processes at a time, one wave after the other. On failure
    the kernels compile on first use instead."""
    start = time.perf_counter()
    print(f"compiling: {sum(map(len, waves))} launches in {jobs} processes", flush=True)
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for tasks in waves:
                for task, err in zip(tasks, pool.map(compile_once, tasks)):
                    if err:
                        print(f"!!! compiling {task}: {err}", flush=True)
    except Exception as err:  # no worker processes: the kernels compile when first timed
        print(f"compiling in worker processes failed ({err!r}); compiling on first use", flush=True)
        return
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)


def require_device(device: str) -> None:
    """Exits unless the kernels can run on ``device``: a CUDA GPU, or the CPU under Triton's interpreter."""
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")


def environment(device: str) -> dict:
    return dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
    )


# --- sweep ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    vocabs: tuple[int, ...]
    batches: tuple[int, ...]
    ks: tuple[int, ...]
    modes: tuple[str, ...]
    stats: tuple[KernelShape, ...]  # candidates besides the default
    race: tuple[KernelShape, ...]


FULL = Grid(
    vocabs=(151936, 32000),
    batches=(1, 8, 64, 256),
    ks=(1, 3, 5),
    modes=MODES,
    stats=tuple(
        (c, b, w) for c in (2048, 4096, 8192, 16384) for b in (512, 1024, 2048, 4096) for w in (4, 8) if b <= c
    ),
    race=tuple((c, b, w) for c in (1024, 2048, 4096, 8192) for b in (256, 512, 1024) for w in (2, 4, 8)),
)
# Smaller chunks for small batches (more programs), larger tiles with more warps for large ones.
QUICK = Grid(
    vocabs=(151936,),
    batches=(1, 64, 256),
    ks=(3,),
    modes=MODES,
    stats=((2048, 512, 4), (2048, 1024, 4), (2048, 1024, 8), (2048, 2048, 8), (4096, 512, 4), (4096, 1024, 4),
           (4096, 1024, 8), (4096, 2048, 8), (8192, 1024, 8), (8192, 2048, 8), (16384, 1024, 4), (16384, 2048, 8)),
    race=((1024, 256, 2), (1024, 512, 2), (1024, 512, 4), (1024, 1024, 8), (2048, 256, 2), (2048, 512, 4),
          (2048, 1024, 4), (2048, 1024, 8), (4096, 512, 4), (4096, 1024, 4), (4096, 1024, 8), (8192, 1024, 8)),
)  # fmt: skip
# A smoke run in the interpreter: several chunks per row, a greedy and a random shape, nothing measured.
TINY = Grid((1000,), (1,), (2,), ("greedy", "dense"), stats=((256, 128, 4), (512, 256, 8)), race=((128, 64, 2),))


def describe(launch: Launch, mode: str) -> str:
    stats = "stats " + "/".join(map(str, stats_of(launch)))
    return stats if mode == "greedy" else f"{stats}, race " + "/".join(map(str, race_of(launch)))


def check_and_time(inputs: dict, launch: Launch, expected, time_us, where: str, failures: list) -> float | None:
    """µs per call of ``launch``, timed only once its tokens equal ``expected``; otherwise None, and
    the problem printed and appended to ``failures``."""
    try:
        problem = difference(rejection_sample_triton(**inputs, launch=launch), expected)
        if not problem:
            return time_us(lambda: rejection_sample_triton(**inputs, launch=launch))
    except Exception as err:  # a launch the GPU cannot run (or capture): report it and go on
        problem = f"error: {err!r}"[:400]
    print(f"!!! MISMATCH {where} {astuple(launch)}: {problem}", flush=True)
    failures.append(dict(launch=asdict(launch), problem=problem))
    return None


def sweep_shape(shape: tuple[int, int, int, str], grid: Grid, device: str, time_us) -> dict:
    """Times the default, the stats candidates (race at the default), then the race candidates with
    the best stats launch. Candidates whose tokens differ from the default's are not timed."""
    vocab, batch, k, mode = shape
    inputs = make_inputs(vocab, batch, k, mode, device)
    default = shape_default(vocab, batch, k, mode)
    expected = rejection_sample_triton(**inputs, launch=default)
    times: dict[Launch, float] = {}
    failures: list[dict] = []

    def measure(launch: Launch) -> None:
        launch = launch.fit(vocab)
        if launch not in times:
            us = check_and_time(inputs, launch, expected, time_us, str(shape), failures)
            if us is not None:
                times[launch] = us

    measure(default)
    for stats in grid.stats:
        measure(with_stats(default, stats))
    best_stats = min(times, key=times.get)
    if mode != "greedy":
        for race in grid.race:
            measure(with_race(best_stats, race))
    best = min(times, key=times.get)
    return dict(
        vocab=vocab, batch=batch, k=k, mode=mode, default=default, default_us=times[default], best=best,
        best_us=times[best], speedup=times[default] / times[best], failures=failures,
        stats_us={stats_of(lc): t for lc, t in times.items() if race_of(lc) == race_of(default)},
        race_us={race_of(lc): t for lc, t in times.items() if stats_of(lc) == stats_of(best_stats)},
    )  # fmt: skip


def least_relative(times_per_shape: list[dict[KernelShape, float]], fallback: KernelShape) -> KernelShape:
    """The candidate, timed on every shape, with the least mean of its time over the shape's best."""
    common = set.intersection(*(set(t) for t in times_per_shape))
    if not common:
        return fallback
    return min(common, key=lambda c: statistics.mean(t[c] / min(t.values()) for t in times_per_shape))


def mode_class(mode: str) -> str:
    return "greedy" if mode == "greedy" else "random"


def suggest(records: list[dict]) -> dict[str, dict[int, Launch]]:
    """Per mode class and batch: the launch from the stats and race candidates best across shapes."""
    table: dict[str, dict[int, Launch]] = {}
    for cls in ("greedy", "random"):
        for batch in sorted({r["batch"] for r in records if cls == "greedy" or r["batch"] <= SMALL_BATCH}):
            group = [r for r in records if mode_class(r["mode"]) == cls and r["batch"] == batch]
            if group:
                launch = group[0]["default"]
                launch = with_stats(launch, least_relative([r["stats_us"] for r in group], stats_of(launch)))
                if cls == "random":
                    launch = with_race(launch, least_relative([r["race_us"] for r in group], race_of(launch)))
                table.setdefault(cls, {})[batch] = launch
    return table


def validate(records: list[dict], table: dict[str, dict[int, Launch]], device: str, time_us) -> None:
    """Times the default and the suggested launch again, back to back, on every shape."""
    for r in records:
        if r["batch"] not in table.get(mode_class(r["mode"]), {}):
            continue  # a large random batch: LARGE_BATCH_TABLE
        inputs = make_inputs(r["vocab"], r["batch"], r["k"], r["mode"], device)
        suggested = table[mode_class(r["mode"])][r["batch"]].fit(r["vocab"])
        expected = rejection_sample_triton(**inputs, launch=r["default"])
        where = f"{(r['vocab'], r['batch'], r['k'], r['mode'])} suggested"
        default_us = check_and_time(inputs, r["default"], expected, time_us, where, r["failures"])
        suggested_us = check_and_time(inputs, suggested, expected, time_us, where, r["failures"])
        if default_us is not None and suggested_us is not None:
            r.update(suggested=suggested, default_again_us=default_us, suggested_us=suggested_us)


def table_literal(table: dict[str, dict[int, Launch]]) -> list[str]:
    """``LAUNCH_TABLE`` as Python, consecutive buckets with the same launch merged."""
    lines = ["LAUNCH_TABLE: dict[str, tuple[tuple[int, Launch], ...]] = {"]
    for cls, by_batch in table.items():
        entries: list[tuple[str, Launch]] = []
        for i, batch in enumerate(sorted(by_batch)):
            limit = "sys.maxsize" if i == len(by_batch) - 1 else str(batch)
            if entries and entries[-1][1] == by_batch[batch]:
                entries.pop()
            entries.append((limit, by_batch[batch]))
        lines.append(f'    "{cls}": (')
        lines += [f"        ({limit}, Launch{astuple(launch)})," for limit, launch in entries]
        lines.append("    ),")
    return [*lines, "}"]


def sweep_waves(shapes: list[tuple[int, int, int, str]], grid: Grid, device: str) -> list[list[tuple]]:
    """The sweep's compile tasks. A kernel's binary depends on its own launch shape, the q mode, vocab and k,
    not on the batch nor on the other kernel's shape; greedy shares one-hot's stats kernel. The defaults go
    first, so that each candidate after them compiles one kernel only."""
    defaults, candidates = set(), set()
    for vocab, batch, k, mode in shapes:
        q_mode, default = ("one_hot" if mode == "greedy" else mode), shape_default(vocab, batch, k, mode)
        defaults.add((vocab, k, q_mode, device, default))
        candidates.update((vocab, k, q_mode, device, with_stats(default, s).fit(vocab)) for s in grid.stats)
        candidates.update((vocab, k, q_mode, device, with_race(default, r).fit(vocab)) for r in grid.race)
    return [sorted(defaults, key=repr), sorted(candidates - defaults, key=repr)]


SHAPE_COLUMNS = ["vocab", "batch", "k", "mode", "default µs", "best µs", "best launch", "speedup"]


def shape_row(r: dict) -> str:
    cells = [r["vocab"], r["batch"], r["k"], r["mode"], f"{r['default_us']:.1f}", f"{r['best_us']:.1f}"]
    cells += [describe(r["best"], r["mode"]), f"{r['speedup']:.2f}x"]
    return "| " + " | ".join(map(str, cells)) + " |"


def table_rows(records: list[dict], table: dict[str, dict[int, Launch]]) -> list[str]:
    columns = ["class", "batch", "suggested launch", "default µs", "suggested µs", "speedup mean (min)"]
    columns.append("best-per-shape mean")
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for cls, by_batch in table.items():
        for batch, launch in sorted(by_batch.items()):
            group = [r for r in records if mode_class(r["mode"]) == cls and r["batch"] == batch and "suggested" in r]
            if not group:
                continue
            ratios = [r["default_again_us"] / r["suggested_us"] for r in group]
            cells = [cls, batch, describe(launch, cls), f"{statistics.mean(r['default_again_us'] for r in group):.1f}"]
            cells += [f"{statistics.mean(r['suggested_us'] for r in group):.1f}"]
            cells += [f"{statistics.mean(ratios):.2f}x ({min(ratios):.2f}x)"]
            cells += [f"{statistics.mean(r['speedup'] for r in group):.2f}x"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def to_json(value):
    """Launches as dicts, kernel shapes as 'chunk/block_v/warps' keys."""
    if isinstance(value, Launch):
        return asdict(value)
    if isinstance(value, dict):
        return {"/".join(map(str, k)) if isinstance(k, tuple) else k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def run_sweep(args: argparse.Namespace, argv: list[str], started: float) -> int:
    grid = TINY if args.tiny else QUICK if args.quick else FULL
    grid = replace(grid, vocabs=tuple(args.vocab or grid.vocabs), batches=tuple(args.batch or grid.batches))
    shapes = [(v, b, k, m) for v in grid.vocabs for b in grid.batches for k in grid.ks for m in grid.modes]
    print(f"{len(shapes)} shapes, {len(grid.stats)} stats and {len(grid.race)} race candidates", flush=True)
    if args.jobs > 0:
        precompile(sweep_waves(shapes, grid, args.device), args.jobs)

    time_us = timer(args.device, args.rep)
    records = []
    print("| " + " | ".join(SHAPE_COLUMNS) + " |\n" + "|---" * len(SHAPE_COLUMNS) + "|", flush=True)
    for shape in shapes:
        records.append(sweep_shape(shape, grid, args.device, time_us))
        print(shape_row(records[-1]), f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        args.out.write_text(json.dumps(dict(partial=True, results=to_json(records)), indent=2))  # if cut short
        if args.device == "cuda":
            torch.cuda.empty_cache()

    table = suggest(records)
    print("\nsuggested launches, timed again against the default:", flush=True)
    validate(records, table, args.device, time_us)
    print("\n".join(table_rows(records, table)))
    literal = table_literal(table)
    print("\nfor specsplit/kernels/triton_rejection_launch.py:\n" + "\n".join(literal))
    failures = sum(len(r["failures"]) for r in records)
    elapsed = time.perf_counter() - started
    summary = dict(
        **environment(args.device), argv=argv, rep_ms=args.rep, elapsed_s=elapsed, failures=failures,
        launch_table="\n".join(literal),
    )  # fmt: skip
    args.out.write_text(json.dumps(dict(summary=summary, suggested=to_json(table), results=to_json(records)), indent=2))
    print(f"\nwrote {args.out} in {elapsed:.0f} s")
    if failures:
        print(f"!!! {failures} candidate launches gave other tokens than the default or failed: see 'failures'")
    return 1 if failures else 0


# --- grid -----------------------------------------------------------------------------------------------------

GRID_STATS = ((4096, 1024, 4), (8192, 1024, 4), (16384, 1024, 4), (16384, 2048, 4))
GRID_SHAPES = [(v, b, k, m, None) for v in (32000, 151936) for b in (64, 256) for k in (1, 3, 5)
               for m in ("greedy", "one_hot", "dense", "sparse")]  # fmt: skip
GRID_SHAPES += [(v, b, 3, "one_hot", 0.8) for v in (32000, 151936) for b in (64, 256)]
# A smoke run in the interpreter: two small shapes, two candidates each, nothing measured.
TINY_GRID_STATS = ((256, 128, 4),)
TINY_GRID_SHAPES = [(1000, 2, 2, "one_hot", None), (1000, 2, 2, "dense", None)]


def grid_candidates(shape: tuple, stats: tuple) -> list[Launch]:
    """The default launch first, then each stats launch (race kernel at the default), one-hot and sparse
    also with race_in_stats flipped."""
    vocab, batch, k, mode, _ = shape
    default = shape_default(vocab, batch, k, mode)
    out = [default]
    for stats_shape in stats:
        base = with_stats(default, stats_shape).fit(vocab)
        out.append(base)
        if mode in ("one_hot", "sparse"):
            out.append(replace(base, race_in_stats=not base.race_in_stats))
    return list(dict.fromkeys(out))


def label(launch: Launch) -> str:
    return f"{launch.stats_chunk}/{launch.stats_block_v}/{launch.stats_warps}{' R' if launch.race_in_stats else ''}"


def grid_shape(shape: tuple, stats: tuple, device: str, time_us) -> tuple[dict, int]:
    """(the shape's record, the number of candidates whose tokens differ from the reference's): every
    candidate checked against the torch reference, then timed."""
    vocab, batch, k, mode, alpha = shape
    inputs = make_inputs(vocab, batch, k, mode, device, alpha)
    plain = {name: value for name, value in inputs.items() if name not in ("max_num_draft", "all_greedy")}
    expected = rejection_sample(**plain, backend="reference")
    times, failures = [], 0
    candidates = grid_candidates(shape, stats)
    for launch in candidates:
        problem = difference(rejection_sample_triton(**inputs, launch=launch), expected, "the reference's")
        if problem:
            failures += 1
            print(f"!!! {shape} {launch}: {problem}", flush=True)
            continue
        us = time_us(lambda launch=launch: rejection_sample_triton(**inputs, launch=launch))
        times.append(dict(launch=asdict(launch), label=label(launch), us=us))
    best = min(times, key=lambda t: t["us"])
    print(f"{vocab} b{batch} k{k} {mode}{f' alpha {alpha}' if alpha else ''} ({batch * (k + 1) * vocab / 1e6:.1f}M "
          f"logits): default {label(candidates[0])} {times[0]['us']:.1f} µs, best {best['label']} "
          f"{best['us']:.1f} µs", flush=True)  # fmt: skip
    record = dict(vocab=vocab, batch=batch, k=k, mode=mode, alpha=alpha, times=times,
                  mean_num_sampled=float(expected.num_sampled.float().mean()))  # fmt: skip
    return record, failures


def run_grid(args: argparse.Namespace, argv: list[str], started: float) -> int:
    shapes, stats = (TINY_GRID_SHAPES, TINY_GRID_STATS) if args.tiny else (GRID_SHAPES, GRID_STATS)
    if args.jobs > 0:
        tasks = {(s[0], s[2], s[3], args.device, lc) for s in shapes for lc in grid_candidates(s, stats)}
        precompile([sorted(tasks, key=repr)], args.jobs)
    time_us = timer(args.device, args.rep)
    records, failures = [], 0
    for shape in shapes:
        record, shape_failures = grid_shape(shape, stats, args.device, time_us)
        records.append(record)
        failures += shape_failures
    summary = dict(**environment(args.device), argv=argv, rep_ms=args.rep, failures=failures,
                   elapsed_s=time.perf_counter() - started)  # fmt: skip
    args.out.write_text(json.dumps(dict(summary=summary, results=records), indent=1))
    print(f"wrote {args.out} in {summary['elapsed_s']:.0f} s")
    return 1 if failures else 0


# --- command line ---------------------------------------------------------------------------------------------

MODE_DEFAULTS = {"sweep": dict(rep=10, jobs=12), "grid": dict(rep=15, jobs=14)}  # --rep ms, --jobs on cuda


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, required=True, help="JSON results file")
    common.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: Triton's interpreter")
    common.add_argument("--rep", type=int, help="ms of CUDA graph replays per candidate (sweep 10, grid 15)")
    common.add_argument("--jobs", type=int, help="compiling processes (0: compile on first use); on cuda 12 / 14")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    sweep = modes.add_parser("sweep", parents=[common], help="candidate launches per shape; suggests LAUNCH_TABLE")
    sweep.add_argument("--quick", action="store_true", help="vocab 151936, batch {1, 64, 256}, k 3, fewer candidates")
    sweep.add_argument("--tiny", action="store_true", help="2 tiny shapes, 2 + 1 candidates (a smoke run)")
    sweep.add_argument("--vocab", type=int, nargs="+", help="only these vocabulary sizes of the grid")
    sweep.add_argument("--batch", type=int, nargs="+", help="only these batch sizes of the grid")
    grid = modes.add_parser("grid", parents=[common], help="large random batches, race in stats on and off")
    grid.add_argument("--tiny", action="store_true", help="two tiny shapes (a smoke run)")
    args = parser.parse_args(argv)
    require_device(args.device)
    defaults = MODE_DEFAULTS[args.mode]
    args.rep = defaults["rep"] if args.rep is None else args.rep
    if args.jobs is None:
        args.jobs = min(defaults["jobs"], os.cpu_count() or 1) if args.device == "cuda" else 0
    started = time.perf_counter()
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return (run_sweep if args.mode == "sweep" else run_grid)(args, argv, started)


if __name__ == "__main__":
    sys.exit(main())
