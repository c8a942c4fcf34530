"""The per-token ops of a decoder layer, each with two implementations: the Triton kernels of
`kernels/` (one launch each) for CUDA tensors, the torch ops elsewhere.

Inside a CUDA graph every launch still costs a few microseconds, so the ~7 torch ops of an RMSNorm,
the ~5 of a rotary embedding and the 2 of silu-and-mul dominate a small-batch decode step; the
kernels cut them to one each. CPU runs (tests, the fp32 lossless oracle) keep the torch ops, also
under TRITON_INTERPRET, where the interpreter would make whole-model runs far too slow; so does
training (the kernels have no backward), i.e. any call whose inputs need gradients.

The kernels are **on by default** for CUDA tensors; the servers' `--no-layer-kernels` (or
`enable_layer_kernels(False)`) keeps the torch ops. They equal the torch ops within fp32 rounding, whole tiny
models included (`tests/gpu/test_layer_kernels_cuda.py`), and shorten a small-batch decode step
(docs/performance.md, "Decode step and kernels").

The linears (`linear`) run the Triton GEMV of `specsplit/kernels/gemv.py` for steps of at most 32 tokens, **by
default only for the shapes `benchmarks/gemv.py` measured** (`specsplit/kernels/gemv_configs.py`; the entries
where cuBLAS was faster keep `F.linear`); `enable_gemv(True)`
(the servers' `--gemv`) also runs unmeasured shapes with a default launch, `enable_gemv(False)`
(`--no-gemv`) keeps cuBLAS everywhere. Everything off CUDA keeps `F.linear`. A block-scaled FP8 linear
(`specsplit.models.fp8_linear.Fp8Linear`) runs its own forward: the Triton W8A8 kernel on CUDA.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from specsplit.kernels.gemv import linear as gemv_linear
from specsplit.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from specsplit.kernels.rotary import apply_rotary_qk_triton, kv_write_supported, rotary_kernel_supports
from specsplit.kernels.silu_mul import silu_mul_reference, silu_mul_triton
from specsplit.models.fp8_linear import Fp8Linear
from specsplit.models.rotary import apply_rotary

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_enabled = True
_gemv_mode = "measured"  # "off", "measured" (shapes in the table), "all"


def enable_layer_kernels(on: bool = True) -> None:
    """Process-wide: CUDA tensors go through the Triton layer kernels (the default) or the torch ops."""
    global _enabled
    _enabled = on


def use_triton(x: torch.Tensor) -> bool:
    """Whether ops on `x` run the Triton kernels: when enabled, on CUDA tensors, unless Triton is interpreted."""
    return _enabled and x.is_cuda and not _INTERPRETED


def enable_gemv(on: bool | None = True) -> None:
    """Process-wide: linears on CUDA tensors of few tokens run the Triton GEMV for every shape (True),
    for the measured shapes only (None, the default), or nowhere (False: cuBLAS)."""
    global _gemv_mode
    _gemv_mode = {True: "all", None: "measured", False: "off"}[on]


def use_gemv(x: torch.Tensor) -> bool:
    """Whether `linear` on `x` may take the Triton GEMV: when enabled, on CUDA, unless Triton is interpreted."""
    return _gemv_mode != "off" and x.is_cuda and not _INTERPRETED


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm(
    x: torch.Tensor,  # [..., size]
    weight: torch.Tensor,  # [size]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., size], added to x first
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out [..., size], new residual (x + residual) or None
    kernel = use_triton(x) and not _needs_grad(x, weight, residual)
    return (rms_norm_triton if kernel else rms_norm_reference)(x, weight, eps, residual)


def apply_rotary_qk(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated q, k (the kernel rotates the given tensors in place)
    if use_triton(q) and not _needs_grad(q, k) and rotary_kernel_supports(q, k, cos, sin):
        return apply_rotary_qk_triton(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary_qk_and_write_kv(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T], -1 = skip
) -> tuple[torch.Tensor, torch.Tensor, bool]:  # rotated q, k; whether k and v are in the cache already
    """The rotary embedding, and where the kernel can, the paged-cache write of k and v in the same launch."""
    if (
        use_triton(q)
        and not _needs_grad(q, k, v)
        and rotary_kernel_supports(q, k, cos, sin)
        and kv_write_supported(k, v, k_cache, v_cache)
    ):
        q, k = apply_rotary_qk_triton(q, k, cos, sin, kv_write=(v, k_cache, v_cache, slot_mapping))
        return q, k, True
    q, k = apply_rotary_qk(q, k, cos, sin)
    return q, k, False


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * inter] as [gate | up] → silu(gate) * up: [T, inter]
    kernel = use_triton(gate_up) and not _needs_grad(gate_up)
    return (silu_mul_triton if kernel else silu_mul_reference)(gate_up)


def linear(x: torch.Tensor, layer: nn.Linear | Fp8Linear) -> torch.Tensor:
    # x: [T, in_features] → [T, out_features]; `layer(x)` unless the GEMV is on
    # (specsplit.kernels.gemv.linear still keeps F.linear for shapes, token counts or dtypes it does not serve)
    if use_gemv(x) and not isinstance(layer, Fp8Linear):
        return gemv_linear(x, layer.weight, layer.bias, measured_only=_gemv_mode == "measured")
    return layer(x)
