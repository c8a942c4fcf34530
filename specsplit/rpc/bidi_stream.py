"""A persistent bidirectional stream used as a sequence of unary calls (one request written, one
response read, in order), and the server-side loop that ends such a stream when the server drains.

Client side: any failure (the peer's error status, a closed stream, no answer within the timeout)
closes the stream and raises a `grpc.RpcError` carrying the status, exactly as a unary call would
fail; the next call opens a new stream. Used for coordinator → verifier (`VerifyStream`) and
verifier → drafter (`ProposeStream`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+
T = TypeVar("T")


async def within(read: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """`await read()`, raising asyncio.TimeoutError past `timeout_s`; on 3.11+ without a task per
    read (3.11's wait_for wraps the awaitable in one)."""
    if _timeout is not None:
        async with _timeout(timeout_s):
            return await read()
    return await asyncio.wait_for(read(), timeout_s)


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
        try:
            await self._call.write(request)
        except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError, asyncio.TimeoutError) as err:
            raise await self._failure(err) from None

    async def receive(self):
        """The response to the request last sent."""
        try:
            response = await within(self._call.read, self._timeout_s)
        except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError, asyncio.TimeoutError) as err:
            raise await self._failure(err) from None
        if response is grpc.aio.EOF:
            self.close()
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"the {self._peer} closed the stream")
        return response

    async def _failure(self, err: BaseException) -> BaseException:
        """Every failure closes the stream and surfaces as the status a unary call would have had."""
        if isinstance(err, grpc.RpcError):
            self.close()
            return err
        if isinstance(err, asyncio.TimeoutError):
            self.close()
            return StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self._timeout_s}s")
        return await self._ended()  # InvalidStateError / UsageError: the stream ended meanwhile (peer died)

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
    (SIGTERM) while it waits for the next one: an idle persistent stream must not hold the grace period.

    The handler awaits each request directly (no task per request: a request wakes the handler in one
    event-loop step); draining cancels that wait, through one watcher per stream."""
    requests = request_iterator.__aiter__()
    task = asyncio.current_task()
    state = _WaitState()

    def on_drain(_future) -> None:
        if state.waiting and not state.cancelled:
            state.cancelled = True
            task.cancel()

    watcher = asyncio.ensure_future(draining.wait())
    watcher.add_done_callback(on_drain)
    try:
        while not draining.is_set():
            state.waiting = True
            try:
                request = await requests.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not state.cancelled:  # the call itself was cancelled
                    raise
                if hasattr(task, "uncancel"):  # Python 3.11+: this cancel is handled here
                    task.uncancel()
                return
            finally:
                state.waiting = False
            yield request
    finally:
        watcher.remove_done_callback(on_drain)
        watcher.cancel()


class _WaitState:
    __slots__ = ("waiting", "cancelled")

    def __init__(self) -> None:
        self.waiting = False
        self.cancelled = False
