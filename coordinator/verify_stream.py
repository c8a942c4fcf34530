"""The coordinator's persistent VerifyStream to the verifier: one VerifyRequest written and one
VerifyResponse read per iteration, without a call set-up per iteration. The engine sends an
iteration's request, streams the previous iteration's outputs, then receives.

Any failure (the verifier's error status, a closed stream, no answer within the timeout) closes the
stream and raises a `grpc.RpcError` carrying the status, exactly as a unary Verify would fail; the
next iteration opens a new stream. With `--verifier-rpc local` the same messages go over the
verifier's `--verify-socket` instead (`local_verify_stream`), failing the same way.
"""

from __future__ import annotations

import grpc

from protos import common_pb2, verifier_pb2, verifier_pb2_grpc
from specsplit.bidi_stream import BidiStream, StreamError
from specsplit.local_stream import LocalStream

__all__ = ["StreamError", "VerifyStream", "local_verify_stream"]


class VerifyStream(BidiStream):
    def __init__(self, stub: verifier_pb2_grpc.VerifierStub, timeout_s: float):
        super().__init__(stub.VerifyStream, timeout_s, "verifier")


def local_verify_stream(stub: verifier_pb2_grpc.VerifierStub, timeout_s: float) -> LocalStream:
    """The VerifyStream on the verifier's `--verify-socket`, its path asked of the verifier at each
    (re)connection (a restarted verifier may serve another one)."""

    async def socket_path() -> str:
        info = await stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout_s)
        if not info.verify_socket:
            raise StreamError(
                grpc.StatusCode.FAILED_PRECONDITION, "the verifier serves no --verify-socket (--verifier-rpc local)"
            )
        return info.verify_socket

    return LocalStream(socket_path, verifier_pb2.VerifyResponse.FromString, timeout_s, "verifier")
