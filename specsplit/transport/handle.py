"""What a receiver agreed to when the transport was opened, and the checks every handle passes.

Malformed handles (dtype, hidden size, rows, slot, offset) are INVALID_ARGUMENT; a handle of an
older generation or out of sequence is FAILED_PRECONDITION: sender and receiver are out of step and
the verifier must open the transport again. A refused handle consumes nothing, so a stray call
cannot put a healthy transport out of step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.client.errors import FailedPrecondition, InvalidArgument
from specsplit.proto import drafter_pb2
from specsplit.transport.base import mismatch
from specsplit.transport.wire import dtype_from_proto

MAX_TRANSFER_BYTES = 1 << 30  # one Propose's rows; bounds what a handle can make the drafter allocate


@dataclass
class OpenState:
    generation: int
    dtype: torch.dtype
    hidden_size: int
    num_slots: int = 0  # cuda_ipc: ring slots; 0 for nccl
    slot_rows: int = 0  # cuda_ipc: rows per slot
    next_sequence: int = 1

    @classmethod
    def from_request(cls, request: drafter_pb2.OpenHiddenTransportRequest, hidden_size: int) -> OpenState:
        dtype = dtype_from_proto(request.dtype)
        if dtype is None or not dtype.is_floating_point:
            raise InvalidArgument(f"OpenHiddenTransport: dtype {request.dtype} is not a floating-point DType")
        if request.hidden_size != hidden_size:
            raise InvalidArgument(
                f"OpenHiddenTransport: hidden_size {request.hidden_size} but this drafter's model has {hidden_size}"
            )
        return cls(request.generation, dtype, hidden_size, len(request.buffers), request.slot_rows)


def check_handle(msg: drafter_pb2.ProposeRequest, state: OpenState | None, transport: str):
    """The handle of `msg` once it passed every check; raises InvalidArgument / FailedPrecondition."""
    if msg.WhichOneof("hidden") != "hidden_states_handle":
        raise mismatch(transport, "hidden_states bytes (grpc)")
    h = msg.hidden_states_handle
    if state is None:
        raise FailedPrecondition(f"no open {transport} transport: the verifier must call OpenHiddenTransport first")
    if dtype_from_proto(h.dtype) != state.dtype:
        raise InvalidArgument(f"hidden_states_handle: dtype {h.dtype} but the transport was opened for {state.dtype}")
    if h.hidden_size != state.hidden_size:
        raise InvalidArgument(f"hidden_states_handle: hidden_size {h.hidden_size}, expected {state.hidden_size}")
    itemsize = state.dtype.itemsize
    if h.num_rows < 0 or h.num_rows * h.hidden_size * itemsize > MAX_TRANSFER_BYTES:
        raise InvalidArgument(f"hidden_states_handle: num_rows {h.num_rows} outside [0, {MAX_TRANSFER_BYTES} bytes]")
    if state.num_slots:
        if not 0 <= h.slot < state.num_slots:
            raise InvalidArgument(f"hidden_states_handle: slot {h.slot} not in [0, {state.num_slots})")
        capacity = state.slot_rows * state.hidden_size
        if h.offset < 0 or h.offset + h.num_rows * h.hidden_size > capacity:
            raise InvalidArgument(
                f"hidden_states_handle: elements [{h.offset}, {h.offset + h.num_rows * h.hidden_size}) "
                f"outside the slot's {capacity}"
            )
    if h.generation != state.generation:
        raise FailedPrecondition(
            f"hidden_states_handle of transport generation {h.generation}; the open one is {state.generation}"
        )
    if h.sequence != state.next_sequence:
        raise FailedPrecondition(
            f"hidden_states_handle: transfer {h.sequence} arrived, {state.next_sequence} expected "
            "(sender and receiver out of step; the verifier opens the transport again)"
        )
    return h
