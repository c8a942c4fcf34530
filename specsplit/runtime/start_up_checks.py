"""What a model server (verifier, drafter) checks before it binds a port or loads a weight: its checkpoint
and its device (its flags' ranges: its config's `from_args`). A mistake raises `UsageError` saying what is
wrong and how to fix it (the CLI prints it as one line and exits 2). Of the checkpoint only config.json is
read; torch is imported only once the directory passed (a plain mistake is told at once)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from collections.abc import Iterator

from specsplit.client.errors import UsageError
from specsplit.runtime.serve_options import ModelOptions

_GIVE_CHECKPOINT = "give --model a local checkpoint directory (config.json and *.safetensors)"


def check_model_server(model: ModelOptions, *, drafter: bool) -> None:
    """The checkpoint and device both model servers take; `drafter`: the checkpoint must have MTP layers."""
    check_checkpoint(model.checkpoint, model.load_format, drafter=drafter)
    check_device(model.device)
    if model.gpu_memory_utilization is not None and model.device.startswith("cpu"):
        raise UsageError(
            f"--gpu-memory-utilization sizes the KV cache from CUDA device memory, not on --device {model.device}; "
            "there give --num-blocks (default 1024) or leave both out"
        )


def check_checkpoint(model: str, load_format: str, *, drafter: bool) -> None:
    """`--model`: a readable directory whose config.json names a supported architecture, with weights
    unless `load_format` is dummy, and (`drafter`) MTP layers."""
    path = pathlib.Path(model)
    if not path.is_dir():
        raise UsageError(f"checkpoint directory {model!r} does not exist; {_GIVE_CHECKPOINT}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"cannot read checkpoint directory {model!r} (permission denied); {_GIVE_CHECKPOINT}")

    from specsplit.models.loader import load_config

    with checkpoint_mistakes(model):
        config = load_config(path)
    weights = ("model.safetensors", "model.safetensors.index.json")
    if load_format != "dummy" and not any((path / name).is_file() for name in weights):
        raise UsageError(
            f"no {' or '.join(weights)} in {model!r}; {_GIVE_CHECKPOINT} (or --load-format dummy: random weights)"
        )
    if drafter and not config.has_mtp:
        raise UsageError(
            f"checkpoint {model!r} has no MTP layers (num_nextn_predict_layers is 0 or missing in its config.json); "
            "the drafter needs a checkpoint with MTP weights"
        )


@contextlib.contextmanager
def checkpoint_mistakes(model: str) -> Iterator[None]:
    """Turns what reading checkpoint `model` raises when it cannot be served (a file missing or
    unreadable, config.json not JSON, an architecture or feature specsplit does not implement, tensors
    missing or of other shapes than config.json says) into UsageError."""
    from specsplit.models.config import UnsupportedArchitectureError

    try:
        yield
    except UnsupportedArchitectureError as err:  # its message names the file and lists the supported ones
        raise UsageError(str(err)) from err
    except json.JSONDecodeError as err:
        raise UsageError(f"{os.path.join(model, 'config.json')!r} is not JSON ({err}); {_GIVE_CHECKPOINT}") from err
    except OSError as err:
        reason = f"cannot read {err.filename!r} ({err.strerror})" if err.filename else str(err)
        raise UsageError(f"{reason}; {_GIVE_CHECKPOINT}") from err
    except ValueError as err:
        raise UsageError(f"checkpoint {model!r}: {err}") from err


def _fp8_block_cuts(raw: dict, size: int, block_n: int, block_k: int) -> str | None:
    """What of config.json `raw` a rank of `size` would hold in part of an FP8 scale block (its rows of a
    column-parallel weight: whole `block_n` blocks; its columns of a row-parallel one: whole `block_k` groups),
    None if nothing: the per-rank sizes of the attention projections, split by head; the dense MLP and the shared
    experts split in whole blocks (`parallel_layers.whole_blocks`) if they have one for every rank."""
    heads, hidden = raw.get("num_attention_heads", 0), raw.get("hidden_size", 0)
    kv_heads = raw.get("num_key_value_heads") or heads
    per_rank = {}  # what → (rows or columns per rank, its block)
    if raw.get("kv_lora_rank"):  # MLA
        qk = raw.get("qk_nope_head_dim", 0) + raw.get("qk_rope_head_dim", 0)
        v = raw.get("v_head_dim", 0)
        per_rank["query rows"] = (heads // size * qk, block_n)
        per_rank["kv_b_proj rows"] = (heads // size * (raw.get("qk_nope_head_dim", 0) + v), block_n)
        per_rank["o_proj columns"] = (heads // size * v, block_k)
    else:
        head_dim = raw.get("head_dim") or hidden // max(heads, 1)
        per_rank["query rows"] = (heads // size * head_dim, block_n)
        per_rank["key/value rows"] = (max(kv_heads // size, 1) * head_dim, block_n)
        per_rank["o_proj columns"] = (heads // size * head_dim, block_k)
    for what, (n, block) in per_rank.items():
        if n % block:
            return f"{what} ({n}) are not whole blocks of {block}"
    unit = math.lcm(block_n, block_k)
    widths = {"shared experts": (raw.get("moe_intermediate_size") or 0) * (raw.get("n_shared_experts") or 0)}
    if not raw.get("n_routed_experts") or raw.get("first_k_dense_replace"):  # dense MLP layers
        widths["MLP"] = raw.get("intermediate_size", 0)
    for what, width in widths.items():
        if 0 < -(-width // unit) < size:
            return f"part of the {what} ({width} wide: {-(-width // unit)} blocks of {unit}) would be empty"
    return None


def check_device(device: str) -> None:
    """`--device`: cpu, or a CUDA device this process sees."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise UsageError(f"--device {device!r} is not a torch device; give cpu, cuda or cuda:N") from err
    if parsed.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: specsplit runs on cpu or cuda; give cpu, cuda or cuda:N")
    if parsed.type == "cpu":
        return
    count = torch.cuda.device_count()
    if count == 0:
        raise UsageError(
            f"--device {device} but this process sees no CUDA device; give --device cpu, or check the driver "
            "and CUDA_VISIBLE_DEVICES"
        )
    if parsed.index is not None and parsed.index >= count:
        raise UsageError(
            f"--device {device} but this process sees {count} CUDA device(s); give cuda:0 to cuda:{count - 1}"
        )


def check_tensor_parallel(model: ModelOptions, size: int) -> None:
    """`--tensor-parallel-size`: the checkpoint's heads, KV heads, MLP and experts split into `size` ranks, for a
    block-scaled FP8 checkpoint along whole scale blocks (`_fp8_block_cuts`; the loader checks each linear:
    `fp8_linear.tensor_parallel_shards`), and a CUDA device for every rank."""
    if size == 1:
        return
    from specsplit.models.loader import load_quantization

    flag = f"--tensor-parallel-size {size}"
    with checkpoint_mistakes(model.checkpoint):
        quantization = load_quantization(model.checkpoint)
    raw = json.loads((pathlib.Path(model.checkpoint) / "config.json").read_text())
    heads = raw.get("num_attention_heads", 0)
    kv_heads = raw.get("num_key_value_heads") or heads
    splits = {
        "num_attention_heads": heads,
        "intermediate_size": raw.get("intermediate_size", 0),
        "n_routed_experts": raw.get("n_routed_experts") or 0,
        "moe_intermediate_size x n_shared_experts": (raw.get("moe_intermediate_size") or 0)
        * (raw.get("n_shared_experts") or 0),
    }
    if kv_heads >= size:
        splits["num_key_value_heads"] = kv_heads
    for name, value in splits.items():
        if value % size:
            raise UsageError(f"{flag}: the checkpoint's {name} ({value}) does not divide into {size} ranks")
    if kv_heads < size and size % kv_heads:
        raise UsageError(
            f"{flag}: the checkpoint's {kv_heads} KV heads cannot be replicated evenly over {size} ranks; give a "
            f"multiple of {kv_heads}"
        )
    if quantization is not None:
        cut = _fp8_block_cuts(raw, size, quantization.block_n, quantization.block_k)
        if cut:
            raise UsageError(
                f"{flag}: checkpoint {model.checkpoint!r} is block-scaled FP8 and a rank's {cut}; serve it with a "
                "size that splits into whole blocks (or --tensor-parallel-size 1)"
            )
    import torch

    device = torch.device(model.device)
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise UsageError(
            f"{flag} from --device {model.device} needs {size} CUDA devices from there, this process sees "
            f"{torch.cuda.device_count()}; give a smaller size or check CUDA_VISIBLE_DEVICES"
        )
