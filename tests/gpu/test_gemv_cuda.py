"""On a CUDA GPU, the Qwen2-7B-shaped target (random bf16 weights) with the Triton GEMV for its measured linears
(the default) is as close to the same weights in fp32 as it is with cuBLAS everywhere (`--no-gemv`): the GEMV adds
no error beyond bf16 rounding.

For steps of 1, 4 and 32 new tokens after a 64-token prefill, each bf16 run's max |logits error| against an fp32
copy of the model (cuBLAS). Random weights give nearly flat logits over 152k tokens, so bf16 rounding alone moves
some argmaxes (printed, not checked); the check is relative: the GEMV's error must stay within 1.5x cuBLAS's
(+ 0.01) on every step.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.lib.shapes import SHAPES
from specsplit.models.attention import use_kernel_for
from specsplit.models.config import ModelConfig
from specsplit.models.layer_ops import enable_gemv
from specsplit.models.layers import fuse_projections
from specsplit.models.target import TargetModel

pytestmark = pytest.mark.gpu

CONTEXT = 64


def random_qwen2_7b(dtype: torch.dtype, device: torch.device) -> TargetModel:
    """The Qwen2-7B shape with N(0, 0.02) weights (norms 1), fused as the loader returns models: unlike the
    dummy weights (`specsplit.models.dummy_weights`), every linear moves the logits, so each one's error shows."""
    config = ModelConfig(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        rms_norm_eps=1e-6,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=True,
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=False,
        num_nextn_predict_layers=0,
        **SHAPES["qwen2-7b"],
    )
    with torch.device("meta"):
        model = fuse_projections(TargetModel(config).to(dtype))
    model = model.to_empty(device=device).requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    """(the bf16 model, an fp32 copy of exactly the same weights), each with its KV cache."""
    model = random_qwen2_7b(torch.bfloat16, torch.device("cuda"))
    reference = copy.deepcopy(model).float()
    yield (model, model.make_kv_cache(64, 16)), (reference, reference.make_kv_cache(64, 16))
    del model, reference
    torch.cuda.empty_cache()


def step_logits(model, cache, prompt: torch.Tensor, ids: torch.Tensor, gemv: bool | None) -> torch.Tensor:
    """Logits of ``ids`` after ``prompt`` (prefilled fresh with cuBLAS), with the GEMV mode ``gemv`` for the step."""
    device = prompt.device
    try:
        enable_gemv(False)
        attn = cache.prepare_step(["r"], [CONTEXT])
        model(prompt, torch.arange(CONTEXT, device=device), cache, attn)
        enable_gemv(gemv)
        n = ids.numel()
        attn = cache.prepare_step(["r"], [n], use_kernel=use_kernel_for(True, [n], [CONTEXT + n], n))
        logits = model.compute_logits(model(ids, torch.arange(CONTEXT, CONTEXT + n, device=device), cache, attn))
    finally:
        cache.free("r")
        enable_gemv(None)  # the default: the GEMV for the measured shapes
    return logits.float()


@pytest.mark.parametrize("new_tokens", [1, 4, 32])
def test_gemv_adds_no_error_beyond_cublas_in_bf16(models, new_tokens):
    (model, cache), (reference, reference_cache) = models
    gen = torch.Generator(device="cuda").manual_seed(new_tokens)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (CONTEXT,), device="cuda", generator=gen)
    ids = torch.randint(0, vocab, (new_tokens,), device="cuda", generator=gen)
    with torch.inference_mode():
        exact = step_logits(reference, reference_cache, prompt, ids, False)
        errors, agree = {}, {}
        for name, mode in (("cublas", False), ("gemv", None)):
            got = step_logits(model, cache, prompt, ids, mode)
            errors[name] = (got - exact).abs().max().item()
            agree[name] = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    print(
        f"{new_tokens} new tokens: max |logits error| vs fp32: cuBLAS {errors['cublas']:.3e}, GEMV "
        f"{errors['gemv']:.3e}; argmax = fp32 argmax: cuBLAS {agree['cublas']:.0%}, GEMV {agree['gemv']:.0%} "
        f"(logits scale {exact.abs().max().item():.2f})"
    )
    assert errors["gemv"] <= 1.5 * errors["cublas"] + 0.01, errors
