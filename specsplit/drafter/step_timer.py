"""How long a propose's step 0 and steps 1..k-1 took on the device."""

from __future__ import annotations

import torch


class StepTimer:
    """Splits a propose into step 0 and steps 1..k-1 by device time: the steps are launched without
    waiting, so host clocks only see launches. On CUDA two timing events around steps 1..k-1 (their
    wait is the one device→host wait of the call); elsewhere the work is synchronous and host clocks do."""

    def __init__(self, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if on_cuda else None

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()

    def stop(self) -> None:
        """Records the end and waits for it (and so for everything queued before)."""
        if self._events is not None:
            self._events[1].record()
            self._events[1].synchronize()

    def split(self, t1: int, t2: int) -> int:
        """The wall-clock end of step 0: host `t1` on CPU, `t2` minus the steps' device time on CUDA."""
        if self._events is None:
            return t1
        later_ns = int(self._events[0].elapsed_time(self._events[1]) * 1e6)
        return min(t2, max(t1, t2 - later_ns))
