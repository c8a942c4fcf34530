"""A persistent bidirectional stream used as a sequence of unary calls (one request written, one
response read, in order), and the server-side loop that ends such a stream when the server drains.

Client side: any failure (the peer's error status, a closed stream, no answer within the timeout)
closes the stream and raises a `grpc.RpcError` carrying the status, exactly as a unary call would
fail; the next call opens a new stream. Used for coordinator → verifier (`VerifyStream`) and
verifier → drafter (`ProposeStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import grpc


class StreamError(grpc.RpcError):
    """A stream failure with the status a unary call would have had."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class BidiStream:
    """`open_call()` starts the stream RPC (e.g. `stub.VerifyStream`); `peer` names it in errors."""

    def __init__(self, open_call: Callable[[], Any], timeout_s: float, peer: str):
        self._open_call = open_call
        self._timeout_s = timeout_s
        self._peer = peer
        self._call = None

    async def call(self, request):
        await self.send(request)
        return await self.receive()

    async def send(self, request) -> None:
        """Writes one request; `receive()` reads its response (the caller may work in between)."""
        if self._call is None:
            self._call = self._open_call()
        async with self._failures():
            await self._call.write(request)

    async def receive(self):
        """The response to the request last sent."""
        async with self._failures():
            response = await asyncio.wait_for(self._call.read(), self._timeout_s)
        if response is grpc.aio.EOF:
            self.close()
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"the {self._peer} closed the stream")
        return response

    @contextlib.asynccontextmanager
    async def _failures(self):
        """Every failure closes the stream and surfaces as the status a unary call would have had."""
        try:
            yield
        except grpc.RpcError:
            self.close()
            raise
        except (asyncio.InvalidStateError, grpc.aio.UsageError):  # the stream ended meanwhile (peer died)
            raise await self._ended() from None
        except asyncio.TimeoutError:
            self.close()
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self._timeout_s}s") from None

    async def _ended(self) -> StreamError:
        """The status a stream that already finished ended with, as the error a unary call would raise."""
        call, self._call = self._call, None
        code = await call.code()
        if code == grpc.StatusCode.OK:
            return StreamError(grpc.StatusCode.UNAVAILABLE, f"the {self._peer} closed the stream")
        return StreamError(code, await call.details())

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


async def until_draining(request_iterator: AsyncIterable, draining: asyncio.Event) -> AsyncIterator:
    """A server stream's requests, ending when the caller closes it or when the server begins draining
    (SIGTERM) while it waits for the next one: an idle persistent stream must not hold the grace period."""
    requests = request_iterator.__aiter__()
    while (request := await _next_unless_draining(requests, draining)) is not None:
        yield request


async def _next_unless_draining(requests: AsyncIterator, draining: asyncio.Event):
    """The stream's next request, or None when the caller closed it or draining began first."""
    next_request = asyncio.ensure_future(requests.__anext__())
    drain = asyncio.ensure_future(draining.wait())
    done, _ = await asyncio.wait({next_request, drain}, return_when=asyncio.FIRST_COMPLETED)
    drain.cancel()
    if next_request not in done:
        next_request.cancel()
        return None
    try:
        return next_request.result()
    except StopAsyncIteration:
        return None
