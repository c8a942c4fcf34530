"""The coordinator's persistent VerifyStream to the verifier: one VerifyRequest written and one
VerifyResponse read per iteration, without a call set-up per iteration. The engine sends an
iteration's request, streams the previous iteration's outputs, then receives.

Any failure (the verifier's error status, a closed stream, no answer within the timeout) closes the
stream and raises a `grpc.RpcError` carrying the status, exactly as a unary Verify would fail; the
next iteration opens a new stream.
"""

from __future__ import annotations

from protos import verifier_pb2_grpc
from specsplit.bidi_stream import BidiStream, StreamError

__all__ = ["StreamError", "VerifyStream"]


class VerifyStream(BidiStream):
    def __init__(self, stub: verifier_pb2_grpc.VerifierStub, timeout_s: float):
        super().__init__(stub.VerifyStream, timeout_s, "verifier")
