"""MTPModule equals a dense reference written from the formula, incrementally through the paged cache.

The reference reads the checkpoint tensors by their published names (DeepSeek-V3 and MiMo layouts)
and runs the MTP block as a one-layer transformers model (inputs_embeds + position_ids).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import safetensors.torch
import torch
import transformers

from specsplit.models.loader import load_mtp, load_target

ATOL = 1e-4


class DenseMTPReference:
    """logits(h, x, positions) over one whole pair sequence, no cache: the formula, nothing else."""

    def __init__(self, path: pathlib.Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
        self.mimo = raw["architectures"] == ["MiMoForCausalLM"]
        if self.mimo:
            prefix = "model.mtp_layers.0."
            names = {
                "e": "token_layernorm",
                "h": "hidden_layernorm",
                "proj": "input_proj",
                "norm": "final_layernorm",
            }
            head = tensors["lm_head.weight"]
        else:
            prefix = f"model.layers.{raw['num_hidden_layers']}."
            names = {"e": "enorm", "h": "hnorm", "proj": "eh_proj", "norm": "shared_head.norm"}
            head = tensors.get(prefix + "shared_head.head.weight", tensors["model.embed_tokens.weight"])
        self.eps = raw["rms_norm_eps"]
        self.embed = tensors["model.embed_tokens.weight"]
        self.w = {k: tensors[f"{prefix}{v}.weight"] for k, v in names.items()}
        self.head = head
        keep = ("model_type", "architectures", "transformers_version")
        cfg = {k: v for k, v in raw.items() if k not in keep} | {"num_hidden_layers": 1}
        config_class = transformers.Qwen2Config if self.mimo else type(transformers.AutoConfig.from_pretrained(path))
        self.block = transformers.AutoModel.from_config(config_class(**cfg)).float().eval()
        block_state = {
            "layers.0." + name.removeprefix(prefix): t
            for name, t in tensors.items()
            if name.startswith(prefix)
            and name.removeprefix(prefix).split(".")[0]
            in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        }
        self.block.load_state_dict(block_state | {"norm.weight": self.w["norm"], "embed_tokens.weight": self.embed})

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def normed_output(self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e, hn = self._rms(self.embed[x], self.w["e"]), self._rms(h, self.w["h"])
        inp = torch.cat([hn, e] if self.mimo else [e, hn], dim=-1) @ self.w["proj"].T
        return self.block(inputs_embeds=inp[None], position_ids=positions[None]).last_hidden_state[0]

    def logits(self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.normed_output(h, x, positions) @ self.head.T


def _target_hidden(path: pathlib.Path, tokens: torch.Tensor) -> torch.Tensor:
    target = load_target(path)
    cache = target.make_kv_cache(32, 4)
    with torch.no_grad():
        return target(tokens, torch.arange(len(tokens)), cache, cache.prepare_step(["t"], [len(tokens)]))


@pytest.mark.parametrize(
    "architecture,tie",
    [("llama", False), ("qwen2", False), ("qwen3", False), ("mimo", False), ("llama", True)],
)
def test_mtp_matches_dense_reference_incrementally(checkpoint_dir, architecture, tie):
    path = checkpoint_dir(architecture, tie_word_embeddings=tie)
    mtp, ref = load_mtp(path), DenseMTPReference(path)
    g = torch.Generator().manual_seed(3)
    tokens = {r: torch.randint(0, mtp.config.vocab_size, (n,), generator=g) for r, n in (("a", 15), ("b", 9))}
    hidden = {r: _target_hidden(path, t) for r, t in tokens.items()}
    cache = mtp.make_kv_cache(num_blocks=16, block_size=4)
    # Pair p = (h_p, x_{p+1}) at position p. Steps: ragged chunks, then a rollback and a redo.
    steps = [
        ({"a": 6, "b": 2}, {}),
        ({"b": 3, "a": 1}, {}),
        ({"a": 4, "b": 3}, {"a": 5, "b": 4}),
        ({"a": 9}, {"a": 5}),
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
                torch.cat([p for _, p in rows]),
                cache,
                attn,
            )
        logits, row = mtp.compute_logits(out), 0
        for r, p in rows:
            end = int(p[-1]) + 1
            full = torch.arange(end)
            expected = ref.logits(hidden[r][:end], tokens[r][full + 1], full)[p]
            torch.testing.assert_close(logits[row : row + len(p)], expected, atol=ATOL, rtol=0)
            if ref.mimo:  # MiMo's forward output is already final_layernorm'ed
                normed = ref.normed_output(hidden[r][:end], tokens[r][full + 1], full)[p]
                torch.testing.assert_close(out[row : row + len(p)], normed, atol=ATOL, rtol=0)
            row += len(p)


@pytest.mark.parametrize("architecture", ["llama", "mimo"])
def test_later_draft_steps_reuse_the_layer_on_its_own_output(checkpoint_dir, architecture):
    path = checkpoint_dir(architecture)
    mtp, ref = load_mtp(path), DenseMTPReference(path)
    tokens = torch.randint(0, mtp.config.vocab_size, (8,), generator=torch.Generator().manual_seed(5))
    hidden = _target_hidden(path, tokens)
    cache = mtp.make_kv_cache(num_blocks=8, block_size=4)
    pairs = torch.arange(7)
    with torch.no_grad():
        out = mtp(tokens[pairs + 1], hidden[pairs], pairs, cache, cache.prepare_step(["a"], [7]))
        draft = mtp.compute_logits(out[-1:]).argmax(-1)
        step1 = mtp(draft, out[-1:], torch.tensor([7]), cache, cache.prepare_step(["a"], [1]))
    full_h = torch.cat([hidden[pairs], out[-1:]])
    full_x = torch.cat([tokens[pairs + 1], draft])
    expected = ref.logits(full_h, full_x, torch.arange(8))[-1:]
    torch.testing.assert_close(mtp.compute_logits(step1), expected, atol=ATOL, rtol=0)


def test_mtp_outputs_do_not_depend_on_a_uniform_position_shift(checkpoint_dir):
    """RoPE sees only position differences: positions p and p + 1 give the same drafts."""
    path = checkpoint_dir("qwen3")
    mtp = load_mtp(path)
    tokens = torch.randint(0, mtp.config.vocab_size, (10,), generator=torch.Generator().manual_seed(6))
    hidden = _target_hidden(path, tokens)
    results = []
    for shift in (0, 1):
        cache = mtp.make_kv_cache(num_blocks=8, block_size=4)
        pairs = torch.arange(9)
        with torch.no_grad():
            results.append(
                mtp.compute_logits(
                    mtp(tokens[pairs + 1], hidden[pairs], pairs + shift, cache, cache.prepare_step(["a"], [9]))
                )
            )
    torch.testing.assert_close(results[0], results[1], atol=ATOL, rtol=0)


def test_mtp_rejects_hidden_of_the_wrong_shape(checkpoint_dir):
    mtp = load_mtp(checkpoint_dir("llama"))
    cache = mtp.make_kv_cache(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="previous_hidden has shape"):
        mtp(
            torch.tensor([1, 2]),
            torch.zeros(3, mtp.config.hidden_size),
            torch.tensor([0, 1]),
            cache,
            cache.prepare_step(["a"], [2]),
        )
