"""Where a drafter runs relative to its verifier: the one choice that sets every hop's path.

- `colocated` — the drafter shares its verifier's host and GPU (a process beside it; on Kubernetes the
  same pod): ProposeStream on the drafter's Unix socket, hidden states through a CUDA IPC buffer ring
  with the device hand-off (on CPU: bytes in the Propose), exactly one drafter.
- `pooled` — the drafter runs on GPUs of its own, any number of replicas behind one DNS name:
  ProposeStream over gRPC, or on the drafter's own Unix socket where that is on the verifier's host
  (`PoolChannel` asks each replica at each new channel), hidden states as bytes in the Propose
  (`grpc`, any number of replicas) or by NCCL to one dedicated drafter (`nccl`, same host over NVLink
  or across hosts with RDMA).

The coordinator runs beside its verifier in both (same host; on Kubernetes the same pod): VerifyStream
on the verifier's Unix socket. Verifier and drafter each resolve the placement they are given on their
own device; the verifier refuses a drafter whose hidden-state transport differs. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

PLACEMENTS = ("colocated", "pooled")
POOLED_TRANSPORTS = ("grpc", "nccl")
DEFAULT_PLACEMENT = "colocated"


@dataclass(frozen=True)
class Placement:
    name: str
    hidden_transport: str  # grpc, cuda_ipc or nccl

    @property
    def drafter_rpc(self) -> str:
        """The verifier → drafter control path: `local` (the drafter's Unix socket, driven by the verifier's step
        thread) or `stream` (through the event loop to each replica: gRPC's stream, or the replica's socket where
        that is on this host)."""
        return "local" if self.name == "colocated" else "stream"

    @property
    def device_hand_off(self) -> bool:
        """Greedy decode steps send their Propose as soon as the step is queued (cuda_ipc only)."""
        return self.hidden_transport == "cuda_ipc"


def resolve_placement(name: str, device: str, hidden_transport: str | None = None) -> Placement:
    """The placement `name` for a model server on `device`. `hidden_transport`: pooled only (grpc or
    nccl, default grpc); co-located it follows from the device (cuda_ipc on CUDA, else grpc)."""
    if name not in PLACEMENTS:
        raise ValueError(f"unknown placement {name!r}; choose one of {', '.join(PLACEMENTS)}")
    if name == "colocated":
        if hidden_transport is not None:
            raise ValueError(
                "--hidden-transport applies to a pooled drafter; a co-located one uses cuda_ipc on CUDA (grpc on CPU)"
            )
        return Placement(name, "cuda_ipc" if device.partition(":")[0] == "cuda" else "grpc")
    transport = hidden_transport or "grpc"
    if transport not in POOLED_TRANSPORTS:
        raise ValueError(
            f"a pooled drafter takes --hidden-transport {' or '.join(POOLED_TRANSPORTS)}, not {transport!r}"
        )
    return Placement(name, transport)


def add_placement_arguments(p: argparse.ArgumentParser, sockets: bool = True) -> None:
    """`--placement`, for a pooled drafter `--hidden-transport`, and (`sockets`: `serve verifier|drafter`)
    `--socket-dir`."""
    p.add_argument(
        "--placement",
        default=DEFAULT_PLACEMENT,
        choices=PLACEMENTS,
        help="colocated: the drafter shares the verifier's GPU (Unix socket, CUDA IPC, device hand-off; one "
        "drafter); pooled: drafters on GPUs of their own (gRPC, any number of replicas). Verifier and "
        "drafter take the same placement",
    )
    p.add_argument(
        "--hidden-transport",
        default=None,
        choices=POOLED_TRANSPORTS,
        help="pooled only: grpc (bytes in each Propose, any number of replicas; the default) or nccl "
        "(torch.distributed send to one dedicated drafter, rendezvous hosted by the verifier)",
    )
    if sockets:
        p.add_argument(
            "--socket-dir",
            default=None,
            metavar="DIR",
            help="where this server's Unix sockets go: the verifier's VerifyStream for its coordinator, a co-located "
            "drafter's ProposeStream for its verifier (default: a private directory under $TMPDIR, removed at exit; "
            "on Kubernetes a volume the pod's containers share). A given directory is made if missing and removed at "
            "exit if this server leaves it empty",
        )
