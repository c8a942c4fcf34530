"""The decoder-layer kernels (fused residual-add + RMSNorm, q/k rotary, silu-and-mul) equal their
pure-torch references, which equal the model's torch ops; odd sizes, strided views, bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from specsplit.kernels.rotary import apply_rotary_qk_reference, apply_rotary_qk_triton
from specsplit.kernels.silu_mul import silu_mul_reference, silu_mul_triton
from specsplit.models.rotary import apply_rotary

FP32 = dict(atol=1e-5, rtol=1e-5)
# The Triton interpreter converts float32 to bfloat16 by truncation (the GPU rounds to nearest even, as
# torch does), so a bf16 result may be one bf16 ulp off here; float16 conversions round to nearest.
TOLERANCE = {torch.float32: FP32, torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = list(TOLERANCE)


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_equals_reference(dtype, with_residual):
    x = _randn(5, 3, 100, seed=0, dtype=dtype) * 3  # odd row count and size
    weight = (1 + 0.1 * _randn(100, seed=1)).to(dtype)
    residual = _randn(5, 3, 100, seed=2, dtype=dtype) if with_residual else None
    out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    if with_residual:
        torch.testing.assert_close(new_residual, expected_residual, **TOLERANCE[dtype])
        if dtype != torch.bfloat16:
            assert torch.equal(new_residual, expected_residual)  # one rounded add, both ways
    else:
        assert new_residual is None


def test_rms_norm_kernel_reads_strided_rows_and_promotes_like_torch():
    x = _randn(7, 2 * 48, seed=3, dtype=torch.float16)[:, 48:]  # rows with a stride of 96
    weight = 1 + 0.1 * _randn(48, seed=4)  # fp32 weight on an fp16 input gives fp32, as in torch
    out, _ = rms_norm_triton(x, weight, 1e-5)
    expected, _ = rms_norm_reference(x, weight, 1e-5)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float16])


def test_rms_norm_reference_is_the_transformers_formula():
    x, weight = _randn(3, 40, seed=5, dtype=torch.bfloat16), _randn(40, seed=6, dtype=torch.bfloat16)
    x32 = x.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(rms_norm_reference(x, weight, 1e-6)[0], expected)


def _qkv_views(num_tokens: int, heads: int, kv_heads: int, dim: int, dtype, seed: int):
    """q, k as views into one fused qkv projection output, as the model produces them."""
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * dim, seed=seed, dtype=dtype)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    return qkv, q, k


def _rope(positions: torch.Tensor, dim: int, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# T, heads, kv heads, head_dim, rotary_dim (< head_dim: partial rotary, GLM-4.5's half and an odd share)
ROTARY_SHAPES = [(5, 7, 1, 24, 24), (3, 28, 4, 128, 128), (1, 6, 2, 10, 10), (3, 12, 2, 128, 64), (2, 5, 1, 24, 10)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
def test_rotary_kernel_equals_reference_in_place(dtype, shape):
    num_tokens, heads, kv_heads, dim, rotary_dim = shape
    qkv, q, k = _qkv_views(num_tokens, heads, kv_heads, dim, dtype, seed=7)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    q_pass, k_pass = q[..., rotary_dim:].clone(), k[..., rotary_dim:].clone()
    cos, sin = _rope(torch.arange(num_tokens) * 37 + 3, rotary_dim, dtype)
    expected_q, expected_k = apply_rotary_qk_reference(q, k, cos, sin)
    out_q, out_k = apply_rotary_qk_triton(q, k, cos, sin)
    assert out_q is q and out_k is k  # rotated in place, inside the fused qkv buffer
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched
    assert torch.equal(q[..., rotary_dim:], q_pass) and torch.equal(k[..., rotary_dim:], k_pass)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 7, 1, 24, 24), (3, 28, 4, 128, 128), (4, 12, 2, 128, 64)])
def test_rotary_kernel_writes_the_rotated_k_and_v_into_their_cache_slots(dtype, shape):
    num_tokens, heads, kv_heads, dim, rotary_dim = shape
    qkv, q, k = _qkv_views(num_tokens, heads, kv_heads, dim, dtype, seed=9)
    v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
    cos, sin = _rope(torch.arange(num_tokens) * 11 + 1, rotary_dim, dtype)
    num_blocks, block_size = 3, 4
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), 7.0, dtype=dtype)
    v_cache = k_cache.clone()
    slots = torch.tensor([9, -1, 2, 5, 0][:num_tokens])  # -1: a padding token, never written
    expected_q, expected_k = apply_rotary_qk_reference(q, k, cos, sin)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k_cache.view(-1, kv_heads, dim)[slot] = expected_k[t]
            expected_v_cache.view(-1, kv_heads, dim)[slot] = v[t]
    apply_rotary_qk_triton(q, k, cos, sin, kv_write=(v, k_cache, v_cache, slots))
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, expected_k_cache, **TOLERANCE[dtype])
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[slots[slots >= 0]], k[slots >= 0])  # what k became
    assert torch.equal(v_cache, expected_v_cache)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_reference_is_the_model_rotary(rotary_dim):
    _, q, k = _qkv_views(4, 6, 2, 16, torch.bfloat16, seed=8)
    cos, sin = _rope(torch.tensor([0, 5, 9, 400]), rotary_dim, torch.bfloat16)
    ref_q, ref_k = apply_rotary_qk_reference(q, k, cos, sin)
    assert torch.equal(ref_q, apply_rotary(q, cos, sin)) and torch.equal(ref_k, apply_rotary(k, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37), (2, 1500)])  # odd widths, more than one block
def test_silu_mul_kernel_equals_reference(dtype, shape):
    num_tokens, inter = shape
    gate_up = _randn(num_tokens, 2 * inter, seed=9, dtype=dtype) * 4
    out = silu_mul_triton(gate_up)
    assert out.dtype == dtype and out.shape == (num_tokens, inter)
    torch.testing.assert_close(out, silu_mul_reference(gate_up), **TOLERANCE[dtype])


def test_silu_mul_reference_takes_gate_then_up():
    gate, up = _randn(2, 9, seed=10), _randn(2, 9, seed=11)
    assert torch.equal(silu_mul_reference(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


def test_kernels_accept_zero_tokens():
    assert rms_norm_triton(torch.zeros(0, 8), torch.ones(8), 1e-6)[0].shape == (0, 8)
    assert silu_mul_triton(torch.zeros(0, 8)).shape == (0, 4)
    q, k = torch.zeros(0, 2, 8), torch.zeros(0, 1, 8)
    assert apply_rotary_qk_triton(q, k, torch.zeros(0, 8), torch.zeros(0, 8))[0].shape == (0, 2, 8)
