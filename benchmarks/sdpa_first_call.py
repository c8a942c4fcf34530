"""First-call cost of `scaled_dot_product_attention` for new shapes, per SDPA backend, on one CUDA GPU.

The runners' eager steps (prefill chunks too large for a CUDA graph) call SDPA with a mask over shapes that
change from step to step. A backend that prepares itself per shape stalls every request in flight on each new
one. Each backend runs in its own process (first-use costs, such as CUDA loading a kernel's module, are per
process), over the same list of new shapes (GQA as Qwen2-7B: 4 KV heads, 7 queries each, head dim 128, bf16),
and reports each shape's first and second call (host wall time with a device sync).

    python3 benchmarks/sdpa_first_call.py [--backends default efficient math no_cudnn] [--out sdpa.json]

`default` is what torch picks; `no_cudnn` is what the runners run (`models.attention.use_precompiled_sdpa`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (requests, new tokens each, keys each): the shapes of padded prefill chunks, all different.
SHAPES = [(1, 16, 128), (32, 4, 132), (32, 4, 133), (3, 64, 200), (5, 40, 170), (7, 33, 150), (32, 4, 200),
          (12, 70, 300), (20, 4, 157), (2, 300, 301), (17, 31, 169)]  # fmt: skip
BACKENDS = ("default", "efficient", "math", "no_cudnn")
KV_HEADS, GROUP, HEAD_DIM = 4, 7, 128


def run_one(backend: str) -> list[dict]:
    """In this process: each shape's first and second call under `backend`."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "no_cudnn":
        sys.path.insert(0, str(ROOT))
        from models.attention import use_precompiled_sdpa

        use_precompiled_sdpa()
    forced = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}.get(backend)
    torch.zeros(1, device="cuda")
    rows = []
    for reqs, new, keys in SHAPES:
        q = torch.randn(reqs, KV_HEADS, GROUP * new, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(reqs, KV_HEADS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.rand(reqs, 1, GROUP * new, keys, device="cuda") > 0.3
        torch.cuda.synchronize()
        ms = []
        for _ in range(2):
            start = time.perf_counter()
            if forced is None:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                with sdpa_kernel(forced):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - start) * 1e3)
        rows.append(dict(requests=reqs, new_tokens=new, keys=keys, first_ms=ms[0], second_ms=ms[1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--one", choices=BACKENDS, help=argparse.SUPPRESS)  # the child process
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)))
        return
    results = {}
    for backend in args.backends:
        proc = subprocess.run(
            [sys.executable, __file__, "--one", backend], capture_output=True, text=True, timeout=300, check=True
        )
        results[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    print("| backend | first call, first shape ms | first call, later new shapes: median ms | max ms | 2nd call ms |")
    print("|---|---|---|---|---|")
    for backend, rows in results.items():
        later = [r["first_ms"] for r in rows[1:]]
        second = statistics.median(r["second_ms"] for r in rows)
        print(
            f"| {backend} | {rows[0]['first_ms']:.1f} | {statistics.median(later):.1f} | {max(later):.1f} | "
            f"{second:.2f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
