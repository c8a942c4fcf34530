"""Transport `grpc`: the rows travel as raw bytes inside the ProposeRequest (portable default)."""

from __future__ import annotations

import torch

from specsplit.client.errors import InvalidArgument
from specsplit.proto import drafter_pb2
from specsplit.transport.base import HiddenStatesReceiver, HiddenStatesSender, Transfer, mismatch
from specsplit.transport.wire import fill_tensor_proto, tensor_from_proto


class GrpcSender(HiddenStatesSender):
    name = "grpc"

    def send(self, hidden_states: torch.Tensor, msg: drafter_pb2.ProposeRequest) -> Transfer:
        """hidden_states: [num_rows, hidden_size]."""
        msg.ClearField("hidden_states")
        fill_tensor_proto(msg.hidden_states, hidden_states)  # in place: no second copy of the bytes
        return Transfer()


class GrpcReceiver(HiddenStatesReceiver):
    name = "grpc"

    def receive(self, msg: drafter_pb2.ProposeRequest) -> torch.Tensor:
        if msg.WhichOneof("hidden") == "hidden_states_handle":
            raise mismatch(self.name, "a handle (cuda_ipc or nccl)")
        try:
            rows = tensor_from_proto(msg.hidden_states, expected_shape=(None, self.hidden_size))
        except ValueError as err:
            raise InvalidArgument(f"hidden_states: {err}") from err
        return rows.to(self.device)
