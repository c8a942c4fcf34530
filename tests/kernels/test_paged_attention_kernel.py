"""The Triton paged attention kernel equals its pure-torch reference, and the reference equals dense
causal attention; the slot-mapped KV write skips slot -1."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.kernels.kv_write import write_kv_triton, write_rows_triton
from specsplit.kernels.paged_attention import paged_attention_triton
from specsplit.kernels.paged_attention_reference import paged_attention_reference
from tests.kernels.paged_layout import scattered_layout


def _ragged_case(
    context_lens: list[int], new_tokens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, dtype, seed=0
):
    """A shuffled paged cache holding each request's context, and its last `new_tokens` as queries."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_tables, req_index, ctx = scattered_layout(context_lens, new_tokens, block_size, g)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(len(ctx), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, block_tables, req_index, ctx


CASES = {
    # context lengths, new tokens per request, heads, kv heads, head dim, block size
    "decode_gqa7_d128": ([37, 1, 130], [1, 1, 1], 28, 4, 128, 16),
    "verify_mixed_d64": ([33, 16, 17, 64], [4, 2, 1, 3], 8, 2, 64, 16),
    "prefill_and_decode_odd_blocks": ([23, 9], [23, 1], 6, 2, 8, 5),
    "mha_block_boundaries": ([16, 32, 15], [16, 2, 15], 4, 4, 16, 16),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_equals_reference_fp32(name, num_splits):
    args = _ragged_case(*CASES[name], dtype=torch.float32)
    expected = paged_attention_reference(*args)
    torch.testing.assert_close(paged_attention_triton(*args, num_splits=num_splits), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_reference_half_precision(dtype):
    args = _ragged_case(*CASES["verify_mixed_d64"], dtype=dtype, seed=1)
    out = paged_attention_triton(*args, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_attention_reference(*args).float(), atol=2e-2, rtol=2e-2)


def test_padding_tokens_get_zero_output_and_do_not_disturb_real_tokens():
    q, k_cache, v_cache, tables, req_index, ctx = _ragged_case([20, 7], [1, 2], 4, 2, 16, 4, torch.float32)
    pad = 3
    q_pad = torch.cat([q, torch.randn(pad, *q.shape[1:])])
    req_pad = torch.cat([req_index, torch.zeros(pad, dtype=req_index.dtype)])
    ctx_pad = torch.cat([ctx, torch.zeros(pad, dtype=ctx.dtype)])
    for num_splits in (1, 4):
        out = paged_attention_triton(q_pad, k_cache, v_cache, tables, req_pad, ctx_pad, num_splits=num_splits)
        assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
        expected = paged_attention_reference(q, k_cache, v_cache, tables, req_index, ctx)
        torch.testing.assert_close(out[:-pad], expected, atol=2e-5, rtol=1e-5)


def test_reference_equals_dense_causal_attention():
    heads, kv_heads, dim, n = 6, 2, 8, 11
    q, k_cache, v_cache, tables, req_index, ctx = _ragged_case([n], [n], heads, kv_heads, dim, 4, torch.float32)
    idx = torch.arange(n)
    keys = k_cache[tables[0].long()[idx // 4], idx % 4].repeat_interleave(heads // kv_heads, 1)  # [n, heads, dim]
    values = v_cache[tables[0].long()[idx // 4], idx % 4].repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(paged_attention_reference(q, k_cache, v_cache, tables, req_index, ctx), dense)


def test_write_kv_puts_rows_at_their_slots_and_skips_negative_slots():
    g = torch.Generator().manual_seed(2)
    k_cache = torch.zeros(4, 3, 2, 8)
    v_cache = torch.zeros(4, 3, 2, 8)
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    slots = torch.tensor([7, -1, 0, 11])
    write_kv_triton(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    for t, s in ((0, 7), (2, 0), (3, 11)):
        assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t])
    untouched = [s for s in range(12) if s not in (7, 0, 11)]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_write_rows_puts_one_vector_per_token_at_its_slot_and_skips_negative_slots():
    """MLA's latents: one row per token (a width that is no power of two), padding tokens (slot -1) write nothing."""
    g = torch.Generator().manual_seed(3)
    cache = torch.zeros(4, 3, 9)
    rows = torch.randn(9, 4, generator=g).t()  # [4, 9], a transposed view: rows not contiguous
    write_rows_triton(rows, cache, torch.tensor([5, -1, 10, 1]))
    flat = cache.view(12, 9)
    for t, s in ((0, 5), (2, 10), (3, 1)):
        assert torch.equal(flat[s], rows[t])
    assert not flat[[s for s in range(12) if s not in (5, 10, 1)]].any()
