"""The coordinator's persistent VerifyStream to the verifier: one VerifyRequest written and one
VerifyResponse read per iteration, without a call set-up per iteration.

Any failure (the verifier's error status, a closed stream, no answer within the timeout) closes the
stream and raises a `grpc.RpcError` carrying the status, exactly as a unary Verify would fail; the
next iteration opens a new stream.
"""

from __future__ import annotations

import asyncio

import grpc

from protos import verifier_pb2, verifier_pb2_grpc


class StreamError(grpc.RpcError):
    """A stream failure with the status a unary call would have had."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class VerifyStream:
    def __init__(self, stub: verifier_pb2_grpc.VerifierStub, timeout_s: float):
        self._stub = stub
        self._timeout_s = timeout_s
        self._call = None

    async def verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        if self._call is None:
            self._call = self._stub.VerifyStream()
        try:
            await self._call.write(request)
            response = await asyncio.wait_for(self._call.read(), self._timeout_s)
        except grpc.RpcError:
            self.close()
            raise
        except asyncio.TimeoutError:
            self.close()
            raise StreamError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no VerifyResponse within {self._timeout_s}s"
            ) from None
        if response is grpc.aio.EOF:
            self.close()
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "the verifier closed the VerifyStream")
        return response

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
