"""On a CUDA GPU (FP8 tensor cores: compute capability >= 8.9), the block-scaled W8A8 Triton kernel equals its torch
reference, and an FP8 checkpoint loaded on the GPU runs its linears through it.

- Kernel: the linears of GLM-4.5-Air and DeepSeek-V3 (blocks [128, 128]) at M = 1..256, default and split-K
  configurations, x or W as the MMA's row operand (`swap_ab`), bf16 and fp32 activations: within summation order
  and the tensor cores' accumulation (1e-3 of max |y|) plus one rounding of the output; the same bits on a second
  call; the same under a CUDA graph replay.
- Model: a tiny FP8 Qwen3 (blocks [24, 32]: per-row scales after fusion) and a tiny FP8 DeepSeek-V3 loaded on
  cuda in fp32 have `Fp8Linear`s (MLA's kv_b_proj dequantized) whose logits equal the CPU W8A8 reference model's
  (`keep_fp8=True`: the same activation quantization, in torch) within 2 % of the logits' standard deviation
  (all tokens but one, which an MoE routing flip may move), and the dequantized model's within the
  activation-quantization tolerance of tests/models/test_fp8_checkpoint.py (for DeepSeek-V3 on average only:
  quantized activations flip some tokens' expert choice, a discrete change).
- Dummy weights from an FP8 config.json at GLM-4.5-Air's attention/MLP widths load FP8 on cuda and decode.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_fp8_cuda.py
"""

from __future__ import annotations

import json

import pytest
import torch

from specsplit.kernels.fp8_gemm import quantize_activations_triton, w8a8_block_linear
from specsplit.kernels.fp8_gemm_configs import Fp8GemmConfig
from specsplit.kernels.fp8_reference import (
    quantize_activations,
    quantize_weight_blockwise,
    w8a8_block_linear_reference,
)
from specsplit.models.fp8_linear import Fp8Linear
from specsplit.models.loader import load_mtp, load_target
from tests.fixtures.fp8 import write_fp8_checkpoint
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint

pytestmark = pytest.mark.gpu

SHAPES = {  # N, K
    "glm45air.qkv": (14336, 4096),
    "glm45air.expert.down": (4096, 1408),
    "dsv3.kv_a_proj": (576, 7168),
    "dsv3.q_b_proj": (24576, 1536),
    "dsv3.expert.gate_up": (4096, 7168),
}
M_VALUES = [1, 3, 16, 33, 128, 256]


@pytest.fixture(scope="module", autouse=True)
def _fp8_tensor_cores():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.fail("FP8 tensor cores need compute capability >= 8.9 (Ada, Hopper)")


def _weights(n: int, k: int):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    return quantize_weight_blockwise(w, 128, 128)


def _assert_equals_reference(y: torch.Tensor, want: torch.Tensor) -> None:
    # Sums in another order, each group's 128 products summed by the tensor cores (whose FP8 accumulation keeps
    # about 14 bits on Hopper, the DeepSeek-V3 report says: hence one group per tl.dot, added in fp32), plus
    # one rounding of y: within 1e-3 of max |y| and an ulp of y.
    scale = want.float().abs().max()
    tol = 1e-3 * scale + want.float().abs() * torch.finfo(y.dtype).eps
    assert ((y.float() - want.float()).abs() <= tol).all(), (y.float() - want.float()).abs().max() / scale


@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_equals_reference_on_model_shapes(name):
    n, k = SHAPES[name]
    w, s = _weights(n, k)
    for m in M_VALUES:
        x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m))
        for dtype in (torch.bfloat16, torch.float32):
            xd = x.to(dtype)
            y = w8a8_block_linear(xd, w, s, None, 128, 128)
            _assert_equals_reference(y, w8a8_block_linear_reference(xd, w, s, None, 128, 128))
            assert torch.equal(y, w8a8_block_linear(xd, w, s, None, 128, 128))


@pytest.mark.parametrize(
    "config",
    [
        Fp8GemmConfig(16, 64, 1),
        Fp8GemmConfig(16, 32, 7, 4, 4),
        Fp8GemmConfig(64, 128, 3),
        Fp8GemmConfig(128, 64, 1),
        Fp8GemmConfig(32, 64, 1, prequantize=True),
        Fp8GemmConfig(16, 64, 5, prequantize=True),
        Fp8GemmConfig(16, 64, 1, swap_ab=True),
        Fp8GemmConfig(16, 128, 4, 4, 4, swap_ab=True),
        Fp8GemmConfig(16, 64, 3, 8, 5, swap_ab=True),
        Fp8GemmConfig(32, 64, 1, prequantize=True, swap_ab=True),
        Fp8GemmConfig(64, 64, 3, swap_ab=True),
    ],
)
def test_kernel_configurations_and_bias(config):
    n, k = 1000, 1408  # N not a multiple of any tile, K of 11 groups
    w, s = _weights(n, k)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for m in (1, 17, 200):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = w8a8_block_linear(x, w, s, bias, 128, 128, config)
        _assert_equals_reference(y, w8a8_block_linear_reference(x, w, s, bias, 128, 128))


def test_activation_quantization_equals_the_reference_bit_for_bit():
    x = torch.randn(256, 7168, device="cuda") * torch.logspace(-3, 3, 7168, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        q, scale = quantize_activations_triton(x.to(dtype), 128)
        want_q, want_scale = quantize_activations(x.to(dtype), 128)
        assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_kernel_replays_in_a_cuda_graph():
    w, s = _weights(4096, 7168)
    x = torch.randn(4, 7168, device="cuda").to(torch.bfloat16)
    eager = w8a8_block_linear(x, w, s, None, 128, 128)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w8a8_block_linear(x, w, s, None, 128, 128)  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = w8a8_block_linear(x, w, s, None, 128, 128)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    cache = model.make_kv_cache(num_blocks=16, block_size=4)
    attn = cache.prepare_step(["r"], [len(tokens)])
    with torch.no_grad():
        return model.compute_logits(model(tokens, torch.arange(len(tokens), device=tokens.device), cache, attn))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-gpu")
    qwen3 = write_tiny_checkpoint(root / "qwen3-src", architecture="qwen3")
    deepseek = write_tiny_deepseek_checkpoint(root / "dsv3-src", seed=1)
    return {
        "qwen3": write_fp8_checkpoint(qwen3, root / "qwen3-fp8", root / "qwen3-deq", (24, 32)),
        "deepseek_v3": write_fp8_checkpoint(deepseek, root / "dsv3-fp8", root / "dsv3-deq", (16, 32)),
    }


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_fp8_model_on_cuda_runs_the_kernel_and_matches_the_reference(checkpoints, kind):
    fp8, dequantized = checkpoints[kind]
    model = load_target(fp8, device="cuda")
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in linears)
    if kind == "deepseek_v3":
        assert not isinstance(model.model.layers[0].self_attn.kv_b_proj, Fp8Linear)  # read directly: dequantized
        experts = model.model.layers[1].mlp.experts  # stacked at load: e4m3 with their block scales, on cuda
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale_inv.is_cuda
    tokens = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    got = _logits(model, tokens.cuda()).cpu()
    reference = _logits(load_target(fp8, keep_fp8=True), tokens)  # the W8A8 torch reference, on the CPU
    want = _logits(load_target(dequantized), tokens)
    sigma = want.std()
    # the same math but for summation order: a token whose MoE routing a rounding flips may differ, no other
    per_token = (got - reference).abs().amax(dim=-1)
    assert (per_token < 0.02 * sigma).sum() >= len(tokens) - 1 and per_token.mean() < 0.05 * sigma
    error = (got - want).abs()  # activation quantization (which flips some MoE routes of DeepSeek-V3 outright)
    assert error.mean() < 0.1 * sigma and (kind != "qwen3" or error.max() < 0.5 * sigma)
    mtp = load_mtp(fp8, device="cuda")
    assert any(isinstance(m, Fp8Linear) for m in mtp.modules())


def test_dummy_fp8_weights_at_glm_widths_decode_on_cuda(tmp_path):
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 1408,
        "num_hidden_layers": 2,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_target(tmp_path, dtype=torch.bfloat16, device="cuda", load_format="dummy")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.shape == (14336, 4096) and qkv.scale_block_n == 128
    logits = _logits(model, torch.arange(1, 9, device="cuda"))
    assert logits.shape == (8, 4096) and torch.isfinite(logits).all()
