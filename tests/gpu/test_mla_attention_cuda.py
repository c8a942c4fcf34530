"""On a CUDA GPU, DeepSeek-V3's MLA through the Triton kernel (`specsplit/kernels/mla_attention.py`): the kernel at
DeepSeek-V3's widths (128 heads, kv_lora_rank 512, rope 64, bf16) equals the reference within bf16 tolerance and
replays from a CUDA graph; tiny DeepSeek-V3's decode / verify steps replayed from CUDA graphs equal its eager MLA
path; its MTP drafter proposes the same drafts with and without graphs. Prints the kernel's time per call.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_mla_attention_cuda.py -s
"""

from __future__ import annotations

import time

import pytest
import torch

from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.kernels.mla_attention import mla_attention_triton
from specsplit.kernels.paged_attention_reference import mla_attention_reference
from specsplit.models.loader import load_mtp, load_target
from specsplit.runtime.cuda_graphs import CudaGraphRunner
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint
from tests.gpu.model_steps import decode_steps

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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("dsv3"), max_position_embeddings=256)


def test_deepseek_decode_replayed_from_cuda_graphs_equals_eager(checkpoint):
    target = load_target(checkpoint, device="cuda")
    results = {}
    for path in ("sdpa", "kernel", "graphs"):
        cache = target.make_kv_cache(64, 16)
        runner = CudaGraphRunner(target, cache, max_model_len=256, max_num_tokens=8) if path == "graphs" else None
        results[path] = decode_steps(target, cache, path, runner)
    for path in ("kernel", "graphs"):
        err = max((a - b).abs().max().item() for a, b in zip(results[path], results["sdpa"]))
        same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(results[path], results["sdpa"]))
        print(f"deepseek-v3 {path} vs eager MLA: max |logits diff| {err:.2e}, argmax equal: {same}")
        assert err <= 1e-3 and same


def test_deepseek_drafter_proposes_the_same_drafts_with_cuda_graphs(checkpoint):
    target, mtp = load_target(checkpoint, device="cuda"), load_mtp(checkpoint, device="cuda")
    tokens = list(range(11, 40))
    with torch.inference_mode():
        cache = target.make_kv_cache(16, 16)
        positions = torch.arange(len(tokens), device="cuda")
        hidden = target(torch.tensor(tokens, device="cuda"), positions, cache, cache.prepare_step(["t"], [len(tokens)]))
    drafts = {}
    for graphs in (False, True):
        cache = mtp.make_kv_cache(32, 16)
        runner = DrafterRunner(mtp, cache, attention_kernel=graphs, cuda_graphs=graphs)
        assert (runner.graphs is not None) == graphs
        first = runner.propose([ProposeItem("r", 0, tokens[1:20], 3)], hidden[:19])
        second = runner.propose([ProposeItem("r", 19, tokens[20:22], 4)], hidden[19:21])
        drafts[graphs] = (first.drafts, second.drafts)
    assert drafts[True] == drafts[False]
    assert [len(d) for step in drafts[False] for d in step] == [3, 4]
