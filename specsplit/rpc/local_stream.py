"""A persistent request/response stream over a Unix-domain socket: the control path between two
services on one host, without gRPC.

The gRPC streams (`BidiStream`) cost each message a trip through grpc.aio's completion-queue
thread and several generator layers on both ends. Two services on one host can instead exchange
the same protobuf messages as length-prefixed frames on a Unix socket, read and written directly by
their event loops (benchmarks/results/cpu_2core.md times both), as the frames of `specsplit.rpc.frames`.

Two servers: `LocalStreamServer` reads and answers on its event loop and awaits an async handler;
`ThreadedLocalStreamServer` (`specsplit/rpc/threaded_stream.py`) serves each connection on a thread of
its own that calls a synchronous handler itself, so a request's bytes reach the model, and its answer
the socket, without waiting for an event loop or handing over between threads (the co-located
drafter's socket).

The client (`LocalStream`) has `BidiStream`'s interface and failure semantics: any failure closes
the connection and raises a `grpc.RpcError` with the status a unary call would have had; the next
call connects again. The socket file is created with mode 0600: only the server's user (or root)
can connect, which is the access control here (the gRPC port keeps its TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from specsplit.client.errors import SpecsplitError, UsageError
from specsplit.proto import common_pb2
from specsplit.rpc.bidi_stream import StreamError, until_draining, within
from specsplit.rpc.frames import HEADER, BadFrame, answer_of, error_frame, message_frame, parse_request, request_length

log = logging.getLogger(__name__)

# The verifier's control paths to its drafters (its placement picks one: `specsplit.rpc.placement`): the gRPC
# ProposeStream or the same stream on a co-located drafter's Unix socket (`specsplit.verifier.drafter_channel`); the
# coordinator's `--verifier-rpc`: the gRPC VerifyStream or the same stream on the verifier's socket.
DRAFTER_RPCS = ("stream", "local")
VERIFIER_RPCS = ("stream", "local")
MAX_PATH_BYTES = 107  # sockaddr_un.sun_path less its terminating NUL (Linux)


async def _write_message(writer: asyncio.StreamWriter, message) -> None:
    """One message frame; waits only when over 1 MiB is still unsent (a large hidden-state message)."""
    writer.write(message_frame(message))
    if writer.transport.get_write_buffer_size() > 2**20:
        await writer.drain()


class LocalStreamServer:
    """Serves `handle(request) -> response` on the Unix socket `path`, one connection per client,
    requests answered in order. `parse(bytes)` makes the request; `handle` raises SpecsplitError for
    a status other than OK. When `draining` is set, a connection waiting for its next request ends
    (as `until_draining` ends a gRPC stream) and `close()` stops accepting."""

    def __init__(
        self,
        path: str,
        parse: Callable[[bytes], Any],
        handle: Callable[[Any], Awaitable[Any]],
        draining: asyncio.Event,
        max_message_bytes: int,
    ):
        self.path = path
        self._parse = parse
        self._handle = handle
        self._draining = draining
        self._max_message_bytes = max_message_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listens; raises ValueError for a path too long for a Unix socket or one another file or live
        server holds (`claim_path`), OSError when it cannot bind."""
        claim_path(self.path)
        old_umask = os.umask(0o177)  # created 0600: no window in which others could connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, self.path)
        finally:
            os.umask(old_umask)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            async for request in until_draining(self._requests(reader, writer), self._draining):
                try:
                    response = await self._handle(request)
                except SpecsplitError as err:
                    writer.write(error_frame(err.code, err.message))
                    return
                await _write_message(writer, response)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; it reconnects for its next call
        except Exception as err:  # noqa: BLE001 (one connection's bug must not take the server down)
            log.exception("local stream %s: handler failed", self.path)
            with contextlib.suppress(ConnectionError):
                writer.write(error_frame(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"))
        finally:
            self._connections.discard(task)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> AsyncIterator[Any]:
        """The connection's requests until the client closes it; a bad frame is answered with its
        error status and ends the connection."""
        while True:
            try:
                header = await reader.readexactly(HEADER.size)
            except asyncio.IncompleteReadError as err:
                header = err.partial
                if not header:
                    return
            try:
                length = request_length(header, self._max_message_bytes)
                request = parse_request(await reader.readexactly(length), self._parse)
            except BadFrame as bad:
                writer.write(bad.frame)
                return
            yield request


def claim_path(path: str) -> None:
    """Makes `path` free for a new socket: refuses (ValueError) a path too long for a Unix socket, a file
    there that is not a socket, or a socket a live server answers on; removes the socket file a process
    that did not stop cleanly left there."""
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ValueError(f"a Unix socket path holds at most {MAX_PATH_BYTES} bytes; {path!r} is longer")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)  # a listening socket on this host accepts at once (into its backlog)
    except OSError:  # nobody listens: stale
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ValueError(f"another server is listening on {path}")


@dataclass
class SocketDir:
    """The directory a service's Unix sockets live in: its `--socket-dir`, or a private one of its own
    (mode 0700). At exit, once the service has closed its sockets, `remove()` deletes a private one, and a
    given one if the service was the last to leave it empty (`specsplit up`'s, shared by verifier and drafter,
    is then gone even when `up` was killed; a mount point, as in the Kubernetes pods, stays)."""

    root: str
    owned: bool

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def remove(self) -> None:
        if self.owned:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        with contextlib.suppress(OSError):  # not empty (the other service still serves), a mount point, gone
            os.rmdir(self.root)


def socket_dir(given: str | None, role: str) -> SocketDir:
    """`--socket-dir` (made if missing; UsageError where it cannot be), or a new private directory under $TMPDIR."""
    if given:
        try:
            os.makedirs(given, mode=0o700, exist_ok=True)
        except OSError as err:
            raise UsageError(
                f"--socket-dir {given} cannot be made a directory ({err.strerror}); give one this user can create"
            ) from err
        return SocketDir(os.path.abspath(given), owned=False)
    return SocketDir(tempfile.mkdtemp(prefix=f"specsplit-{role}-"), owned=True)


async def serve_or_exit(
    server: LocalStreamServer | None,
    flag: str,
    stop_server: Callable[[], Awaitable[None]],
    sockets: SocketDir | None = None,
) -> LocalStreamServer | None:
    """A service's start-up, before its weights load (a bad path fails at once): starts `server` (a
    `LocalStreamServer` or a `ThreadedLocalStreamServer`, listening on a socket under the service's `flag`;
    None: no socket). Where it cannot listen it logs why and exits 2 after `stop_server()`, removing
    `sockets` if it made them."""
    if server is None:
        return None
    try:
        await server.start()
    except (OSError, ValueError) as err:
        log.error("cannot serve %s %s: %s", flag, server.path, err)
        if sockets is not None:
            sockets.remove()
        await stop_server()
        raise SystemExit(2) from err
    return server


async def serve_if_possible(server, sockets: SocketDir):
    """`server` (a `LocalStreamServer` or `ThreadedLocalStreamServer`) started if it can be, else None (logged,
    `sockets` removed if made): for a socket that only speeds up peers on this host, which gRPC serves without it
    (a pooled drafter's)."""
    try:
        await server.start()
    except (OSError, ValueError) as err:
        log.warning("not serving %s (%s): peers on this host take gRPC's stream", server.path, err)
        sockets.remove()
        return None
    return server


def served_socket(stub, field: str, peer: str, timeout_s: float) -> Callable[[], Awaitable[str]]:
    """`LocalStream`'s `connect`: the path the server behind `stub` names in `ModelInfo.<field>`, asked
    at each (re)connection (a restarted server may serve another one). Without one, the call fails
    with FAILED_PRECONDITION."""

    async def path() -> str:
        info = await stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout_s)
        if not getattr(info, field):
            raise StreamError(grpc.StatusCode.FAILED_PRECONDITION, f"the {peer} serves no Unix socket (no {field})")
        return getattr(info, field)

    return path


class LocalStream:
    """Client end: `connect()` returns the socket's path (asked of the server, so a restarted server
    is found again); `parse(bytes)` makes the response. Same interface as `BidiStream`."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[str]],
        parse: Callable[[bytes], Any],
        timeout_s: float,
        peer: str,
    ):
        self._connect = connect
        self._parse = parse
        self._timeout_s = timeout_s
        self._peer = peer
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def call(self, request):
        await self.send(request)
        return await self.receive()

    async def send(self, request) -> None:
        """Writes one request; `receive()` reads its response (the caller may work in between)."""
        try:
            if self._writer is None:
                path = await self._connect()
                self._reader, self._writer = await asyncio.open_unix_connection(path)
            await _write_message(self._writer, request)
        except OSError as err:
            self.close()
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"cannot reach the {self._peer}: {err}") from None

    async def receive(self):
        """The response to the request last sent."""
        if self._reader is None:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"no open stream to the {self._peer}")
        try:
            kind, body = await within(self._read_frame, self._timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self._timeout_s}s") from None
        except (OSError, asyncio.IncompleteReadError):
            self.close()
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"the {self._peer} closed the stream") from None
        try:
            return answer_of(kind, body, self._parse, self._peer)
        except StreamError:
            self.close()
            raise

    async def _read_frame(self) -> tuple[int, bytes]:
        length, kind = HEADER.unpack(await self._reader.readexactly(HEADER.size))
        return kind, await self._reader.readexactly(length)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
