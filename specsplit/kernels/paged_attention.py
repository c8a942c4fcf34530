"""Triton paged attention for a flat, ragged batch of query tokens (decode, verify, and mixed steps).

Same function as `specsplit/kernels/paged_attention_reference.py`, whose docstring defines the terms
(`token_req_index`, `token_context_lens`, block tables, GQA group). One program handles one query
token and one kv head: the `group` query heads that share that kv head are the rows of one tile, so
K/V are read once per (token, kv head). Online softmax over `BLOCK_N` cache entries at a time, each
entry's slot looked up through the block table.

Split-K (flash-decoding): with `num_splits > 1` the context of every token is cut into `num_splits`
contiguous ranges, each program writes a partial (max, sum, unnormalised output) and a second kernel
combines them. It fills the GPU when `tokens x kv_heads` is far below the number of SMs (batch-1
decode). The grid depends only on tensor shapes and `num_splits`, never on the contents, so a launch
can be captured in a CUDA graph.

A padding token (context length 0) gets a zero output. Nothing here syncs with the host.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def online_softmax_step(s, valid, m, denom):
    """One tile of scores s [rows, BLOCK_N] (columns not `valid` left out) into the running max m and denominator
    [rows]: the tile's unnormalised probabilities, the factor that rescales what was summed before, the new max and
    denominator."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return p, alpha, m_new, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def token_key_range(token_req_index_ptr, token_context_lens_ptr, t, split, num_splits, BLOCK_N: tl.constexpr):
    """Token t's request and the cache indices [start, end) its split `split` of `num_splits` attends over."""
    req = tl.load(token_req_index_ptr + t).to(tl.int64)
    context_len = tl.load(token_context_lens_ptr + t).to(tl.int32)
    keys_per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    return req, start, tl.minimum(start + keys_per_split, context_len)


@triton.jit
def cache_rows(
    block_tables_ptr, req, stride_bt_req, cache_index, valid, stride_c_block, stride_c_pos, BLOCK_SIZE: tl.constexpr
):
    """Offsets into a paged cache of request `req`'s entries at `cache_index` (through its block table)."""
    block = tl.load(block_tables_ptr + req * stride_bt_req + cache_index // BLOCK_SIZE, mask=valid, other=0)
    return block.to(tl.int64) * stride_c_block + (cache_index % BLOCK_SIZE) * stride_c_pos


@triton.jit
def store_attention(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    acc,
    m,
    denom,
    t,
    heads,
    h_mask,
    offs_d,
    d_mask,
    stride_o_t,
    stride_o_h,
    num_heads,
    num_splits,
    split,
    D_P2: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """A program's rows (`heads` of token t): normalised into `out`, or with SPLIT its split's partials
    (`split_partials`' layout), which `combine_splits` normalises."""
    if SPLIT:
        part = (t * num_heads + heads) * num_splits + split  # into [T, num_heads, num_splits]
        tl.store(part_m_ptr + part, m, mask=h_mask)
        tl.store(part_l_ptr + part, denom, mask=h_mask)
        tl.store(part_acc_ptr + part[:, None] * D_P2 + offs_d[None, :], acc, mask=h_mask[:, None])
    else:
        o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        o_ptrs = out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _attend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    token_req_index_ptr,
    token_context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_q_t,
    stride_q_h,
    stride_c_block,
    stride_c_pos,
    stride_c_head,
    stride_bt_req,
    stride_o_t,
    stride_o_h,
    num_heads,
    num_splits,
    scale,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, start, end = token_key_range(token_req_index_ptr, token_context_lens_ptr, t, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + t * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cache_index = n0 + tl.arange(0, BLOCK_N)
        valid = cache_index < end
        row = cache_rows(
            block_tables_ptr, req, stride_bt_req, cache_index, valid, stride_c_block, stride_c_pos, BLOCK_SIZE
        )
        row += kv_head * stride_c_head
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        k, v = k.to(DOT_DTYPE), v.to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_P2, BLOCK_N]
        p, alpha, m, denom = online_softmax_step(s, valid, m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)

    store_attention(
        out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, acc, m, denom, t, heads, g_mask, offs_d, d_mask,
        stride_o_t, stride_o_h, num_heads, num_splits, split, HEAD_DIM_P2, SPLIT,
    )  # fmt: skip


@triton.jit
def _combine_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_o_t,
    stride_o_h,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    s_mask = offs_s < num_splits
    part = (t * num_heads + h) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    denom = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: a padding token
    w = tl.exp(m - m_ref)  # 0 for empty splits (m = -inf)
    total = tl.sum(w * denom, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def dot_dtype(cache_dtype: torch.dtype) -> tl.dtype:
    """The cache's dtype, except bf16 under the Triton interpreter (CPU tests), whose tl.dot miscomputes
    bf16 tiles (triton 3.9): there they are upcast to fp32, on the GPU the dot runs in bf16."""
    if cache_dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[cache_dtype]


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_tokens: int, kv_heads: int, device: torch.device) -> int:
    """Enough splits that tokens x kv_heads x splits covers the GPU about twice; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device)
    programs = max(1, num_tokens * kv_heads)
    return 1 if programs >= sms else min(16, triton.cdiv(2 * sms, programs))


def paged_attention_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32/int64
    token_req_index: torch.Tensor,  # [T] int32/int64
    token_context_lens: torch.Tensor,  # [T] int32/int64, 0 = padding token
    scale: float | None = None,
    num_splits: int = 1,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if num_heads % kv_heads or cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("q and the caches need a contiguous head_dim, and K and V caches equal strides")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    group = num_heads // kv_heads
    head_dim_p2 = max(MIN_DOT, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    part_acc, part_m, part_l = split_partials(out, num_splits, head_dim_p2)
    _attend_kernel[(num_tokens, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        token_req_index,
        token_context_lens,
        out,
        part_acc,
        part_m,
        part_l,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        head_dim**-0.5 if scale is None else scale,
        GROUP=group,
        GROUP_P2=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_N=64 if head_dim_p2 <= 64 else 32,
        SPLIT=split,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        DOT_DTYPE=dot_dtype(k_cache.dtype),
    )
    if split:
        combine_splits(part_acc, part_m, part_l, out, head_dim)
    return out


def split_partials(out: torch.Tensor, num_splits: int, width_p2: int) -> tuple[torch.Tensor, ...]:
    """Split-K's partials for `out` ([T, num_heads, ...]): each split's unnormalised output [T, num_heads, num_splits,
    width_p2], running max and denominator [T, num_heads, num_splits], float32; `out` three times (not read) when
    there is one split."""
    if num_splits == 1:
        return out, out, out
    num_tokens, num_heads = out.shape[:2]
    part_acc = torch.empty(num_tokens, num_heads, num_splits, width_p2, dtype=torch.float32, device=out.device)
    part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=out.device)
    return part_acc, part_m, torch.empty_like(part_m)


def combine_splits(
    part_acc: torch.Tensor,  # [T, num_heads, num_splits, D_P2] float32: each split's unnormalised output
    part_m: torch.Tensor,  # [T, num_heads, num_splits] float32: each split's running max
    part_l: torch.Tensor,  # [T, num_heads, num_splits] float32: each split's softmax denominator
    out: torch.Tensor,  # [T, num_heads, >= head_dim]: written, its first head_dim values per head
    head_dim: int,
) -> None:
    """Split-K's second kernel: each (token, head)'s partials into its normalised output."""
    num_tokens, num_heads, num_splits, head_dim_p2 = part_acc.shape
    _combine_kernel[(num_tokens, num_heads)](
        part_acc,
        part_m,
        part_l,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        SPLITS_P2=triton.next_power_of_2(num_splits),
    )
