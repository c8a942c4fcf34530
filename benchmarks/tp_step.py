"""Tensor-parallel verify-step time per rank, and the share of it spent in collectives, at real shapes with
random weights (`--load-format dummy`: each rank builds its shard on its GPU).

    # 8 H200s: a 72B-shaped target at TP 2, 4 and 8 (TP 1 does not fit one GPU in bf16)
    python benchmarks/tp_step.py --shape qwen2-72b --tp 2 4 8 --batches 1 8 32 --k 3
    # 2 GPUs, the 7B shape: TP 1 against TP 2
    python benchmarks/tp_step.py --shape qwen2-7b --tp 1 2 --batches 1 8 32
    # CPU smoke run (gloo)
    python benchmarks/tp_step.py --shape qwen2-tiny --device cpu --tp 1 2 --batches 1 --steps 3

Per (TP size, batch B): B requests with --context tokens cached each run verify steps of k + 1 new tokens
(forward, logits of every new token gathered to rank 0), rolled back after each step so the context stays
put; per rank the median over --steps of
- `eager_ms`: the step run eagerly (CUDA events around forward + logits; the Triton paged attention on CUDA),
- `collective_ms` / `collective_share`: the time inside the step's all-reduces and logits gather (CUDA events
  around each: `specsplit.models.parallel.time_collectives`), waiting for slower ranks included,
- `graph_ms`: the same step replayed from a CUDA graph (what the verifier runs; CUDA only).
The ranks are spawned processes on cuda:0 .. cuda:N-1 joined over NCCL (gloo on the CPU). A TP size needing
more GPUs than the machine has is skipped with a line. The table is printed; --out (default $OUT/tp_step.json
when $OUT is set) gets the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.launcher import free_port  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--k", type=int, default=3, help="drafts per request: k + 1 new tokens per step")
    p.add_argument("--context", type=int, default=512, help="tokens cached per request")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


class CollectiveTimes:
    """Times every device collective of a step: CUDA events on CUDA, the host clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.spans = cuda, []

    @contextmanager
    def __call__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.append(time.perf_counter() - t0)

    def take_ms(self) -> float:
        """The step's collective time so far (after a synchronize), and a fresh start."""
        spans, self.spans = self.spans, []
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in spans)
        return 1000 * sum(spans)


def rank_main(rank: int, size: int, address: str, args: argparse.Namespace, path: str, results) -> None:
    try:
        results.put((rank, run_rank(rank, size, address, args, path)))
    except BaseException as err:  # noqa: BLE001 (reported by the parent)
        results.put((rank, f"{type(err).__name__}: {err}"))


def run_rank(rank: int, size: int, address: str, args: argparse.Namespace, path: str) -> list[dict]:
    from specsplit.models.cuda_graphs import CudaGraphRunner
    from specsplit.models.loader import load_target
    from specsplit.models.parallel import init_tensor_parallel, time_collectives

    cuda = args.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    init_tensor_parallel(rank, size, address, backend="nccl" if cuda else "gloo", timeout_s=600, device=device)
    model = load_target(path, dtype=getattr(torch, args.dtype), device=device, load_format="dummy")
    n_new, max_batch = args.k + 1, max(args.batches)
    block = 16
    per_request = -(-(args.context + n_new) // block)
    cache = model.make_kv_cache(num_blocks=max_batch * per_request + 8, block_size=block)
    max_tokens = max_batch * n_new
    graphs = None
    if cuda:
        graphs = CudaGraphRunner(model, cache, max_model_len=args.context + n_new, max_num_tokens=max_tokens)
    timer = CollectiveTimes(cuda)
    vocab = model.config.vocab_size
    rows = []
    for batch in args.batches:
        ids = [f"r{i}" for i in range(batch)]
        generator = torch.Generator().manual_seed(batch)  # every rank the same tokens
        with torch.inference_mode():
            for r in ids:  # the context, one request at a time (eager SDPA)
                attn = cache.prepare_step([r], [args.context])
                tokens = torch.randint(0, vocab, (args.context,), generator=generator).to(device)
                model(tokens, torch.arange(args.context, device=device), cache, attn)
        input_ids = torch.randint(0, vocab, (batch * n_new,), generator=generator).to(device)
        positions = torch.arange(args.context, args.context + n_new, device=device).repeat(batch)
        eager, collective, replay = [], [], []
        for step in range(args.steps + 3):  # 3 untimed warm-up steps
            for mode in ("eager", "graph") if cuda else ("eager",):
                attn = cache.prepare_step(ids, [n_new] * batch, use_kernel=cuda)
                start = time.perf_counter()
                if cuda:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                with torch.inference_mode():
                    if mode == "graph":
                        graphs.run(input_ids, positions, attn)
                    else:
                        time_collectives(timer)
                        model.compute_logits(model(input_ids, positions, cache, attn))
                        time_collectives(None)
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                    ms = begin.elapsed_time(end)
                else:
                    ms = 1000 * (time.perf_counter() - start)
                collective_ms = timer.take_ms() if mode == "eager" else 0.0
                for r in ids:
                    cache.truncate(r, args.context)
                if step >= 3:
                    (replay if mode == "graph" else eager).append(ms)
                    if mode == "eager":
                        collective.append(collective_ms)
        for r in ids:
            cache.free(r)
        eager_ms, coll_ms = statistics.median(eager), statistics.median(collective)
        rows.append(
            {
                "tp": size,
                "rank": rank,
                "batch": batch,
                "tokens": batch * n_new,
                "eager_ms": round(eager_ms, 3),
                "collective_ms": round(coll_ms, 3),
                "collective_share": round(coll_ms / eager_ms, 3) if eager_ms else 0.0,
                "graph_ms": round(statistics.median(replay), 3) if replay else None,
            }
        )
    return rows


def run_tp(size: int, args: argparse.Namespace, path: str) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, size, address, args, path, results)) for r in range(size)]
    for p in procs:
        p.start()
    rows, failures = [], []
    for _ in range(size):
        rank, out = results.get(timeout=3600)
        (failures.append(f"rank {rank}: {out}") if isinstance(out, str) else rows.extend(out))
    for p in procs:
        p.join(60)
    if failures:
        raise SystemExit(f"TP {size} failed: " + "; ".join(failures))
    return rows


def print_table(rows: list[dict]) -> None:
    columns = (("tp", 3), ("batch", 5), ("tokens", 6), ("rank", 4), ("eager ms", 9), ("coll ms", 8), ("coll %", 6))
    print(" ".join(f"{name:>{width}}" for name, width in (*columns, ("graph ms", 9))))
    for r in sorted(rows, key=lambda r: (r["tp"], r["batch"], r["rank"])):
        graph = f"{r['graph_ms']:9.3f}" if r["graph_ms"] is not None else f"{'-':>9}"
        print(
            f"{r['tp']:>3} {r['batch']:>5} {r['tokens']:>6} {r['rank']:>4} {r['eager_ms']:9.3f} "
            f"{r['collective_ms']:8.3f} {100 * r['collective_share']:5.1f}% {graph}"
        )


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for a smoke run")
    path = str(write_shape(args.shape, Path(tempfile.mkdtemp(prefix="specsplit-tp-")) / args.shape))
    rows = []
    for size in args.tp:
        if args.device == "cuda" and size > torch.cuda.device_count():
            print(f"[TP {size}: skipped, {torch.cuda.device_count()} GPUs here]", file=sys.stderr)
            continue
        t0 = time.monotonic()
        rows.extend(run_tp(size, args, path))
        print(f"[TP {size}: {time.monotonic() - t0:.0f} s]", file=sys.stderr)
    print(f"{args.shape}, {args.dtype}, k = {args.k}, {args.context} tokens of context, median of {args.steps} steps")
    print_table(rows)
    out = args.out or (Path(os.environ["OUT"]) / "tp_step.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
        print(f"[wrote {out}]", file=sys.stderr)


if __name__ == "__main__":
    main()
