"""Transport `cuda_ipc`: the verifier keeps a ring of preallocated GPU buffers, shares them once by
CUDA IPC (OpenHiddenTransport), and each Propose names only (slot, rows, dtype, offset). The
drafter maps the buffers once; its MTP step reads each call's rows in place (copied across when the
drafter runs on another GPU), and it waits for that work before it replies, so a slot is free again
when the reply arrives (`SlotRing`).

Both processes run on one host and see the verifier's GPU (in Kubernetes: one pod, or hostIPC with
both GPUs visible to both containers); GPUs are matched by UUID, since device indices differ
between processes. Mapping the buffers gives the drafter a CUDA context on the verifier's GPU.
"""

from __future__ import annotations

import logging

import torch

from models.transport.base import HiddenStatesReceiver, HiddenStatesSender, OpenCall, Transfer, TransportError
from models.transport.handle import OpenState, check_handle
from models.transport.ipc_ring import RingFull, SlotRing
from models.wire import dtype_to_proto
from protos import drafter_pb2
from specsplit.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)
MIN_SLOT_ROWS = 256


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share(buffer: torch.Tensor) -> drafter_pb2.CudaIpcBuffer:
    """The CUDA IPC description of `buffer`'s storage (`buffer` must start at its storage's start)."""
    _device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = (
        buffer.untyped_storage()._share_cuda_()
    )
    return drafter_pb2.CudaIpcBuffer(
        handle=handle,
        storage_size_bytes=size,
        storage_offset_bytes=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync,
    )


def open_shared(msg: drafter_pb2.CudaIpcBuffer, device_index: int, dtype: torch.dtype) -> torch.Tensor:
    """Maps a buffer shared by `share` into this process: [storage_size_bytes / itemsize]."""
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index,
        msg.handle,
        msg.storage_size_bytes,
        msg.storage_offset_bytes,
        msg.ref_counter_handle,
        msg.ref_counter_offset,
        msg.event_handle or None,
        msg.event_sync_required,
    )
    numel = msg.storage_size_bytes // dtype.itemsize
    return torch.empty(0, dtype=dtype, device=f"cuda:{device_index}").set_(storage, 0, (numel,), (1,))


class CudaIpcSender(HiddenStatesSender):
    name = "cuda_ipc"

    def __init__(self, num_slots: int = 4):
        self.num_slots = num_slots
        self.slot_rows = 0
        self.generation = 0
        self._slots: list[torch.Tensor] = []  # per slot: [slot_rows * hidden_size]
        self._ring: SlotRing | None = None
        self._open_for: tuple | None = None
        self._sequence = 0

    def needs_open(self, hidden_states: torch.Tensor) -> bool:  # [num_rows, hidden_size]
        sig = (hidden_states.dtype, hidden_states.shape[1], hidden_states.device)
        return self._ring is None or self._open_for != sig or hidden_states.shape[0] > self.slot_rows

    async def open(self, hidden_states: torch.Tensor, call: OpenCall) -> None:  # [num_rows, hidden_size]
        if not hidden_states.is_cuda:
            raise TransportError(f"cuda_ipc needs the verifier on a CUDA device, not {hidden_states.device}")
        self.reset()
        rows, hidden_size = hidden_states.shape
        self.slot_rows = max(MIN_SLOT_ROWS, self.slot_rows, 1 << (rows - 1).bit_length())
        self._slots = [
            torch.empty(self.slot_rows * hidden_size, dtype=hidden_states.dtype, device=hidden_states.device)
            for _ in range(self.num_slots)
        ]
        self.generation += 1
        request = drafter_pb2.OpenHiddenTransportRequest(
            transport=self.name,
            generation=self.generation,
            dtype=dtype_to_proto(hidden_states.dtype),
            hidden_size=hidden_size,
            buffers=[share(s) for s in self._slots],
            slot_rows=self.slot_rows,
            device_uuid=device_uuid(hidden_states.device),
        )
        await call(request)
        self._ring = SlotRing(self.num_slots)
        self._open_for = (hidden_states.dtype, hidden_size, hidden_states.device)
        self._sequence = 0
        log.info("cuda_ipc transport open (generation %d, %d slots x %d rows)", self.generation, self.num_slots, rows)

    def send(self, hidden_states: torch.Tensor, msg: drafter_pb2.ProposeRequest) -> Transfer:
        """hidden_states: [num_rows, hidden_size] on the verifier's GPU."""
        if self._ring is None:
            raise TransportError("cuda_ipc transport is not open")
        try:
            slot = self._ring.acquire()
        except RingFull as err:
            raise TransportError(str(err)) from err
        rows, hidden_size = hidden_states.shape
        self._slots[slot][: rows * hidden_size].view(rows, hidden_size).copy_(hidden_states)
        # The drafter reads the slot as soon as it has the handle: the rows must be there first.
        torch.cuda.current_stream(hidden_states.device).synchronize()
        self._sequence += 1
        msg.hidden_states_handle.CopyFrom(
            drafter_pb2.HiddenStatesHandle(
                generation=self.generation,
                sequence=self._sequence,
                dtype=dtype_to_proto(hidden_states.dtype),
                num_rows=rows,
                hidden_size=hidden_size,
                slot=slot,
                offset=0,
            )
        )
        return Transfer(self._sequence, slot=slot)

    def finish(self, transfer: Transfer, ok: bool) -> None:
        if self._ring is None or transfer.slot is None:
            return
        if ok:
            self._ring.release(transfer.slot)
        else:
            self._ring.lose(transfer.slot)
            self.reset()

    def reset(self) -> None:
        # torch keeps a shared storage alive while the drafter still maps it (IPC reference counter).
        self._ring = None
        self._slots = []
        self._open_for = None


class CudaIpcReceiver(HiddenStatesReceiver):
    name = "cuda_ipc"

    def __init__(self, device: str, hidden_size: int):
        super().__init__(device, hidden_size)
        self._slots: list[torch.Tensor] = []  # per slot: [>= slot_rows * hidden_size], on the verifier's GPU
        self._state: OpenState | None = None
        self._reading: torch.device | None = None  # the slots' device while a receive's rows are in use

    def open(self, request: drafter_pb2.OpenHiddenTransportRequest) -> None:
        super().open(request)
        state = OpenState.from_request(request, self.hidden_size)
        if not request.buffers or request.slot_rows <= 0:
            raise InvalidArgument("OpenHiddenTransport: cuda_ipc needs buffers and slot_rows > 0")
        if self.device.type != "cuda":
            raise FailedPrecondition(f"cuda_ipc needs a CUDA drafter; this one is on {self.device}")
        index = next(
            (
                i
                for i in range(torch.cuda.device_count())
                if device_uuid(torch.device("cuda", i)) == request.device_uuid
            ),
            None,
        )
        if index is None:
            raise FailedPrecondition(
                f"the verifier's GPU {request.device_uuid} is not visible to this drafter; cuda_ipc needs both "
                "processes on one host with that GPU visible (use nccl or grpc otherwise)"
            )
        self.close()
        try:
            slots = [open_shared(b, index, state.dtype) for b in request.buffers]
        except RuntimeError as err:
            raise FailedPrecondition(f"cannot map the verifier's CUDA IPC buffers: {err}") from err
        need = request.slot_rows * self.hidden_size
        if any(s.numel() < need for s in slots):
            raise InvalidArgument(f"OpenHiddenTransport: a buffer holds fewer than slot_rows x hidden_size = {need}")
        self._slots, self._state = slots, state
        log.info("cuda_ipc transport open (generation %d, %d slots on cuda:%d)", state.generation, len(slots), index)

    def receive(self, msg: drafter_pb2.ProposeRequest) -> torch.Tensor:
        """The rows in place in the verifier's slot, no copy: the MTP step reads them (its CUDA graph
        copies them into its input buffer anyway); `release()` waits for that before the reply frees the
        slot."""
        h = check_handle(msg, self._state, self.name)
        n = h.num_rows * h.hidden_size
        self._state.next_sequence += 1
        self._reading = self._slots[h.slot].device
        return self._slots[h.slot][h.offset : h.offset + n].view(h.num_rows, h.hidden_size)

    def release(self) -> None:
        """Waits for the work queued on the rows (on the drafter's device, and on the slot's where the
        rows were copied across): the slot may be rewritten once the reply leaves."""
        if self._reading is None:
            return
        torch.cuda.current_stream(self.device).synchronize()
        if self._reading != self.device:
            torch.cuda.current_stream(self._reading).synchronize()
        self._reading = None

    def close(self) -> None:
        self._slots = []
        self._state = None
