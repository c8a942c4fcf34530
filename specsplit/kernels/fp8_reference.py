"""Block-scaled FP8 (e4m3) weights and the W8A8 linear over them, in plain torch: the CPU path's
dequantization and the reference the Triton kernel (`specsplit/kernels/fp8_gemm.py`) is tested against.

The layout is DeepSeek-V3's (`quantization_config: {quant_method: "fp8", weight_block_size: [bn, bk]}`):
a weight `W` [N, K] is stored as `W_fp8` (float8_e4m3fn, [N, K]) and `weight_scale_inv` (fp32,
[ceil(N / bn), ceil(K / bk)]) with W ≈ W_fp8 * scale_inv blockwise.

The W8A8 linear quantizes activations dynamically, per token and per group of `bk` along K (each row's
group is scaled so its largest magnitude maps to 448, e4m3's largest finite value), then
    y[m, n] = Σ_g  x_scale[m, g] · w_scale[n // bn, g] · Σ_{k ∈ g} x_fp8[m, k] · W_fp8[n, k]
with fp32 products and sums. Here that is the exact fp32 product of the two dequantized operands; the
kernel sums per group, so the two agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
SCALE_FLOOR = 1e-10  # an all-zero group gets this amax, so no scale is 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_scales(scale: torch.Tensor, rows: int, cols: int, block_n: int, block_k: int) -> torch.Tensor:
    # scale: [ceil(rows / block_n), ceil(cols / block_k)] → [rows, cols], each block's scale on its elements
    return scale.repeat_interleave(block_n, 0)[:rows].repeat_interleave(block_k, 1)[:, :cols]


def quantize_weight_blockwise(
    weight: torch.Tensor,  # [N, K], any float dtype
    block_n: int,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # W_fp8 [N, K] e4m3, scale_inv [ceil(N / bn), ceil(K / bk)] fp32
    """What FP8 checkpoints store: each [block_n, block_k] block scaled so its largest magnitude is 448."""
    n, k = weight.shape
    w = F.pad(weight.float(), (0, cdiv(k, block_k) * block_k - k, 0, cdiv(n, block_n) * block_n - n))
    blocks = w.view(w.shape[0] // block_n, block_n, w.shape[1] // block_k, block_k)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(SCALE_FLOOR) / FP8_MAX
    q = (w / expand_scales(scale, w.shape[0], w.shape[1], block_n, block_k)).clamp(-FP8_MAX, FP8_MAX)
    return q[:n, :k].to(FP8_DTYPE).contiguous(), scale.contiguous()


def dequantize_weight_blockwise(
    weight: torch.Tensor,  # [N, K] e4m3
    scale_inv: torch.Tensor,  # [ceil(N / scale_block_n), ceil(K / block_k)] fp32
    scale_block_n: int,
    block_k: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K] in dtype: W_fp8 * scale_inv computed in fp32, then cast
    n, k = weight.shape
    return (weight.float() * expand_scales(scale_inv.float(), n, k, scale_block_n, block_k)).to(dtype)


def quantize_activations(
    x: torch.Tensor,  # [M, K]
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [M, K] e4m3, x_scale [M, ceil(K / group)] fp32
    """Dynamic per-token, per-group quantization: x ≈ x_fp8 * x_scale per group of `group` along K (x times
    the scale's reciprocal, rounded to nearest even: what the kernel computes, bit for bit)."""
    m, k = x.shape
    xf = F.pad(x.float(), (0, cdiv(k, group) * group - k))
    amax = xf.view(m, -1, group).abs().amax(dim=-1).clamp_min(SCALE_FLOOR)
    # Tensor by tensor, both divisions correctly rounded on every device: CUDA torch divides by a Python scalar
    # as a multiplication by its reciprocal, which is off by an ulp in some scales (and then some e4m3 values).
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf * (torch.ones_like(scale) / scale).repeat_interleave(group, 1)).clamp(-FP8_MAX, FP8_MAX)
    return q[:, :k].to(FP8_DTYPE), scale


def w8a8_block_linear_reference(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] e4m3
    scale_inv: torch.Tensor,  # [ceil(N / scale_block_n), ceil(K / block_k)] fp32
    bias: torch.Tensor | None,  # [N]
    scale_block_n: int,
    block_k: int,
) -> torch.Tensor:  # [..., N] in x's dtype
    """The W8A8 block-scaled linear in exact fp32 math (see the module docstring)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    x_fp8, x_scale = quantize_activations(x2, block_k)
    xd = x_fp8.float() * x_scale.repeat_interleave(block_k, 1)[:, :k]
    y = xd @ dequantize_weight_blockwise(weight, scale_inv, scale_block_n, block_k).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
