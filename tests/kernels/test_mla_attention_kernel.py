"""The Triton MLA kernel (absorbed form, `specsplit/kernels/mla_attention.py`) equals its reference, paged attention's
run as MLA is defined (one KV head whose keys are the cached latents [c_kv; k_pe] and whose values are c_kv), and the
reference equals the model's eager absorbed attention."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.mla_attention import mla_attention_triton
from specsplit.kernels.paged_attention_reference import mla_attention_reference
from specsplit.models.deepseek_v3.mla import attend_absorbed
from tests.kernels.paged_layout import scattered_layout


def _ragged_case(context_lens, new_tokens, heads, rank, rope, block_size, dtype, seed=0, padding=0):
    """A shuffled paged latent cache holding each request's context, its last `new_tokens` as queries (plus
    `padding` tokens of context length 0), the query's latent part a transposed view as the model makes it."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_tables, req_index, ctx = scattered_layout(context_lens, new_tokens, block_size, g)
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=g).to(dtype)
    req_index = torch.cat([req_index, torch.zeros(padding, dtype=torch.int32)])
    ctx = torch.cat([ctx, torch.zeros(padding, dtype=ctx.dtype)])
    tokens = len(ctx)
    q_latent = torch.randn(heads, tokens, rank, generator=g).to(dtype).transpose(0, 1)  # [T, H, R], a bmm's view
    q_pe = torch.randn(tokens, heads, rope, generator=g).to(dtype)
    return q_latent, q_pe, cache, block_tables, req_index, ctx


CASES = {
    # context lengths, new tokens per request, heads, kv_lora_rank, rope dim, block size
    "tiny_verify": ([37, 5, 19], [4, 1, 2], 4, 32, 8, 16),
    "heads_past_a_block_odd_blocks": ([23, 9], [3, 1], 20, 48, 16, 5),
    "deepseek_dims_decode": ([70, 1], [1, 1], 16, 512, 64, 16),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_equals_reference_fp32(name, num_splits):
    args = _ragged_case(*CASES[name], dtype=torch.float32, padding=1)
    scale = 0.11
    out = mla_attention_triton(*args, scale=scale, num_splits=num_splits)
    assert out.shape == args[0].shape
    torch.testing.assert_close(out, mla_attention_reference(*args, scale), atol=2e-5, rtol=1e-5)
    assert torch.all(out[-1] == 0)  # the padding token


def test_kernel_equals_reference_bf16():
    args = _ragged_case(*CASES["tiny_verify"], dtype=torch.bfloat16, seed=1)
    out = mla_attention_triton(*args, scale=0.2, num_splits=2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), mla_attention_reference(*args, 0.2).float(), atol=2e-2, rtol=2e-2)


def test_reference_equals_the_models_eager_absorbed_attention():
    """One request's queries over its context: the reference against `attend_absorbed` with W_UK = identity (q_nope is
    then q_latent) and W_UV = identity (its output is the latent sum)."""
    heads, rank, rope, context, new = 3, 8, 4, 11, 3
    q_latent, q_pe, cache, tables, req_index, ctx = _ragged_case([context], [new], heads, rank, rope, 4, torch.float32)
    eye = torch.eye(rank).repeat(heads, 1, 1)  # [heads, rank, rank]
    kv_b_weight = torch.cat([eye, eye], dim=1).reshape(heads * 2 * rank, rank)  # W_UK and W_UV per head
    slots = (tables[0, torch.arange(context) // 4].long() * 4 + torch.arange(context) % 4).tolist()
    latents = cache.view(-1, rank + rope)[slots]
    mask = torch.arange(context)[None, :] <= torch.arange(context - new, context)[:, None]
    eager = attend_absorbed(q_latent.contiguous(), q_pe, latents, kv_b_weight, 0.3, mask)
    torch.testing.assert_close(mla_attention_reference(q_latent, q_pe, cache, tables, req_index, ctx, 0.3), eager)


def test_shapes_that_do_not_fit_are_refused():
    q_latent, q_pe, cache, tables, req_index, ctx = _ragged_case(*CASES["tiny_verify"], dtype=torch.float32)
    with pytest.raises(ValueError, match="do not fit the latent cache"):
        mla_attention_triton(q_latent, q_pe[..., :-1], cache, tables, req_index, ctx, scale=1.0)
    with pytest.raises(ValueError, match="num_splits"):
        mla_attention_triton(q_latent, q_pe, cache, tables, req_index, ctx, scale=1.0, num_splits=0)
