"""On a CUDA GPU, penalties, min_tokens and logprobs (`specsplit/verifier/logits_processors.py`) equal the same
processing on the CPU, at a real vocabulary (151,936) and batch (32 requests, 3 drafts each), and greedy sampling by
the Triton sampler on the processed rows equals their argmax.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.kernels import rejection_sample
from specsplit.verifier.logits_processors import LogitsOptions, LogitsPlan, RequestRows, apply, take_logprobs

pytestmark = pytest.mark.gpu
V, K, B = 151_936, 3, 32


def _plan(rng: random.Random) -> LogitsPlan:
    requests = []
    for i in range(B):
        options = LogitsOptions(
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
            presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, -0.3, 0.7]),
            min_tokens=rng.choice([0, 40]),
            end_token_ids=(2, 151_643),
            logprobs=rng.choice([None, 0, 5]),
        )
        history = [rng.randrange(V) for _ in range(rng.randrange(5, 60))]
        drafts = [rng.choice(history) for _ in range(K)]  # drafts that repeat: penalised rows differ from row 0's
        requests.append(RequestRows(i, i * (K + 1), drafts, history, len(history) // 2, len(history), options))
    return LogitsPlan(requests)


def test_processing_on_the_gpu_equals_the_cpu_and_feeds_the_triton_sampler():
    rng = random.Random(0)
    plan = _plan(rng)
    logits = torch.randn(B * (K + 1), V, generator=torch.Generator().manual_seed(0)) * 4
    cpu, gpu = logits.clone(), logits.cuda()
    taken_cpu, taken_gpu = take_logprobs(cpu, plan), take_logprobs(gpu, plan)
    apply(cpu, plan)
    apply(gpu, plan)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)  # a division by the penalty: a few ulp
    torch.testing.assert_close(taken_gpu.logprobs.cpu(), taken_cpu.logprobs, rtol=1e-4, atol=1e-4)  # sums of 151,936
    drafts = torch.tensor([t for r in plan.requests for t in r.drafts], device="cuda")
    cu = torch.arange(0, (B + 1) * K, K, dtype=torch.int32, device="cuda")
    zeros = torch.zeros(B, device="cuda")
    out = rejection_sample(
        gpu, drafts, cu, zeros, None, None, torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64,
        device="cuda"), backend="triton", max_num_draft=K, all_greedy=True,
    )  # fmt: skip
    argmax = gpu.argmax(-1).view(B, K + 1).cpu()  # the processed rows (equal to the CPU's, above)
    for j, r in enumerate(plan.requests):
        n = int(out.num_sampled[j])
        want = []
        for k in range(K + 1):
            want.append(int(argmax[j, k]))
            if k == K or r.drafts[k] != want[-1]:
                break
        assert out.sampled[j, :n].tolist() == want, j
