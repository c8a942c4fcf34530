"""Start-up warm-up of a runner's eager path (prefill steps too large for its CUDA graphs).

The first eager step in a process pays one-time costs on a GPU: CUDA loads the modules of the cuBLAS /
attention kernels it picks on their first launch, a stall for the first request that takes that path
(docs/performance.md, "Decode step and kernels"). A runner on CUDA therefore runs a few
dummy eager steps at start-up, as large as a step the coordinator's token budget allows, with several
requests (one padded SDPA call per layer) and with one (per-request SDPA). No warm-up can cover cuDNN
building an SDPA plan for each new shape, so SDPA stays off cuDNN
(`specsplit.models.attention.use_precompiled_sdpa`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache

# (requests, tokens each): steps of the coordinator's default budget and past it, as prefill chunks come.
EAGER_WARM_UP_STEPS = ((16, 128), (1, 1024))


def warm_up_eager(
    kv_cache: PagedKVCache,
    run: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], object],  # (input ids [T], positions [T], attn)
    steps: tuple[tuple[int, int], ...] = EAGER_WARM_UP_STEPS,
    force: bool = False,  # run on a CPU cache too (tests)
) -> tuple[int, float]:
    """Runs each step of dummy requests (token id 0) through `run` eagerly, then frees them; a step the
    cache has no room for is skipped. Only on CUDA unless `force`. Returns (steps run, seconds)."""
    if kv_cache.device.type != "cuda" and not force:
        return 0, 0.0
    t0, ran = time.perf_counter(), 0
    for num_requests, tokens in steps:
        ids = [f"__warm_up_{i}" for i in range(num_requests)]
        if not kv_cache.can_append(ids, [tokens] * num_requests):
            continue
        try:
            attn = kv_cache.prepare_step(ids, [tokens] * num_requests)
            input_ids = torch.zeros(num_requests * tokens, dtype=torch.int64, device=kv_cache.device)
            positions = torch.arange(tokens, device=kv_cache.device).repeat(num_requests)
            with torch.inference_mode():
                run(input_ids, positions, attn)
            if kv_cache.device.type == "cuda":
                torch.cuda.synchronize(kv_cache.device)
            ran += 1
        finally:
            for rid in ids:
                kv_cache.free(rid)
    return ran, time.perf_counter() - t0
