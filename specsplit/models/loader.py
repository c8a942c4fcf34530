"""Builds models from a local Hugging Face checkpoint directory, loading only the tensors they need.

Models are constructed on the meta device (no random init), then each parameter is read from its
safetensors shard, checked against the expected shape, cast and assigned. With
`load_format="dummy"` only config.json is read and the weights are random (`specsplit.models.dummy_weights`).
A tensor-parallel rank's model holds its shard only: each sharded parameter reads its slice of the checkpoint
tensor (`specsplit.models.parallel_layers.Shard`), on the host, before moving to the device.
A block-scaled FP8 checkpoint (`specsplit.models.quantization`) loads each linear with a `weight_scale_inv`
beside its weight as an `Fp8Linear` (`specsplit.models.fp8_linear`): kept in FP8 on CUDA, dequantized to
`dtype` elsewhere; with dummy weights and an FP8 config.json the random linears are quantized the same way.
Tensor-parallel FP8: each rank's slice is whole scale blocks, its scales with it (`whole_blocks`,
`fp8_linear.tensor_parallel_shards`).
Every model returned has its projections fused (`specsplit.models.layers.fuse_projections`: q/k/v → qkv_proj,
gate/up → gate_up_proj), so its parameter names differ from the checkpoint's there.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable

import safetensors
import torch
from torch import nn

from specsplit.kernels.fp8_reference import FP8_DTYPE
from specsplit.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, checkpoint_architecture, read_config_json
from specsplit.models.deepseek_v3 import DeepseekV3Config, DeepseekV3MTP, DeepseekV3Target
from specsplit.models.deepseek_v3.config import ARCHITECTURES as DEEPSEEK_V3_ARCHITECTURES
from specsplit.models.dummy_weights import init_dummy_weights, random_tensor
from specsplit.models.fp8_linear import dequantize_fp8_linears, quantize_linears, use_fp8_linears
from specsplit.models.glm4_moe import Glm4MoeConfig, Glm4MoeMTP, Glm4MoeTarget
from specsplit.models.glm4_moe.config import ARCHITECTURES as GLM4_MOE_ARCHITECTURES
from specsplit.models.layers import fuse_projections
from specsplit.models.meta_init import on_meta
from specsplit.models.mtp import MTPModule
from specsplit.models.parallel_layers import shard_of, whole_blocks
from specsplit.models.quantization import Fp8BlockQuantization, read_quantization
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
    `checkpoint_architecture` says, among every architecture specsplit implements); a quantization
    specsplit does not implement is refused here, for every family (`load_quantization`)."""
    path = _checkpoint_dir(path)
    raw = read_config_json(path)
    architecture = checkpoint_architecture(path, raw, ARCHITECTURES)
    read_quantization(raw, path)
    if architecture in DEEPSEEK_V3_ARCHITECTURES:
        return DeepseekV3Config.from_pretrained(path)
    if architecture in GLM4_MOE_ARCHITECTURES:
        return Glm4MoeConfig.from_pretrained(path)
    return ModelConfig.from_pretrained(path)


def load_quantization(path: str | pathlib.Path) -> Fp8BlockQuantization | None:
    """The checkpoint's block-scaled FP8 quantization, None if unquantized; ValueError (one line) for
    every other `quantization_config`."""
    path = _checkpoint_dir(path)
    return read_quantization(read_config_json(path), path)


LOAD_FORMATS = ("auto", "dummy")


def load_target(
    path: str | pathlib.Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    keep_fp8: bool | None = None,
) -> TargetModel:
    """`load_format`: "auto" reads the safetensors; "dummy" builds seeded random weights on `device`.
    `keep_fp8` (FP8 checkpoints): linears stay FP8 (None: on CUDA only; True on the CPU runs the W8A8
    reference in torch, for tests)."""
    path = _checkpoint_dir(path)
    config = load_config(path)
    quantization = load_quantization(path)
    with on_meta(), whole_blocks(_split_unit(quantization)):
        model = FAMILIES[type(config)][0](config)
    tied = config.tie_word_embeddings

    def candidates(name: str) -> list[str]:
        return ["model.embed_tokens.weight"] if tied and name == "lm_head.weight" else [name]

    _fill(model, path, quantization, candidates, load_format, dtype=dtype, device=device, keep_fp8=keep_fp8)
    return fuse_projections(model).eval()


def load_mtp(
    path: str | pathlib.Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    keep_fp8: bool | None = None,
) -> MTPModule | DeepseekV3MTP:
    """MTP layer 0 plus the shared embedding and LM head (see `specsplit.models.mtp_layout` for the names);
    `load_format` and `keep_fp8` as for `load_target`."""
    path = _checkpoint_dir(path)
    config = load_config(path)
    if not config.has_mtp:
        raise ValueError(
            f"checkpoint {str(path)!r} has no MTP weights (num_nextn_predict_layers is 0 or missing "
            "in config.json); it cannot serve as a drafter"
        )
    quantization = load_quantization(path)
    with on_meta(), whole_blocks(_split_unit(quantization)):
        model = FAMILIES[type(config)][1](config)

    def candidates(name: str) -> list[str]:
        return model.layout.checkpoint_candidates(config, name)

    _fill(model, path, quantization, candidates, load_format, dtype=dtype, device=device, keep_fp8=keep_fp8)
    return fuse_projections(model).eval()


def _split_unit(quantization: Fp8BlockQuantization | None) -> int:
    """A tensor-parallel rank's MLP width splits in whole FP8 scale blocks: both of a column-parallel weight's
    rows (bn) and of the row-parallel one's input columns (bk)."""
    return 1 if quantization is None else math.lcm(quantization.block_n, quantization.block_k)


def load_tokenizer(path: str | pathlib.Path) -> transformers.PreTrainedTokenizerBase:  # noqa: F821
    import transformers  # only here: the services that load models never import it (see models/config.py)

    return transformers.AutoTokenizer.from_pretrained(str(_checkpoint_dir(path)), local_files_only=True)


def _checkpoint_dir(path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    return path


def _fill(
    model: nn.Module,
    path: pathlib.Path,
    quantization: Fp8BlockQuantization | None,
    candidates: Callable[[str], list[str]],
    load_format: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_fp8: bool | None,
) -> None:
    if load_format == "auto":
        index = _tensor_index(path)
        if quantization is not None:
            names = _fp8_linears_in_checkpoint(model, index, candidates)
            use_fp8_linears(model, names, quantization.block_n, quantization.block_k)
        _load(model, path, index, candidates, dtype=dtype, device=device)
    elif load_format == "dummy":
        fp8_names = _fp8_linears_of_dummy(model, quantization) if quantization is not None else []
        fp8_weights = {f"{name}.weight" for name in fp8_names}
        init_dummy_weights(
            model,
            lambda name: _shared_name(candidates(name)),
            dtype=dtype,
            device=device,
            param_dtype=lambda name: _param_dtype(model, name, dtype),
            shard=lambda name: shard_of(model, name),
            skip=fp8_weights.__contains__,
        )
        if fp8_names:  # drawn and quantized one at a time: the peak is the FP8 model, not the bf16 one

            def weight_of(name: str) -> torch.Tensor:
                shape = tuple(model.get_submodule(name).weight.shape)
                return random_tensor(candidates(f"{name}.weight")[0], shape, dtype, device)

            quantize_linears(model, fp8_names, quantization.block_n, quantization.block_k, weight_of)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    if quantization is not None:
        on_cuda = torch.device(device).type == "cuda"
        dequantize_fp8_linears(model, dtype, keep_fp8=on_cuda if keep_fp8 is None else keep_fp8)


def _fp8_linears_in_checkpoint(
    model: nn.Module, index: dict[str, pathlib.Path], candidates: Callable[[str], list[str]]
) -> list[str]:
    """The linears whose checkpoint weight has a `weight_scale_inv` beside it."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found = next((n for n in candidates(f"{name}.weight") if n in index), None)
            if found is not None and f"{found}_scale_inv" in index:
                names.append(name)
    return names


# Linears an FP8 checkpoint keeps in bf16 (DeepSeek-V3's head, its MTP head and eh_proj); norms,
# embeddings and the MoE router are no nn.Linear.
_UNQUANTIZED_LINEARS = ("lm_head", "shared_head.head", "eh_proj")


def _fp8_linears_of_dummy(model: nn.Module, quantization: Fp8BlockQuantization) -> list[str]:
    """The linears dummy weights quantize: every one an FP8 checkpoint quantizes (those of the decoder
    layers), less config.json's modules_to_not_convert / ignored_layers."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not name.endswith(_UNQUANTIZED_LINEARS)
        and not any(part in name for part in quantization.not_converted)
    ]


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
    index: dict[str, pathlib.Path],
    candidates: Callable[[str], list[str]],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Fills every parameter of a meta-device `model`; parameters sharing one checkpoint tensor
    (tied embeddings / heads) end up as one tensor. A module may name parameters that stay float32
    whatever `dtype` (`keep_in_float32`, e.g. the DeepSeek-V3 router) or keep the dtype they are
    stored in (`stored_dtypes`: `Fp8Linear`'s weight and scales). A float8 tensor loads only into an
    `Fp8Linear` (so never unscaled), and an `Fp8Linear` only from e4m3."""
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
                shard = shard_of(model, param_names[0])
                if shard is not None:
                    want = shard.full_shape(want)
                if got != want:
                    raise ValueError(
                        f"tensor {tensor_name!r} in {str(path)!r} has shape {got}, "
                        f"expected {want} (for {param_names[0]!r})"
                    )
                _check_fp8(tensor_name, f.get_slice(tensor_name).get_dtype(), expected[param_names[0]].dtype, path)
    for file, tensors in by_file.items():
        with safetensors.safe_open(str(file), framework="pt") as f:
            for tensor_name, param_names in tensors.items():
                shard = shard_of(model, param_names[0])
                tensor = f.get_tensor(tensor_name) if shard is None else shard.take(f.get_slice(tensor_name))
                tensor = tensor.to(device=device, dtype=_param_dtype(model, param_names[0], dtype))
                param = nn.Parameter(tensor, requires_grad=False)
                for param_name in param_names:  # one Parameter for tied names
                    _set_parameter(model, param_name, param)


def _check_fp8(tensor_name: str, stored: str, wanted: torch.dtype, path: pathlib.Path) -> None:
    """`stored`: the safetensors dtype ("F8_E4M3", "BF16", ...); `wanted`: the parameter's dtype."""
    if stored.startswith("F8") and wanted != FP8_DTYPE:
        raise ValueError(
            f"tensor {tensor_name!r} in {str(path)!r} is {stored} but not a block-scaled FP8 linear weight (FP8 "
            "weights need quantization_config quant_method 'fp8' with weight_block_size in config.json and a "
            "weight_scale_inv beside each)"
        )
    if wanted == FP8_DTYPE and stored != "F8_E4M3":
        raise ValueError(
            f"tensor {tensor_name!r} in {str(path)!r} is {stored}; beside a weight_scale_inv it must be F8_E4M3"
        )


def _param_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in getattr(module, "stored_dtypes", {}):
        return module.stored_dtypes[leaf]
    return torch.float32 if leaf in getattr(module, "keep_in_float32", ()) else dtype


def _set_parameter(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_name), leaf, value)
