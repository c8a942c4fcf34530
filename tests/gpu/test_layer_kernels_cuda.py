"""On a CUDA GPU, the Triton layer kernels (`--layer-kernels`): each kernel against its torch op on random inputs
(fp32 and bf16, within a tolerance relative to the reference's largest magnitude), then whole models with the
kernels on against the same models with them off (the Triton paged-attention path, eager and CUDA-graph replay).

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from specsplit.kernels.rotary import apply_rotary_qk_triton
from specsplit.kernels.silu_mul import silu_mul_reference, silu_mul_triton
from specsplit.models.layer_ops import enable_layer_kernels
from specsplit.models.loader import load_target
from specsplit.models.rotary import apply_rotary
from specsplit.runtime.cuda_graphs import CudaGraphRunner
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_glm4_moe import write_tiny_glm4_moe_checkpoint
from tests.gpu.model_steps import decode_steps

pytestmark = pytest.mark.gpu

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative to the reference's largest magnitude
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SIZES = pytest.mark.parametrize(("tokens", "size"), [(1, 320), (7, 1000), (64, 3584), (256, 4096)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(0)


@pytest.fixture
def layer_kernels_restored():
    """Tests that switch the layer kernels leave them at the default (on) afterwards."""
    yield
    enable_layer_kernels(True)


@DTYPES
@SIZES
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_kernel_matches_the_torch_op(dtype, tokens, size, residual, gen):
    x, r, w = (
        _randn(gen, tokens, size, dtype=dtype),
        _randn(gen, tokens, size, dtype=dtype),
        _randn(gen, size, dtype=dtype),
    )
    res = r if residual else None
    got, got_res = rms_norm_triton(x, w, 1e-6, res)
    ref, ref_res = rms_norm_reference(x, w, 1e-6, res)
    assert _rel(got, ref) <= TOL[dtype]
    if residual:
        assert _rel(got_res, ref_res) <= TOL[dtype]


@DTYPES
@SIZES
def test_silu_mul_kernel_matches_the_torch_op(dtype, tokens, size, gen):
    gate_up = _randn(gen, tokens, 2 * size, dtype=dtype)
    assert _rel(silu_mul_triton(gate_up), silu_mul_reference(gate_up)) <= TOL[dtype]


@DTYPES
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim", "rotary_dim"),
    [(1, 28, 4, 128, 128), (33, 8, 2, 64, 64), (256, 32, 8, 128, 128), (1, 96, 8, 128, 64), (37, 96, 8, 128, 64)],
)  # the last two: GLM-4.5-Air's heads, RoPE on half of each
def test_rotary_kernel_matches_the_torch_op_on_strided_views(dtype, tokens, heads, kv_heads, head_dim, rotary_dim, gen):
    qkv = _randn(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views, as in the model
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angle = torch.rand(tokens, rotary_dim // 2, device="cuda", generator=gen) * 6.28
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    ref_q, ref_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    got_q, got_k = apply_rotary_qk_triton(q, k, cos, sin)
    assert _rel(got_q, ref_q) <= TOL[dtype]
    assert _rel(got_k, ref_k) <= TOL[dtype]


@pytest.mark.parametrize(
    ("model", "tol"),
    [("tiny qwen3 fp32", 1e-3), ("tiny qwen2 fp32", 1e-3), ("tiny glm4_moe fp32", 1e-3), ("demo bf16", 0.25)],
)
def test_whole_model_logits_with_layer_kernels_match_the_torch_ops(model, tol, tmp_path, layer_kernels_restored):
    dev = torch.device("cuda")
    if model == "demo bf16":
        target = load_target(DEMO, dtype=torch.bfloat16, device=dev)
    elif model == "tiny glm4_moe fp32":  # partial rotary, q/k norm, the fused MoE: graphs too
        checkpoint = write_tiny_glm4_moe_checkpoint(tmp_path / "glm", use_qk_norm=True, max_position_embeddings=256)
        target = load_target(checkpoint, device=dev)
    else:
        arch = model.split()[1]
        checkpoint = write_tiny_checkpoint(tmp_path / arch, architecture=arch, max_position_embeddings=256)
        target = load_target(checkpoint, device=dev)
    logits = {}
    paths = ("kernel", "graphs") if target.supports_cuda_graphs else ("kernel",)
    for on in (False, True):
        enable_layer_kernels(on)
        for path in paths:
            cache = target.make_kv_cache(64, 16)
            runner = CudaGraphRunner(target, cache, max_model_len=256, max_num_tokens=8) if path == "graphs" else None
            logits[on, path] = decode_steps(target, cache, path, runner)
    for path in paths:
        a, b = logits[True, path], logits[False, path]
        err = max((x - y).abs().max().item() for x, y in zip(a, b))
        same = all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b))
        print(f"{model} {path}: layer kernels vs torch ops: max |logits diff| {err:.2e}, argmax equal: {same}")
        assert err <= tol, f"{model} {path}: layer kernels vs torch ops: max |logits diff| {err:.2e} > {tol}"
