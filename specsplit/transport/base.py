"""The hidden-state transport interface: a sender on the verifier, a receiver on the drafter.

Sender, per Propose call to the one drafter it serves:
    if sender.needs_open(hidden_states): await sender.open(hidden_states, call)   # OpenHiddenTransport
    transfer = sender.send(hidden_states, msg)      # fills msg.hidden_states or msg.hidden_states_handle
    ... the Propose call ...
    sender.finish(transfer, ok)                     # after the reply (ok) or the failure (not ok)
A failed call leaves the transport in an unknown state (a slot may still be read, a send may be
unpaired), so `finish(..., ok=False)` resets it and the next call opens it afresh (a new generation).

Receiver, in the drafter: `open(request)` for OpenHiddenTransport, `receive(msg)` for each Propose
(both raise `SpecsplitError`s carrying the status the verifier should get), and `release()` once the
drafter's device work on the rows is queued, before it replies: the sender may reuse their memory as
soon as the reply arrives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specsplit.client.errors import FailedPrecondition
from specsplit.proto import drafter_pb2

OpenCall = Callable[[drafter_pb2.OpenHiddenTransportRequest], Awaitable[drafter_pb2.OpenHiddenTransportResponse]]


@dataclass
class DeviceTokens:
    """A device hand-off's sampled tokens, still on the device (`specsplit/drafter/device_propose.py`)."""

    tokens: torch.Tensor  # [num_reqs, width] int64: request r's sampled tokens in columns < num_sampled[r]
    num_sampled: torch.Tensor  # [num_reqs] int64: accepted drafts + 1 per request
    wait: Callable[[], None] = field(default=lambda: None)  # queues the device's wait for the tokens and rows


class TransportError(Exception):
    """The sender cannot move the rows (peer gone, wait timed out); the call counts as failed."""


@dataclass
class Transfer:
    """One send, kept until the reply to the Propose call that carries it has arrived."""

    sequence: int = 0
    slot: int | None = None  # cuda_ipc: the ring slot holding the rows
    work: Any = None  # nccl: the torch.distributed send in flight
    rows: torch.Tensor | None = None  # nccl: [num_rows, hidden_size], alive until the peer has it


def mismatch(drafter_transport: str, verifier_transport: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"the drafter was started with --hidden-transport {drafter_transport} but the verifier sends "
        f"hidden states by {verifier_transport}; start both with the same --hidden-transport"
    )


class HiddenStatesSender:
    name: str

    def needs_open(self, hidden_states: torch.Tensor) -> bool:  # [num_rows, hidden_size]
        return False

    async def open(self, hidden_states: torch.Tensor, call: OpenCall) -> None:  # [num_rows, hidden_size]
        """Opens the transport for rows like `hidden_states` (dtype, device, hidden size)."""

    def send(self, hidden_states: torch.Tensor, msg: drafter_pb2.ProposeRequest) -> Transfer:
        """hidden_states: [num_rows, hidden_size] on the verifier's device."""
        raise NotImplementedError

    # A device hand-off (`specsplit/drafter/device_propose.py`): the rows and the sampled tokens go as the
    # verifier's step queued them, before it finished; only cuda_ipc to a drafter on the same GPU.
    device_hand_off = False

    def send_on_device(
        self,
        hidden_states: torch.Tensor,  # [num_rows, hidden_size]
        sampled: torch.Tensor,  # [num_reqs, width] int
        num_sampled: torch.Tensor,  # [num_reqs] int
        msg: drafter_pb2.ProposeRequest,
    ) -> Transfer:
        raise NotImplementedError

    def finish(self, transfer: Transfer, ok: bool) -> None:
        """The call carrying `transfer` ended; not ok: the transport is reset."""

    def reset(self) -> None:
        """Forgets the open transport (the next call opens it again)."""

    def close(self) -> None:
        self.reset()


class HiddenStatesReceiver:
    name: str

    def __init__(self, device: str, hidden_size: int):
        self.device = torch.device(device)
        self.hidden_size = hidden_size

    def open(self, request: drafter_pb2.OpenHiddenTransportRequest) -> None:
        if request.transport != self.name:
            raise mismatch(self.name, request.transport or "an unnamed transport")

    device_hand_off = False  # takes `tokens_on_device` handles (cuda_ipc on the verifier's GPU)

    def device_tokens(self, msg: drafter_pb2.ProposeRequest) -> DeviceTokens:
        """A device hand-off's sampled tokens (`specsplit.drafter.device_propose.DeviceTokens`), after `receive`."""
        raise FailedPrecondition(f"transport {self.name} takes no device hand-off")

    def receive(self, msg: drafter_pb2.ProposeRequest) -> torch.Tensor:
        """The rows of `msg`, [num_rows, hidden_size], on the drafter's device (cuda_ipc: in place on the
        verifier's GPU; the caller moves them where they are needed); valid until `release()`."""
        raise NotImplementedError

    def release(self) -> None:
        """The rows of the last `receive` are read no more once the work queued so far is done: waits
        for that where their memory is the sender's (cuda_ipc). Called before every reply."""

    def close(self) -> None:
        """Forgets the open transport."""
