"""Transport `nccl`: a torch.distributed point-to-point send (GPU to GPU with backend nccl; gloo is
the CPU stand-in) paired with each Propose; gRPC carries only the handle (shape, dtype, sequence).

The verifier is rank 0 and owns the rendezvous store at `rendezvous`; the drafter is rank 1 and
joins when the verifier calls OpenHiddenTransport. Sends and receives pair up in call order (one
drafter, one call at a time), and every handle's sequence number is checked. Every wait is bounded
by `timeout_s`: a lost peer fails the call (the iteration goes on without drafts) instead of
hanging, and the next call opens a new process group.
"""

from __future__ import annotations

import asyncio
import logging

import torch

import specsplit.transport.process_group as pg
from specsplit.client.errors import InvalidArgument, Unavailable
from specsplit.proto import drafter_pb2
from specsplit.transport.base import HiddenStatesReceiver, HiddenStatesSender, OpenCall, Transfer, TransportError
from specsplit.transport.handle import OpenState, check_handle
from specsplit.transport.wire import dtype_to_proto

log = logging.getLogger(__name__)
PEER = {0: 1, 1: 0}


class NcclSender(HiddenStatesSender):
    name = "nccl"

    def __init__(self, rendezvous: str, backend: str | None = None, timeout_s: float = 30.0):
        pg.split_address(rendezvous)  # a bad address fails at start-up
        self.rendezvous = rendezvous
        self.backend = backend  # None: nccl for CUDA tensors, gloo otherwise
        self.timeout_s = timeout_s
        self._store = None
        self._group = None
        self._open_for: tuple | None = None  # (dtype, hidden_size, device) of the open group
        self.generation = 0
        self._sequence = 0

    def needs_open(self, hidden_states: torch.Tensor) -> bool:  # [num_rows, hidden_size]
        return self._group is None or self._open_for != _signature(hidden_states)

    async def open(self, hidden_states: torch.Tensor, call: OpenCall) -> None:  # [num_rows, hidden_size]
        self.reset()
        backend = self.backend or ("nccl" if hidden_states.is_cuda else "gloo")
        if self._store is None:
            self._store = pg.open_store(self.rendezvous, True, self.timeout_s)
        host, _ = pg.split_address(self.rendezvous)
        self.generation += 1
        request = drafter_pb2.OpenHiddenTransportRequest(
            transport=self.name,
            generation=self.generation,
            dtype=dtype_to_proto(hidden_states.dtype),
            hidden_size=hidden_states.shape[1],
            rendezvous=f"{host}:{self._store.port}",
            backend=backend,
            timeout_s=self.timeout_s,
        )
        loop = asyncio.get_running_loop()
        device, generation = hidden_states.device, self.generation
        join = loop.run_in_executor(None, self._join, backend, host, generation, device)
        try:
            await asyncio.gather(call(request), join)
        except BaseException:
            # The join ends by itself (its waits are bounded); a group it makes after all is dropped.
            join.add_done_callback(lambda f: f.cancelled() or f.exception() or pg.drop(f.result()))
            raise
        self._group = join.result()
        self._open_for = _signature(hidden_states)
        self._sequence = 0
        log.info(
            "nccl transport open (generation %d, backend %s, rendezvous %s)", generation, backend, request.rendezvous
        )

    def _join(self, backend: str, host: str, generation: int, device: torch.device):
        group = pg.make_pair_group(backend, self._store, generation, 0, host, self.timeout_s)
        try:  # one element through: communicators form now, not inside the first Propose
            pg.wait(group.send([torch.ones(1, device=device)], 1, 0), self.timeout_s, "transport warm-up send")
        except BaseException:
            pg.drop(group)
            raise
        return group

    def send(self, hidden_states: torch.Tensor, msg: drafter_pb2.ProposeRequest) -> Transfer:
        """hidden_states: [num_rows, hidden_size] on the verifier's device."""
        if self._group is None:
            raise TransportError("nccl transport is not open")
        rows = hidden_states.contiguous()
        try:  # gloo finds a peer that went away here, at once (nccl at the wait, in `finish`)
            work = self._group.send([rows], 1, 0) if rows.numel() else None
        except RuntimeError as err:
            self.reset()  # every later send would fail the same way: the next call opens a new group
            raise TransportError(f"hidden-state send {self._sequence + 1} failed: {err}") from err
        self._sequence += 1
        msg.hidden_states_handle.CopyFrom(
            drafter_pb2.HiddenStatesHandle(
                generation=self.generation,
                sequence=self._sequence,
                dtype=dtype_to_proto(rows.dtype),
                num_rows=rows.shape[0],
                hidden_size=rows.shape[1],
            )
        )
        return Transfer(self._sequence, work=work, rows=rows)

    def finish(self, transfer: Transfer, ok: bool) -> None:
        if not ok:
            self.reset()
            return
        if transfer.work is not None:  # the drafter replied, so it holds the rows: this returns at once
            try:
                pg.wait(transfer.work, self.timeout_s, f"hidden-state send {transfer.sequence}")
            except TimeoutError as err:
                self.reset()
                raise TransportError(str(err)) from err

    def reset(self) -> None:
        pg.drop(self._group)
        self._group = None
        self._open_for = None


class NcclReceiver(HiddenStatesReceiver):
    name = "nccl"

    def __init__(self, device: str, hidden_size: int):
        super().__init__(device, hidden_size)
        self._group = None
        self._state: OpenState | None = None
        self.timeout_s = 30.0

    def open(self, request: drafter_pb2.OpenHiddenTransportRequest) -> None:
        super().open(request)
        state = OpenState.from_request(request, self.hidden_size)
        if request.backend not in ("nccl", "gloo"):
            raise InvalidArgument(f"OpenHiddenTransport: backend {request.backend!r} is not nccl or gloo")
        if request.backend == "nccl" and self.device.type != "cuda":
            raise InvalidArgument(
                f"OpenHiddenTransport: backend nccl needs a CUDA drafter; this one is on {self.device}"
            )
        self.close()
        timeout_s = request.timeout_s if request.timeout_s > 0 else 30.0
        try:
            host, _ = pg.split_address(request.rendezvous)
            store = pg.open_store(request.rendezvous, False, timeout_s)
            group = pg.make_pair_group(request.backend, store, request.generation, 1, host, timeout_s)
            warm = torch.empty(1, device=self.device)
            pg.wait(group.recv([warm], 0, 0), timeout_s, "transport warm-up receive")
        except ValueError as err:
            raise InvalidArgument(f"OpenHiddenTransport: {err}") from err
        except (RuntimeError, TimeoutError) as err:
            raise Unavailable(f"cannot join the verifier's process group at {request.rendezvous}: {err}") from err
        self._group, self._state, self.timeout_s = group, state, timeout_s
        log.info("nccl transport open (generation %d, backend %s)", request.generation, request.backend)

    def receive(self, msg: drafter_pb2.ProposeRequest) -> torch.Tensor:
        h = check_handle(msg, self._state, self.name)
        rows = torch.empty((h.num_rows, h.hidden_size), dtype=self._state.dtype, device=self.device)
        if rows.numel():
            try:
                pg.wait(self._group.recv([rows], 0, 0), self.timeout_s, f"hidden-state receive {h.sequence}")
            except TimeoutError as err:
                self.close()  # out of step for good: the verifier opens a new group
                raise Unavailable(str(err)) from err
        self._state.next_sequence += 1
        return rows

    def close(self) -> None:
        pg.drop(self._group)
        self._group = None
        self._state = None


def _signature(hidden_states: torch.Tensor) -> tuple:
    return hidden_states.dtype, hidden_states.shape[1], hidden_states.device
