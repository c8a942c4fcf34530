"""DeepSeek-V3's MTP module equals a dense reference written from the formula, through its latent cache.

The reference reads the checkpoint tensors by their published names (`model.layers.{N}.enorm`, …)
and runs the MTP block as a one-layer transformers DeepseekV3Model (an MoE layer) on inputs_embeds.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import safetensors.torch
import torch
import transformers

from specsplit.models.loader import load_mtp, load_target
from specsplit.models.moe import MoE
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint

ATOL = 1e-4
BLOCK_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> pathlib.Path:
    return write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("deepseek-mtp"), seed=2)


class DenseMTPReference:
    """logits(h, x, positions) over one whole pair sequence, no cache: the formula, nothing else."""

    def __init__(self, path: pathlib.Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
        prefix = f"model.layers.{raw['num_hidden_layers']}."
        self.eps = raw["rms_norm_eps"]
        self.embed = tensors["model.embed_tokens.weight"]
        self.w = {k: tensors[f"{prefix}{k}.weight"] for k in ("enorm", "hnorm", "eh_proj", "shared_head.norm")}
        self.head = tensors[prefix + "shared_head.head.weight"]
        config = transformers.AutoConfig.from_pretrained(str(path), num_hidden_layers=1, first_k_dense_replace=0)
        self.block = transformers.DeepseekV3Model(config).float().eval()
        block = {
            name.removeprefix(prefix): t
            for name, t in tensors.items()
            if name.startswith(prefix) and name.removeprefix(prefix).split(".")[0] in BLOCK_PARTS
        }
        state = {"layers.0." + k: v for k, v in _stack_experts(block, raw["n_routed_experts"]).items()}
        self.block.load_state_dict(
            state | {"norm.weight": self.w["shared_head.norm"], "embed_tokens.weight": self.embed}
        )

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def logits(self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e, hn = self._rms(self.embed[x], self.w["enorm"]), self._rms(h, self.w["hnorm"])
        inp = torch.cat([e, hn], dim=-1) @ self.w["eh_proj"].T
        out = self.block(inputs_embeds=inp[None], position_ids=positions[None]).last_hidden_state[0]
        return out @ self.head.T


def _stack_experts(block: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors → transformers' stacked `experts.gate_up_proj` / `experts.down_proj`."""
    expert = "mlp.experts.{}.{}_proj.weight"
    stacked = {k: v for k, v in block.items() if not k.startswith("mlp.experts.")}
    stacked["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([block[expert.format(e, "gate")], block[expert.format(e, "up")]]) for e in range(num_experts)]
    )
    stacked["mlp.experts.down_proj"] = torch.stack([block[expert.format(e, "down")] for e in range(num_experts)])
    return stacked


def _target_hidden(path: pathlib.Path, tokens: torch.Tensor) -> torch.Tensor:
    target = load_target(path)
    cache = target.make_kv_cache(32, 4)
    with torch.no_grad():
        return target(tokens, torch.arange(len(tokens)), cache, cache.prepare_step(["t"], [len(tokens)]))


def test_mtp_layer_is_the_checkpoint_moe_block_with_a_latent_cache(path):
    mtp = load_mtp(path)
    config = mtp.config
    assert isinstance(mtp.block.mlp, MoE)  # the MTP layer index is past first_k_dense_replace
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    prefix = f"model.layers.{config.num_hidden_layers}."
    assert torch.equal(mtp.eh_proj.weight, tensors[prefix + "eh_proj.weight"])
    assert torch.equal(mtp.block.mlp.gate.weight, tensors[prefix + "mlp.gate.weight"])
    assert torch.equal(mtp.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    cache = mtp.make_kv_cache(num_blocks=4, block_size=4)
    assert cache.latent.shape == (1, 4, 4, config.kv_lora_rank + config.qk_rope_head_dim)


def test_mtp_matches_dense_reference_incrementally(path):
    mtp, ref = load_mtp(path), DenseMTPReference(path)
    g = torch.Generator().manual_seed(3)
    tokens = {r: torch.randint(0, mtp.config.vocab_size, (n,), generator=g) for r, n in (("a", 44), ("b", 9))}
    hidden = {r: _target_hidden(path, t) for r, t in tokens.items()}
    cache = mtp.make_kv_cache(num_blocks=24, block_size=4)
    # Pair p = (h_p, x_{p+1}) at position p + 1, as the drafter runs it. Ragged chunks (the first
    # one long enough for the expanded MLA path), then a rollback and a redo.
    steps = [
        ({"a": 36, "b": 2}, {}),
        ({"b": 3, "a": 1}, {}),
        ({"a": 4, "b": 3}, {"a": 34, "b": 4}),
        ({"a": 9}, {"a": 33}),
    ]
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


def test_later_draft_steps_reuse_the_layer_on_its_own_output(path):
    mtp, ref = load_mtp(path), DenseMTPReference(path)
    tokens = torch.randint(0, mtp.config.vocab_size, (8,), generator=torch.Generator().manual_seed(5))
    hidden = _target_hidden(path, tokens)
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
