"""Builds models from a local Hugging Face checkpoint directory, loading only the tensors they need.

Models are constructed on the meta device (no random init), then each parameter is read from its
safetensors shard, checked against the expected shape, cast and assigned. With
`load_format="dummy"` only config.json is read and the weights are random (`specsplit.models.dummy_weights`).
Every model returned has its projections fused (`specsplit.models.layers.fuse_projections`: q/k/v → qkv_proj,
gate/up → gate_up_proj), so its parameter names differ from the checkpoint's there.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import safetensors
import torch
import transformers
from torch import nn

from specsplit.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, checkpoint_architecture, read_config_json
from specsplit.models.deepseek_v3 import DeepseekV3Config, DeepseekV3MTP, DeepseekV3Target
from specsplit.models.deepseek_v3.config import ARCHITECTURES as DEEPSEEK_V3_ARCHITECTURES
from specsplit.models.dummy_weights import init_dummy_weights
from specsplit.models.glm4_moe import Glm4MoeConfig, Glm4MoeMTP, Glm4MoeTarget
from specsplit.models.glm4_moe.config import ARCHITECTURES as GLM4_MOE_ARCHITECTURES
from specsplit.models.layers import fuse_projections
from specsplit.models.mtp import MTPModule
from specsplit.models.target import TargetModel

ARCHITECTURES = SUPPORTED_ARCHITECTURES + DEEPSEEK_V3_ARCHITECTURES + GLM4_MOE_ARCHITECTURES
# Each model family: its configuration record → (target class, MTP class).
FAMILIES = {
    ModelConfig: (TargetModel, MTPModule),
    DeepseekV3Config: (DeepseekV3Target, DeepseekV3MTP),
    Glm4MoeConfig: (Glm4MoeTarget, Glm4MoeMTP),
}


def load_config(path: str | pathlib.Path) -> ModelConfig | DeepseekV3Config | Glm4MoeConfig:
    """The configuration of a checkpoint, as the record of its model family (chosen as
    `checkpoint_architecture` says, among every architecture specsplit implements)."""
    path = _checkpoint_dir(path)
    architecture = checkpoint_architecture(path, read_config_json(path), ARCHITECTURES)
    if architecture in DEEPSEEK_V3_ARCHITECTURES:
        return DeepseekV3Config.from_pretrained(path)
    if architecture in GLM4_MOE_ARCHITECTURES:
        return Glm4MoeConfig.from_pretrained(path)
    return ModelConfig.from_pretrained(path)


LOAD_FORMATS = ("auto", "dummy")


def load_target(
    path: str | pathlib.Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
) -> TargetModel:
    """`load_format`: "auto" reads the safetensors; "dummy" builds seeded random weights on `device`."""
    path = _checkpoint_dir(path)
    config = load_config(path)
    with torch.device("meta"):
        model = FAMILIES[type(config)][0](config)
    tied = config.tie_word_embeddings

    def candidates(name: str) -> list[str]:
        return ["model.embed_tokens.weight"] if tied and name == "lm_head.weight" else [name]

    _fill(model, path, candidates, load_format, dtype=dtype, device=device)
    return fuse_projections(model).eval()


def load_mtp(
    path: str | pathlib.Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
) -> MTPModule | DeepseekV3MTP:
    """MTP layer 0 plus the shared embedding and LM head (see `specsplit.models.mtp_layout` for the names)."""
    path = _checkpoint_dir(path)
    config = load_config(path)
    if not config.has_mtp:
        raise ValueError(
            f"checkpoint {str(path)!r} has no MTP weights (num_nextn_predict_layers is 0 or missing "
            "in config.json); it cannot serve as a drafter"
        )
    with torch.device("meta"):
        model = FAMILIES[type(config)][1](config)

    def candidates(name: str) -> list[str]:
        return model.layout.checkpoint_candidates(config, name)

    _fill(model, path, candidates, load_format, dtype=dtype, device=device)
    return fuse_projections(model).eval()


def load_tokenizer(path: str | pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(_checkpoint_dir(path)), local_files_only=True)


def _checkpoint_dir(path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    return path


def _fill(
    model: nn.Module,
    path: pathlib.Path,
    candidates: Callable[[str], list[str]],
    load_format: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    if load_format == "auto":
        _load(model, path, candidates, dtype=dtype, device=device)
    elif load_format == "dummy":
        init_dummy_weights(
            model,
            lambda name: _shared_name(candidates(name)),
            dtype=dtype,
            device=device,
            param_dtype=lambda name: _param_dtype(model, name, dtype),
        )
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")


def _shared_name(names: list[str]) -> str:
    """The target's own tensor when a parameter may load from it (MTP embedding and head), so random
    shared tensors are the same in the verifier and the drafter."""
    shared = [n for n in names if n in ("model.embed_tokens.weight", "lm_head.weight")]
    return shared[-1] if shared else names[0]


def _tensor_index(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name → the safetensors file holding it (single file or sharded with an index)."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        shards = {shard: path / shard for shard in set(weight_map.values())}
        absent = sorted(shard for shard, file in shards.items() if not file.is_file())
        if absent:
            raise FileNotFoundError(f"shards listed in {str(index_file)!r} are missing: {', '.join(absent)}")
        return {name: shards[shard] for name, shard in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(path)!r}")
    with safetensors.safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _load(
    model: nn.Module,
    path: pathlib.Path,
    candidates: Callable[[str], list[str]],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Fills every parameter of a meta-device `model`; parameters sharing one checkpoint tensor
    (tied embeddings / heads) end up as one tensor. A module may name parameters that stay float32
    whatever `dtype` (`keep_in_float32`, e.g. the DeepSeek-V3 router)."""
    index = _tensor_index(path)
    expected = dict(model.named_parameters(remove_duplicate=False))
    chosen: dict[str, str] = {}  # parameter name → checkpoint tensor name
    missing: list[str] = []
    for param_name in expected:
        names = candidates(param_name)
        found = next((n for n in names if n in index), None)
        if found is None:
            missing.append(" or ".join(names))
        else:
            chosen[param_name] = found
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks tensors: {', '.join(missing)}")

    by_file: dict[pathlib.Path, dict[str, list[str]]] = {}  # file → tensor name → parameters using it
    for param_name, tensor_name in chosen.items():
        by_file.setdefault(index[tensor_name], {}).setdefault(tensor_name, []).append(param_name)
    for file, tensors in by_file.items():  # check every shape before loading anything
        with safetensors.safe_open(str(file), framework="pt") as f:
            for tensor_name, param_names in tensors.items():
                got = tuple(f.get_slice(tensor_name).get_shape())
                want = tuple(expected[param_names[0]].shape)
                if got != want:
                    raise ValueError(
                        f"tensor {tensor_name!r} in {str(path)!r} has shape {got}, "
                        f"expected {want} (for {param_names[0]!r})"
                    )
    for file, tensors in by_file.items():
        with safetensors.safe_open(str(file), framework="pt") as f:
            for tensor_name, param_names in tensors.items():
                tensor = f.get_tensor(tensor_name).to(device=device, dtype=_param_dtype(model, param_names[0], dtype))
                param = nn.Parameter(tensor, requires_grad=False)
                for param_name in param_names:  # one Parameter for tied names
                    _set_parameter(model, param_name, param)


def _param_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    module_name, _, leaf = name.rpartition(".")
    return torch.float32 if leaf in getattr(model.get_submodule(module_name), "keep_in_float32", ()) else dtype


def _set_parameter(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_name), leaf, value)
