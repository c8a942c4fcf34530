"""One-hot rejection sampling on one CUDA GPU: two launches (stats, then the race on each stop row) against
the race run in the stats pass (one launch, ``Launch.one_hot_race_in_stats``), per shape and chunk size; the
data behind ``RACE_IN_STATS_MAX_LOGITS`` in ``kernels/triton_rejection_launch.py``.

    cd benchmarks && PYTHONPATH=.. python3 race_in_stats.py --out race_in_stats.json
    cd benchmarks && TRITON_INTERPRET=1 PYTHONPATH=.. python3 race_in_stats.py --device cpu --tiny --out /tmp/r.json

Inputs are ``rejection_sampler.py``'s (one-hot, temperature 0.8). Shapes: vocab {151936, 32000} x batch
{1, 8, 64, 256} x k {1, 3, 5}. Per shape: the two-launch shape ``LAUNCH_TABLE`` holds for the batch, the
race in the stats pass at chunks of 1,024 to 16,384 ids (tiles of 512, 4 warps), and ``default_launch``'s
pick. Every candidate's tokens must equal the two launches' before it is timed (else the run exits 1).
Time: CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median); in the interpreter (``--tiny``,
a smoke run) one plain call, nothing measured.
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from rejection_sampler import make_inputs  # benchmarks/ is on sys.path when run as a script
from rejection_sweep import check_and_time, timer

from kernels.triton_rejection import rejection_sample_triton
from kernels.triton_rejection_launch import Launch, default_launch, table_launch

CHUNKS = (1024, 2048, 4096, 8192, 16384)


def candidates(chunks: tuple[int, ...], block_v: int) -> dict[str, Launch]:
    return {f"in stats {c}": Launch(c, min(block_v, c), 4, c, min(block_v, c), 4, True) for c in chunks}


def measure(vocab: int, batch: int, k: int, device: str, time_us, chunks, block_v, failures: list) -> dict:
    inputs = make_inputs(vocab, batch, k, "one_hot", device)
    num_logits = batch * (k + 1)
    two = replace(table_launch(batch, "one_hot"), one_hot_race_in_stats=False).fit(vocab)
    expected = rejection_sample_triton(**inputs, launch=two)
    where = f"vocab {vocab} batch {batch} k {k}"
    row = dict(vocab=vocab, batch=batch, k=k, num_logits=num_logits)
    row["two_launches_us"] = check_and_time(inputs, two, expected, time_us, where, failures)
    row["in_stats_us"] = {
        name: check_and_time(inputs, launch.fit(vocab), expected, time_us, where, failures)
        for name, launch in candidates(chunks, block_v).items()
    }
    picked = default_launch(batch, num_logits, vocab, "one_hot").fit(vocab)
    row["default"] = f"in stats {picked.stats_chunk}" if picked.one_hot_race_in_stats else "two launches"
    row["default_us"] = check_and_time(inputs, picked, expected, time_us, where, failures)
    timings = {
        "two launches": row["two_launches_us"],
        **row["in_stats_us"],
        f"default ({row['default']})": row["default_us"],
    }
    print(f"{where}: " + ", ".join(f"{n} {us(t)}" for n, t in timings.items()), flush=True)
    return row


def us(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def markdown(rows: list[dict]) -> list[str]:
    names = list(rows[0]["in_stats_us"]) if rows else []
    head = ["vocab", "batch", "k", "two launches µs", *[f"{n} µs" for n in names], "default", "default µs", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = r["two_launches_us"] / r["default_us"] if r["two_launches_us"] and r["default_us"] else None
        cells = [r["vocab"], r["batch"], r["k"], us(r["two_launches_us"]), *map(us, r["in_stats_us"].values())]
        cells += [r["default"], us(r["default_us"]), "-" if ratio is None else f"{ratio:.2f}x"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the interpreter, a smoke run")
    parser.add_argument("--tiny", action="store_true", help="vocab 1000, batch 1 and 3, k 2, chunks 256 and 512")
    parser.add_argument("--rep", type=int, default=30, help="ms of CUDA graph replays per timing")
    args = parser.parse_args()
    shapes = [(v, b, k) for v in (151936, 32000) for b in (1, 8, 64, 256) for k in (1, 3, 5)]
    chunks, block_v = CHUNKS, 512
    if args.tiny:
        shapes, chunks, block_v = [(1000, 1, 2), (1000, 3, 2)], (256, 512), 128
    failures: list = []
    time_us = timer(args.device, args.rep)
    rows = [measure(*shape, args.device, time_us, chunks, block_v, failures) for shape in shapes]
    table = markdown(rows)
    print("\n".join(table))
    args.out.write_text(json.dumps(dict(results=rows, failures=failures, table=table), indent=1))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
