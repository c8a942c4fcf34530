"""Triton paged attention for multi-head latent attention (MLA, DeepSeek-V2/V3) in its absorbed form.

MLA caches one latent per token, [c_kv; k_pe] (`kv_lora_rank` R + `qk_rope_head_dim` P values,
`specsplit/models/deepseek_v3/latent_cache.py`). With W_UK folded into the query (q_latent = W_UK[h]ᵀ q_nope[h])
and W_UV applied after the weighted sum (`specsplit/models/deepseek_v3/mla.py`), every head attends over the
cached latents directly: keys [c_kv; k_pe] (R + P wide), values c_kv (R wide), one KV head shared by all query
heads. That is `paged_attention_triton`'s problem with one KV head, except that keys and values differ in width
and the key is stored in two parts; this kernel scores the two parts apart (q_latent · c_kv + q_pe · k_pe) and
keeps R-wide outputs, where padding R + P = 576 to a power of two would double DeepSeek-V3's tiles.

Same terms as `specsplit/kernels/paged_attention_reference.py` (`token_req_index`, `token_context_lens`, block
tables; a padding token, context length 0, gets a zero output). One program handles one query token and
`BLOCK_H` of its heads: the latents are read once per (token, head block). Split-K as in
`paged_attention_triton` (partials combined by its `combine_splits`), so the grid depends only on shapes and
`num_splits`, and a launch can be captured in a CUDA graph. Nothing here syncs with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsplit.kernels.paged_attention import (
    MIN_DOT,
    cache_rows,
    choose_num_splits,
    combine_splits,
    dot_dtype,
    online_softmax_step,
    split_partials,
    store_attention,
    token_key_range,
)

BLOCK_H = 16  # query heads per program (tl.dot's least M)
BLOCK_N = 32  # cache entries per iteration


@triton.jit
def _mla_kernel(
    q_latent_ptr,
    q_pe_ptr,
    cache_ptr,
    block_tables_ptr,
    token_req_index_ptr,
    token_context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_ql_t,
    stride_ql_h,
    stride_qp_t,
    stride_qp_h,
    stride_c_block,
    stride_c_pos,
    stride_bt_req,
    stride_o_t,
    stride_o_h,
    num_heads,
    num_splits,
    scale,
    RANK: tl.constexpr,
    RANK_P2: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    req, start, end = token_key_range(token_req_index_ptr, token_context_lens_ptr, t, split, num_splits, BLOCK_N)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_r = tl.arange(0, RANK_P2)
    offs_p = tl.arange(0, ROPE_P2)
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    q_lat = tl.load(
        q_latent_ptr + t * stride_ql_t + heads[:, None] * stride_ql_h + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pe = tl.load(
        q_pe_ptr + t * stride_qp_t + heads[:, None] * stride_qp_h + offs_p[None, :],
        mask=h_mask[:, None] & p_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_P2], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cache_index = n0 + tl.arange(0, BLOCK_N)
        valid = cache_index < end
        row = cache_rows(
            block_tables_ptr, req, stride_bt_req, cache_index, valid, stride_c_block, stride_c_pos, BLOCK_SIZE
        )
        c_kv = tl.load(cache_ptr + row[:, None] + offs_r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(
            cache_ptr + row[:, None] + RANK + offs_p[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0
        )
        c_kv, k_pe = c_kv.to(DOT_DTYPE), k_pe.to(DOT_DTYPE)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION)
        s = (s + tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)) * scale  # [BLOCK_H, BLOCK_N]
        p, alpha, m, denom = online_softmax_step(s, valid, m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c_kv, input_precision=PRECISION)

    store_attention(
        out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, acc, m, denom, t, heads, h_mask, offs_r, r_mask,
        stride_o_t, stride_o_h, num_heads, num_splits, split, RANK_P2, SPLIT,
    )  # fmt: skip


def mla_attention_triton(
    q_latent: torch.Tensor,  # [T, num_heads, R]: W_UK-absorbed q_nope
    q_pe: torch.Tensor,  # [T, num_heads, P], rotated
    latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]: [c_kv; k_pe], one layer
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32/int64
    token_req_index: torch.Tensor,  # [T] int32/int64
    token_context_lens: torch.Tensor,  # [T] int32/int64, 0 = padding token
    scale: float,
    num_splits: int | None = None,  # None: `choose_num_splits` over (tokens, head blocks)
) -> torch.Tensor:  # [T, num_heads, R] in q_latent's dtype: Σ_s p[h, s] c_kv[s]
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    if q_pe.shape[:2] != (num_tokens, num_heads) or latent_cache.shape[2] != rank + rope:
        raise ValueError(
            f"q_latent {tuple(q_latent.shape)} and q_pe {tuple(q_pe.shape)} do not fit the latent cache "
            f"{tuple(latent_cache.shape)}"
        )
    if q_latent.stride(2) != 1 or q_pe.stride(2) != 1 or latent_cache.stride(2) != 1:
        raise ValueError("q_latent, q_pe and the latent cache need a contiguous last dimension")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens, head_blocks, q_latent.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = q_latent.new_empty(num_tokens, num_heads, rank)
    if num_tokens == 0:
        return out
    rank_p2 = max(MIN_DOT, triton.next_power_of_2(rank))
    split = num_splits > 1
    part_acc, part_m, part_l = split_partials(out, num_splits, rank_p2)
    _mla_kernel[(num_tokens, head_blocks, num_splits)](
        q_latent,
        q_pe,
        latent_cache,
        block_tables,
        token_req_index,
        token_context_lens,
        out,
        part_acc,
        part_m,
        part_l,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        scale,
        RANK=rank,
        RANK_P2=rank_p2,
        ROPE=rope,
        ROPE_P2=max(MIN_DOT, triton.next_power_of_2(rope)),
        BLOCK_H=BLOCK_H,
        BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_N=BLOCK_N,
        SPLIT=split,
        PRECISION="ieee" if latent_cache.dtype == torch.float32 else "tf32",
        DOT_DTYPE=dot_dtype(latent_cache.dtype),
    )
    if split:
        combine_splits(part_acc, part_m, part_l, out, rank)
    return out
