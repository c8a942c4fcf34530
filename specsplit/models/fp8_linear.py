"""The one representation of a block-scaled FP8 linear: `Fp8Linear` (e4m3 weight + fp32 block scales).

On CUDA its forward is the Triton W8A8 kernel (`specsplit.kernels.fp8_gemm`): activations quantized per
token and per group of `block_k`, fp32 accumulation, scaled per block. Elsewhere the loader turns every
`Fp8Linear` back into an `nn.Linear` holding the dequantized weight in the compute dtype
(`dequantize_fp8_linears`): the CPU path, which is also the reference the FP8 path is measured against.
An `Fp8Linear` left on the CPU (tests) computes the W8A8 reference in torch.

Fusing projections (q/k/v, gate/up) concatenates weights and scales; where a part's row count is not a
multiple of the scale block's rows, the fused layer carries one scale per row (`scale_block_n` 1), so
every row keeps the scale it had.

Tensor-parallel (`specsplit.models.parallel_layers`): a rank's slice of a column-parallel FP8 weight is whole
blocks of `block_n` rows, of a row-parallel one whole groups of `block_k` columns, and its scales the blocks
its slice covers (`tensor_parallel_shards`); a slice that would cut a block is refused (ValueError, one
line): a rank cannot quantize its activations in the checkpoint's groups, nor scale its rows, from part of one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from specsplit.kernels.fp8_gemm import w8a8_block_linear
from specsplit.kernels.fp8_reference import (
    FP8_DTYPE,
    cdiv,
    dequantize_weight_blockwise,
    quantize_weight_blockwise,
    w8a8_block_linear_reference,
)
from specsplit.models.meta_init import on_meta
from specsplit.models.parallel_layers import Shard

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class Fp8Linear(nn.Module):
    # The loader keeps these parameters in the checkpoint's dtypes whatever the model dtype.
    stored_dtypes = {"weight": FP8_DTYPE, "weight_scale_inv": torch.float32}

    def __init__(self, in_features: int, out_features: int, bias: bool, scale_block_n: int, block_k: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scale_block_n, self.block_k = scale_block_n, block_k
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scale_shape = (cdiv(out_features, scale_block_n), cdiv(in_features, block_k))
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, blocks=[{self.scale_block_n}, {self.block_k}]"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] → [..., out_features] in x's dtype
        args = (self.weight, self.weight_scale_inv, self.bias, self.scale_block_n, self.block_k)
        if x.is_cuda and not _INTERPRETED:
            return w8a8_block_linear(x, *args)
        return w8a8_block_linear_reference(x, *args)

    def dequantized(self, dtype: torch.dtype) -> nn.Linear:
        """An nn.Linear holding W_fp8 * scale_inv (computed in fp32) in `dtype`, on this layer's device."""
        with on_meta():
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        scale = self.weight_scale_inv
        weight = dequantize_weight_blockwise(self.weight, scale, self.scale_block_n, self.block_k, dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.to(dtype), requires_grad=False)
        return linear

    @classmethod
    def quantize(cls, linear: nn.Linear, block_n: int, block_k: int) -> Fp8Linear:
        """`linear`'s weight quantized blockwise (what an FP8 checkpoint of it would store); bias kept."""
        with on_meta():
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None, block_n, block_k)
        weight, scale = quantize_weight_blockwise(linear.weight.detach(), block_n, block_k)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    @classmethod
    def concat(cls, *parts: Fp8Linear) -> Fp8Linear:
        """One layer whose output rows are the parts' rows, in order, each with the scale it had."""
        first = parts[0]
        if any(p.block_k != first.block_k or p.in_features != first.in_features for p in parts):
            raise ValueError("fused FP8 projections need the same in_features and scale group along K")
        aligned = all(p.scale_block_n == first.scale_block_n for p in parts) and all(
            p.out_features % p.scale_block_n == 0 for p in parts[:-1]
        )
        scale_block_n = first.scale_block_n if aligned else 1
        out_features = sum(p.out_features for p in parts)
        with on_meta():
            fused = cls(first.in_features, out_features, first.bias is not None, scale_block_n, first.block_k)
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        scales = [p.weight_scale_inv for p in parts]
        if not aligned:  # one scale per row
            scales = [s.repeat_interleave(p.scale_block_n, 0)[: p.out_features] for s, p in zip(scales, parts)]
        fused.weight_scale_inv = nn.Parameter(torch.cat(scales), requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        return fused


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def _reads_weight_directly(model: nn.Module, name: str) -> bool:
    """Whether the parent of linear `name` uses its weight tensor rather than calling it (its
    `dequantized_linears`, e.g. MLA's kv_b_proj, absorbed into the attention)."""
    parent, _, leaf = name.rpartition(".")
    return leaf in getattr(model.get_submodule(parent), "dequantized_linears", ())


def use_fp8_linears(model: nn.Module, names: list[str], block_n: int, block_k: int) -> None:
    """Replaces the nn.Linear modules `names` of a meta-device `model` by meta `Fp8Linear`s to load into (a
    tensor-parallel rank's: its slices of weight, bias and scales)."""
    for name in names:
        linear = model.get_submodule(name)
        with on_meta():
            layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, block_n, block_k)
        if getattr(linear, "tp_shards", None):
            layer.tp_shards = tensor_parallel_shards(name, linear.tp_shards, block_n, block_k)
        _replace(model, name, layer)


def tensor_parallel_shards(name: str, shards: dict[str, Shard], block_n: int, block_k: int) -> dict[str, Shard]:
    """The slices an `Fp8Linear` replacing sharded linear `name` loads: its weight's and bias's as they were, and
    the scales of the blocks the weight's slice covers; ValueError (one line) for a slice that cuts a block."""
    weight = shards["weight"]
    block = block_n if weight.dim == 0 else block_k
    end = weight.start + weight.size
    if weight.start % block or (weight.size % block and end < weight.full):
        what = "rows" if weight.dim == 0 else "input columns"
        raise ValueError(
            f"{name}: a tensor-parallel rank's {what} [{weight.start}, {end}) of {weight.full} cut its FP8 scale "
            f"blocks of {block}; give a --tensor-parallel-size that splits it into whole blocks"
        )
    scales = Shard(weight.dim, weight.start // block, cdiv(weight.size, block), cdiv(weight.full, block))
    return {**shards, "weight_scale_inv": scales}


def quantize_linears(
    model: nn.Module, names: list[str], block_n: int, block_k: int, weight_of: Callable[[str], torch.Tensor]
) -> None:
    """Replaces the nn.Linear modules `names` (weights still on the meta device, biases filled) by the
    blockwise FP8 quantization of `weight_of(name)`, one at a time: dummy weights in FP8 never hold more
    than one linear's weight in the compute dtype."""
    for name in names:
        linear = model.get_submodule(name)
        linear.weight = nn.Parameter(weight_of(name), requires_grad=False)
        _replace(model, name, Fp8Linear.quantize(linear, block_n, block_k))


def dequantize_fp8_linears(model: nn.Module, dtype: torch.dtype, keep_fp8: bool) -> None:
    """Turns `Fp8Linear`s into dequantized nn.Linear in `dtype`: all of them, or (`keep_fp8`) those whose
    weight their parent reads directly."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Linear) and (not keep_fp8 or _reads_weight_directly(model, name)):
            _replace(model, name, module.dequantized(dtype))
