"""Writes a step's new K and V into a paged cache through a slot mapping; slot < 0 is skipped.

Slot s is entry `s % block_size` of block `s // block_size`, i.e. row s of the cache viewed as
`[num_blocks * block_size, kv_heads * head_dim]`. Padding tokens of a CUDA-graph bucket carry
slot -1, so their K/V never land in the cache. One launch for K and V, no host sync. MLA's latent cache
holds one vector per token: `write_rows_triton` writes it, the same kernel without V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_v_t,
    ROW: tl.constexpr,
    ROW_P2: tl.constexpr,
    WITH_V: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_P2)
    mask = offs < tl.where(slot >= 0, ROW, 0)
    k = tl.load(k_ptr + t * stride_k_t + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if WITH_V:
        v = tl.load(v_ptr + t * stride_v_t + offs, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
) -> None:
    num_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K and V caches must be contiguous")
    if k_cache.shape[2] * k_cache.shape[3] != row or v.shape != k.shape:
        raise ValueError(f"K {tuple(k.shape)} / V {tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}")
    _launch(k.reshape(num_tokens, row), v.reshape(num_tokens, row), k_cache, v_cache, slot_mapping)


def write_rows_triton(
    rows: torch.Tensor,  # [T, row]
    cache: torch.Tensor,  # [num_blocks, block_size, row], contiguous
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
) -> None:
    """One vector per token into a paged cache (MLA's latents)."""
    if not cache.is_contiguous():
        raise ValueError("the cache must be contiguous")
    if cache.shape[2] != rows.shape[1]:
        raise ValueError(f"rows {tuple(rows.shape)} do not fit the cache {tuple(cache.shape)}")
    _launch(rows, None, cache, None, slot_mapping)


def _launch(
    k: torch.Tensor,  # [T, row]
    v: torch.Tensor | None,  # [T, row], or None: K alone
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, row = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(1) == 1 else k.contiguous()
    with_v = v is not None
    if with_v:
        v = v if v.stride(1) == 1 else v.contiguous()
    else:
        v, v_cache = k, k_cache  # not read
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        ROW=row,
        ROW_P2=triton.next_power_of_2(row),
        WITH_V=with_v,
    )
