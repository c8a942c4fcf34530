"""The Triton GEMV equals F.linear (fp32 exactly up to summation order, bf16 within its rounding) on
both paths, split or not, on odd shapes; it is deterministic; `linear` keeps F.linear off CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels import gemv_configs
from specsplit.kernels.gemv import gemv, linear, linear_config
from specsplit.kernels.gemv_configs import GemvConfig, cdiv, config_for, effective_split, m_bucket

FMA = GemvConfig(dot=False, block_n=32, block_k=256, split_k=1)
FMA_SPLIT = GemvConfig(dot=False, block_n=64, block_k=128, split_k=4)
DOT = GemvConfig(dot=True, block_n=32, block_k=128, split_k=1)
DOT_SPLIT = GemvConfig(dot=True, block_n=64, block_k=256, split_k=3)
CONFIGS = {"fma": FMA, "fma-split": FMA_SPLIT, "dot": DOT, "dot-split": DOT_SPLIT}


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _inputs(m: int, n: int, k: int, bias: bool, dtype=torch.float32, seed: int = 0):
    x = _randn(m, k, seed=seed, dtype=dtype)
    weight = (_randn(n, k, seed=seed + 1) / k**0.5).to(dtype)
    return x, weight, _randn(n, seed=seed + 2, dtype=dtype) if bias else None


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", [(1, 1000, 777), (3, 100, 300), (4, 48, 64)])  # M, N, K
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_f_linear_in_fp32(name, shape, bias):
    x, weight, b = _inputs(*shape, bias)
    torch.testing.assert_close(gemv(x, weight, b, CONFIGS[name]), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [5, 16, 17, 32])  # padded to 16 or 32 rows
def test_dot_path_takes_up_to_32_rows(m):
    x, weight, b = _inputs(m, 40, 96, bias=True)
    for config in (DOT, DOT_SPLIT):
        torch.testing.assert_close(gemv(x, weight, b, config), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["fma-split", "dot", "dot-split"])
def test_16_bit_inputs_within_their_rounding(dtype, name):
    x, weight, b = _inputs(3, 100, 300, bias=True, dtype=dtype)
    out = gemv(x, weight, b, CONFIGS[name])
    assert out.dtype == dtype
    expected = F.linear(x.float(), weight.float(), b.float())
    # The interpreter truncates fp32 to bf16 (the GPU rounds to nearest): up to one bf16 ulp.
    tolerance = 2**-7 if dtype == torch.bfloat16 else 2**-10
    assert (out.float() - expected).abs().max() <= tolerance * expected.abs().max()


def test_split_k_is_deterministic_and_takes_the_default_config():
    x, weight, b = _inputs(2, 300, 1000, bias=True)
    first = gemv(x, weight, b)  # the default configuration splits K for this shape
    assert gemv_configs.default_config(300, 1000, 2, 132).split_k > 1
    assert torch.equal(first, gemv(x, weight, b))
    torch.testing.assert_close(first, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_leading_dims_strided_rows_and_empty_inputs():
    x, weight, _ = _inputs(6, 24, 32, bias=False)
    x3 = x.view(2, 3, 32)
    assert gemv(x3, weight, None, DOT).shape == (2, 3, 24)
    torch.testing.assert_close(gemv(x3, weight, None, DOT), F.linear(x3, weight), atol=1e-5, rtol=1e-5)
    wide = _randn(3, 64, seed=9)[:, :32]  # rows with a stride of 64
    torch.testing.assert_close(gemv(wide, weight, None, FMA), F.linear(wide, weight), atol=1e-5, rtol=1e-5)
    assert gemv(torch.zeros(0, 32), weight).shape == (0, 24)
    torch.testing.assert_close(
        gemv(torch.ones(2, 0), torch.ones(5, 0), torch.arange(5.0)), torch.arange(5.0).repeat(2, 1)
    )


def test_inputs_it_does_not_take_raise():
    x, weight, _ = _inputs(5, 24, 32, bias=False)
    with pytest.raises(ValueError, match="rows of x"):
        gemv(x, weight, None, FMA)  # the FMA path takes at most 4 rows
    with pytest.raises(ValueError, match="share a dtype"):
        gemv(x, weight.half(), None, DOT)
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x, weight.t(), None, DOT)


def test_k_slices_hold_whole_tiles_and_none_is_empty():
    for k in (1, 77, 128, 777, 3584, 18944):
        for block_k in (64, 256, 512):
            for split_k in (1, 2, 3, 5, 8, 64):
                split = effective_split(k, block_k, split_k)
                per_split = cdiv(cdiv(k, block_k), split) * block_k
                assert 1 <= split <= split_k
                assert (split - 1) * per_split < k <= split * per_split


def test_the_table_picks_configs_per_m_bucket_and_none_means_torch(monkeypatch):
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 9, 17, 32)] == [1, 2, 4, 4, 8, 16, 32, 32]
    tuned = GemvConfig(dot=True, block_n=128, block_k=64, split_k=2)
    monkeypatch.setattr(gemv_configs, "CONFIGS", {(24, 32, 4): tuned, (24, 32, 8): None})
    assert config_for(24, 32, 3, 132) is tuned
    assert config_for(24, 32, 7, 132) is None
    assert config_for(24, 32, 1, 132) == gemv_configs.default_config(24, 32, 1, 132)
    assert config_for(24, 32, 1, 132, measured_only=True) is None  # the servers' default: measured shapes only


def test_linear_keeps_f_linear_off_cuda_and_for_gradients():
    x, weight, b = _inputs(2, 24, 32, bias=True, dtype=torch.bfloat16)
    assert linear_config(x, weight, b) is None  # CPU tensors
    assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))
    x32 = _randn(2, 32, seed=3).requires_grad_()
    out = linear(x32, weight.float())
    assert out.grad_fn is not None
