"""One host→device transfer for a step's small integer arrays (slot mapping, block tables, ...).

On CUDA the arrays are packed into one reused pinned buffer and copied with `non_blocking=True`;
a CUDA event guards the buffer, so the next step never overwrites bytes still in flight. Elsewhere
each call returns fresh host tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class StepUpload:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._pinned: torch.Tensor | None = None  # [capacity] uint8
        self._copied: torch.cuda.Event | None = None

    def __call__(
        self, int64_arrays: Sequence[Sequence[int]], int32_arrays: Sequence[Sequence[int]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The arrays as 1-D device tensors, int64 ones first, in the order given."""
        host64 = torch.tensor(list(itertools.chain.from_iterable(int64_arrays)), dtype=torch.int64)
        host32 = torch.tensor(list(itertools.chain.from_iterable(int32_arrays)), dtype=torch.int32)
        if self.device.type == "cuda":
            host64, host32 = self._copy(host64, host32)
        else:
            host64, host32 = host64.to(self.device), host32.to(self.device)
        sizes64, sizes32 = [len(a) for a in int64_arrays], [len(a) for a in int32_arrays]
        return list(host64.split(sizes64)), list(host32.split(sizes32))

    def _copy(self, host64: torch.Tensor, host32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n64, n32 = host64.numel() * 8, host32.numel() * 4  # int64 first keeps both views aligned
        pinned = self._buffer(n64 + n32)
        pinned[:n64].view(torch.int64).copy_(host64)
        pinned[n64 : n64 + n32].view(torch.int32).copy_(host32)
        device = pinned[: n64 + n32].to(self.device, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return device[:n64].view(torch.int64), device[n64:].view(torch.int32)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the buffer (normally long ago)
        if self._pinned is None or self._pinned.numel() < nbytes:
            capacity = max(nbytes, 2 * (0 if self._pinned is None else self._pinned.numel()), 1 << 16)
            self._pinned = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        return self._pinned
