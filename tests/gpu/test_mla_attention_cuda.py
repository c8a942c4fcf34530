"""On a CUDA GPU, DeepSeek-V3's MLA through the Triton kernel (`specsplit/kernels/mla_attention.py`) at DeepSeek-V3's
widths (128 heads, kv_lora_rank 512, rope 64, bf16): equal to the reference within bf16 tolerance and replayed from
a CUDA graph. Prints its time per call. Tiny DeepSeek-V3's steps and drafts through it, eager and in CUDA graphs:
`tests/gpu/test_paged_attention_cuda.py`.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_mla_attention_cuda.py -s
"""

from __future__ import annotations

import time

import pytest
import torch

from specsplit.kernels.mla_attention import mla_attention_triton
from specsplit.kernels.paged_attention_reference import mla_attention_reference

pytestmark = pytest.mark.gpu

HEADS, RANK, ROPE, BLOCK = 128, 512, 64, 16


def _case(batch: int, new: int, context: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    cache = torch.randn(batch * blocks + 1, BLOCK, RANK + ROPE, generator=g).to(torch.bfloat16)
    tables = torch.randperm(batch * blocks + 1, generator=g)[: batch * blocks].view(batch, blocks).to(torch.int32)
    req = torch.arange(batch).repeat_interleave(new).to(torch.int32)
    ctx = torch.arange(context - new + 1, context + 1).repeat(batch)
    q_latent = torch.randn(HEADS, batch * new, RANK, generator=g).to(torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(batch * new, HEADS, ROPE, generator=g).to(torch.bfloat16)
    return [t.cuda() for t in (q_latent, q_pe, cache, tables, req, ctx)]


@pytest.mark.parametrize(("batch", "new", "context"), [(1, 1, 1000), (4, 4, 300), (32, 1, 200)])
def test_kernel_at_deepseek_widths_equals_the_reference_and_replays_in_a_graph(batch, new, context):
    args = _case(batch, new, context)
    scale = 0.1147  # DeepSeek-V3's, with YaRN's mscale
    out = mla_attention_triton(*args, scale=scale)
    ref = mla_attention_reference(*[a.cpu() for a in args], scale).float()
    err = (out.float().cpu() - ref).abs().max().item()
    assert err <= 2e-2 * max(1.0, ref.abs().max().item()), err
    static = [a.clone() for a in args]
    graph = torch.cuda.CUDAGraph()
    mla_attention_triton(*static, scale=scale)  # compiled outside the capture
    with torch.cuda.graph(graph):
        replayed = mla_attention_triton(*static, scale=scale)
    fresh = _case(batch, new, context, seed=1)
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.testing.assert_close(replayed, mla_attention_triton(*fresh, scale=scale), atol=0, rtol=0)
    torch.cuda.synchronize()
    t0, calls = time.perf_counter(), 50
    for _ in range(calls):
        graph.replay()
    torch.cuda.synchronize()
    kv_bytes = batch * context * (RANK + ROPE) * 2
    per_call = (time.perf_counter() - t0) / calls
    rate = kv_bytes / per_call / 1e9
    print(f"MLA kernel, {batch} x {new} tokens over {context}: {per_call * 1e6:.1f} us, latents read {rate:.0f} GB/s")
