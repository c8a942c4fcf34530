"""Rotary position embedding of q and k in one launch (rotate-half layout: Llama, Qwen2/3, MiMo, GLM-4.5).

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])

over the first R = rotary_dim values of each head, with `cos`/`sin` the per-token tables of
`specsplit.models.rotary.RotaryEmbedding` ([T, rotary_dim], both halves stored, so any frequency scaling lives
in the tables). R is head_dim except for partial rotary (GLM-4.5: head_dim / 2), whose other values pass.
Each product is rounded to the input dtype before the sum, as the torch expression is. The kernel rotates
q and k *in place* (they are fresh projection outputs in the model); one program handles every head of one
token. Given a paged KV cache and a slot mapping (`kv_write`), the same launch also writes the rotated k
and v into the token's cache slot (slot < 0: skipped), as `specsplit/kernels/kv_write.py` would in a launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_rotary_qk_reference(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # new q, k
    def rotate(x: torch.Tensor) -> torch.Tensor:
        rotary_dim = cos.shape[-1]
        x, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        half = rotary_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return torch.cat((x * cos[:, None, :] + rotated * sin[:, None, :], passed), dim=-1)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    cos1,
    cos2,
    sin1,
    sin2,
    NUM_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    cache_ptr,  # the token's row of a paged cache [NUM_HEADS, HEAD_DIM], or None
    write_heads,  # scalar: how many heads to store there too (NUM_HEADS, or 0 for a skipped slot)
    HEAD_DIM: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_P2)
    offs_d = tl.arange(0, HALF_P2)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    first = base_ptr + offs_h[:, None] * stride_h + offs_d[None, :]  # [HEADS_P2, HALF_P2]
    dtype = base_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos1[None, :]).to(dtype).to(tl.float32) + (-x2 * sin1[None, :]).to(dtype).to(tl.float32)
    o2 = (x2 * cos2[None, :]).to(dtype).to(tl.float32) + (x1 * sin2[None, :]).to(dtype).to(tl.float32)
    tl.store(first, o1.to(dtype), mask=mask)
    tl.store(first + HALF, o2.to(dtype), mask=mask)
    if cache_ptr is not None:
        row = cache_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        cache_dtype = cache_ptr.dtype.element_ty
        write = (offs_h < write_heads)[:, None] & (offs_d < HALF)[None, :]
        tl.store(row, o1.to(dtype).to(cache_dtype), mask=write)
        tl.store(row + HALF, o2.to(dtype).to(cache_dtype), mask=write)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cos_t,
    stride_sin_t,
    v_ptr,  # [T, kv_heads, head_dim] (WRITE_KV)
    stride_v_t,
    stride_v_h,
    k_cache_ptr,  # [num_slots, kv_heads, head_dim] contiguous (WRITE_KV)
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int32/int64, -1 = skip (WRITE_KV)
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_P2: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    K_HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # >= 2 * HALF: the values past 2 * HALF pass unrotated (partial rotary)
    HEAD_P2: tl.constexpr,
    WRITE_KV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_P2)
    d_mask = offs_d < HALF
    cos1 = tl.load(cos_ptr + t * stride_cos_t + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_cos_t + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_sin_t + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_sin_t + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q_base = q_ptr + t * stride_q_t
    _rotate_heads(
        q_base, stride_q_h, cos1, cos2, sin1, sin2, NUM_Q_HEADS, Q_HEADS_P2, HALF, HALF_P2, None, 0, HEAD_DIM
    )  # fmt: skip
    k_base = k_ptr + t * stride_k_t
    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        write_heads = tl.where(slot >= 0, NUM_K_HEADS, 0)
        row_size = NUM_K_HEADS * HEAD_DIM
        cache_offset = tl.maximum(slot, 0) * row_size
        _rotate_heads(
            k_base, stride_k_h, cos1, cos2, sin1, sin2, NUM_K_HEADS, K_HEADS_P2, HALF, HALF_P2,
            k_cache_ptr + cache_offset, write_heads, HEAD_DIM,
        )  # fmt: skip
        offs_h = tl.arange(0, K_HEADS_P2)
        offs_d = tl.arange(0, HEAD_P2)
        mask = (offs_h < write_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
        v = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
        cache_rows = cache_offset + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(v_cache_ptr + cache_rows, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
        if 2 * HALF < HEAD_DIM:  # the unrotated values of k go to the cache as they are
            passed = mask & (offs_d >= 2 * HALF)[None, :]
            k_pass = tl.load(k_base + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=passed)
            tl.store(k_cache_ptr + cache_rows, k_pass.to(k_cache_ptr.dtype.element_ty), mask=passed)
    else:
        _rotate_heads(
            k_base, stride_k_h, cos1, cos2, sin1, sin2, NUM_K_HEADS, K_HEADS_P2, HALF, HALF_P2, None, 0, HEAD_DIM
        )  # fmt: skip


def rotary_kernel_supports(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Even rotary_dim <= head_dim, one dtype throughout, unit stride along head_dim (q, k may be strided views)."""
    return (
        cos.shape[-1] % 2 == 0
        and cos.shape[-1] <= q.shape[-1]
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    )


def kv_write_supported(
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
) -> bool:
    """The fused cache write needs contiguous caches of k's row shape and v with unit stride along head_dim."""
    return (
        k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape[2:] == v_cache.shape[2:] == k.shape[1:] == v.shape[1:]
        and v.stride(-1) == 1
    )


def apply_rotary_qk_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # q, k (the same tensors)
    """kv_write: (v [T, kv_heads, head_dim], k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim],
    slot_mapping [T]): also writes the rotated k and v into the caches (`kv_write_supported`)."""
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[::2] != (num_tokens, head_dim) or cos.shape[0] != num_tokens or sin.shape != cos.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} do not fit"
        )
    if not rotary_kernel_supports(q, k, cos, sin):
        raise ValueError(
            "the rotary kernel needs an even rotary_dim <= head_dim, one dtype and unit stride along head_dim"
        )
    if kv_write is not None and not kv_write_supported(k, kv_write[0], kv_write[1], kv_write[2]):
        raise ValueError("the fused cache write needs contiguous caches that fit k and v")
    if num_tokens == 0:
        return q, k
    half = cos.shape[-1] // 2
    v, k_cache, v_cache, slot_mapping = kv_write if kv_write is not None else (k, k, k, cos)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        v,
        v.stride(0),
        v.stride(1),
        k_cache,
        v_cache,
        slot_mapping,
        NUM_Q_HEADS=num_heads,
        Q_HEADS_P2=triton.next_power_of_2(num_heads),
        NUM_K_HEADS=k.shape[1],
        K_HEADS_P2=triton.next_power_of_2(k.shape[1]),
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        HEAD_DIM=head_dim,
        HEAD_P2=triton.next_power_of_2(head_dim),
        WRITE_KV=kv_write is not None,
    )
    return q, k
