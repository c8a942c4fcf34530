"""Where one rejection-sampler call spends its time on a CUDA GPU: per-kernel GPU time
(torch.profiler), the wall time of back-to-back eager calls, and the time of one call replayed from
a CUDA graph. When eager wall time is far above the GPU time, the call is bound by host work.

    PYTHONPATH=$PWD python3 benchmarks/profile_rejection_sampler.py [--sweep]

``--sweep`` also times the batch-256 random modes for several launch shapes (chunk, tile, warps).
"""

import argparse
import sys
from pathlib import Path

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphed import captured  # noqa: E402
from rejection_sampler import make_inputs  # noqa: E402

import kernels.triton_rejection as launcher  # noqa: E402
from kernels import rejection_sample  # noqa: E402

CASES = [(151936, 1, 3, "greedy"), (151936, 1, 3, "one_hot"), (151936, 64, 3, "one_hot")]
CASES += [(151936, 256, 3, m) for m in ("greedy", "one_hot", "dense", "sparse")]
SHAPES = [(4096, 1024, 4), (8192, 1024, 4), (8192, 2048, 8), (16384, 2048, 8), (4096, 2048, 8), (2048, 512, 4)]


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
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
    if args.sweep:
        print("\n| chunk, tile, warps | " + " | ".join(m for m in ("greedy", "one_hot", "dense", "sparse")) + " |")
        print("|---|---|---|---|---|")
        default = launcher.GPU_CHUNK, launcher.GPU_BLOCK_V, launcher.GPU_NUM_WARPS
        for shape in SHAPES:
            launcher.GPU_CHUNK, launcher.GPU_BLOCK_V, launcher.GPU_NUM_WARPS = shape
            cells = []
            for mode in ("greedy", "one_hot", "dense", "sparse"):
                inputs = make_inputs(151936, 256, 3, mode, "cuda")
                call = lambda inputs=inputs: rejection_sample(**inputs, backend="triton")  # noqa: E731
                cells.append(f"{triton.testing.do_bench_cudagraph(call) * 1000:.1f}")
            print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)
        launcher.GPU_CHUNK, launcher.GPU_BLOCK_V, launcher.GPU_NUM_WARPS = default


if __name__ == "__main__":
    main()
