"""Tensor parallelism's process state and collectives, over torch.distributed (NCCL on GPUs, gloo on CPU).

A tensor-parallel model runs as `size` processes, one per device, each holding a slice of the weights
(`specsplit.models.parallel_layers`) and taking part in the same collectives at the same points of every
forward. Rank 0 is the *first rank*: it alone speaks gRPC and samples; the others are *followers* that run
each step rank 0 broadcasts (`specsplit.runtime.tensor_parallel`).

Two process groups: the *device group* (the default one: NCCL on CUDA, gloo on CPU) carries the model's
all-reduces and the logits gather inside a forward, capturable in a CUDA graph on NCCL; the *control group*
(always gloo, on the host) carries the step descriptions rank 0 broadcasts, so a follower's wait for the
next step costs no device work. The control group waits without a deadline (a verifier may be idle for
hours); a peer that dies closes its sockets, which ends any wait at once. This group is not the NCCL
hidden-state transport's (`specsplit.transport.nccl`), which is a separate rendezvous of its own.

With no tensor parallelism set up (`init_tensor_parallel` never called) every process is rank 0 of 1 and
every collective here returns its input: single-device models pay nothing.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The control group's wait for the next step: effectively none (see the module's docstring).
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelStartError(RuntimeError):
    """A rank did not join the group in time (the message is one line for the user)."""


@dataclass(frozen=True)
class TensorParallelState:
    rank: int
    size: int
    device_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup | None


_state = TensorParallelState(rank=0, size=1, device_group=None, control_group=None)
# Benchmarks only (`time_collectives`): called around every device collective, else None.
_collective_timer = None


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def init_tensor_parallel(
    rank: int, size: int, address: str, *, backend: str, timeout_s: float, device: torch.device | str = "cpu"
) -> None:
    """Joins this process as `rank` of `size` at the rendezvous `address` (HOST:PORT, hosted by rank 0).
    `backend`: "nccl" or "gloo". Raises TensorParallelStartError when the group is not complete within
    `timeout_s` (a rank that never joins), also the timeout of each device collective."""
    global _state
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of {size}")
    if size == 1:
        _state = TensorParallelState(0, 1, None, None)
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=size,
            timeout=timeout,
            device_id=torch.device(device) if backend == "nccl" else None,
        )
        control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
        dist.barrier(group=control)  # every rank is in before the first step
    except Exception as err:  # noqa: BLE001 (torch raises several kinds: DistStoreError, RuntimeError, ...)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TensorParallelStartError(
            f"tensor-parallel group of {size} ranks at {address} not formed within {timeout_s:g} s "
            f"(rank {rank}): {first_line}"
        ) from err
    _state = TensorParallelState(rank, size, dist.group.WORLD, control)


def destroy_tensor_parallel() -> None:
    global _state
    if _state.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallelState(0, 1, None, None)


def time_collectives(timer) -> None:
    """Benchmarks: `timer` (a context manager factory, e.g. CUDA events) wraps every device collective from now
    on; None stops. Eager steps only (a CUDA graph's replay runs what was captured)."""
    global _collective_timer
    _collective_timer = timer


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place (a row-parallel layer's partial outputs)."""
    if _state.size > 1:
        if _collective_timer is None:
            dist.all_reduce(x, group=_state.device_group)
        else:
            with _collective_timer():
                dist.all_reduce(x, group=_state.device_group)
    return x


def gather_last_dim_to_first(x: torch.Tensor, full_size: int) -> torch.Tensor | None:
    """Every rank's `x` [..., n] concatenated along the last dimension and cut to `full_size`, on the first
    rank; None on the others (the vocab-parallel LM head: only the sampler, on rank 0, needs the logits)."""
    if _state.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.size)] if _state.rank == 0 else None
    if _collective_timer is None:
        dist.gather(x, parts, dst=0, group=_state.device_group)
    else:
        with _collective_timer():
            dist.gather(x, parts, dst=0, group=_state.device_group)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[..., :full_size]


def broadcast_tensor_from_first(x: torch.Tensor) -> torch.Tensor:
    """The first rank's `x`, in place on every rank (the others pass a tensor of its shape and dtype), over the
    device group: e.g. a drafter's hidden states or the drafts its first rank picked."""
    if _state.size > 1:
        dist.broadcast(x, src=0, group=_state.device_group)
    return x


def broadcast_from_first(obj: object = None) -> object:
    """`obj` of the first rank, on every rank (the followers pass nothing): a step description, over the
    control group. Raises when a rank is gone."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_state.control_group)
    return box[0]


def min_over_ranks(value: int) -> int:
    """The least of every rank's `value` (each rank calls it), over the control group: e.g. the KV cache's
    blocks, sized from each rank's device memory, which must be one count on every rank."""
    if _state.size == 1:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=_state.control_group)
    return int(box.item())


def wait_for_ranks() -> None:
    """Returns once every rank has called it (over the control group): e.g. every rank ready to serve."""
    if _state.size > 1:
        dist.barrier(group=_state.control_group)
