"""SwiGLU activation `silu(gate) * up` from the fused `gate_up_proj` output, in one launch.

The input row is `[gate | up]` (`[T, 2 * inter]`). silu is computed in float32 and rounded to the
input dtype before the product, as the two torch ops are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = tl.constexpr(1024)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * inter] → [T, inter]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, INTER: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + t * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_in + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, (silu * up).to(dtype), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * inter] → [T, inter]
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has an odd width {width}; expected [gate | up]")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, BLOCK.value))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter
    )
    return out
