"""Which GPU a model server's threads work on.

CUDA's current device is a property of the host thread, and Triton launches its kernels on the
current device: a server whose weights live on ``cuda:1`` must make ``cuda:1`` current on every
thread that runs model work (loading, graph capture, steps, transport set-up), not only on the main
thread. Every executor a model server creates comes from here.
"""

from __future__ import annotations

import concurrent.futures

import torch


def use_device(device: str | torch.device) -> None:
    """Make ``device`` this thread's current CUDA device (nothing to do for the CPU, nor for a bare
    ``cuda``, which means whatever device is current)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def device_executor(device: str | torch.device, max_workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads all work on ``device``."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers, thread_name_prefix=name, initializer=use_device, initargs=(device,)
    )
