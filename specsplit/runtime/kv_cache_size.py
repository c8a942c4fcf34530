"""How many KV cache blocks a model server gets from `--gpu-memory-utilization F` (vLLM's meaning): the
server may use F × the device's total memory; what its weights, CUDA graphs and step workspace take at
their peak comes first, the KV cache gets the rest. Pure arithmetic on byte counts (no torch): the
numbers come from `specsplit.runtime.memory_profile`, which measures them at start-up on CUDA.

Two services on one device (a co-located drafter beside its verifier) each have their own F; their
F's must add up to less than 1 (`specsplit up` splits its `--gpu-memory-utilization`: `service_shares`).
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.client.errors import UsageError

GPU_MEMORY_UTILIZATION = 0.9  # a model server's default F on CUDA, vLLM's
COLOCATED_DRAFTER_SHARE = 0.1  # of the device, a co-located drafter's F; its verifier gets the rest of `up`'s F
CPU_NUM_BLOCKS = 1024  # --num-blocks on a CPU device when none is given
# Of a share, what the cache leaves free for the allocations that come after the profile (the CUDA graphs captured
# again on the real cache, the allocator's rounding), which overshoot a share without it; chosen by measurement
# (tests/gpu/test_memory_sizing_cuda.py; docs/deployment.md, "GPU memory and the KV cache").
HEADROOM = 1 / 200
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryUse:
    """One model server's use of its device, in bytes, measured before its KV cache is allocated."""

    total: int  # the device's memory
    weights: int  # its weights, once loaded
    peak: int  # its peak over loading, graph capture and a warm-up step of the largest size (weights included)
    probe_cache: int  # of `peak`, a small KV cache the warm-up ran on (it goes; the real cache replaces it)


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    block_size: int  # tokens per block
    block_bytes: int  # over all the cache's layers
    source: str  # how num_blocks was chosen, for the start-up log line

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """The start-up log line."""
        gib = self.num_blocks * self.block_bytes / GIB
        return (
            f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {self.num_tokens} tokens "
            f"({gib:.3g} GiB), {self.source}"
        )


def blocks_from_memory(
    fraction: float,  # --gpu-memory-utilization
    use: MemoryUse,
    block_bytes: int,
    block_size: int,
    max_model_len: int,  # tokens one request may hold: the cache must hold at least one such request
    max_model_len_flag: str | None = "--max-model-len",  # the flag that lowers it, if the server has one
) -> KVCacheSize:
    """floor((fraction × total × (1 − HEADROOM) − peak without the probe cache) / block_bytes) blocks; UsageError
    (one line) when the weights alone exceed the share or the rest holds fewer tokens than one `max_model_len`
    request."""
    if block_bytes < 1 or block_size < 1:
        raise ValueError(f"block_bytes and block_size must be >= 1, got {block_bytes}, {block_size}")
    check_weights_fit(fraction, use.total, use.weights)
    share = fraction * use.total
    flag = f"--gpu-memory-utilization {fraction:g}"
    without_cache = use.peak - use.probe_cache
    num_blocks = max(0, int((share * (1 - HEADROOM) - without_cache) // block_bytes))
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise UsageError(
            f"{flag} of {use.total / GIB:.2f} GiB leaves {max(0.0, share - without_cache) / GIB:.2f} GiB after "
            f"weights and workspace ({without_cache / GIB:.2f} GiB): {num_blocks} KV cache blocks of {block_size} "
            f"tokens, fewer than the {needed} one request of max_model_len {max_model_len} needs; raise "
            f"{flag.split()[0]}" + (f" or lower {max_model_len_flag}" if max_model_len_flag else "")
        )
    used = (without_cache + num_blocks * block_bytes) / GIB
    return KVCacheSize(
        num_blocks,
        block_size,
        block_bytes,
        f"from {flag}: {used:.2f} of {share / GIB:.2f} GiB (weights {use.weights / GIB:.2f} GiB, peak without "
        f"the cache {without_cache / GIB:.2f} GiB)",
    )


def check_weights_fit(fraction: float, total: int, weights: int) -> None:
    """UsageError (one line) when the weights alone take more than `fraction` of `total` bytes."""
    if not 0 < fraction <= 1:
        raise UsageError(f"--gpu-memory-utilization {fraction} is out of range; give a fraction in (0, 1]")
    share = fraction * total
    if weights > share:
        raise UsageError(
            f"the weights alone take {weights / GIB:.2f} GiB, more than --gpu-memory-utilization {fraction:g} of "
            f"{total / GIB:.2f} GiB ({share / GIB:.2f} GiB); raise --gpu-memory-utilization, use a device with more "
            "memory, or a smaller dtype"
        )


def check_free(fraction: float, total: int, free: int) -> None:
    """UsageError (one line) when less than `fraction` of `total` bytes was free as this server started: other
    processes on the device hold more than 1 - F of it (two servers on one device whose F's add up past 1)."""
    share = fraction * total
    if free < share:
        raise UsageError(
            f"--gpu-memory-utilization {fraction:g} asks for {share / GIB:.2f} GiB of the device, but only "
            f"{free / GIB:.2f} GiB were free at start-up (other processes hold the rest); lower it so that the shares "
            "of the processes on the device add up below 1"
        )


def given_blocks(num_blocks: int, block_size: int, block_bytes: int, on_cuda: bool) -> KVCacheSize:
    """--num-blocks as given (on CUDA it overrides sizing from memory)."""
    source = "--num-blocks (overrides --gpu-memory-utilization)" if on_cuda else "--num-blocks"
    return KVCacheSize(num_blocks, block_size, block_bytes, source)


def service_shares(
    fraction: float | None, devices: dict[str, str], verifier_ranks: int = 1, drafter_ranks: int = 1
) -> dict[str, float]:
    """`specsplit up --gpu-memory-utilization F` (None: `GPU_MEMORY_UTILIZATION`): the F of each model server
    (role → its device) on a CUDA device. On a device of its own a service gets F; a drafter sharing its
    verifier's device gets `COLOCATED_DRAFTER_SHARE` and the verifier F minus that, so the two add up to F.
    A tensor-parallel verifier (`verifier_ranks` > 1) has the devices from its own on, one per rank, each of
    the same F: a drafter on any of them takes its share from every rank's. So does a tensor-parallel drafter
    (`drafter_ranks` > 1, the devices from its own on) with any of its ranks on one of the verifier's.
    UsageError (one line) for an F given with no service on CUDA, or one that leaves a co-located verifier nothing."""
    on_cuda = {role: _cuda(device) for role, device in devices.items() if _cuda(device)}
    if not on_cuda:
        if fraction is not None:
            raise UsageError(
                "--gpu-memory-utilization sizes the KV caches from CUDA device memory, not on "
                f"--device {devices.get('verifier', 'cpu')}; leave it out on the CPU"
            )
        return {}
    f = GPU_MEMORY_UTILIZATION if fraction is None else fraction
    if not 0 < f <= 1:
        raise UsageError(f"--gpu-memory-utilization {f} is out of range; give a fraction in (0, 1]")
    shares = dict.fromkeys(on_cuda, f)
    ranks = {"verifier": verifier_ranks, "drafter": drafter_ranks}
    used = {
        role: {f"cuda:{int(device.split(':')[1]) + rank}" for rank in range(ranks[role])}
        for role, device in on_cuda.items()
    }
    if used.get("drafter", set()) & used.get("verifier", set()):
        verifier = round(f - COLOCATED_DRAFTER_SHARE, 6)
        if verifier <= 0:
            raise UsageError(
                f"--gpu-memory-utilization {f:g}: a drafter on the verifier's device takes {COLOCATED_DRAFTER_SHARE:g} "
                f"of it, which leaves the verifier nothing; give more than {COLOCATED_DRAFTER_SHARE:g}"
            )
        shares.update(verifier=verifier, drafter=COLOCATED_DRAFTER_SHARE)
    return shares


def _cuda(device: str) -> str | None:
    """A CUDA device's name with its index (bare `cuda` is device 0 of a new process); None for another device."""
    if not device.startswith("cuda"):
        return None
    return device if ":" in device else f"{device}:0"
