"""Small-M linear layers, `y = x @ W.T (+ bias)` with M = 1..32 rows of x, as a memory-bound GEMV.

At decode and verify steps M is the number of tokens in the step, and a linear reads its whole weight
([N, K], as nn.Linear stores it) to do 2·M·N·K flops: its time is the weight's bytes over HBM
bandwidth. Each program streams a [BLOCK_N, K / SPLIT_K] slab of W once, in [BLOCK_N, BLOCK_K]
vector loads, against every row of x, and accumulates in fp32, on one of two paths:

- FMA (`dot=False`, M <= 4): per row of x, [BLOCK_N, BLOCK_K] partial products are summed
  elementwise over the K loop and reduced over BLOCK_K once, at the end.
- dot: `tl.dot(W tile, x tileᵀ)` on tensor cores, x's rows padded to 16 (or 32). W is the MMA's
  wide operand, so the padding adds no weight traffic.

Where N / BLOCK_N programs would leave SMs idle, K is split: each program writes fp32 partial sums to
a [SPLIT_K, M, N] scratch and a second launch adds them in a fixed order, adds the bias and casts, so
results are the same run to run (no atomics). Nothing syncs with the host and the scratch comes from
torch's allocator: calls can be captured in CUDA graphs. Launch configurations: `specsplit/kernels/gemv_configs.py`.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specsplit.kernels.gemv_configs import (
    DEFAULT_NUM_SMS,
    MAX_FMA_M,
    MAX_M,
    GemvConfig,
    block_m,
    cdiv,
    config_for,
    default_config,
    effective_split,
)

SUM_BLOCK = 1024  # outputs per program of the split-K sum


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N] (read only if HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or [SPLIT_K, M, N] fp32 partial sums if SPLIT
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_k = tl.program_id(1)
    n_start = tl.program_id(0) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = n_start + offs_n < N
    w_rows = w_ptr + n_start.to(tl.int64) * stride_wn + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # dot path
    # FMA path: one accumulator per row of x, each in the W tile's register layout (a single
    # [BLOCK_M, BLOCK_N, BLOCK_K] one makes Triton pass every W tile through shared memory).
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k + offs_k
        k_mask = kk < K  # slices hold whole tiles, so only K's end needs a mask
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT:
            x_t = tl.load(
                x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0
            )  # [BLOCK_K, BLOCK_M]
            acc = tl.dot(w.to(DOT_DTYPE), x_t.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        else:
            # rows past M re-read the last row; their sums are not stored
            w = w.to(tl.float32)
            x_row = x_ptr + kk
            acc0 += w * tl.load(x_row, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            if BLOCK_M > 1:
                x_row1 = x_row + tl.minimum(1, M - 1) * stride_xm
                acc1 += w * tl.load(x_row1, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            if BLOCK_M > 2:
                x_row2 = x_row + tl.minimum(2, M - 1) * stride_xm
                x_row3 = x_row + tl.minimum(3, M - 1) * stride_xm
                acc2 += w * tl.load(x_row2, mask=k_mask, other=0.0).to(tl.float32)[None, :]
                acc3 += w * tl.load(x_row3, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    if DOT:
        y = tl.trans(acc)
    else:
        rows = offs_m[:, None]
        y = tl.where(rows == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
        if BLOCK_M > 1:
            y = tl.where(rows == 1, tl.sum(acc1, axis=1)[None, :], y)
        if BLOCK_M > 2:
            y = tl.where(rows == 2, tl.sum(acc2, axis=1)[None, :], y)
            y = tl.where(rows == 3, tl.sum(acc3, axis=1)[None, :], y)
    # y: [BLOCK_M, BLOCK_N] fp32
    cols = n_start + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + cols, y, mask=mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=n_mask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_k_sum_kernel(
    partial_ptr,  # [SPLIT_K, M * N] fp32
    bias_ptr,  # [N] (read only if HAS_BIAS)
    out_ptr,  # [M * N]
    N,
    MN,
    SPLIT_K,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """x's dtype, except bf16 under the Triton interpreter (CPU tests), whose tl.dot miscomputes bf16
    tiles (triton 3.9): there they are upcast to fp32; on the GPU the dot runs in bf16."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


@functools.lru_cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: int, config: GemvConfig) -> None:
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} (strides {weight.stride()}) does not fit x {tuple(x.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, {getattr(bias, 'dtype', None)}"
        )
    if m > (MAX_M if config.dot else MAX_FMA_M):
        raise ValueError(f"{m} rows of x; the {'dot' if config.dot else 'FMA'} path takes at most that many")


def gemv(
    x: torch.Tensor,  # [..., K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, K], unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,  # None: the table's (or the default) for this shape
) -> torch.Tensor:  # [..., N] in x's dtype
    """`F.linear(x, weight, bias)` by the Triton GEMV (also where the table prefers cuBLAS)."""
    k, n = x.shape[-1], weight.shape[0]
    m = math.prod(x.shape[:-1])
    if config is None:
        sms = num_sms(x.device)
        config = config_for(n, k, m, sms) or default_config(n, k, m, sms)
    _check(x, weight, bias, m, config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    x2 = x.reshape(m, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    split_k = effective_split(k, config.block_k, config.split_k)
    k_per_split = cdiv(cdiv(k, config.block_k), split_k) * config.block_k
    dot_dtype = _dot_dtype(x.dtype)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(cdiv(n, config.block_n), split_k)](
        x2,
        weight,
        weight if bias is None else bias,
        target,
        m,
        n,
        k,
        k_per_split,
        x2.stride(0),
        weight.stride(0),
        target.stride(0) if split_k > 1 else 0,
        target.stride(-2),
        BLOCK_M=block_m(m, config.dot),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT=config.dot,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",  # exact fp32; ignored for 16-bit inputs
        HAS_BIAS=bias is not None and split_k == 1,
        SPLIT=split_k > 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split_k > 1:
        split_k_sum_kernel[(cdiv(m * n, SUM_BLOCK),)](
            target,
            weight if bias is None else bias,
            out,
            n,
            m * n,
            split_k,
            BLOCK=SUM_BLOCK,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], n)


def linear_config(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, measured_only: bool = False
) -> GemvConfig | None:
    """The configuration `linear` runs the GEMV with, or None for F.linear: CUDA tensors of one 16-bit
    dtype that need no gradient, 1 <= M <= MAX_M, a unit-stride weight, and no table entry for cuBLAS
    (`measured_only`: and a table entry at all)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != x.dtype for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # the kernel has no backward
    if weight.dim() != 2 or weight.stride(1) != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return None
    m = math.prod(x.shape[:-1])
    if not 1 <= m <= MAX_M:
        return None
    return config_for(weight.shape[0], weight.shape[1], m, num_sms(x.device), measured_only)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, measured_only: bool = False
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: by the Triton GEMV where `linear_config` gives one, else by torch."""
    config = linear_config(x, weight, bias, measured_only)
    return F.linear(x, weight, bias) if config is None else gemv(x, weight, bias, config)
