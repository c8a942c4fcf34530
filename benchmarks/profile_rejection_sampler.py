"""Where one rejection-sampler call spends its time on a CUDA GPU: per-kernel GPU time
(torch.profiler) next to the wall time of back-to-back calls. When the wall time is far above the
summed GPU time, the call is bound by host work (Python, allocations, launches), not by the GPU.

    PYTHONPATH=$PWD python3 benchmarks/profile_rejection_sampler.py
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rejection_sampler import make_inputs  # noqa: E402

from kernels import rejection_sample  # noqa: E402

CASES = [(151936, 1, 3, "greedy"), (151936, 1, 3, "one_hot"), (151936, 64, 3, "one_hot"), (151936, 256, 3, "dense")]


def main() -> None:
    for vocab, batch, k, mode in CASES:
        inputs = make_inputs(vocab, batch, k, mode, "cuda")
        for _ in range(5):
            rejection_sample(**inputs, backend="triton")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                rejection_sample(**inputs, backend="triton")
            torch.cuda.synchronize()
        print(f"=== vocab {vocab} batch {batch} k {k} {mode}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            rejection_sample(**inputs, backend="triton")
        end.record()
        torch.cuda.synchronize()
        print(f"back-to-back: {start.elapsed_time(end) / 200 * 1000:.1f} us per call")


if __name__ == "__main__":
    main()
