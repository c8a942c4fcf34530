"""Block-scaled FP8 checkpoints (DeepSeek-V3's layout) load right, and every other quantization is refused.

A tiny Qwen3 checkpoint with MTP is quantized blockwise (`tests/fixtures/fp8.py`) with blocks of
[24, 32]: 24 does not divide the 64 query rows or the 128 gate rows, so fusing q/k/v and gate/up must
keep a scale per row, and K = 64 / 128 spans several scale groups.

Tolerance of the W8A8 path (activations quantized to e4m3 per token and group of 32, against the
dequantized weights in fp32, i.e. the same weights): e4m3 keeps 3 mantissa bits, so rounding an
activation costs up to 2^-4 of its value; the errors of a dot product are independent, so they grow as
√K like the output itself: each linear's output is off by about 2.5 % rms of its scale whatever K
(measured at K = 64..4096). The tiny model chains ~8 such linears per token (2 layers: qkv, o, gate_up,
down) through residual adds, norms and attention, and its logits are off by about 6 % of their standard
deviation σ on average (40 % at worst of 3840 logits): bounded here by 0.1 σ on average and 0.5 σ at
most, with at least 3 of 4 greedy picks the same. Without the activation quantization the W8A8 path
equals the dequantized model exactly (checked while writing this test), and a wrong scale moves
logits by several σ.
"""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch

from specsplit.models.fp8_linear import Fp8Linear
from specsplit.models.loader import load_config, load_mtp, load_quantization, load_target
from tests.fixtures.fp8 import write_fp8_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint
from tests.fixtures.tiny_glm4_moe import write_tiny_glm4_moe_checkpoint

BLOCK = (24, 32)


@pytest.fixture(scope="module")
def checkpoints(checkpoint_dir, tmp_path_factory):
    """(fp8, dequantized) checkpoint directories of one tiny Qwen3 with MTP."""
    root = tmp_path_factory.mktemp("fp8")
    return write_fp8_checkpoint(checkpoint_dir("qwen3"), root / "fp8", root / "dequantized", BLOCK)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    cache = model.make_kv_cache(num_blocks=16, block_size=4)
    attn = cache.prepare_step(["r"], [len(tokens)])
    with torch.no_grad():
        return model.compute_logits(model(tokens, torch.arange(len(tokens)), cache, attn))


def _assert_within_activation_quantization(got: torch.Tensor, want: torch.Tensor) -> None:
    sigma, error = want.std(), (got - want).abs()
    assert 0 < error.max() < 0.5 * sigma and error.mean() < 0.1 * sigma  # > 0: activations were quantized


def _tokens(vocab_size: int, n: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(0))


def test_the_block_size_is_read(checkpoints):
    quantization = load_quantization(checkpoints[0])
    assert (quantization.block_n, quantization.block_k) == BLOCK
    assert load_quantization(checkpoints[1]) is None


def test_cpu_load_equals_the_dequantized_checkpoint_exactly(checkpoints):
    fp8, dequantized = (load_target(path) for path in checkpoints)
    assert not any(isinstance(m, Fp8Linear) for m in fp8.modules())
    want = dict(dequantized.named_parameters())
    got = dict(fp8.named_parameters())
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    mtp, mtp_dequantized = (load_mtp(path) for path in checkpoints)
    for name, tensor in mtp.named_parameters():
        assert torch.equal(tensor, dict(mtp_dequantized.named_parameters())[name]), name


def test_scales_are_not_ignored(checkpoints):
    """The issue's bug: loading e4m3 values as weights without their scales."""
    fp8 = load_target(checkpoints[0])
    raw = safetensors.torch.load_file(str(checkpoints[0] / "model.safetensors"))
    unscaled = raw["model.layers.0.mlp.down_proj.weight"].float()
    loaded = fp8.model.layers[0].mlp.down_proj.weight
    assert (loaded - unscaled).abs().max() > 10 * loaded.abs().max()


def test_w8a8_logits_match_the_dequantized_within_activation_quantization(checkpoints):
    fp8 = load_target(checkpoints[0], keep_fp8=True)  # the CPU runs the W8A8 torch reference
    layer = fp8.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and layer.self_attn.qkv_proj.scale_block_n == 1
    assert isinstance(layer.mlp.down_proj, Fp8Linear) and layer.mlp.down_proj.scale_block_n == BLOCK[0]
    dequantized = load_target(checkpoints[1])
    tokens = _tokens(fp8.config.vocab_size)
    got, want = _logits(fp8, tokens), _logits(dequantized, tokens)
    _assert_within_activation_quantization(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_w8a8_mtp_logits_match_the_dequantized(checkpoints):
    fp8, dequantized = load_mtp(checkpoints[0], keep_fp8=True), load_mtp(checkpoints[1])
    assert isinstance(fp8.block.mlp.gate_up_proj, Fp8Linear) and not isinstance(fp8.eh_proj, Fp8Linear)
    tokens = _tokens(fp8.config.vocab_size, 6)
    hidden = torch.randn(6, fp8.config.hidden_size, generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (fp8, dequantized):
        cache = model.make_kv_cache(num_blocks=8, block_size=4)
        attn = cache.prepare_step(["r"], [6])
        with torch.no_grad():
            outs.append(model.compute_logits(model(tokens, hidden, torch.arange(6), cache, attn)))
    _assert_within_activation_quantization(*outs)


def test_fused_fp8_projections_compute_as_the_parts():
    torch.manual_seed(0)
    for block_n, rows in ((16, (32, 16, 16)), (24, (64, 32, 32))):  # aligned: block scales; not: row scales
        parts = [Fp8Linear.quantize(torch.nn.Linear(64, r), block_n, 32) for r in rows]
        fused = Fp8Linear.concat(*parts)
        assert fused.scale_block_n == (block_n if all(r % block_n == 0 for r in rows[:-1]) else 1)
        x = torch.randn(3, 64)
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)
        torch.testing.assert_close(
            fused.dequantized(torch.float32).weight, torch.cat([p.dequantized(torch.float32).weight for p in parts])
        )


def test_modules_not_converted_load_unquantized(checkpoint_dir, tmp_path):
    fp8_dir, dequantized_dir = write_fp8_checkpoint(
        checkpoint_dir("qwen3"), tmp_path / "fp8", tmp_path / "deq", BLOCK, not_converted=("self_attn",)
    )
    model = load_target(fp8_dir, keep_fp8=True)
    layer = model.model.layers[1]
    assert not isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.gate_up_proj, Fp8Linear)
    want = load_target(dequantized_dir).model.layers[1].self_attn.o_proj.weight
    assert torch.equal(layer.self_attn.o_proj.weight, want)


def test_dummy_weights_of_an_fp8_config_are_block_quantized(checkpoints):
    model = load_target(checkpoints[0], load_format="dummy", keep_fp8=True)
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight_scale_inv.shape == (64 // BLOCK[0] + 1, 128 // BLOCK[1])
    assert model.lm_head.weight.dtype == torch.float32
    cpu = load_target(checkpoints[0], load_format="dummy")  # the CPU path: the same weights dequantized
    assert torch.equal(cpu.model.layers[0].mlp.down_proj.weight, layer.mlp.down_proj.dequantized(torch.float32).weight)


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


REFUSED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}},
    "per-tensor fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8 static activations": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
    "fp8 e5m2": {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"},
    "fp8 odd group": {"quant_method": "fp8", "weight_block_size": [128, 100]},
    "fp8 group of 16": {"quant_method": "fp8", "weight_block_size": [16, 16]},
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_other_quantizations_are_refused_with_one_line(checkpoint_dir, tmp_path, kind):
    path = _with_config(checkpoint_dir("qwen3"), tmp_path / "q", quantization_config=REFUSED[kind])
    for load in (load_config, load_target, load_mtp):
        with pytest.raises(ValueError) as err:
            load(path)
        message = str(err.value)
        assert "\n" not in message
        assert "is not supported; supported: unquantized weights, or block-scaled FP8" in message


def test_fp8_tensors_without_an_fp8_config_are_refused(checkpoints, tmp_path):
    """A checkpoint whose config.json lost its quantization_config never loads e4m3 values as weights."""
    path = _with_config(checkpoints[0], tmp_path / "noconfig")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"is F8_E4M3 but not a block-scaled FP8 linear weight"):
        load_target(path)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_moe_families_load_fp8_target_and_mtp(tmp_path, family):
    """DeepSeek-V3 (MLA, MoE) and GLM-4.5 (GQA with bias, MoE): CPU load = the dequantized checkpoint exactly,
    target and MTP layer; the W8A8 path keeps experts in FP8 (MLA's kv_b_proj dequantized, its weight is read
    directly) and its logits stay within the activation tolerance on average (quantized activations may flip a
    token's experts, a discrete change, so no bound on the largest error)."""
    writer = write_tiny_deepseek_checkpoint if family == "deepseek_v3" else write_tiny_glm4_moe_checkpoint
    fp8_dir, dequantized_dir = write_fp8_checkpoint(
        writer(tmp_path / "src", seed=1), tmp_path / "f", tmp_path / "d", (16, 32)
    )
    for load in (load_target, load_mtp):
        want = dict(load(dequantized_dir).named_parameters())
        got = dict(load(fp8_dir).named_parameters())
        assert got.keys() == want.keys() and all(torch.equal(t, want[n]) for n, t in got.items())
    model = load_target(fp8_dir, keep_fp8=True)
    layer = model.model.layers[1]
    experts = layer.mlp.experts  # stacked at load, e4m3 with their block scales
    assert (
        experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn and experts.fp8_blocks is not None
    )
    assert isinstance(layer.mlp.shared_experts.gate_up_proj, Fp8Linear)  # fused as the dense MLP's
    if family == "deepseek_v3":
        assert not isinstance(layer.self_attn.kv_b_proj, Fp8Linear) and isinstance(layer.self_attn.q_b_proj, Fp8Linear)
    tokens = _tokens(model.config.vocab_size)
    got, want = _logits(model, tokens), _logits(load_target(dequantized_dir), tokens)
    assert 0 < (got - want).abs().mean() < 0.1 * want.std()
