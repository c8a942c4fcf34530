"""How an iteration's hidden states travel from the verifier to the drafter.

The verifier holds a `HiddenStatesSender`, the drafter a `HiddenStatesReceiver` of the same name:
- `grpc`     — raw bytes inside the ProposeRequest (the default: portable, any placement);
- `cuda_ipc` — a ring of verifier GPU buffers shared once by CUDA IPC; each Propose names a slot
               and the drafter peer-copies the rows out (processes on one host);
- `nccl`     — a torch.distributed point-to-point send paired with each Propose, gRPC carries only
               the control message (same host over NVLink/PCIe, or across hosts with RDMA;
               backend `gloo` is the CPU stand-in).
Only this module is torch-free, so command lines can offer the names without importing torch.
"""

from __future__ import annotations

TRANSPORTS = ("grpc", "cuda_ipc", "nccl")


def make_sender(name: str, **options):
    """The verifier side. Options: nccl `rendezvous`, `backend` (default: nccl on CUDA, gloo on CPU), `timeout_s`;
    cuda_ipc `num_slots` (default `RING_SLOTS`), `device_hand_off` (offer the drafter device hand-offs, default
    True)."""
    if name == "grpc":
        from specsplit.transport.grpc_bytes import GrpcSender

        return GrpcSender()
    if name == "cuda_ipc":
        from specsplit.transport.cuda_ipc import RING_SLOTS, CudaIpcSender

        return CudaIpcSender(
            num_slots=options.get("num_slots", RING_SLOTS), offer_hand_off=options.get("device_hand_off", True)
        )
    if name == "nccl":
        from specsplit.transport.nccl import NcclSender

        return NcclSender(
            options.get("rendezvous", "127.0.0.1:0"), options.get("backend"), options.get("timeout_s", 30)
        )
    raise ValueError(f"unknown hidden-state transport {name!r}; choose one of {', '.join(TRANSPORTS)}")


def make_receiver(name: str, device: str, hidden_size: int):
    """The drafter side, delivering rows on `device`."""
    if name == "grpc":
        from specsplit.transport.grpc_bytes import GrpcReceiver

        return GrpcReceiver(device, hidden_size)
    if name == "cuda_ipc":
        from specsplit.transport.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(device, hidden_size)
    if name == "nccl":
        from specsplit.transport.nccl import NcclReceiver

        return NcclReceiver(device, hidden_size)
    raise ValueError(f"unknown hidden-state transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
