"""Launch-shape sweep of the Triton rejection sampler on one CUDA GPU: per shape (vocab, batch, k,
mode), the time of candidate launch shapes (``kernels/triton_rejection_launch.py``), and a suggested
``LAUNCH_TABLE`` for ``default_launch``.

    cd benchmarks && PYTHONPATH=.. python3 rejection_sweep.py --quick --out sweep.json
    cd benchmarks && TRITON_INTERPRET=1 PYTHONPATH=.. python3 rejection_sweep.py --device cpu --tiny --out /tmp/s.json

Inputs are ``rejection_sampler.py``'s. Shapes: vocab {151936, 32000} x batch {1, 8, 64, 256} x k
{1, 3, 5} x mode {greedy, one_hot, dense, sparse}; ``--quick``: vocab 151936, batch {1, 64, 256},
k 3. The two kernels are tuned one after the other (their cross product is too large): the stats
kernel's (chunk, tile, warps) with the race kernel at the default, then the race kernel's with the
shape's best stats launch; greedy shapes launch no race. Each candidate's tokens must equal the
default launch's on the same inputs before it is timed; a mismatch (or an error) is printed, the
candidate is not timed, and the run exits 1.

Time: ``triton.testing.do_bench_cudagraph`` (replays of a CUDA graph, GPU work only; ``--rep`` ms per
candidate). Compilation would dominate (each kernel's chunk, tile, warps and q mode, per vocab and
k, is one compilation of ~1 s), so ``--jobs`` processes first run every candidate once on a batch-1
input, filling Triton's on-disk cache, and the timing loop only loads binaries.

Suggested table: per mode class (greedy, random) and batch, the stats launch, then the race launch,
with the least mean time relative to each shape's best; then that launch and the default are timed
again on every shape. A bucket covers the batch sizes up to the one measured. Random batches of more
than ``SMALL_BATCH`` requests get no suggestion: ``LARGE_BATCH_TABLE`` is keyed per mode by logits
(rows x vocab), which a batch size alone does not pin down; the per-shape best launches set it.

Duration on an H200 (estimated, not yet measured): ``--quick`` (12 shapes, 12 + 12 candidates, 75
compilations, 288 timings) about 1 minute: ~20 s compiling, ~30 s timing (up to 2.5 minutes if the
worker processes fail and the kernels compile one by one); the full sweep (96 shapes, 24 + 36
candidates, ~650 compilations, ~5200 timings) about 8 minutes, or half that per vocabulary
(``--vocab 151936``, then ``--vocab 32000``).
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

from kernels.triton_rejection import rejection_sample_triton
from kernels.triton_rejection_launch import SMALL_BATCH, Launch, default_launch

KernelShape = tuple[int, int, int]  # one kernel's (chunk, block_v, warps)


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


def stats_of(launch: Launch) -> KernelShape:
    return launch.stats_chunk, launch.stats_block_v, launch.stats_warps


def race_of(launch: Launch) -> KernelShape:
    return launch.race_chunk, launch.race_block_v, launch.race_warps


def with_stats(launch: Launch, shape: KernelShape) -> Launch:
    return replace(launch, stats_chunk=shape[0], stats_block_v=shape[1], stats_warps=shape[2])


def with_race(launch: Launch, shape: KernelShape) -> Launch:
    return replace(launch, race_chunk=shape[0], race_block_v=shape[1], race_warps=shape[2])


def describe(launch: Launch, mode: str) -> str:
    stats = "stats " + "/".join(map(str, stats_of(launch)))
    return stats if mode == "greedy" else f"{stats}, race " + "/".join(map(str, race_of(launch)))


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


def precompile(shapes: list[tuple[int, int, int, str]], grid: Grid, device: str, jobs: int) -> None:
    """Compiles every kernel the sweep will launch, ``jobs`` at a time. A kernel's binary depends on
    its own launch shape, the q mode, vocab and k, not on the batch nor on the other kernel's shape;
    greedy shares one-hot's stats kernel. The defaults go first, so that each candidate after them
    compiles one kernel only. On failure the sweep compiles on first use instead."""
    defaults, candidates = set(), set()
    for vocab, batch, k, mode in shapes:
        q_mode, default = ("one_hot" if mode == "greedy" else mode), shape_default(vocab, batch, k, mode)
        defaults.add((vocab, k, q_mode, device, default))
        candidates.update((vocab, k, q_mode, device, with_stats(default, s).fit(vocab)) for s in grid.stats)
        candidates.update((vocab, k, q_mode, device, with_race(default, r).fit(vocab)) for r in grid.race)
    waves = [sorted(defaults, key=repr), sorted(candidates - defaults, key=repr)]
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


def require_device(device: str) -> None:
    """Exits unless the kernels can run on ``device``: a CUDA GPU, or the CPU under Triton's interpreter."""
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="vocab 151936, batch {1, 64, 256}, k 3, fewer candidates")
    parser.add_argument("--tiny", action="store_true", help="2 tiny shapes, 2 + 1 candidates (a smoke run)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: Triton's interpreter")
    parser.add_argument("--vocab", type=int, nargs="+", help="only these vocabulary sizes of the grid")
    parser.add_argument("--batch", type=int, nargs="+", help="only these batch sizes of the grid")
    parser.add_argument("--rep", type=int, default=10, help="ms of CUDA graph replays per candidate")
    parser.add_argument("--jobs", type=int, help="compiling processes (0: compile on first use); default 12 on cuda")
    args = parser.parse_args(argv)
    require_device(args.device)
    grid = TINY if args.tiny else QUICK if args.quick else FULL
    grid = replace(grid, vocabs=tuple(args.vocab or grid.vocabs), batches=tuple(args.batch or grid.batches))
    jobs = args.jobs if args.jobs is not None else (min(12, os.cpu_count() or 1) if args.device == "cuda" else 0)
    shapes = [(v, b, k, m) for v in grid.vocabs for b in grid.batches for k in grid.ks for m in grid.modes]
    started = time.perf_counter()
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{len(shapes)} shapes, {len(grid.stats)} stats and {len(grid.race)} race candidates", flush=True)
    if jobs > 0:
        precompile(shapes, grid, args.device, jobs)

    time_us = timer(args.device, args.rep)
    records = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
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
    print("\nfor kernels/triton_rejection_launch.py:\n" + "\n".join(literal))
    failures = sum(len(r["failures"]) for r in records)
    elapsed = time.perf_counter() - started
    summary = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
        torch=torch.__version__, triton=triton.__version__, argv=sys.argv[1:] if argv is None else argv,
        rep_ms=args.rep, elapsed_s=elapsed, failures=failures, launch_table="\n".join(literal),
    )  # fmt: skip
    args.out.write_text(json.dumps(dict(summary=summary, suggested=to_json(table), results=to_json(records)), indent=2))
    print(f"\nwrote {args.out} in {elapsed:.0f} s")
    if failures:
        print(f"!!! {failures} candidate launches gave other tokens than the default or failed: see 'failures'")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
