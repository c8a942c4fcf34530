"""One host→device transfer for a step's small arrays (slot mapping, block tables, token ids, ...).

On CUDA the arrays are packed into one reused pinned buffer and copied with `non_blocking=True`;
a CUDA event guards the buffer, so the next step never overwrites bytes still in flight. Elsewhere
each call returns fresh host tensors. Calls must not overlap (steps are serial).
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence

import torch

# int64 first: every group then starts at an offset its element size divides.
DTYPES = (torch.int64, torch.int32, torch.float32)
TYPECODES = ("q", "i", "f")  # the same, as `array` type codes


def host_tensor(arrays: Sequence[Sequence], typecode: str, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of `arrays` concatenated, through `array.array` (C conversion per element, faster
    than `torch.tensor` on a list; lists are taken whole by `fromlist`, faster again than element by element:
    docs/performance.md, "Host time around the GPU work (CPU)"); the same values, since both round a Python
    float to float32 the same way."""
    buffer = array.array(typecode)
    for values in arrays:
        if type(values) is list:
            buffer.fromlist(values)
        else:
            buffer.extend(values)
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


class StepUpload:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._pinned: torch.Tensor | None = None  # [capacity] uint8
        self._copied: torch.cuda.Event | None = None

    def __call__(
        self,
        int64_arrays: Sequence[Sequence[int]],
        int32_arrays: Sequence[Sequence[int]] = (),
        float32_arrays: Sequence[Sequence[float]] = (),
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The arrays as 1-D device tensors, per dtype in the order given."""
        groups = (int64_arrays, int32_arrays, float32_arrays)
        hosts = [host_tensor(g, c, d) for g, c, d in zip(groups, TYPECODES, DTYPES)]
        if self.device.type == "cuda":
            devices = self._copy(hosts)
        else:
            devices = [h.to(self.device) for h in hosts]
        return tuple(list(t.split([len(a) for a in g])) for t, g in zip(devices, groups))

    def _copy(self, hosts: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [h.numel() * h.element_size() for h in hosts]
        offsets = [0, *itertools.accumulate(sizes)]
        pinned = self._buffer(offsets[-1])
        for h, start, end in zip(hosts, offsets, offsets[1:]):
            pinned[start:end].view(h.dtype).copy_(h)
        device = pinned[: offsets[-1]].to(self.device, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return [device[start:end].view(h.dtype) for h, start, end in zip(hosts, offsets, offsets[1:])]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the buffer (normally long ago)
        if self._pinned is None or self._pinned.numel() < nbytes:
            capacity = max(nbytes, 2 * (0 if self._pinned is None else self._pinned.numel()), 1 << 16)
            self._pinned = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        return self._pinned
