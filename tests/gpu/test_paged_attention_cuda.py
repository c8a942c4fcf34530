"""On a CUDA GPU, the code paths the CPU tests cannot reach:

1. The compiled Triton paged attention against the torch reference on the same device: random ragged batches
   (1-8 requests, contexts up to 700, 1-5 new tokens or a 40-token chunk), GQA shapes of Qwen2-7B / Llama-3-8B /
   the demo, fp32 / bf16 / fp16, split-K on and off; 60 cases.
2. Target decode / verify steps: SDPA path vs Triton path vs captured CUDA graphs (replayed), on tiny fp32
   checkpoints (Qwen3; DeepSeek-V3, its eager MLA path against `specsplit/kernels/mla_attention.py`) and the demo
   checkpoint in bf16; the drafter's MTP steps eager vs CUDA graphs (Qwen3, DeepSeek-V3).

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.kernels.paged_attention import choose_num_splits, paged_attention_triton
from specsplit.kernels.paged_attention_reference import paged_attention_reference
from specsplit.models.loader import load_mtp, load_target
from specsplit.runtime.cuda_graphs import CudaGraphRunner
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint
from tests.gpu.model_steps import decode_steps

pytestmark = pytest.mark.gpu

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
SHAPES = [(28, 4, 128), (32, 8, 128), (5, 5, 64), (8, 2, 64)]  # heads, kv heads, head_dim
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
CASES = 60


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    qwen3 = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), architecture="qwen3", max_position_embeddings=256)
    deepseek = write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("dsv3"), max_position_embeddings=256)
    return {"qwen3": qwen3, "deepseek-v3": deepseek}


@pytest.mark.parametrize("i", range(CASES))
def test_triton_paged_attention_matches_the_reference(i):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(i)
    heads, kv_heads, dim = SHAPES[i % len(SHAPES)]
    dtype = DTYPES[i % 3]
    block_size, num_reqs = 16, int(torch.randint(1, 9, (1,), generator=gen))
    ctx = torch.randint(1, 700, (num_reqs,), generator=gen).tolist()
    new = [min(c, 40 if i % 5 == 0 else int(torch.randint(1, 6, (1,), generator=gen))) for c in ctx]
    blocks = [-(-c // block_size) for c in ctx]
    perm = torch.randperm(sum(blocks) + 4, generator=gen).tolist()
    tables = torch.full((num_reqs, max(blocks) + 2), -1, dtype=torch.int32)
    for r, nb in enumerate(blocks):
        tables[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    k_cache = torch.randn(sum(blocks) + 4, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(sum(blocks) + 4, block_size, kv_heads, dim, generator=gen).to(dtype)
    req = [r for r, n in enumerate(new) for _ in range(n)]
    lens = [length for c, n in zip(ctx, new) for length in range(c - n + 1, c + 1)]
    q = torch.randn(len(req), heads, dim, generator=gen).to(dtype)
    args = [t.to(dev) for t in (q, k_cache, v_cache, tables, torch.tensor(req), torch.tensor(lens, dtype=torch.int32))]
    expected = paged_attention_reference(*args).float()
    errors = {
        splits: (paged_attention_triton(*args, num_splits=splits).float() - expected).abs().max().item()
        for splits in sorted({1, 5, choose_num_splits(len(req), kv_heads, dev)})
    }
    where = f"{dtype} heads {heads}/{kv_heads} d {dim}, contexts {ctx}, new tokens {new}"
    assert all(err <= TOL[dtype] for err in errors.values()), f"{where}: max |error| per num_splits {errors}"


@pytest.mark.parametrize(
    ("model", "tol"), [("tiny qwen3 fp32", 1e-3), ("tiny deepseek-v3 fp32", 1e-3), ("demo bf16", 0.25)]
)
def test_target_steps_agree_across_sdpa_kernel_and_cuda_graphs(model, tol, tiny_checkpoints):
    dev = torch.device("cuda")
    if model == "demo bf16":
        target = load_target(DEMO, dtype=torch.bfloat16, device=dev)
    else:
        target = load_target(tiny_checkpoints[model.split()[1]], device=dev)
    results = {}
    for path in ("sdpa", "kernel", "graphs"):
        cache = target.make_kv_cache(64, 16)
        runner = CudaGraphRunner(target, cache, max_model_len=256, max_num_tokens=8) if path == "graphs" else None
        results[path] = decode_steps(target, cache, path, runner)
    for path in ("kernel", "graphs"):
        err = max((a - b).abs().max().item() for a, b in zip(results[path], results["sdpa"]))
        same_argmax = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(results[path], results["sdpa"]))
        print(f"{model}: {path} vs sdpa: max |logits diff| {err:.2e}, argmax equal: {same_argmax}")
        assert err <= tol, f"{model}: {path} vs sdpa: max |logits diff| {err:.2e} > {tol}"


@pytest.mark.parametrize("architecture", ["qwen3", "deepseek-v3"])
def test_drafter_proposes_the_same_drafts_with_cuda_graphs(tiny_checkpoints, architecture):
    dev = torch.device("cuda")
    path = tiny_checkpoints[architecture]
    target, mtp = load_target(path, device=dev), load_mtp(path, device=dev)
    tokens = list(range(11, 40))
    with torch.inference_mode():
        cache = target.make_kv_cache(16, 16)
        hidden = target(
            torch.tensor(tokens, device=dev),
            torch.arange(len(tokens), device=dev),
            cache,
            cache.prepare_step(["t"], [len(tokens)]),
        )
    drafts = {}
    for graphs in (False, True):
        cache = mtp.make_kv_cache(32, 16)
        runner = DrafterRunner(mtp, cache, attention_kernel=graphs, cuda_graphs=graphs)
        assert (runner.graphs is not None) == graphs
        first = runner.propose([ProposeItem("r", 0, tokens[1:20], 3)], hidden[:19])
        second = runner.propose([ProposeItem("r", 19, tokens[20:22], 4)], hidden[19:21])
        drafts[graphs] = (first.drafts, second.drafts)
    assert drafts[True] == drafts[False]
    assert [len(d) for step in drafts[False] for d in step] == [3, 4]  # one request, k drafts per step
