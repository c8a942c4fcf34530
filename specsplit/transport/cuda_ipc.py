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

from specsplit.client.errors import FailedPrecondition, InvalidArgument
from specsplit.proto import drafter_pb2
from specsplit.transport.base import (
    DeviceTokens,
    HiddenStatesReceiver,
    HiddenStatesSender,
    OpenCall,
    Transfer,
    TransportError,
)
from specsplit.transport.handle import OpenState, check_handle
from specsplit.transport.ipc_ring import RingFull, SlotRing
from specsplit.transport.wire import dtype_to_proto

log = logging.getLogger(__name__)
RING_SLOTS = 4  # buffers in the verifier's ring: Proposes in flight at once
MIN_SLOT_ROWS = 256
MAX_TOKEN_WIDTH = 32  # device hand-off: tokens per request (1 + at most 31 drafts)


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

    def __init__(self, num_slots: int = RING_SLOTS, offer_hand_off: bool = True):
        self.num_slots = num_slots
        self.offer_hand_off = offer_hand_off  # False: no token buffers or events, every Propose waits on the host
        self.slot_rows = 0
        self.generation = 0
        self._slots: list[torch.Tensor] = []  # per slot: [slot_rows * hidden_size]
        self._ring: SlotRing | None = None
        self._open_for: tuple | None = None
        self._sequence = 0
        self._tokens: list[torch.Tensor] = []  # per slot: [slot_tokens] int64, the device hand-off's tokens
        self._events: list[torch.cuda.Event] = []  # per slot: recorded once its rows and tokens are written

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
        # Device hand-off: tokens [num_reqs, width] and num_sampled [num_reqs] of at most slot_rows requests.
        slot_tokens = self.slot_rows * (MAX_TOKEN_WIDTH + 1) if self.offer_hand_off else 0
        self._tokens = [
            torch.empty(slot_tokens, dtype=torch.int64, device=hidden_states.device)
            for _ in range(self.num_slots if self.offer_hand_off else 0)
        ]
        self._events = [torch.cuda.Event(interprocess=True) for _ in self._tokens]
        request = drafter_pb2.OpenHiddenTransportRequest(
            transport=self.name,
            generation=self.generation,
            dtype=dtype_to_proto(hidden_states.dtype),
            hidden_size=hidden_size,
            buffers=[share(s) for s in self._slots],
            slot_rows=self.slot_rows,
            device_uuid=device_uuid(hidden_states.device),
            token_buffers=[share(t) for t in self._tokens],
            event_handles=[e.ipc_handle() for e in self._events],
            slot_tokens=slot_tokens,
        )
        response = await call(request)
        self.device_hand_off = bool(response.device_hand_off)
        self._ring = SlotRing(self.num_slots)
        self._open_for = (hidden_states.dtype, hidden_size, hidden_states.device)
        self._sequence = 0
        log.info("cuda_ipc transport open (generation %d, %d slots x %d rows)", self.generation, self.num_slots, rows)

    def send(self, hidden_states: torch.Tensor, msg: drafter_pb2.ProposeRequest) -> Transfer:
        """hidden_states: [num_rows, hidden_size] on the verifier's GPU."""
        if self._ring is None:
            raise TransportError("cuda_ipc transport is not open")
        slot = self._copy_rows(hidden_states)
        # The drafter reads the slot as soon as it has the handle: the rows must be there first.
        torch.cuda.current_stream(hidden_states.device).synchronize()
        return self._handle(msg, slot, hidden_states)

    def _copy_rows(self, hidden_states: torch.Tensor) -> int:  # [num_rows, hidden_size]
        """A free slot, with the copy of the rows into it queued."""
        try:
            slot = self._ring.acquire()
        except RingFull as err:
            raise TransportError(str(err)) from err
        rows, hidden_size = hidden_states.shape
        self._slots[slot][: rows * hidden_size].view(rows, hidden_size).copy_(hidden_states)
        return slot

    def _handle(self, msg: drafter_pb2.ProposeRequest, slot: int, hidden_states: torch.Tensor) -> Transfer:
        """`msg`'s handle to the rows in `slot`: the next transfer of this generation."""
        self._sequence += 1
        h = msg.hidden_states_handle
        h.generation, h.sequence, h.dtype = self.generation, self._sequence, dtype_to_proto(hidden_states.dtype)
        h.num_rows, h.hidden_size, h.slot, h.offset = *hidden_states.shape, slot, 0
        return Transfer(self._sequence, slot=slot)

    def send_on_device(
        self,
        hidden_states: torch.Tensor,  # [num_rows, hidden_size]
        sampled: torch.Tensor,  # [num_reqs, width] int
        num_sampled: torch.Tensor,  # [num_reqs] int
        msg: drafter_pb2.ProposeRequest,
    ) -> Transfer:
        """Queues the copies of the rows and the tokens into a slot and its event after them; no wait:
        the drafter's device waits on the event (`CudaIpcReceiver.device_tokens`)."""
        if self._ring is None or not self.device_hand_off:
            raise TransportError("cuda_ipc transport is not open for device hand-offs")
        num_reqs, width = sampled.shape
        if width > MAX_TOKEN_WIDTH or num_reqs > self.slot_rows:
            raise TransportError(f"{num_reqs} requests of {width} tokens do not fit a slot's token buffer")
        slot = self._copy_rows(hidden_states)
        tokens = self._tokens[slot]
        tokens[: num_reqs * width].view(num_reqs, width).copy_(sampled)
        tokens[num_reqs * width : num_reqs * (width + 1)].copy_(num_sampled)
        self._events[slot].record(torch.cuda.current_stream(hidden_states.device))
        transfer = self._handle(msg, slot, hidden_states)
        msg.hidden_states_handle.tokens_on_device, msg.hidden_states_handle.token_width = True, width
        return transfer

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
        self._tokens, self._events = [], []
        self.device_hand_off = False


class CudaIpcReceiver(HiddenStatesReceiver):
    name = "cuda_ipc"

    def __init__(self, device: str, hidden_size: int):
        super().__init__(device, hidden_size)
        self._slots: list[torch.Tensor] = []  # per slot: [>= slot_rows * hidden_size], on the verifier's GPU
        self._state: OpenState | None = None
        self._reading: torch.device | None = None  # the slots' device while a receive's rows are in use
        self._tokens: list[torch.Tensor] = []  # device hand-off: per slot, [slot_tokens] int64
        self._events: list[torch.cuda.Event] = []  # device hand-off: per slot, the verifier's event

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
        self._open_hand_off(request, index)
        log.info(
            "cuda_ipc transport open (generation %d, %d slots on cuda:%d, device hand-off %s)",
            state.generation,
            len(slots),
            index,
            "on" if self.device_hand_off else "off",
        )

    def _open_hand_off(self, request: drafter_pb2.OpenHiddenTransportRequest, index: int) -> None:
        """Maps the token buffers and opens the events of a device hand-off, where the verifier offers
        them for every slot and its GPU is this drafter's; otherwise the hand-offs stay off."""
        self.device_hand_off = False
        offered = len(request.token_buffers) == len(request.event_handles) == len(request.buffers)
        # The verifier's GPU by its UUID, not by index: a drafter on a bare `cuda` (the current device, as
        # `specsplit up` starts it) has no index to compare.
        same_gpu = request.device_uuid == device_uuid(self.device)
        if not offered or not same_gpu or request.slot_tokens <= 0:
            return
        try:
            tokens = [open_shared(b, index, torch.int64) for b in request.token_buffers]
            events = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in request.event_handles]
        except RuntimeError as err:
            log.warning("cuda_ipc: no device hand-off (cannot map the token buffers or events: %s)", err)
            return
        if any(t.numel() < request.slot_tokens for t in tokens):
            raise InvalidArgument(f"OpenHiddenTransport: a token buffer holds fewer than {request.slot_tokens}")
        self._tokens, self._events, self._slot_tokens = tokens, events, request.slot_tokens
        self.device_hand_off = True

    def device_tokens(self, msg: drafter_pb2.ProposeRequest) -> DeviceTokens:
        """The sampled tokens of a device hand-off, in place in the slot's token buffer (after `receive`)."""
        h = msg.hidden_states_handle
        if not self.device_hand_off:
            raise FailedPrecondition("cuda_ipc: a device hand-off, but the transport was opened without one")
        num_reqs, width = len(msg.requests), h.token_width
        if not 1 <= width <= MAX_TOKEN_WIDTH or num_reqs * (width + 1) > self._slot_tokens:
            raise InvalidArgument(
                f"hidden_states_handle: {num_reqs} requests x token_width {width} do not fit the token buffer "
                f"(token_width 1..{MAX_TOKEN_WIDTH}, {self._slot_tokens} elements)"
            )
        buffer, event = self._tokens[h.slot], self._events[h.slot]
        stream = torch.cuda.current_stream(self.device)
        return DeviceTokens(
            buffer[: num_reqs * width].view(num_reqs, width),
            buffer[num_reqs * width : num_reqs * (width + 1)],
            lambda: stream.wait_event(event),
        )

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
        self._tokens, self._events = [], []
        self.device_hand_off = False
