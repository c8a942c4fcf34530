"""On 2+ CUDA GPUs: a tensor-parallel target over NCCL (one spawned process per GPU) with the Triton layer
kernels and paged attention, eager and replayed from CUDA graphs whose all-reduces and logits gather were
captured, gives the one-GPU model's logits (fp32, within rounding of the changed reduction order).

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_tensor_parallel_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from specsplit.models.cuda_graphs import CudaGraphRunner
from specsplit.models.loader import load_target
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.models.tensor_parallel_ranks import run_ranks

pytestmark = pytest.mark.gpu

STEPS = ((7, 5), (1, 1), (4, 4), (2, 3))  # a prefill, then decode and verify steps (graph buckets 2, 8, 8)


def graph_logits(path: str) -> list | None:
    """Every step's logits on this rank's GPU (`[tokens, vocab]` per step on rank 0, None on the others): the
    prefill eager, the other steps replayed from CUDA graphs."""
    device = f"cuda:{torch.cuda.current_device()}"
    torch.manual_seed(0)
    model = load_target(path, dtype=torch.float32, device=device)
    cache = model.make_kv_cache(num_blocks=32, block_size=16)
    graphs = CudaGraphRunner(model, cache, max_model_len=256, max_num_tokens=16)
    vocab, out = model.config.vocab_size, []
    with torch.inference_mode():
        for i, counts in enumerate(STEPS):
            attn = cache.prepare_step(["a", "b"], list(counts), use_kernel=i > 0)
            ids = torch.randint(0, vocab, (sum(counts),)).to(device)
            ends = [cache.num_tokens(r) for r in "ab"]
            positions = torch.cat([torch.arange(end - n, end) for end, n in zip(ends, counts)]).to(device)
            if i == 0:
                logits = model.compute_logits(model(ids, positions, cache, attn))
            else:
                assert graphs.can_run(attn)
                logits = graphs.run(ids, positions, attn)[1]
            out.append(None if logits is None else logits.cpu().numpy())
    torch.cuda.synchronize()
    return None if out[0] is None else out


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_tp2_cuda_graphs_over_nccl_equal_one_gpu(tmp_path, architecture):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} here")
    path = str(write_tiny_checkpoint(tmp_path / architecture, architecture=architecture, vocab_size=321))
    reference = graph_logits(path)
    for got, want in zip(run_ranks(2, graph_logits, path, cuda=True, timeout_s=300), reference):
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-4, atol=1e-4)
