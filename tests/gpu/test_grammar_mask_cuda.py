"""On a CUDA GPU, structured output's masks (`specsplit.runtime.grammar.apply_masks`: the pinned upload and the
Triton kernel) set the logits the CPU's torch ops set, at a real vocabulary (151,936) and a batch of 32 requests x 4
rows, in bfloat16 and float32.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.runtime.grammar import apply_masks

pytestmark = pytest.mark.gpu
V, ROWS = 151_936, 128


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masks_on_the_gpu_equal_the_cpus(dtype):
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(ROWS - 8, -(-V // 32)), dtype=np.int64).astype(np.int32)
    words[:, 100:] &= rng.integers(0, 2, size=(ROWS - 8, 1)).astype(np.int32) * -1  # some rows allow few ids
    rows = rng.permutation(ROWS)[: ROWS - 8].tolist()  # 8 rows unmasked
    logits = (torch.randn(ROWS, V, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    cpu, gpu = logits.clone(), logits.cuda()
    apply_masks(cpu, rows, words)
    for _ in range(3):  # the same masks again: pinned buffers reused by later uploads do not change what was sent
        apply_masks(gpu, rows, words)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.isinf(cpu).any() and torch.isfinite(cpu).any()
