"""Transport `grpc`: the rows travel as raw bytes inside the ProposeRequest (portable default)."""

from __future__ import annotations

import torch

from models.transport.base import HiddenStatesReceiver, HiddenStatesSender, Transfer, mismatch
from models.wire import tensor_from_proto, tensor_to_proto
from protos import drafter_pb2
from specsplit.errors import InvalidArgument


class GrpcSender(HiddenStatesSender):
    name = "grpc"

    def send(self, hidden_states: torch.Tensor, msg: drafter_pb2.ProposeRequest) -> Transfer:
        """hidden_states: [num_rows, hidden_size]."""
        msg.hidden_states.CopyFrom(tensor_to_proto(hidden_states))
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
