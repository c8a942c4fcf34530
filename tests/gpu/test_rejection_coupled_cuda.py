"""On a CUDA GPU, coupled verification (seeded requests) in the Triton sampler against the torch reference on the
same device: random ragged batches (1-8 requests, every mode, top-k / top-p) and large ones (64-256 requests), most
requests coupled, their drafts the target's own samples on about 60 % of the rows, so requests stop at every row.
No request's tokens may differ except at a near-tie of two race scores (the GPU's approximate logs: see
``test_rejection_cuda.py``). Then a chi-square over many seeds that the Triton path's coupled tokens follow the
target's distribution.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_rejection_coupled_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels import rejection_sample
from tests.gpu.test_rejection_cuda import NEAR_TIE, case, large_case, race_gap
from tests.kernels.test_rejection_stats import assert_follows, filtered_probs, problem

pytestmark = pytest.mark.gpu
CASES, LARGE_CASES = 60, 12


def with_coupled_drafts(gen: torch.Generator, inputs: dict) -> dict:
    """``inputs`` with about 80 % of the requests coupled and about 60 % of the drafts replaced by the target's own
    sample at their row (the reference's, from k = 0 calls), so coupled requests accept some drafts."""
    num_reqs = inputs["seeds"].numel()
    coupled = (torch.rand(num_reqs, generator=gen) < 0.8).to(inputs["seeds"].device)
    cu = inputs["cu_num_draft"].tolist()
    rows = torch.tensor([cu[r] + r + j for r in range(num_reqs) for j in range(cu[r + 1] - cu[r])], dtype=torch.long)
    if rows.numel():
        req = torch.tensor([r for r in range(num_reqs) for _ in range(cu[r + 1] - cu[r])])
        col = torch.tensor([j for r in range(num_reqs) for j in range(cu[r + 1] - cu[r])])
        dev = inputs["seeds"].device
        own = rejection_sample(
            inputs["target_logits"][rows.to(dev)], torch.empty(0, dtype=torch.int64, device=dev),
            torch.zeros(rows.numel() + 1, dtype=torch.int32, device=dev), inputs["temperature"][req.to(dev)],
            None if inputs["top_k"] is None else inputs["top_k"][req.to(dev)],
            None if inputs["top_p"] is None else inputs["top_p"][req.to(dev)],
            inputs["seeds"][req.to(dev)], inputs["positions"][req.to(dev)] + col.to(dev), backend="reference",
            coupled=torch.ones(rows.numel(), dtype=torch.bool, device=dev),
        ).sampled[:, 0]  # fmt: skip
        hit = (torch.rand(rows.numel(), generator=gen) < 0.6).to(dev)
        inputs = inputs | {"draft_token_ids": torch.where(hit, own, inputs["draft_token_ids"])}
    return inputs | {"coupled": coupled}


def coupled_gap(inputs: dict, r: int, col: int, token_a: int, token_b: int) -> float:
    """The race-score gap of two tokens at a coupled row: the race from p, nothing excluded (as at a bonus row)."""
    plain = inputs | {"draft_probs": None, "cu_num_draft": torch.zeros_like(inputs["cu_num_draft"])}
    cu = inputs["cu_num_draft"].tolist()
    row = cu[r] + r + col
    one = {k: v[r : r + 1] if k in ("temperature", "top_k", "top_p", "seeds", "positions") and v is not None else v
           for k, v in plain.items()}  # fmt: skip
    one = one | {"target_logits": inputs["target_logits"][row : row + 1], "positions": one["positions"] + col}
    one["cu_num_draft"] = torch.zeros(2, dtype=torch.int32, device=inputs["seeds"].device)
    return race_gap(one, 0, 0, token_a, token_b)


def differing_coupled_requests(inputs: dict, calls: int) -> list[str]:
    b = rejection_sample(**inputs, backend="reference")
    bad = []
    for call in range(calls):
        a = rejection_sample(**inputs, backend="triton")
        diff = (a.sampled != b.sampled).any(-1) | (a.num_sampled != b.num_sampled)
        for r in diff.nonzero().flatten().tolist():
            col = int((a.sampled[r] != b.sampled[r]).nonzero()[0])
            line = f"call {call} request {r}: triton {a.sampled[r].tolist()} reference {b.sampled[r].tolist()}"
            coupled = bool(inputs["coupled"][r]) and float(inputs["temperature"][r]) > 0
            gap = coupled_gap(inputs, r, col, int(a.sampled[r, col]), int(b.sampled[r, col])) if coupled else 1.0
            print(f"{line}, race-score gap {gap:.1e}")
            if gap >= NEAR_TIE:
                bad.append(f"{line}, race-score gap {gap:.1e}")
    return bad


@pytest.mark.parametrize("i", range(CASES))
def test_small_coupled_batches_match_the_reference(i):
    gen = torch.Generator().manual_seed(2_000_000 + i)
    bad = differing_coupled_requests(with_coupled_drafts(gen, case(gen, i)), calls=1)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("i", range(LARGE_CASES))
def test_large_coupled_batches_match_the_reference_on_every_call(i):
    gen = torch.Generator().manual_seed(3_000_000 + i)
    bad = differing_coupled_requests(with_coupled_drafts(gen, large_case(gen, i)), calls=3)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.7)])
def test_coupled_tokens_follow_the_target_on_the_gpu(temperature, top_k, top_p):
    n, vocab_size, k = 200_000, 12, 2
    target_logits, q = problem(vocab_size, k, seed=12)
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(13)).T
    out = rejection_sample(
        target_logits.repeat(n, 1).cuda(), drafts.flatten().cuda(),
        (torch.arange(n + 1, dtype=torch.int32) * k).cuda(), torch.full((n,), temperature).cuda(),
        torch.full((n,), top_k, dtype=torch.int32).cuda(), torch.full((n,), top_p).cuda(),
        (torch.arange(n, dtype=torch.int64) * 7919 + 5).cuda(), torch.full((n,), 77, dtype=torch.int64).cuda(),
        backend="triton", coupled=torch.ones(n, dtype=torch.bool).cuda(),
    )  # fmt: skip
    sampled, num_sampled = out.sampled.cpu(), out.num_sampled.cpu()
    for row in range(k + 1):
        reached = num_sampled > row
        assert_follows(sampled[reached, row], filtered_probs(target_logits[row], temperature, top_k, top_p))
