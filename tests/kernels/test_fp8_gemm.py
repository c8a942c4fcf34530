"""The Triton block-scaled W8A8 kernel equals its torch reference (fp32 to summation order; 16-bit
outputs within one rounding) under the interpreter: split K or not, scales per block or per row, odd
M / N / K, with bias, either operand the MMA's rows; and the reference itself quantizes as the published format says."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.fp8_gemm import quantize_activations_triton, w8a8_block_linear
from specsplit.kernels.fp8_gemm_configs import Fp8GemmConfig, default_config, effective_split
from specsplit.kernels.fp8_reference import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight_blockwise,
    quantize_activations,
    quantize_weight_blockwise,
    w8a8_block_linear_reference,
)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _case(m: int, n: int, k: int, block: tuple[int, int], bias: bool, dtype: torch.dtype, seed: int = 0):
    weight, scale = quantize_weight_blockwise(_randn(n, k, seed=seed) / k**0.5, *block)
    x = _randn(m, k, seed=seed + 1)
    x[0, : k // 3] *= 40.0  # groups of very different magnitude in one row
    return x.to(dtype), weight, scale, _randn(n, seed=seed + 2).to(dtype) if bias else None


CASES = {  # name: (M, N, K, block (rows per scale, group along K), config)
    "one-row": (1, 200, 300, (128, 128), Fp8GemmConfig(16, 32, 1)),
    "split-k": (3, 200, 300, (128, 128), Fp8GemmConfig(16, 64, 2)),
    "row-scales": (17, 96, 64, (1, 32), Fp8GemmConfig(16, 32, 1)),
    "small-blocks": (5, 130, 256, (64, 64), Fp8GemmConfig(16, 32, 3)),
    "m-tiles": (40, 48, 96, (16, 32), Fp8GemmConfig(16, 16, 1)),
    "prequantized": (40, 48, 96, (16, 32), Fp8GemmConfig(32, 16, 1, prequantize=True)),
    "prequantized-split": (3, 200, 300, (128, 128), Fp8GemmConfig(16, 64, 2, prequantize=True)),
    # W's tile as the MMA's row operand (swap_ab): whole and split K, row scales, several M tiles, prequantized.
    "swapped": (1, 200, 300, (128, 128), Fp8GemmConfig(16, 32, 1, swap_ab=True)),
    "swapped-split": (3, 200, 300, (128, 128), Fp8GemmConfig(16, 64, 2, swap_ab=True)),
    "swapped-row-scales": (40, 96, 64, (1, 32), Fp8GemmConfig(16, 32, 1, swap_ab=True)),
    "swapped-prequantized": (40, 48, 96, (16, 32), Fp8GemmConfig(32, 16, 3, prequantize=True, swap_ab=True)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_reference_in_fp32(name, bias):
    m, n, k, block, config = CASES[name]
    x, weight, scale, b = _case(m, n, k, block, bias, torch.float32)
    got = w8a8_block_linear(x, weight, scale, b, *block, config)
    torch.testing.assert_close(got, w8a8_block_linear_reference(x, weight, scale, b, *block), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_reference_in_16_bits_within_one_rounding(dtype):
    m, n, k, block, config = CASES["split-k"]
    x, weight, scale, b = _case(m, n, k, block, True, dtype)
    got = w8a8_block_linear(x, weight, scale, b, *block, config)
    want = w8a8_block_linear_reference(x, weight, scale, b, *block)
    assert got.dtype == dtype and got.shape == (m, n)
    ulp = 2.0 ** (torch.frexp(want.float().abs()).exponent - 1) * torch.finfo(dtype).eps
    assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.parametrize("shape", [(1, 300), (17, 64), (5, 256)])
def test_activation_quantization_kernel_equals_the_reference_bit_for_bit(shape):
    x = _randn(*shape, seed=5) * torch.logspace(-3, 3, shape[1])  # every magnitude, to the subnormals
    group = 128 if shape[1] >= 128 else 32
    for dtype in (torch.float32, torch.bfloat16):
        q, scale = quantize_activations_triton(x.to(dtype), group)
        want_q, want_scale = quantize_activations(x.to(dtype), group)
        assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_kernel_takes_leading_dimensions_and_the_default_config():
    x, weight, scale, _ = _case(6, 64, 128, (32, 64), False, torch.float32)
    got = w8a8_block_linear(x.view(2, 3, 128), weight, scale, None, 32, 64)
    assert got.shape == (2, 3, 64)
    want = w8a8_block_linear_reference(x, weight, scale, None, 32, 64)
    torch.testing.assert_close(got.view(6, 64), want, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_mismatched_scales():
    x, weight, scale, _ = _case(2, 64, 128, (32, 64), False, torch.float32)
    with pytest.raises(ValueError, match="scale_inv must be fp32"):
        w8a8_block_linear(x, weight, scale[:1], None, 32, 64)


def test_weight_quantization_round_trips_within_e4m3():
    w = _randn(70, 300, seed=3)
    w[:, 128:256] *= 1e-3  # a block of small values keeps its own scale
    q, scale = quantize_weight_blockwise(w, 32, 128)
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 3) and scale.dtype == torch.float32
    back = dequantize_weight_blockwise(q, scale, 32, 128)
    assert ((back - w).abs() <= w.abs() * 2.0**-4 + 2.0**-9 * scale.max()).all()
    assert q.float().abs().amax() == FP8_MAX  # each block's largest magnitude maps to 448


def test_activation_quantization_is_per_token_and_group():
    x = _randn(3, 200, seed=4)
    x[1, 130:] *= 100.0
    q, scale = quantize_activations(x, 128)
    assert scale.shape == (3, 2) and scale[1, 1] > 50 * scale[1, 0]
    back = q.float() * scale.repeat_interleave(128, 1)[:, :200]
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + 1e-6).all()


def test_default_config_splits_k_for_few_programs_and_prequantizes_many_rows():
    config = default_config(576, 7168, 1, 132)  # DeepSeek-V3's kv_a_proj: 9 tiles of N
    assert config.split_k > 1 and effective_split(7168, 128, config.split_k)[0] * 9 >= 132
    assert default_config(37888, 4096, 1, 132).split_k == 1
    assert not config.prequantize and default_config(576, 7168, 64, 132).prequantize
