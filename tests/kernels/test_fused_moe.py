"""The fused MoE (`specsplit.kernels.fused_moe`) under the Triton interpreter: the pairs' alignment by expert, and
the grouped GEMM launches equal the per-expert torch loop (the CPU path) in fp32, bf16 and block-scaled FP8, with
ragged expert counts (experts with no token), one token, and this rank holding only some of the experts."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.fp8_reference import quantize_weight_blockwise
from specsplit.kernels.fused_moe import (
    align_pairs,
    align_pairs_reference,
    fused_routed_experts,
    routed_experts_reference,
)

HIDDEN, INTER, EXPERTS, TOP_K = 64, 48, 6, 2  # INTER is no multiple of the K tile or of FP8's 32-wide groups


def _routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token among experts 0..4 (expert 5 never chosen), ragged counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=g)[:TOP_K] for _ in range(num_tokens)])
    return ids, torch.rand(num_tokens, TOP_K, generator=g)


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g), 0.1 * torch.randn(
        EXPERTS, HIDDEN, INTER, generator=g
    )


@pytest.mark.parametrize("align", [align_pairs, align_pairs_reference], ids=["kernel", "torch"])
@pytest.mark.parametrize(
    ("num_tokens", "first", "local", "block_m"), [(1, 0, 6, 16), (9, 0, 6, 16), (9, 2, 3, 4), (70, 1, 4, 16)]
)
def test_align_pairs_groups_this_ranks_pairs_by_expert_in_padded_blocks(align, num_tokens, first, local, block_m):
    ids, _ = _routing(num_tokens, seed=num_tokens)
    sorted_pairs, block_expert, num_padded = align(ids, first, local, block_m)
    if align is align_pairs:  # the kernel's is the torch ops' result exactly
        for got, want in zip(
            (sorted_pairs, block_expert, num_padded), align_pairs_reference(ids, first, local, block_m)
        ):
            assert torch.equal(got, want)
    num_pairs = ids.numel()
    num_blocks = -(-(num_pairs + local * (block_m - 1)) // block_m)
    assert sorted_pairs.shape == (num_blocks * block_m,) and block_expert.shape == (num_blocks,)  # worst case
    flat = ids.flatten()
    mine = [p for p in range(num_pairs) if first <= flat[p] < first + local]
    used = int(num_padded.item())
    assert used % block_m == 0 and sorted(p for p in sorted_pairs[:used].tolist() if p < num_pairs) == mine
    assert (sorted_pairs[used:] == num_pairs).all()  # past the count: only the sentinel
    for b in range(used // block_m):
        pairs = [p for p in sorted_pairs[b * block_m : (b + 1) * block_m].tolist() if p < num_pairs]
        assert pairs and all(flat[p] - first == block_expert[b] for p in pairs)  # one expert, no empty block
        assert pairs == sorted(pairs)
    counts = torch.bincount(flat[mine] - first, minlength=local).tolist()
    assert used == sum(-(-c // block_m) * block_m for c in counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "first", "local"), [(1, 0, 6), (9, 0, 6), (9, 2, 3)])
def test_fused_experts_equal_the_per_expert_loop(dtype, num_tokens, first, local):
    ids, weights = _routing(num_tokens, seed=10 + num_tokens)
    w13, w2 = (w[first : first + local].to(dtype) for w in _weights(seed=1))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = fused_routed_experts(x, ids, weights, w13, w2, first)
    want = routed_experts_reference(x, ids, weights, w13, w2, first)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    # fp32: summation order; bf16: the intermediates' roundings (a few of bf16's ulps at these magnitudes)
    atol = 1e-5 if dtype == torch.float32 else 0.03
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    assert want.abs().max() > 0.1  # the sum is no all-zero
    routed = [t for t in range(num_tokens) if any(first <= e < first + local for e in ids[t].tolist())]
    unrouted = [t for t in range(num_tokens) if t not in routed]
    assert (got[unrouted] == 0).all() and (got[routed].abs().amax(dim=1) > 0).all()
    assert torch.equal(got, fused_routed_experts(x, ids, weights, w13, w2, first))  # the same bits again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_fused_experts_equal_the_w8a8_loop(dtype):
    num_tokens, block = 9, (32, 32)
    ids, weights = _routing(num_tokens, seed=3)
    w13, w2 = _weights(seed=4)
    q13, s13 = zip(*(quantize_weight_blockwise(w, *block) for w in w13))
    q2, s2 = zip(*(quantize_weight_blockwise(w, *block) for w in w2))
    q13, q2 = torch.stack(q13), torch.stack(q2)
    scales = (torch.stack(s13), torch.stack(s2), block[0], block[0], block[1])
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = fused_routed_experts(x, ids, weights, q13, q2, 0, scales)
    want = routed_experts_reference(x, ids, weights, q13, q2, 0, scales)
    # The same e4m3 activations and scales; fp32: per-group sums in another order
    atol = 1e-5 if dtype == torch.float32 else 0.03
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    assert want.abs().max() > 0.1
    # and a W8A8 result, not the dequantized weights' product (the activation quantization shows)
    dense = routed_experts_reference(x.float(), ids, weights, w13, w2, 0)
    assert 0 < (got.float() - dense).abs().max() < 0.05
