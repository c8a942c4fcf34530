"""The sharded pieces of a tensor-parallel model: column- and row-parallel linears, the vocab-parallel
embedding and LM head.

Each rank builds its modules at its slice's size and records, per parameter, which slice of the checkpoint
tensor it holds (`Shard`, in the module's `tp_shards`); the loader reads only that slice, before the tensor
reaches the device (`specsplit.models.loader`), and random weights are sliced the same way, so a rank never
holds the whole model. With one rank these are plain `nn.Linear` / `nn.Embedding` without shards.

- column-parallel: output rows split (q/k/v heads, gate/up). The outputs stay split: what follows is local.
- row-parallel: input columns split (o_proj, down_proj); each rank's output is a partial sum, which the
  caller all-reduces (`parallel.all_reduce`). Its bias lives on the first rank only (zeros elsewhere), so
  the sum adds it once and `linear` (the GEMV too) runs unchanged.
- a dimension split by default (an MLP's width) splits in equal parts; built inside `whole_blocks(unit)` (a
  block-scaled FP8 checkpoint), in whole multiples of `unit`, as evenly as whole units go (the last rank's part
  may end in a partial unit, where the tensor ends), so no rank holds part of a scale block.
- vocab-parallel: the embedding's and the LM head's vocabulary rows split in equal parts (the last padded
  with zero rows); an embedding row not in a rank's part is zero there, the all-reduce fills it in; the LM
  head's logits are gathered to the first rank (`compute_logits`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.models.parallel import all_reduce, gather_last_dim_to_first, tp_rank, tp_size


@dataclass(frozen=True)
class Shard:
    """A parameter's slice of its checkpoint tensor: indices [start, start + size) of dimension `dim`, whose
    checkpoint length is `full` (indices past it read as zeros: vocab padding); `zero`: all zeros (a
    row-parallel bias off the first rank)."""

    dim: int
    start: int
    size: int
    full: int
    zero: bool = False

    def full_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's shape, given this slice's."""
        return tuple(self.full if d == self.dim else n for d, n in enumerate(shape))

    def take(self, tensor) -> torch.Tensor:
        """This slice of `tensor` (a torch tensor or a safetensors slice, indexed before it is read)."""
        shape = tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)
        if self.zero:
            return torch.zeros(shape) if hasattr(tensor, "get_shape") else torch.zeros_like(tensor)
        end = min(self.start + self.size, self.full)
        index = (slice(None),) * self.dim + (slice(self.start, end),)
        part = tensor[index]
        if end - self.start < self.size:  # the vocabulary's padding rows
            pad = list(part.shape)
            pad[self.dim] = self.size - (end - self.start)
            part = torch.cat([part, part.new_zeros(pad)], dim=self.dim)
        return part


def shard_of(model: nn.Module, param_name: str) -> Shard | None:
    """The slice parameter `param_name` of `model` holds (None: the whole tensor)."""
    module_name, _, leaf = param_name.rpartition(".")
    return getattr(model.get_submodule(module_name), "tp_shards", {}).get(leaf)


def _with_shards(module: nn.Module, **shards: Shard) -> nn.Module:
    if tp_size() > 1:
        module.tp_shards = shards
    return module


def column_parallel_linear(
    in_features: int, out_features: int, bias: bool, *, start: int | None = None, size: int | None = None
) -> nn.Linear:
    """The rank's output rows [start, start + size) of a linear of `out_features` (default: an equal part)."""
    if start is None:
        start, size = _equal_part(out_features)
    shard = Shard(0, start, size, out_features)
    layer = nn.Linear(in_features, size, bias=bias)
    return _with_shards(layer, weight=shard, **({"bias": shard} if bias else {}))


def row_parallel_linear(in_features: int, out_features: int, bias: bool, *, start: int | None = None, size=None):
    """The rank's input columns [start, start + size) of a linear over `in_features` (default: an equal part);
    its output is a partial sum (the caller all-reduces), its bias the first rank's only."""
    if start is None:
        start, size = _equal_part(in_features)
    layer = nn.Linear(size, out_features, bias=bias)
    bias_shard = Shard(0, 0, out_features, out_features, zero=tp_rank() != 0)
    return _with_shards(layer, weight=Shard(1, start, size, in_features), **({"bias": bias_shard} if bias else {}))


_split_unit = 1  # `whole_blocks`: the unit of the dimensions split by default, while a model is built


@contextlib.contextmanager
def whole_blocks(unit: int) -> Iterator[None]:
    """Modules built inside split their default-parted dimensions in whole multiples of `unit` (a block-scaled
    FP8 checkpoint's lcm(bn, bk)); where the units do not divide into the ranks, the parts differ by one unit."""
    global _split_unit
    previous, _split_unit = _split_unit, unit
    try:
        yield
    finally:
        _split_unit = previous


def _equal_part(total: int) -> tuple[int, int]:
    unit = _split_unit
    if unit > 1 and total % (tp_size() * unit):
        units = -(-total // unit)
        first, end = tp_rank() * units // tp_size(), (tp_rank() + 1) * units // tp_size()
        if first == end:
            raise ValueError(
                f"a dimension of {total} has fewer blocks of {unit} than {tp_size()} tensor-parallel ranks"
            )
        return first * unit, min(end * unit, total) - first * unit
    size = total // tp_size()
    if size * tp_size() != total:
        raise ValueError(f"a dimension of {total} does not divide into {tp_size()} tensor-parallel ranks")
    return tp_rank() * size, size


def vocab_part(vocab_size: int) -> tuple[int, int]:
    """(start, size) of the rank's vocabulary rows: equal parts, the last one padded."""
    size = -(-vocab_size // tp_size())
    return tp_rank() * size, size


class VocabParallelEmbedding(nn.Embedding):
    """The rank's vocabulary rows; each token's embedding comes from the rank holding it (all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.vocab_start, size = vocab_part(vocab_size)
        super().__init__(size, hidden_size)
        _with_shards(self, weight=Shard(0, self.vocab_start, size, vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] → [T, hidden]
        if tp_size() == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(held, local, 0), self.weight)
        return all_reduce(out * held[:, None].to(out.dtype))


def lm_head(hidden_size: int, vocab_size: int) -> nn.Linear:
    """The LM head's vocabulary rows of this rank (`gather_logits` puts the logits together)."""
    start, size = vocab_part(vocab_size)
    return _with_shards(nn.Linear(hidden_size, size, bias=False), weight=Shard(0, start, size, vocab_size))


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    # local: [N, vocab part] float32 → [N, vocab] on the first rank, None on the others
    return gather_last_dim_to_first(local, vocab_size)
