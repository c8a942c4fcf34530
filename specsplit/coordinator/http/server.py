"""uvicorn in the coordinator's asyncio loop, beside the gRPC server (it leaves the signals to the coordinator)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import uvicorn

from specsplit.client.errors import UsageError


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the coordinator's run_until_signal owns SIGTERM/SIGINT and drains both APIs
        yield


class HttpServer:
    """Serves `api` (an `app.HttpApi`), with TLS from `tls_dir` (tls.crt, tls.key) as the gRPC server has it."""

    def __init__(self, api, host: str, port: int, tls_dir: str | None, grace_s: float):
        self.api = api
        tls = {}
        if tls_dir:
            tls = {"ssl_certfile": str(Path(tls_dir) / "tls.crt"), "ssl_keyfile": str(Path(tls_dir) / "tls.key")}
        config = uvicorn.Config(
            api.app(),
            host=host,
            port=port,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=max(1, int(grace_s)),
            **tls,
        )
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Listens; a port it cannot bind raises UsageError."""
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():  # uvicorn logs why (a port in use) and exits
                raise UsageError(
                    f"the HTTP API cannot listen on {self._server.config.host}:{self._server.config.port}; give "
                    "--http-port a free port"
                )
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stops listening; requests in flight get the grace period to finish."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self._task
