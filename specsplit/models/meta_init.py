"""Modules built on the meta device without running their weights' random initialisation.

The loader builds a model's modules on the meta device, then fills every parameter from the checkpoint (or with
seeded dummy weights). A module's constructor still calls `torch.nn.init` on its meta weights, which runs no math
but sends each call through torch's Python reference kernels, whose first use imports `torch._dynamo`: a
noticeable part of every model server's start (docs/design.md §8), for nothing. Inside
`on_meta()` the `torch.nn.init` functions leave their tensor as it is. It is a torch function mode, so it holds
for the thread that entered it only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _NoInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]  # the tensor, left as it is
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules constructed inside are on the meta device, their `torch.nn.init` calls skipped."""
    with torch.device("meta"), _NoInit():
        yield
