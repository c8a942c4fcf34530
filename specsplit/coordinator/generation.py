"""One API request's completions on the Engine: the loop the gRPC servicer and the HTTP API share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from specsplit.client.errors import SpecsplitError
from specsplit.coordinator import observability as obs
from specsplit.coordinator.engine import Engine, RequestOutput
from specsplit.coordinator.request import Request


class Choices:
    """The n completions (choices) of one API request, indexed by their place in `requests`.

    `start()` adds them to the engine (a refusal, such as a full queue, raises its SpecsplitError there, before
    anything is streamed); `outputs()` yields (index, request, output) as they come, each completion ending with
    an output that carries its finish_reason, and raises the SpecsplitError of a completion that fails; `close()`
    aborts everywhere (`Engine.abort`) every completion not finished: the caller cancelled or went away, a
    deadline, an error, server shutdown. `async with` does start() and close()."""

    def __init__(self, engine: Engine, requests: list[Request], model: str, parent_ctx, deadline: float | None = None):
        self.engine = engine
        self.requests = requests
        self.model = model
        self.parent_ctx = parent_ctx
        self.deadline = deadline
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._unfinished: dict[str, tuple[int, Request]] = {}

    def start(self) -> None:
        try:
            for i, req in enumerate(self.requests):
                req.deadline = self.deadline
                req.span = obs.start_request_span(req, self.model, self.parent_ctx)
                try:
                    self.engine.add_request(req, self._queue)
                except SpecsplitError as err:
                    obs.end_request_span(req.span, req, "rejected", err)
                    raise
                self._unfinished[req.request_id] = (i, req)
        except BaseException:
            self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, Request, RequestOutput]]:
        while self._unfinished:
            out = await self._queue.get()
            i, req = self._unfinished[out.request_id]
            if out.error is not None:
                del self._unfinished[out.request_id]
                obs.end_request_span(req.span, req, "error", out.error)
                raise out.error
            if out.finish_reason is not None:
                del self._unfinished[out.request_id]
                obs.end_request_span(req.span, req, out.finish_reason)
            yield i, req, out

    def close(self) -> None:
        """Aborts the unfinished completions (idempotent)."""
        while self._unfinished:
            _, (_, req) = self._unfinished.popitem()
            self.engine.abort(req.request_id)
            obs.end_request_span(req.span, req, "abort")

    async def __aenter__(self) -> Choices:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
