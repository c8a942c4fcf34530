"""A model server's KV cache, sized on CUDA from `--gpu-memory-utilization` (`specsplit.runtime.kv_cache_size`).

The order at start-up (`size_kv_cache`): the weights load; a runner is built on a small probe cache, which
captures its CUDA graphs (steps of up to 512 tokens) and runs its warm-up (the rejection sampler's kernels, eager
steps of 16 × 128 and 1 × 1,024 tokens: `EAGER_WARM_UP_STEPS`), so the process's peak is seen (a coordinator whose
--max-num-batched-tokens is past 1,024 makes larger eager steps than were measured); that runner and its cache
go; the real cache gets what is left of the share; the real runner captures its graphs against it and warms up
again. Graphs bake in the cache's address, so they are captured twice (the second capture reuses the compiled
kernels).

What this process uses is measured from its own side: torch's peak reserved memory (its caching allocator:
weights, activations, graph pools, allocator slack) plus what grew outside torch since the baseline (cuBLAS,
Triton modules, graph objects: the device's used memory minus torch's, before and after). The device's free
memory is not used for the size: another process on the device (a co-located drafter) holds some of it; it is
only checked to hold the share at start-up. The CUDA context
created before the baseline (a few hundred MiB) is outside F, as in vLLM. A device's free memory also moves when
another process loads beside this one, so co-located services take turns measuring (`device_memory_lock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from specsplit.models.kv_cache import PagedBlocks
from specsplit.runtime.kv_cache_size import (
    GPU_MEMORY_UTILIZATION,
    KVCacheSize,
    MemoryUse,
    blocks_from_memory,
    check_free,
    check_weights_fit,
    given_blocks,
)
from specsplit.runtime.warm_up import EAGER_WARM_UP_STEPS

log = logging.getLogger(__name__)
Runner = TypeVar("Runner")
LOCK_FILE = "device-memory.lock"


@contextlib.contextmanager
def device_memory_lock(directory: str | None) -> Iterator[None]:
    """Holds an exclusive lock on `directory`/device-memory.lock (the socket directory co-located services
    share) while this process measures its device memory, so the other one loads before or after; no lock
    without a directory (nothing shares it)."""
    if directory is None:
        yield
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # the directory is removed when empty, at the services' exit
                os.unlink(path)
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class DeviceBaseline:
    """The device as this process found it before loading anything (its CUDA context already made)."""

    device: torch.device
    total: int
    free: int
    reserved: int
    allocated: int

    @classmethod
    def take(cls, device: str | torch.device) -> DeviceBaseline:
        device = torch.device(device)
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        torch.cuda.reset_peak_memory_stats(device)
        return cls(device, total, free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))

    def weights(self) -> int:
        """What torch allocated since the baseline: the weights, once they are loaded (call it then)."""
        return torch.cuda.memory_allocated(self.device) - self.allocated

    def forget_loading(self) -> None:
        """Lets go of what loading the weights held only for a while, so that the peak counts the weights and
        then the steps', not the loader's (call it once they are loaded)."""
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        """This process's peak since the baseline: torch's peak reserved memory, plus what grew outside torch."""
        torch.cuda.synchronize(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        outside_torch = max(0, (self.free - free) - (reserved - self.reserved))
        return torch.cuda.max_memory_reserved(self.device) - self.reserved + outside_torch


def cache_bytes(cache: PagedBlocks) -> int:
    """Bytes of a cache's tensors."""
    return sum(t.nbytes for t in vars(cache).values() if isinstance(t, torch.Tensor))


def probe_blocks(block_size: int, steps: tuple[tuple[int, int], ...] = EAGER_WARM_UP_STEPS) -> int:
    """Blocks the largest warm-up step needs: the probe cache's size."""
    return max(n * -(-tokens // block_size) for n, tokens in steps)


def size_kv_cache(
    make_cache: Callable[[int], PagedBlocks],  # num_blocks → a cache on the device
    make_runner: Callable[[PagedBlocks], Runner],  # captures graphs and warms up on CUDA
    *,
    block_size: int,
    num_blocks: int | None,  # --num-blocks (it overrides); None: from memory (CUDA)
    fraction: float | None,  # --gpu-memory-utilization; None: GPU_MEMORY_UTILIZATION
    max_model_len: int,  # the cache must hold one request this long
    baseline: DeviceBaseline | None,  # taken before the weights loaded; None: not on CUDA
    max_model_len_flag: str | None = "--max-model-len",  # the server's flag that lowers max_model_len, if any
    agree: Callable[[int], int] | None = None,  # a block count sized from memory → the one every rank uses
) -> tuple[PagedBlocks, Runner, KVCacheSize]:
    """The cache, its runner and how it was sized (logged); UsageError (one line) when the weights or one
    `max_model_len` request do not fit the share. `agree` (a tensor-parallel verifier: the least over its
    ranks, `parallel.min_over_ranks`) is called by every rank that sizes from memory, once it has its own
    count: the first rank's block plans index every rank's cache, so all hold the same number of blocks."""
    block_bytes = cache_bytes(make_cache(1))
    if num_blocks is not None:
        size = given_blocks(num_blocks, block_size, block_bytes, on_cuda=baseline is not None)
    elif baseline is None:
        raise ValueError("sizing the KV cache from memory needs a CUDA device and its baseline")
    else:
        f = GPU_MEMORY_UTILIZATION if fraction is None else fraction
        check_free(f, baseline.total, baseline.free)
        weights = baseline.weights()
        check_weights_fit(f, baseline.total, weights)  # before seconds of graph capture
        baseline.forget_loading()
        probe = make_cache(probe_blocks(block_size))
        runner = make_runner(probe)
        use = MemoryUse(baseline.total, weights, baseline.peak(), cache_bytes(probe))
        del runner, probe
        gc.collect()  # the graphs and the probe cache, before the allocator lets their memory go
        torch.cuda.empty_cache()
        size = blocks_from_memory(f, use, block_bytes, block_size, max_model_len, max_model_len_flag)
        if agree is not None:
            agreed = agree(size.num_blocks)  # <= this rank's: it fits here too, and holds max_model_len
            if agreed != size.num_blocks:
                source = f"{size.source}; the least over the tensor-parallel ranks (this rank's: {size.num_blocks})"
                size = dataclasses.replace(size, num_blocks=agreed, source=source)
    cache = make_cache(size.num_blocks)
    runner = make_runner(cache)
    log.info(size.describe())
    return cache, runner, size
