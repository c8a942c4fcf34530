"""GLM-4.5 (`Glm4MoeForCausalLM`): our target gives transformers' logits on tiny random checkpoints, through
the paged KV cache in ragged chunks with rollbacks too; the MTP layer gives what transformers' own MTP
layer (`transformers.modeling_layers.MtpLayer` around a Glm4MoeDecoderLayer) gives on the same tensors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import safetensors.torch
import torch
import transformers
from transformers.modeling_layers import MtpModel

from specsplit.models.glm4_moe import Glm4MoeConfig, Glm4MoeTarget
from specsplit.models.layers import MLP
from specsplit.models.loader import load_config, load_mtp, load_target
from specsplit.models.moe import MoE
from specsplit.models.mtp_layout import DEEPSEEK_LAYOUT
from tests.fixtures.tiny_glm4_moe import write_tiny_glm4_moe_checkpoint

ATOL = 1e-4

VARIANTS = {
    # GLM-4.5-Air's choices: no q/k norm, one expert group, routed_scaling_factor 1, MTP copies of embed/head.
    "air": {},
    # GLM-4.5 / 4.6's: q/k norm, routed_scaling_factor 2.5; and grouped top-k (4 groups, 2 kept), odd
    # rotary share (head_dim 20 × 0.6 = 12), an MTP layer without its own embedding and head.
    "qk-norm-groups": {
        "use_qk_norm": True,
        "routed_scaling_factor": 2.5,
        "n_routed_experts": 12,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 3,
        "head_dim": 20,
        "partial_rotary_factor": 0.6,
        "mtp_stores_shared": False,
    },
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def make(variant: str = "air"):
        if variant not in cache:
            cache[variant] = write_tiny_glm4_moe_checkpoint(tmp_path_factory.mktemp(variant), **VARIANTS[variant])
        return cache[variant]

    return make


@pytest.fixture(scope="module")
def models(checkpoint):
    """models(variant) → (our target, transformers' Glm4MoeForCausalLM), loaded once per module."""
    cache = {}

    def make(variant: str = "air"):
        if variant not in cache:
            path = checkpoint(variant)
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            assert type(hf).__name__ == "Glm4MoeForCausalLM"
            cache[variant] = load_target(path), hf
        return cache[variant]

    return make


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ragged_prefill_logits_match_transformers(models, variant):
    model, hf = models(variant)
    prompts = _prompts(model.config.vocab_size, [7, 1, 40, 3])
    cache = model.make_kv_cache(num_blocks=32, block_size=4)
    attn = cache.prepare_step([f"r{i}" for i in range(len(prompts))], [len(p) for p in prompts])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        ours = model.compute_logits(model(torch.cat(prompts), positions, cache, attn))
        expected = torch.cat([hf(p[None]).logits[0].float() for p in prompts])
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_decode_and_rollbacks_match_transformers(models, variant):
    """Prefill chunks, decode and verify-like steps, rollbacks across block boundaries: every step's
    logits are transformers' over the request's whole sequence so far."""
    model, hf = models(variant)
    cache = model.make_kv_cache(num_blocks=48, block_size=4)
    g = torch.Generator().manual_seed(1)
    sequences: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def step(new_tokens: dict[str, int], rollback: dict[str, int] | None = None) -> None:
        for req_id, keep in (rollback or {}).items():
            cache.truncate(req_id, keep)
            del sequences[req_id][keep:]
        req_ids = list(new_tokens)
        starts = [cache.num_tokens(r) for r in req_ids]
        for r in req_ids:
            sequences[r] += torch.randint(0, model.config.vocab_size, (new_tokens[r],), generator=g).tolist()
        attn = cache.prepare_step(req_ids, [new_tokens[r] for r in req_ids])
        ids = torch.tensor([t for r, s in zip(req_ids, starts) for t in sequences[r][s:]])
        positions = torch.cat([torch.arange(s, len(sequences[r])) for r, s in zip(req_ids, starts)])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, cache, attn))
        row = 0
        for r, s in zip(req_ids, starts):
            n = len(sequences[r]) - s
            with torch.no_grad():
                expected = hf(torch.tensor([sequences[r]])).logits[0, s:].float()
            torch.testing.assert_close(logits[row : row + n], expected, atol=ATOL, rtol=0)
            row += n

    step({"a": 17, "b": 3})  # prefill chunks
    step({"b": 12, "a": 4, "c": 5})  # a chunk, a verify-like step (last token + 3 drafts), a new prompt
    step({"a": 1, "b": 1, "c": 1})  # decode
    step({"a": 3, "c": 2}, rollback={"a": 19})  # 2 drafts of a rejected: roll back, re-verify
    step({"b": 4}, rollback={"b": 14})  # rollback across a block boundary


def _stacked_expert_name(name: str) -> str:
    """Our per-expert names (the checkpoint's) → transformers' stacked expert tensors."""
    name = re.sub(r"experts\.\d+\.(gate|up)_proj\.weight$", "experts.gate_up_proj", name)
    return re.sub(r"experts\.\d+\.down_proj\.weight$", "experts.down_proj", name)


def test_parameter_names_equal_transformers_up_to_stacked_experts(checkpoint, models):
    _, hf = models("air")
    with torch.device("meta"):
        built = Glm4MoeTarget(load_config(checkpoint("air")))
    ours = {_stacked_expert_name(name) for name, _ in built.named_parameters()}
    theirs = {name for name, _ in hf.named_parameters()}
    theirs |= {name for name, _ in hf.named_buffers() if name.endswith("e_score_correction_bias")}
    assert ours == theirs


def test_config_reads_partial_rotary_biases_and_moe_fields(checkpoint, models):
    config, model = load_config(checkpoint("air")), models("air")[0]
    assert isinstance(config, Glm4MoeConfig) and config.has_mtp
    assert config.head_dim == 24 and config.rotary_dim == 12  # head_dim × partial_rotary_factor 0.5
    assert config.attention_bias and not config.o_proj_bias and not config.qk_norm
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]  # layer 3: the MTP layer
    assert isinstance(model.layers[0].mlp, MLP) and isinstance(model.layers[1].mlp, MoE)
    assert model.layers[1].self_attn.qkv_proj.bias is not None and model.layers[1].self_attn.o_proj.bias is None
    assert model.rotary(torch.arange(3), torch.float32)[0].shape == (3, 12)
    grouped = load_config(checkpoint("qk-norm-groups"))
    assert grouped.qk_norm and grouped.rotary_dim == 12 and (grouped.n_group, grouped.topk_group) == (4, 2)


def test_missing_architectures_reads_glm_through_model_type(checkpoint, tmp_path):
    path = tmp_path / "unlisted"
    shutil.copytree(checkpoint(), path)
    raw = json.loads((path / "config.json").read_text())
    del raw["architectures"]
    (path / "config.json").write_text(json.dumps(raw))
    assert load_config(path) == load_config(checkpoint())


@pytest.mark.parametrize(
    "change,message",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "per-tensor FP8"),
        ({"n_group": 3}, "groups of >= 2 experts"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ],
)
def test_unimplemented_glm_variants_are_rejected(checkpoint, tmp_path, change, message):
    path = tmp_path / "variant"
    shutil.copytree(checkpoint(), path)
    (path / "config.json").write_text(json.dumps(json.loads((path / "config.json").read_text()) | change))
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_bfloat16_load_keeps_the_router_in_float32(checkpoint):
    model = load_target(checkpoint(), dtype=torch.bfloat16)
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    experts = model.layers[1].mlp.experts  # stacked at load
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.bfloat16
    cache = model.make_kv_cache(4, 4)
    assert cache.k.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model.compute_logits(model(torch.arange(5), torch.arange(5), cache, cache.prepare_step(["a"], [5])))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# --- the MTP layer ---


class TransformersMTP:
    """transformers' generic MTP layer (enorm, hnorm, eh_proj, a Glm4MoeDecoderLayer with the MoE, post_norm)
    filled from the checkpoint's `model.layers.{N}.*` tensors, sharing the embedding and LM head of
    transformers' target: logits(h, x, positions) over one whole pair sequence, no cache."""

    def __init__(self, path, hf) -> None:
        raw = json.loads((path / "config.json").read_text())
        tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
        prefix = f"model.layers.{raw['num_hidden_layers']}."
        self.hf, self.mtp = hf, MtpModel(hf, num_mtp_layers=1).float().eval()
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "post_norm"}
        state, num_experts = {}, raw["n_routed_experts"]
        for name, tensor in tensors.items():
            if not name.startswith(prefix) or name.startswith((prefix + "embed_tokens", prefix + "shared_head.head")):
                continue
            local = name.removeprefix(prefix)
            module = local.rpartition(".")[0]
            if module in names:
                state[f"layers.0.{names[module]}.weight"] = tensor
            elif not re.match(r"mlp\.experts\.\d+\.", local):
                state[f"layers.0.mtp_block.{local}"] = tensor
        expert = prefix + "mlp.experts.{}.{}_proj.weight"
        state["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[expert.format(e, "gate")], tensors[expert.format(e, "up")]])
                for e in range(num_experts)
            ]
        )
        state["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack(
            [tensors[expert.format(e, "down")] for e in range(num_experts)]
        )
        missing, unexpected = self.mtp.load_state_dict(state, strict=False)
        assert not unexpected and all(k.startswith(("embed_tokens", "shared_head")) for k in missing), missing
        assert isinstance(self.mtp.layers[0].mtp_block.mlp, type(hf.model.layers[-1].mlp))  # the MoE

    @torch.no_grad()
    def logits(self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.mtp.forward_layer(0, h[None], positions[None], None, input_ids=x[None])
        return self.hf.lm_head(out)[0].float()


@pytest.fixture(scope="module")
def mtp_setup(checkpoint, models):
    """variant → (our MTP module, transformers' MTP reference, our target)."""
    cache = {}

    def make(variant: str):
        if variant not in cache:
            target, hf = models(variant)
            cache[variant] = load_mtp(checkpoint(variant)), TransformersMTP(checkpoint(variant), hf), target
        return cache[variant]

    return make


def _target_hidden(target, tokens: torch.Tensor) -> torch.Tensor:
    cache = target.make_kv_cache(32, 4)
    with torch.no_grad():
        return target(tokens, torch.arange(len(tokens)), cache, cache.prepare_step(["t"], [len(tokens)]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_layer_loads_the_checkpoint_moe_block_and_shares_embedding_and_head(checkpoint, variant):
    path = checkpoint(variant)
    mtp = load_mtp(path)
    config = mtp.config
    assert isinstance(mtp.block.mlp, MoE)  # the MTP layer index is past first_k_dense_replace
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    prefix = DEEPSEEK_LAYOUT.prefix(config)
    assert prefix == f"model.layers.{config.num_hidden_layers}."
    assert torch.equal(mtp.eh_proj.weight, tensors[prefix + "eh_proj.weight"])
    assert torch.equal(mtp.block.mlp.gate.e_score_correction_bias, tensors[prefix + "mlp.gate.e_score_correction_bias"])
    assert (prefix + "shared_head.head.weight" in tensors) == VARIANTS[variant].get("mtp_stores_shared", True)
    assert torch.equal(mtp.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(mtp.shared_head.head.weight, tensors["lm_head.weight"])
    assert mtp.make_kv_cache(num_blocks=4, block_size=4).k.shape == (1, 4, 4, 2, config.head_dim)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_matches_transformers_mtp_layer_incrementally(mtp_setup, variant):
    mtp, ref, target = mtp_setup(variant)
    g = torch.Generator().manual_seed(3)
    tokens = {r: torch.randint(0, mtp.config.vocab_size, (n,), generator=g) for r, n in (("a", 36), ("b", 9))}
    hidden = {r: _target_hidden(target, t) for r, t in tokens.items()}
    cache = mtp.make_kv_cache(num_blocks=24, block_size=4)
    # Pair p = (h_p, x_{p+1}) at position p + 1, as the drafter runs it. Ragged chunks, a rollback, a redo.
    steps = [({"a": 20, "b": 2}, {}), ({"b": 3, "a": 1}, {}), ({"a": 4, "b": 3}, {"a": 18, "b": 4}), ({"a": 9}, {})]
    for new, rollback in steps:
        for r, keep in rollback.items():
            cache.truncate(r, keep)
        starts = {r: cache.num_tokens(r) for r in new}
        attn = cache.prepare_step(list(new), list(new.values()))
        rows = [(r, torch.arange(starts[r], starts[r] + n)) for r, n in new.items()]
        with torch.no_grad():
            out = mtp(
                torch.cat([tokens[r][p + 1] for r, p in rows]),
                torch.cat([hidden[r][p] for r, p in rows]),
                torch.cat([p + 1 for _, p in rows]),
                cache,
                attn,
            )
        logits, row = mtp.compute_logits(out), 0
        for r, p in rows:
            full = torch.arange(int(p[-1]) + 1)
            expected = ref.logits(hidden[r][full], tokens[r][full + 1], full + 1)[p]
            torch.testing.assert_close(logits[row : row + len(p)], expected, atol=ATOL, rtol=0)
            row += len(p)


def test_later_draft_steps_reuse_the_layer_on_its_own_output(mtp_setup):
    mtp, ref, target = mtp_setup("air")
    tokens = torch.randint(0, mtp.config.vocab_size, (8,), generator=torch.Generator().manual_seed(5))
    hidden = _target_hidden(target, tokens)
    cache = mtp.make_kv_cache(num_blocks=8, block_size=4)
    pairs = torch.arange(7)
    with torch.no_grad():
        out = mtp(tokens[pairs + 1], hidden[pairs], pairs + 1, cache, cache.prepare_step(["a"], [7]))
        draft = mtp.compute_logits(out[-1:]).argmax(-1)
        step1 = mtp(draft, out[-1:], torch.tensor([8]), cache, cache.prepare_step(["a"], [1]))
    full_h = torch.cat([hidden[pairs], out[-1:]])
    full_x = torch.cat([tokens[pairs + 1], draft])
    expected = ref.logits(full_h, full_x, torch.arange(1, 9))[-1:]
    torch.testing.assert_close(mtp.compute_logits(step1), expected, atol=ATOL, rtol=0)


def test_dummy_bf16_greedy_does_not_depend_on_the_batch(checkpoint):
    """What a `--load-format dummy` benchmark relies on to compare target-only with speculative output: the
    residual stream stays the token embedding, so routing and argmax are the same in any batch; and tokens
    spread over the experts as real ones do (the benchmark must read most expert weights at batch 32)."""
    model = load_target(checkpoint(), load_format="dummy", dtype=torch.bfloat16)
    prompts = _prompts(model.config.vocab_size, [17, 5, 30], seed=3)

    def forward(group: list[torch.Tensor]) -> torch.Tensor:
        cache = model.make_kv_cache(num_blocks=32, block_size=4)
        attn = cache.prepare_step([f"r{i}" for i in range(len(group))], [len(p) for p in group])
        positions = torch.cat([torch.arange(len(p)) for p in group])
        with torch.no_grad():
            return model.compute_logits(model(torch.cat(group), positions, cache, attn))

    together = forward(prompts)
    assert torch.isfinite(together).all()
    assert torch.equal(together.argmax(-1), torch.cat([forward([p]) for p in prompts]).argmax(-1))
    with torch.no_grad():
        chosen, _ = model.layers[1].mlp.gate(model.embed_tokens(torch.cat(prompts)).float())
    assert chosen.unique().numel() == model.config.n_routed_experts  # 52 tokens × 2 reach all 8 experts
