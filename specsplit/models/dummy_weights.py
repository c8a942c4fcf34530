"""Random ("dummy") weights built directly on the device: `--load-format dummy` (vLLM has the same idea).

For speed measurements on realistic shapes without a checkpoint: only `config.json` is read. Every
tensor is drawn from a generator seeded by (seed, checkpoint tensor name), so the verifier and the
drafter, in different processes, build identical shared tensors (embedding, LM head).

Scales are chosen so bf16 activations stay finite and greedy decoding is *stable* across batch
shapes (a benchmark compares target-only output with speculative output token for token):
- embedding N(0, 1); norms 1; biases 0; other linear layers N(0, 1/fan_in), activations of order 1;
- the residual branches' output projections (`o_proj`, `down_proj`) are scaled by `RESIDUAL_SCALE`,
  so the residual stream stays the token embedding up to bf16 rounding. The next token then
  depends on the last token only and rounding differences between kernels cannot flip an argmax;
  with ordinary random weights the top-2 logits of a 152k vocabulary are close enough that bf16
  noise changes greedy output within a few dozen tokens. Values do not change the cost of a forward.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

RESIDUAL_SCALE = 1e-5
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")


def init_dummy_weights(
    model: nn.Module,
    checkpoint_name: Callable[[str], str],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    param_dtype: Callable[[str], torch.dtype],
    seed: int = 0,
    shard=lambda param_name: None,
    skip: Callable[[str], bool] = lambda param_name: False,
) -> None:
    """Replaces every parameter of a meta-device `model` by a seeded random tensor on `device`.

    `checkpoint_name(param_name)` names the tensor a parameter would load from; parameters sharing
    one name (tied embeddings) share one tensor. `param_dtype(param_name)` is the dtype to use.
    `shard(param_name)`: the slice a tensor-parallel rank keeps (`parallel_layers.Shard`, None: all), cut from
    the whole tensor, so every rank's slices are those of the one-device model.
    Parameters `skip` names stay on the meta device (the loader draws FP8 linears' weights one at a
    time with `random_tensor`, quantizing each before the next).
    """
    made: dict[str, nn.Parameter] = {}
    for param_name, param in list(model.named_parameters(remove_duplicate=False)):
        if skip(param_name):
            continue
        name = checkpoint_name(param_name)
        if name not in made:
            part = shard(param_name)
            shape = tuple(param.shape) if part is None else part.full_shape(tuple(param.shape))
            tensor = random_tensor(name, shape, param_dtype(param_name), device, seed)
            made[name] = nn.Parameter(tensor if part is None else part.take(tensor).contiguous(), requires_grad=False)
        module_name, _, leaf = param_name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, made[name])


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """The dummy value of checkpoint tensor `name`."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias") or len(shape) < 2:
        return torch.zeros(shape, dtype=dtype, device=device)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest, "big") >> 1)
    if "embed_tokens" in name:
        std = 1.0
    else:
        std = 1.0 / math.sqrt(shape[-1])
        if name.endswith(_RESIDUAL_OUTPUTS):
            std *= RESIDUAL_SCALE
    tensor = torch.empty(shape, dtype=dtype, device=device)
    return tensor.normal_(0.0, std, generator=generator)
