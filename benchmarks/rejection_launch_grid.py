"""Launch grid of the Triton rejection sampler's large random batches on one CUDA GPU: per shape (vocab,
batch, k, mode), the time of a fixed set of stats launches, each with and without the race in the stats
kernel (one-hot and sparse), beside the default launch. ``LARGE_BATCH_TABLE`` and the race-in-stats
bounds in ``kernels/triton_rejection_launch.py`` are read from its output.

    cd benchmarks && PYTHONPATH=.. python3 rejection_launch_grid.py --out grid.json
    cd benchmarks && TRITON_INTERPRET=1 PYTHONPATH=.. python3 rejection_launch_grid.py --device cpu --tiny --out g.json

Shapes: vocab {32000, 151936} x batch {64, 256} x k {1, 3, 5} x mode {greedy, one_hot, dense, sparse}, and
one-hot drafts accepted with probability 0.8 at k 3 (``rejection_sampler.py``'s inputs). Unlike
``rejection_sweep.py`` it also flips ``race_in_stats`` and keeps each launch's race kernel at the default,
so that the table can be keyed by logits (rows x vocab) rather than by batch. Every candidate's tokens are
compared with the reference's before it is timed (``triton.testing.do_bench_cudagraph``, median); a
difference is printed with !!! and the run exits 1. About 1 minute on an H200 (compiling in ``--jobs``
processes first).
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton
import triton.testing
from rejection_sampler import make_inputs  # benchmarks/ is on sys.path when run as a script
from rejection_sweep import compile_once, difference, require_device

from kernels import rejection_sample
from kernels.triton_rejection import rejection_sample_triton
from kernels.triton_rejection_launch import Launch, default_launch

STATS = ((4096, 1024, 4), (8192, 1024, 4), (16384, 1024, 4), (16384, 2048, 4))
SHAPES = [(v, b, k, m, None) for v in (32000, 151936) for b in (64, 256) for k in (1, 3, 5)
          for m in ("greedy", "one_hot", "dense", "sparse")]  # fmt: skip
SHAPES += [(v, b, 3, "one_hot", 0.8) for v in (32000, 151936) for b in (64, 256)]
# A smoke run in the interpreter: two small shapes, two candidates each, nothing measured.
TINY_STATS = ((256, 128, 4),)
TINY_SHAPES = [(1000, 2, 2, "one_hot", None), (1000, 2, 2, "dense", None)]


def candidates(shape: tuple, stats: tuple) -> list[Launch]:
    """The default launch first, then each stats launch (race kernel at the default), one-hot and sparse
    also with race_in_stats flipped."""
    vocab, batch, k, mode, _ = shape
    default = default_launch(batch, batch * (k + 1), vocab, mode).fit(vocab)
    out = [default]
    for chunk, block_v, warps in stats:
        base = replace(default, stats_chunk=chunk, stats_block_v=block_v, stats_warps=warps).fit(vocab)
        out.append(base)
        if mode in ("one_hot", "sparse"):
            out.append(replace(base, race_in_stats=not base.race_in_stats))
    return list(dict.fromkeys(out))


def label(launch: Launch) -> str:
    return f"{launch.stats_chunk}/{launch.stats_block_v}/{launch.stats_warps}{' R' if launch.race_in_stats else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: Triton's interpreter")
    parser.add_argument("--tiny", action="store_true", help="two tiny shapes (a smoke run)")
    parser.add_argument("--rep", type=int, default=15, help="ms of CUDA graph replays per candidate")
    parser.add_argument("--jobs", type=int, help="compiling processes (0: compile on first use); default 14 on cuda")
    args = parser.parse_args(argv)
    require_device(args.device)
    shapes, stats = (TINY_SHAPES, TINY_STATS) if args.tiny else (SHAPES, STATS)
    jobs = args.jobs if args.jobs is not None else (min(14, os.cpu_count() or 1) if args.device == "cuda" else 0)
    started = time.perf_counter()
    if jobs > 0:
        tasks = sorted({(s[0], s[2], s[3], args.device, lc) for s in shapes for lc in candidates(s, stats)}, key=repr)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for task, err in zip(tasks, pool.map(compile_once, tasks)):
                if err:
                    print("!!! compiling", task, err, flush=True)
        print(f"compiled {len(tasks)} launches in {time.perf_counter() - started:.0f} s", flush=True)

    records, failures = [], 0
    for shape in shapes:
        vocab, batch, k, mode, alpha = shape
        inputs = make_inputs(vocab, batch, k, mode, args.device, alpha)
        plain = {name: value for name, value in inputs.items() if name not in ("max_num_draft", "all_greedy")}
        expected = rejection_sample(**plain, backend="reference")
        times = []
        for launch in candidates(shape, stats):
            problem = difference(rejection_sample_triton(**inputs, launch=launch), expected, "the reference's")
            if problem:
                failures += 1
                print(f"!!! {shape} {launch}: {problem}", flush=True)
                continue
            if args.device == "cuda":
                fn = lambda launch=launch, inputs=inputs: rejection_sample_triton(**inputs, launch=launch)  # noqa: E731
                us = triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3
            else:
                us = 0.0
            times.append(dict(launch=asdict(launch), label=label(launch), us=us))
        best = min(times, key=lambda t: t["us"])
        print(f"{vocab} b{batch} k{k} {mode}{f' alpha {alpha}' if alpha else ''} ({batch * (k + 1) * vocab / 1e6:.1f}M "
              f"logits): default {label(candidates(shape, stats)[0])} {times[0]['us']:.1f} µs, best {best['label']} "
              f"{best['us']:.1f} µs", flush=True)  # fmt: skip
        records.append(dict(vocab=vocab, batch=batch, k=k, mode=mode, alpha=alpha, times=times,
                            mean_num_sampled=float(expected.num_sampled.float().mean())))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)", torch=torch.__version__,
        triton=triton.__version__, rep_ms=args.rep, failures=failures, elapsed_s=time.perf_counter() - started,
    )  # fmt: skip
    args.out.write_text(json.dumps(dict(summary=summary, results=records), indent=1))
    print(f"wrote {args.out} in {summary['elapsed_s']:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
