"""The drafter's propose() alone: wall time against its GPU time, per batch size, on one model shape.

    PYTHONPATH=. python benchmarks/propose_step.py --shape qwen2-7b --batches 1,32 --k 3       # H200
    PYTHONPATH=. python benchmarks/propose_step.py --shape qwen2-tiny --device cpu --batches 1  # smoke

Each request holds `--context` tokens of MTP KV and brings k + 1 hidden-state rows (a fully accepted
iteration); after every propose it is rolled back, so the context stays put. Reported per batch: the
median wall time of `DrafterRunner.propose` (host planning, uploads, MTP step 0 and steps 1..k-1, the
drafts to the host), the median GPU time between its first and last kernel (CUDA events), and on
CUDA the kernels of one propose by GPU time (torch.profiler). Wall − GPU is what the host adds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402


def bench(runner, batch: int, k: int, context: int, steps: int, warmup: int, profile: bool) -> dict:
    import torch

    from specsplit.drafter.runner import ProposeItem

    device = runner.device
    hidden_size = runner.mtp.config.hidden_size
    vocab = runner.mtp.config.vocab_size
    dtype = next(runner.mtp.parameters()).dtype
    ids = [f"r{i}" for i in range(batch)]
    gen = torch.Generator().manual_seed(0)

    def items(start: int, rows: int, spec: int) -> list[ProposeItem]:
        return [ProposeItem(rid, start, torch.randint(0, vocab, (rows,), generator=gen).tolist(), spec) for rid in ids]

    with torch.inference_mode():
        # The context: one long "accepted" run per request, no drafts wanted.
        runner.propose(items(0, context, 0), torch.randn(batch * context, hidden_size, device=device, dtype=dtype))
        hidden = torch.randn(batch * (k + 1), hidden_size, device=device, dtype=dtype)
        on_cuda = device.type == "cuda"
        walls, gpus = [], []
        for i in range(warmup + steps):
            batch_items = items(context, k + 1, k)
            if on_cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = runner.propose(batch_items, hidden)
            wall = time.perf_counter() - t0
            if on_cuda:
                end.record()
                torch.cuda.synchronize()
            if i >= warmup:
                walls.append(wall)
                if on_cuda:
                    gpus.append(start.elapsed_time(end) / 1e3)
            assert all(len(d) == k for d in out.drafts), "every request gets k drafts"
            for rid in ids:  # back to the context: the next propose sees the same state
                runner.kv_cache.truncate(rid, context)
        kernels = kernel_table(runner, items(context, k + 1, k), hidden, ids, context) if on_cuda and profile else []
    return {
        "batch": batch,
        "k": k,
        "wall_ms": statistics.median(walls) * 1e3,
        "gpu_ms": statistics.median(gpus) * 1e3 if gpus else None,
        "kernels": kernels,
    }


def kernel_table(runner, batch_items, hidden, ids, context) -> list[tuple[str, float, int]]:
    """(kernel name, µs, calls) of one propose, by GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.propose(batch_items, hidden)
        torch.cuda.synchronize()
    for rid in ids:
        runner.kv_cache.truncate(rid, context)
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time_total)
    rows = [(name, sum(t), len(t)) for name, t in per_name.items()]
    return sorted(rows, key=lambda r: -r[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from specsplit.drafter.runner import DrafterRunner
    from specsplit.models.loader import load_mtp

    model_dir = write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    mtp = load_mtp(str(model_dir), dtype=getattr(torch, args.dtype), device=args.device, load_format="dummy")
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (-(-(args.context + 2 * args.k + 2) // 16)) + 8
    runner = DrafterRunner(mtp, mtp.make_kv_cache(blocks, 16))
    rows = []
    for batch in batches:
        row = bench(runner, batch, args.k, args.context, args.steps, args.warmup, profile=True)
        rows.append(row)
        gpu = f"{row['gpu_ms']:.3f}" if row["gpu_ms"] is not None else "-"
        print(f"batch {batch:3d} k {args.k}: propose wall {row['wall_ms']:.3f} ms, GPU {gpu} ms", flush=True)
        total = sum(us for _, us, _ in row["kernels"])
        if row["kernels"]:
            print(f"  kernels: {total:.0f} µs in {sum(n for *_, n in row['kernels'])} launches", flush=True)
        for name, us, n in row["kernels"][:10]:
            print(f"  {us:8.0f} µs {n:4d}× {name[:100]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
