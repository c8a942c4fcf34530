"""Fused projections (qkv_proj, gate_up_proj) give the unfused model's outputs with single weights;
the Triton layer ops and the Triton GEMV, run through the interpreter on whole models, give the torch
ops' outputs; CUDA tensors dispatch to the Triton kernels (the GEMV only when switched on)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from specsplit.kernels.gemv import gemv
from specsplit.models import layer_ops
from specsplit.models.layers import MLP, SelfAttention, fuse_projections
from specsplit.models.loader import load_config, load_mtp, load_target
from specsplit.models.target import TargetModel

# A ragged prefill over two requests, then decode / verify steps.
STEPS = [{"a": 6, "b": 3}, {"a": 1, "b": 3}, {"b": 1, "a": 2}]


def _run_steps(model, use_kernel: bool = False, seed: int = 0, steps: list = STEPS) -> list[torch.Tensor]:
    """Logits of every step; steps after the prefill take the Triton attention path if `use_kernel`."""
    g = torch.Generator().manual_seed(seed)
    cache = model.make_kv_cache(num_blocks=16, block_size=4)
    logits = []
    for i, step in enumerate(steps):
        ids = torch.randint(0, model.config.vocab_size, (sum(step.values()),), generator=g)
        positions = torch.cat([torch.arange(cache.num_tokens(r), cache.num_tokens(r) + n) for r, n in step.items()])
        attn = cache.prepare_step(list(step), list(step.values()), use_kernel=use_kernel and i > 0)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, positions, cache, attn)))
    return logits


def _unfused_model(checkpoint_dir, architecture: str) -> TargetModel:
    torch.manual_seed(0)  # nn.Linear's own init: random weights and biases
    model = TargetModel(load_config(checkpoint_dir(architecture))).eval()
    with torch.no_grad():
        for module in model.modules():  # norm weights away from 1, so a misplaced weight shows
            if hasattr(module, "eps"):
                module.weight.uniform_(0.8, 1.2)
    return model


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])  # qkv bias; per-head q/k norms
def test_fused_projections_equal_the_unfused_model(checkpoint_dir, architecture):
    unfused = _unfused_model(checkpoint_dir, architecture)
    fused = fuse_projections(copy.deepcopy(unfused))
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    ref_attn, ref_mlp = unfused.layers[0].self_attn, unfused.layers[0].mlp
    q, k, v = ref_attn.q_proj, ref_attn.k_proj, ref_attn.v_proj
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q.weight, k.weight, v.weight]))
    if q.bias is not None:
        assert torch.equal(attn.qkv_proj.bias, torch.cat([q.bias, k.bias, v.bias]))
    else:
        assert attn.qkv_proj.bias is None
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight]))
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert not any(hasattr(mlp, n) for n in ("gate_proj", "up_proj"))
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in unfused.parameters())
    for got, expected in zip(_run_steps(fused), _run_steps(unfused)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fusing_twice_changes_nothing(checkpoint_dir):
    model = fuse_projections(_unfused_model(checkpoint_dir, "llama"))
    weights = {name: p for name, p in model.named_parameters()}
    fuse_projections(model)
    assert {name: p for name, p in model.named_parameters()} == weights


def test_the_loader_returns_fused_target_and_mtp(checkpoint_dir):
    path = checkpoint_dir("mimo")
    modules = [*load_target(path).modules(), *load_mtp(path).modules()]
    assert all(m.qkv_proj is not None for m in modules if isinstance(m, SelfAttention))
    assert all(m.gate_up_proj is not None for m in modules if isinstance(m, MLP))


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_triton_layer_ops_through_the_whole_model_equal_the_torch_ops(checkpoint_dir, monkeypatch, architecture):
    """The CUDA route (kernels on strided views of the fused GEMM outputs, in-place rotary, fused
    add + norm), on CPU through the Triton interpreter; attention on both of its paths."""
    model = load_target(checkpoint_dir(architecture))
    expected = _run_steps(model, use_kernel=True)
    launched = []

    def use_triton(x: torch.Tensor) -> bool:
        launched.append(x.shape)
        return True

    monkeypatch.setattr(layer_ops, "use_triton", use_triton)
    got = _run_steps(model, use_kernel=True)
    # Per layer 2 norms, rotary, silu-mul (+ q and k norms on Qwen3); the final norm.
    per_layer = 4 + 2 * model.config.qk_norm
    assert len(launched) == len(STEPS) * (model.config.num_hidden_layers * per_layer + 1)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def _force_gemv(monkeypatch) -> list[tuple[int, int]]:
    """Every `layer_ops.linear` runs the Triton GEMV (the CUDA route, whatever the device and dtype);
    returns the list that collects each call's weight shape."""
    launched = []

    def gemv_linear(x, weight, bias, measured_only=False):
        launched.append(tuple(weight.shape))
        return gemv(x, weight, bias)

    monkeypatch.setattr(layer_ops, "use_gemv", lambda x: True)
    monkeypatch.setattr(layer_ops, "gemv_linear", gemv_linear)
    return launched


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])  # qkv bias; none
def test_triton_gemv_through_the_whole_model_equals_the_torch_linears(checkpoint_dir, monkeypatch, architecture):
    """`--gemv` on CPU through the Triton interpreter, fp32: both GEMV paths (1 token: FMA; more: dot)."""
    model = load_target(checkpoint_dir(architecture))
    steps = [*STEPS, {"a": 1}]
    expected = _run_steps(model, steps=steps)
    launched = _force_gemv(monkeypatch)
    got = _run_steps(model, steps=steps)
    # Per layer qkv, o, gate_up, down; the LM head.
    assert len(launched) == len(steps) * (model.config.num_hidden_layers * 4 + 1)
    assert launched[-1] == tuple(model.lm_head.weight.shape)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_triton_gemv_through_the_mtp_module_equals_the_torch_linears(checkpoint_dir, monkeypatch):
    mtp = load_mtp(checkpoint_dir("qwen2"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mtp.config.vocab_size, (5,), generator=g)
    hidden = torch.randn(5, mtp.config.hidden_size, generator=g)

    def logits():
        cache = mtp.make_kv_cache(num_blocks=4, block_size=4)
        with torch.inference_mode():
            return mtp.compute_logits(mtp(ids, hidden, torch.arange(5), cache, cache.prepare_step(["a"], [5])))

    expected = logits()
    launched = _force_gemv(monkeypatch)
    torch.testing.assert_close(logits(), expected, atol=1e-5, rtol=1e-5)
    assert len(launched) == 6  # eh_proj, the block's four linears, the head


def test_cuda_tensors_dispatch_to_triton_unless_interpreted(monkeypatch):
    on_cuda = SimpleNamespace(is_cuda=True)  # no GPU here: only the predicate is under test
    monkeypatch.setattr(layer_ops, "_INTERPRETED", False)
    assert layer_ops.use_triton(on_cuda)  # on by default
    assert layer_ops.use_gemv(on_cuda)  # on by default (for the measured shapes)
    monkeypatch.setattr(layer_ops, "_enabled", False)  # --no-layer-kernels
    monkeypatch.setattr(layer_ops, "_gemv_mode", "off")  # --no-gemv
    assert not layer_ops.use_triton(on_cuda)
    assert not layer_ops.use_gemv(on_cuda)
    monkeypatch.setattr(layer_ops, "_gemv_mode", "all")  # --gemv
    assert layer_ops.use_gemv(on_cuda)
    monkeypatch.setattr(layer_ops, "_enabled", True)
    assert not layer_ops.use_triton(torch.zeros(2)) and not layer_ops.use_gemv(torch.zeros(2))
    monkeypatch.setattr(layer_ops, "_INTERPRETED", True)
    assert not layer_ops.use_triton(on_cuda) and not layer_ops.use_gemv(on_cuda)


def test_linears_are_the_modules_own_when_the_gemv_is_off():
    layer = torch.nn.Linear(32, 24)
    x = torch.randn(3, 32)
    assert torch.equal(layer_ops.linear(x, layer), layer(x))


def test_inputs_that_need_gradients_keep_the_torch_ops(monkeypatch):
    """Training runs the model on CUDA with autograd; the kernels have no backward."""
    kernel_calls = []
    monkeypatch.setattr(layer_ops, "use_triton", lambda x: True)
    monkeypatch.setattr(layer_ops, "rms_norm_triton", lambda *args: kernel_calls.append("rms_norm"))
    monkeypatch.setattr(layer_ops, "silu_mul_triton", lambda *args: kernel_calls.append("silu_mul"))
    weight = torch.ones(8, requires_grad=True)
    assert layer_ops.rms_norm(torch.randn(3, 8), weight, 1e-6)[0].grad_fn is not None
    assert layer_ops.silu_mul(torch.randn(3, 8, requires_grad=True)).grad_fn is not None
    assert kernel_calls == []
    with torch.no_grad():
        layer_ops.rms_norm(torch.randn(3, 8), weight, 1e-6)
        layer_ops.silu_mul(torch.randn(3, 8, requires_grad=True))
    assert kernel_calls == ["rms_norm", "silu_mul"]


def test_the_servers_eager_switch_turns_every_kernel_off_and_only_then(monkeypatch):
    from specsplit.runtime.serve_options import apply_eager_option

    monkeypatch.setattr(layer_ops, "_enabled", layer_ops._enabled)  # restored after the test
    monkeypatch.setattr(layer_ops, "_gemv_mode", layer_ops._gemv_mode)
    assert apply_eager_option(True) == {"attention_kernel": False, "cuda_graphs": False}
    assert not layer_ops._enabled and layer_ops._gemv_mode == "off"
    assert apply_eager_option(False) == {"attention_kernel": None, "cuda_graphs": None}
    assert layer_ops._enabled and layer_ops._gemv_mode == "measured"


def test_each_moe_layers_experts_are_freed_as_it_stacks_them(tmp_path, monkeypatch):
    """Fusing holds no module past its parent's fusion: the fused per-expert weights of a MoE layer are gone as soon as
    the layer has stacked them (the loader's peak is one layer's experts twice, not the whole model's), the shared
    experts fused as the dense MLP is."""
    import weakref

    from specsplit.models.glm4_moe.model import Glm4MoeTarget
    from specsplit.models.moe import MoE
    from tests.fixtures.tiny_glm4_moe import write_tiny_glm4_moe_checkpoint

    model = Glm4MoeTarget(load_config(write_tiny_glm4_moe_checkpoint(tmp_path / "glm", seed=0)))
    stack, freed = MoE.fuse_projections, []

    def stack_and_check(self: MoE) -> None:
        fused_experts = [weakref.ref(expert.gate_up_proj.weight) for expert in self.experts.values()]
        stack(self)
        freed.append(all(ref() is None for ref in fused_experts))

    monkeypatch.setattr(MoE, "fuse_projections", stack_and_check)
    fuse_projections(model)
    assert len(freed) == sum(isinstance(layer.mlp, MoE) for layer in model.model.layers) >= 2 and all(freed)
    assert all(layer.mlp.shared_experts.gate_up_proj is not None for layer in model.model.layers[1:])
