"""The coordinator's persistent VerifyStream to the verifier: one VerifyRequest written and one
VerifyResponse read per iteration, without a call set-up per iteration. The engine sends an
iteration's request, streams the previous iteration's outputs, then receives.

Any failure (the verifier's error status, a closed stream, no answer within the timeout) closes the
stream and raises a `grpc.RpcError` carrying the status, exactly as a unary Verify would fail; the
next iteration opens a new stream. With `--verifier-rpc local` the same messages go over the
verifier's Unix socket instead (`local_verify_stream`), failing the same way.
"""

from __future__ import annotations

from specsplit.bidi_stream import BidiStream, StreamError
from specsplit.local_stream import LocalStream, served_socket
from specsplit.proto import verifier_pb2, verifier_pb2_grpc

__all__ = ["StreamError", "VerifyStream", "local_verify_stream"]


class VerifyStream(BidiStream):
    def __init__(self, stub: verifier_pb2_grpc.VerifierStub, timeout_s: float):
        super().__init__(stub.VerifyStream, timeout_s, "verifier")


def local_verify_stream(stub: verifier_pb2_grpc.VerifierStub, timeout_s: float) -> LocalStream:
    """The VerifyStream on the verifier's Unix socket."""
    connect = served_socket(stub, "verify_socket", "verifier", timeout_s)
    return LocalStream(connect, verifier_pb2.VerifyResponse.FromString, timeout_s, "verifier")
