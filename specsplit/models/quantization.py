"""Which `quantization_config` a checkpoint may have: none, or block-scaled FP8 (DeepSeek-V3's layout).

Block-scaled FP8: `{quant_method: "fp8", weight_block_size: [bn, bk], fmt: "e4m3", activation_scheme:
"dynamic"}`, each quantized linear's `weight` stored in float8_e4m3fn beside a `weight_scale_inv`
(`specsplit.kernels.fp8_reference`). Every other kind (awq, gptq, bitsandbytes, compressed-tensors,
per-tensor FP8, static activation scales, ...) is refused with one line naming what is supported,
never loaded as if its tensors were plain weights.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

SUPPORTED_QUANTIZATION = (
    "unquantized weights, or block-scaled FP8 (quant_method 'fp8' with weight_block_size [bn, bk], bk a power "
    "of two >= 32, fmt 'e4m3', activation_scheme 'dynamic')"
)


@dataclass(frozen=True)
class Fp8BlockQuantization:
    block_n: int  # weight rows one scale covers
    block_k: int  # weight columns one scale covers; activations are quantized in groups of as many
    # modules_to_not_convert / ignored_layers: module names (or name parts) kept unquantized; the
    # checkpoint says per tensor anyway (a weight_scale_inv beside it), dummy weights follow this list
    not_converted: tuple[str, ...] = ()


def read_quantization(raw: dict[str, Any], path: pathlib.Path) -> Fp8BlockQuantization | None:
    """The quantization of config.json `raw` (in checkpoint directory `path`); raises ValueError for
    one specsplit does not implement."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    where = str(path / "config.json")

    def refuse(what: str) -> ValueError:
        return ValueError(f"{what} in {where!r} is not supported; supported: {SUPPORTED_QUANTIZATION}")

    if not isinstance(qc, dict):
        raise refuse(f"quantization_config {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise refuse(f"quantization_config with quant_method {method!r}")
    block = qc.get("weight_block_size")
    if block is None:
        raise refuse("per-tensor FP8 (quantization_config without weight_block_size)")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
        or block[1] < 32
        or block[1] & (block[1] - 1)
    ):
        raise refuse(f"FP8 weight_block_size {block!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"FP8 fmt {qc['fmt']!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(f"FP8 activation_scheme {qc['activation_scheme']!r}")
    not_converted = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    return Fp8BlockQuantization(block_n=block[0], block_k=block[1], not_converted=not_converted)
