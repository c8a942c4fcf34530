"""Decode / verify steps through a whole target model, shared by the GPU tests that compare its paths."""

from __future__ import annotations

import torch

from specsplit.runtime.cuda_graphs import CudaGraphRunner


def decode_steps(model, cache, path: str, runner: CudaGraphRunner | None, seed: int = 0) -> list[torch.Tensor]:
    """Logits of a ragged prefill and then decode / verify steps of 1-4 tokens for three requests. ``path``:
    "sdpa" (no attention kernel), "kernel" (Triton paged attention after the prefill), or "graphs" (as
    "kernel", steps that fit replayed from ``runner``'s CUDA graphs)."""
    gen, dev = torch.Generator().manual_seed(seed), cache.device
    steps = [{"a": 37, "b": 5, "c": 20}, {"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 2}, {"c": 3, "a": 1}, {"b": 1}]
    out = []
    with torch.inference_mode():
        for i, step in enumerate(steps):
            ids = torch.randint(0, model.config.vocab_size, (sum(step.values()),), generator=gen).to(dev)
            positions = torch.cat([torch.arange(cache.num_tokens(r), cache.num_tokens(r) + n) for r, n in step.items()])
            attn = cache.prepare_step(list(step), list(step.values()), use_kernel=path != "sdpa" and i > 0)
            if path == "graphs" and runner.can_run(attn):
                out.append(runner.run(ids, positions.to(dev), attn)[1].clone())
            else:
                out.append(model.compute_logits(model(ids, positions.to(dev), cache, attn)))
    return out
