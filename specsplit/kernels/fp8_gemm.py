"""The block-scaled FP8 linear on the GPU: `y = x @ W.T (+ bias)` with W in e4m3 and one fp32 scale
per [bn, bk] block (`weight_scale_inv`), activations quantized to e4m3 per token and per group of bk
along K (inside the kernel, or by a launch before it), fp32 accumulation. It computes what
`specsplit.kernels.fp8_reference.w8a8_block_linear_reference` does, to fp32 rounding.

At decode and verify steps (M = 1..256 tokens) a linear is a read of its weight: e4m3 halves the bytes
of bf16. Each program owns [BLOCK_M, BLOCK_N] outputs and walks K one scale group (bk = 128 in the
published checkpoints) at a time: it loads x's [BLOCK_M, bk] tile, takes each row's absolute maximum,
quantizes the tile to e4m3, loads W's [bk, BLOCK_N] e4m3 tile and runs `tl.dot` on FP8 tensor cores,
then scales the group's fp32 sum by x's row scales and W's block scales. With `prequantize` (the default
above 32 rows, `fp8_gemm_configs.py`) a first launch quantizes x once and the programs load e4m3 rows
and their scales instead: the in-kernel quantization is repeated by every program over N. Programs over
M come first in the grid, so the programs sharing a weight tile run together (L2 serves the re-reads at
M > BLOCK_M).

With `swap_ab` the operands trade places: W's [BLOCK_N, bk] tile is the MMA's row operand and x's tile,
transposed, its [bk, BLOCK_M] column operand, the result transposed back once per program. At M = 1..16 the
default puts x's rows on the MMA's rows, padded to 16 and then to the tensor cores' height (64 for Hopper's
wgmma); swapped, the weight fills that height and x is a 16-wide column operand, the shape in which the bf16
GEMV's tensor-core path (`specsplit/kernels/gemv.py`) runs near the HBM roofline (docs/performance.md, "Decode
step and kernels").

Where N / BLOCK_N programs would leave SMs idle, K is split in whole groups: fp32 partial sums go to a
[SPLIT_K, M, N] scratch and the GEMV's fixed-order split-K sum adds them (results the same run to run,
no atomics). Nothing syncs with the host: calls can be captured in CUDA graphs.

`scale_block_n` is the rows one scale covers: bn as stored, or 1 where fused projections whose row
counts are not multiples of bn carry a scale per row (`specsplit.models.fp8_linear`).

Under the Triton interpreter (CPU tests) the fp32 → e4m3 cast rounds wrongly when rounding carries into
the exponent (triton 3.9: 124.7 becomes 64, not 128), so there the kernel rounds to e4m3's grid in fp32
first (round half to even, as the GPU's cvt.rn does) and the cast is exact; the dot runs in fp32.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from specsplit.kernels.fp8_gemm_configs import Fp8GemmConfig, config_for, effective_split
from specsplit.kernels.fp8_reference import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from specsplit.kernels.gemv import SUM_BLOCK, num_sms, split_k_sum_kernel
from specsplit.kernels.gemv_configs import cdiv

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_E4M3_MAX = tl.constexpr(FP8_MAX)
_SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)
QUANTIZE_BLOCK_M = 16  # rows per program of the separate activation quantization


@triton.jit
def _round_to_e4m3_grid(v):
    """v (fp32, |v| <= 448) rounded half to even onto the e4m3 values: 3 mantissa bits; below 2^-6
    the subnormal spacing 2^-9."""
    exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, 127 - 6)
    ulp = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    scaled = v / ulp  # exact: a power of two
    rounded = (scaled + 12582912.0) - 12582912.0  # 1.5 * 2^23: round half to even for |scaled| < 2^22
    return rounded * ulp


@triton.jit
def _quantize_group(x, EMULATE_CAST: tl.constexpr):
    """x: [R, GROUP_K] fp32 → e4m3 [R, GROUP_K] and fp32 scales [R]: each row times 448 / its largest magnitude
    (the reciprocal of the scale, both correctly rounded as torch computes them), rounded to nearest even."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _SCALE_FLOOR)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32))
    inverse = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    q = tl.clamp(x * inverse[:, None], -_E4M3_MAX, _E4M3_MAX)
    if EMULATE_CAST:
        q = _round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv), scale


@triton.jit(do_not_specialize=["M", "stride_sm"])
def _quantize_activations_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32, unit stride along K
    q_ptr,  # [M, K] e4m3
    scale_ptr,  # [M, ceil(K / GROUP_K)] fp32
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    kk = g * GROUP_K + tl.arange(0, GROUP_K)
    m_mask = offs_m < M
    mask = m_mask[:, None] & (kk < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=mask, other=0.0)
    q, scale = _quantize_group(x.to(tl.float32), EMULATE_CAST)
    tl.store(q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + kk[None, :], q, mask=mask)
    tl.store(scale_ptr + offs_m * stride_sm + g, scale, mask=m_mask)


@triton.jit
def _quantize_columns(x, EMULATE_CAST: tl.constexpr):
    """`_quantize_group` of a transposed tile: x [GROUP_K, C] fp32 (C rows of x as columns) → e4m3 [GROUP_K, C]
    and fp32 scales [C], the same values bit for bit."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), _SCALE_FLOOR)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32))
    inverse = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    q = tl.clamp(x * inverse[None, :], -_E4M3_MAX, _E4M3_MAX)
    if EMULATE_CAST:
        q = _round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _groups_x_by_w(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, offs_n, m_mask, n_mask, K, g_start, g_end,
    stride_xm, stride_xsm, stride_wn, stride_sn,
    SCALE_BN: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREQUANTIZED: tl.constexpr, EMULATE_CAST: tl.constexpr,
):  # fmt: skip
    """Σ over groups [g_start, g_end) of x's [BLOCK_M, GROUP_K] tile (quantized) @ W's [GROUP_K, BLOCK_N] tile,
    each group's sum scaled: [BLOCK_M, BLOCK_N] fp32. x is the MMA's row operand (padded to BLOCK_M rows)."""
    offs_k = tl.arange(0, GROUP_K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    x_scales = x_scale_ptr + offs_m * stride_xsm  # [BLOCK_M]
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    w_scales = w_scale_ptr + (offs_n // SCALE_BN) * stride_sn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(g_start, g_end):
        kk = g * GROUP_K + offs_k
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, GROUP_K]
        if PREQUANTIZED:
            x_q = x
            x_scale = tl.load(x_scales + g, mask=m_mask, other=0.0)
        else:
            x_q, x_scale = _quantize_group(x.to(tl.float32), EMULATE_CAST)
        w = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [GROUP_K, BLOCK_N]
        if EMULATE_CAST:  # the interpreter's dot: in fp32 (exact for e4m3 products)
            part = tl.dot(x_q.to(tl.float32), w.to(tl.float32))
        else:  # one group per dot, added in fp32 (FP8 tensor cores accumulate with fewer bits)
            part = tl.dot(x_q, w)
        w_scale = tl.load(w_scales + g, mask=n_mask, other=0.0)  # [BLOCK_N]
        acc += part * x_scale[:, None] * w_scale[None, :]
    return acc


@triton.jit
def _groups_w_by_x(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, offs_n, m_mask, n_mask, K, g_start, g_end,
    stride_xm, stride_xsm, stride_wn, stride_sn,
    SCALE_BN: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREQUANTIZED: tl.constexpr, EMULATE_CAST: tl.constexpr,
):  # fmt: skip
    """`_groups_x_by_w` with the operands swapped (`swap_ab`): W's [BLOCK_N, GROUP_K] tile is the MMA's row
    operand and x's tile, transposed, its [GROUP_K, BLOCK_M] column operand, so a few rows of x are a narrow
    MMA instead of rows padded to the tensor cores' height; returns [BLOCK_M, BLOCK_N] fp32 like it."""
    offs_k = tl.arange(0, GROUP_K)
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm  # [1, BLOCK_M]
    x_scales = x_scale_ptr + offs_m * stride_xsm  # [BLOCK_M]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    w_scales = w_scale_ptr + (offs_n // SCALE_BN) * stride_sn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(g_start, g_end):
        kk = g * GROUP_K + offs_k
        k_mask = kk < K
        x = tl.load(x_cols + kk[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)  # [GROUP_K, BLOCK_M]
        if PREQUANTIZED:
            x_q = x
            x_scale = tl.load(x_scales + g, mask=m_mask, other=0.0)
        else:
            x_q, x_scale = _quantize_columns(x.to(tl.float32), EMULATE_CAST)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, GROUP_K]
        if EMULATE_CAST:
            part = tl.dot(w.to(tl.float32), x_q.to(tl.float32))
        else:
            part = tl.dot(w, x_q)
        w_scale = tl.load(w_scales + g, mask=n_mask, other=0.0)  # [BLOCK_N]
        acc += part * x_scale[None, :] * w_scale[:, None]  # in the order of _groups_x_by_w
    return tl.trans(acc)


# Integers Triton would otherwise compile a variant for by divisibility (by 16, or = 1) where it buys nothing: M, the
# loop's length and the scales' row strides (numbers of groups along K); K and the data strides stay specialized.
@triton.jit(do_not_specialize=["M", "groups_per_split", "stride_xsm", "stride_sn"])
def _w8a8_block_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32, or e4m3 if PREQUANTIZED; unit stride along K
    x_scale_ptr,  # [M, ceil(K / GROUP_K)] fp32 (read only if PREQUANTIZED)
    w_ptr,  # [N, K] e4m3, unit stride along K
    w_scale_ptr,  # [ceil(N / SCALE_BN), ceil(K / GROUP_K)] fp32
    bias_ptr,  # [N] (read only if HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or [SPLIT_K, M, N] fp32 partial sums if SPLIT
    M,
    N,
    K,
    groups_per_split,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_sn,
    stride_os,
    stride_om,
    SCALE_BN: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREQUANTIZED: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, tl.cdiv(K, GROUP_K))
    if SWAP_AB:
        acc = _groups_w_by_x(
            x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, offs_n, m_mask, n_mask, K, g_start, g_end,
            stride_xm, stride_xsm, stride_wn, stride_sn,
            SCALE_BN, GROUP_K, BLOCK_M, BLOCK_N, PREQUANTIZED, EMULATE_CAST,
        )  # fmt: skip
    else:
        acc = _groups_x_by_w(
            x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, offs_m, offs_n, m_mask, n_mask, K, g_start, g_end,
            stride_xm, stride_xsm, stride_wn, stride_sn,
            SCALE_BN, GROUP_K, BLOCK_M, BLOCK_N, PREQUANTIZED, EMULATE_CAST,
        )  # fmt: skip
    cols = offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + cols, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=n_mask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x, weight, scale_inv, bias, scale_block_n: int, block_k: int) -> None:
    n, k = weight.shape
    if weight.dtype != FP8_DTYPE or weight.stride(1) != 1 or k != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K] {FP8_DTYPE} with unit stride along K and K = x's last dimension; got "
            f"{tuple(weight.shape)} {weight.dtype} (strides {weight.stride()}) for x {tuple(x.shape)}"
        )
    want = (cdiv(n, scale_block_n), cdiv(k, block_k))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv must be fp32 {want}, got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    if block_k < 32 or block_k & (block_k - 1):
        raise ValueError(f"the scale group along K must be a power of two >= 32 (FP8 tl.dot's least K), got {block_k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")


def quantize_activations_triton(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32, unit stride along K
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [M, K] e4m3, x_scale [M, ceil(K / group)] fp32
    """`specsplit.kernels.fp8_reference.quantize_activations` in one launch, bit for bit."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, cdiv(k, group), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_activations_kernel[(cdiv(m, QUANTIZE_BLOCK_M), cdiv(k, group))](
        x,
        q,
        scale,
        m,
        k,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        GROUP_K=group,
        BLOCK_M=QUANTIZE_BLOCK_M,
        EMULATE_CAST=_INTERPRETED,
        num_warps=4,
    )
    return q, scale


def w8a8_block_linear(
    x: torch.Tensor,  # [..., K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, K] e4m3
    scale_inv: torch.Tensor,  # [ceil(N / scale_block_n), ceil(K / block_k)] fp32
    bias: torch.Tensor | None,  # [N]
    scale_block_n: int,
    block_k: int,
    config: Fp8GemmConfig | None = None,  # None: the table's (or the default) for this shape
) -> torch.Tensor:  # [..., N] in x's dtype
    _check(x, weight, scale_inv, bias, scale_block_n, block_k)
    (n, k), m = weight.shape, math.prod(x.shape[:-1])
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if config is None:
        config = config_for(n, k, m, num_sms(x.device))
    x2 = x.reshape(m, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    split_k, groups_per_split = effective_split(k, block_k, config.split_k)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    x_scale = x2  # unread unless prequantized
    if config.prequantize:
        x2, x_scale = quantize_activations_triton(x2, block_k)
    _w8a8_block_kernel[(cdiv(m, config.block_m), cdiv(n, config.block_n), split_k)](
        x2,
        x_scale,
        weight,
        scale_inv,
        weight if bias is None else bias,
        target,
        m,
        n,
        k,
        groups_per_split,
        x2.stride(0),
        x_scale.stride(0),
        weight.stride(0),
        scale_inv.stride(0),
        target.stride(0) if split_k > 1 else 0,
        target.stride(-2),
        SCALE_BN=scale_block_n,
        GROUP_K=block_k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PREQUANTIZED=config.prequantize,
        EMULATE_CAST=_INTERPRETED,
        HAS_BIAS=bias is not None and split_k == 1,
        SPLIT=split_k > 1,
        SWAP_AB=config.swap_ab,
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
