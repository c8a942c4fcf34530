"""Where one rejection-sampler call spends its time on a CUDA GPU: per-kernel GPU time
(torch.profiler), the wall time of back-to-back eager calls, and the time of one call replayed from
a CUDA graph. When eager wall time is far above the GPU time, the call is bound by host work.

    PYTHONPATH=$PWD python3 benchmarks/profile_rejection_sampler.py

Launch shapes (chunk, tile, warps per kernel) are timed by ``benchmarks/rejection_sweep.py``.
"""

import sys
from pathlib import Path

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphed import captured  # noqa: E402
from rejection_sampler import make_inputs  # noqa: E402

from kernels import rejection_sample  # noqa: E402

CASES = [(151936, 1, 3, "greedy"), (151936, 1, 3, "one_hot"), (151936, 64, 3, "one_hot")]
CASES += [(151936, 256, 3, m) for m in ("greedy", "one_hot", "dense", "sparse")]


def kernel_times(fn) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total > 0}
    return ", ".join(f"{name[:24]} {us:.1f}" for name, us in sorted(times.items(), key=lambda t: -t[1]))


def wall_us(fn, n: int = 200) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


def main() -> None:
    print("| vocab, batch, k, mode | GPU µs per kernel | eager back-to-back µs | CUDA graph µs |")
    print("|---|---|---|---|")
    for vocab, batch, k, mode in CASES:
        inputs = make_inputs(vocab, batch, k, mode, "cuda")

        def call(inputs=inputs):
            return rejection_sample(**inputs, backend="triton")

        for _ in range(3):
            call()
        graph = captured(call)
        for _ in range(3):  # replays reuse the workspace counters: outputs must stay equal to eager calls
            assert torch.equal(graph().sampled, call().sampled), "graph replay differs from an eager call"
        graph_us = triton.testing.do_bench_cudagraph(call) * 1000
        print(f"| {vocab}, {batch}, {k}, {mode} | {kernel_times(call)} | {wall_us(call):.1f} | {graph_us:.1f} |")


if __name__ == "__main__":
    main()
