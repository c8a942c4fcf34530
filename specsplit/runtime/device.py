"""Which GPU a model server's threads work on.

CUDA's current device is a property of the host thread, and Triton launches its kernels on the
current device: a server whose weights live on ``cuda:1`` must make ``cuda:1`` current on every
thread that runs model work (loading, graph capture, steps, transport set-up), not only on the main
thread. Every executor a model server creates comes from here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


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


class StepThread:
    """One thread that runs a model server's steps, in submission order, on ``device``.

    ``await step_thread.run(fn, *args)`` is ``loop.run_in_executor(pool, fn, *args)`` with one
    worker, less its per-call cost: the worker resolves the caller's asyncio future itself
    (``call_soon_threadsafe``) instead of chaining a ``concurrent.futures.Future`` to it, one
    callback instead of three on the event loop per step. A caller cancelled while its call runs
    does not stop the call (as with an executor); its result is dropped.
    """

    def __init__(self, device: str | torch.device, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, args=(device,), name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        """Ends the thread once the calls already submitted have run."""
        self._queue.put(None)

    def _work(self, device: str | torch.device) -> None:
        use_device(device)
        while (call := self._queue.get()) is not None:
            loop, future, fn, args = call
            try:
                result, error = fn(*args), None
            except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
                result, error = None, err
            try:
                loop.call_soon_threadsafe(_resolve, future, result, error)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass
            del call, loop, future, fn, args, result, error


def _resolve(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class DeviceClaim:
    """`claim()` queues a one-element kernel on ``device``'s current stream. A service calls it as soon
    as the other service is done with the GPU and its own work is next (the drafter: a Propose arrived;
    the verifier: its drafts are in), before the host plans its step. Not earlier: a kernel queued
    while the other process still works takes the GPU from it.

    Two processes on one GPU (the verifier and the drafter) take turns on it, and a turn that starts
    while the other process's context still holds the GPU waits for the switch. Claiming first starts
    the switch early, so part of it overlaps the host work (the claim's own launch can wait for the rest)
    and the step waits less (docs/performance.md, "One iteration on one clock"). Nothing to do off CUDA."""

    def __init__(self, device: str | torch.device):
        device = torch.device(device)
        self._flag = torch.ones(1, device=device) if device.type == "cuda" else None

    def claim(self) -> None:
        if self._flag is not None:
            self._flag.neg_()
