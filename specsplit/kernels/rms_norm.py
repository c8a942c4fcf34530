"""RMSNorm, optionally fused with the residual add before it, in one launch.

    residual' = x + residual                       (rounded to x's dtype, as the torch add is)
    out       = weight * (r32 * rsqrt(mean(r32^2) + eps)).to(dtype)     with r32 = residual' in float32

The statistics are float32 and the normalised row is cast to the input dtype before the weight, as
transformers' Llama/Qwen RMSNorm does; the output dtype is `promote(weight, x)`, as in torch. One
program normalises one row; nothing syncs with the host (capturable in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_reference(
    x: torch.Tensor,  # [..., size]
    weight: torch.Tensor,  # [size]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., size], added to x first
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out [..., size], new residual (x + residual) or None
    if residual is not None:
        x = residual = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_ro,
    stride_o,
    eps,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < SIZE
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / SIZE + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, size: int) -> torch.Tensor:
    """`t` as [rows, size] with unit stride along the row (a view when possible)."""
    t = t.reshape(-1, size)
    return t if t.stride(1) == 1 else t.contiguous()


def rms_norm_triton(
    x: torch.Tensor,  # [..., size]
    weight: torch.Tensor,  # [size]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., size], added to x first
) -> tuple[torch.Tensor, torch.Tensor | None]:  # out [..., size], new residual (x + residual) or None
    size = x.shape[-1]
    if weight.shape != (size,) or (residual is not None and (residual.shape, residual.dtype) != (x.shape, x.dtype)):
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} and residual "
            f"{None if residual is None else (tuple(residual.shape), residual.dtype)} do not fit"
        )
    x2 = _rows(x, size)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, size)
    if residual is not None:
        r2 = _rows(residual, size)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = new_residual.view(-1, size)
    else:
        r2 = ro2 = x2  # not read
        new_residual = None
    if x2.shape[0] == 0:
        return out, new_residual
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        ro2,
        weight,
        out2,
        x2.stride(0),
        r2.stride(0),
        ro2.stride(0),
        out2.stride(0),
        eps,
        SIZE=size,
        BLOCK=triton.next_power_of_2(size),
        HAS_RESIDUAL=residual is not None,
    )
    return out, new_residual
