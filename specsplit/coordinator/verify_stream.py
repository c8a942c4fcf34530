"""The coordinator's verifier handle over the wire: one persistent VerifyStream, one VerifyRequest written and one
VerifyResponse read per iteration, without a call set-up per iteration (`RpcVerifier`). The engine's loop sends an
iteration, streams the previous iteration's outputs, then receives.

Any failure (the verifier's error status, a closed stream, no answer within the timeout) closes the stream and
raises a `grpc.RpcError` carrying the status, exactly as a unary Verify would fail; the next iteration opens a new
stream. With `--verifier-rpc local` the same messages go over the verifier's Unix socket instead, failing the same
way. The in-process handle with the same methods is `specsplit.engine.local.LocalVerifier`.
"""

from __future__ import annotations

import uuid

from specsplit.coordinator import wire
from specsplit.coordinator.iteration import SchedulerOutput, VerifyOutcome
from specsplit.proto import verifier_pb2, verifier_pb2_grpc
from specsplit.rpc.bidi_stream import BidiStream
from specsplit.rpc.local_stream import LocalStream, served_socket
from specsplit.rpc.telemetry import inject_trace_context


class RpcVerifier:
    """The verifier at `stub`'s channel: `rpc` "stream" (gRPC's VerifyStream) or "local" (its Unix socket)."""

    def __init__(
        self,
        stub: verifier_pb2_grpc.VerifierStub,
        eos_token_ids,
        *,
        timeout_s: float = 120.0,
        rpc: str = "stream",
    ):
        self.eos_token_ids = eos_token_ids
        self.coordinator_id = uuid.uuid4().hex  # the verifier serves one coordinator at a time: this one
        if rpc == "local":
            connect = served_socket(stub, "verify_socket", "verifier", timeout_s)
            self._stream = LocalStream(connect, verifier_pb2.VerifyResponse.FromString, timeout_s, "verifier")
        else:
            self._stream = BidiStream(stub.VerifyStream, timeout_s, "verifier")

    async def send(self, output: SchedulerOutput) -> None:
        """The iteration's VerifyRequest, in the current span's trace context."""
        request = wire.verify_request(output, self.coordinator_id, self.eos_token_ids)
        inject_trace_context(request.trace_context)
        await self._stream.send(request)

    async def receive(self) -> VerifyOutcome:
        return wire.verify_outcome(await self._stream.receive())

    def close(self) -> None:
        self._stream.close()
