"""`ThreadedLocalStreamServer`: `specsplit.rpc.local_stream`'s protocol (`specsplit.rpc.frames`) served by one thread
per
connection.

The thread reads a request, calls the synchronous handler itself and writes the answer: no event loop
and no hand-over between threads lies between a request's bytes and the model (the co-located
drafter's socket). Same frames, statuses, draining and path rules as `LocalStreamServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc

from specsplit.client.errors import SpecsplitError
from specsplit.rpc.frames import (
    HEADER,
    BadFrame,
    error_frame,
    message_frame,
    parse_request,
    recv_exactly,
    request_length,
)
from specsplit.rpc.local_stream import claim_path

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 30.0  # the wait for the rest of a frame begun


class ThreadedLocalStreamServer:
    """`LocalStreamServer`'s protocol and failure semantics, each connection served by its own thread:
    it reads a request, calls the synchronous `handle(request) -> response` itself, and writes the
    answer. `handle` runs on several threads at once when several clients are connected: it guards
    what it shares. `draining` (an `asyncio.Event` or a `threading.Event`: only `is_set()` is read)
    ends connections waiting for their next request; a call in flight finishes. `start()` and
    `close()` are coroutines, as `LocalStreamServer`'s."""

    IDLE_POLL_S = 0.1  # how often a connection waiting for a request looks at `draining`

    def __init__(
        self,
        path: str,
        parse: Callable[[bytes], Any],
        handle: Callable[[Any], Any],
        draining,
        max_message_bytes: int,
        name: str = "local-stream",
        thread_init: Callable[[], None] | None = None,  # run first on every connection's thread
        thread_exit: Callable[[], None] | None = None,  # run last on every connection's thread, once it closed
    ):
        self.path = path
        self._thread_init = thread_init
        self._thread_exit = thread_exit
        self._parse = parse
        self._handle = handle
        self._draining = draining
        self._max_message_bytes = max_message_bytes
        self._name = name
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._connections: dict[threading.Thread, socket.socket] = {}

    async def start(self) -> None:
        claim_path(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # created 0600: no window in which others could connect
        try:
            listener.bind(self.path)
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(old_umask)
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, name=f"{self._name}-accept", daemon=True).start()

    async def close(self) -> None:
        """Stops accepting, ends every connection (waiting for the calls in flight, up to 30 s) and
        removes the socket file."""
        if self._listener is None:
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._listener = None
        with self._lock:
            threads = list(self._connections)
        await asyncio.get_running_loop().run_in_executor(None, _join_all, threads, 30.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        listener = self._listener
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            thread = threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True)
            with self._lock:
                self._connections[thread] = conn
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)  # for the rest of a frame once its first byte is here
        try:
            if self._thread_init is not None:
                self._thread_init()
            while (request := self._next_request(conn)) is not None:
                try:
                    response = self._handle(request)
                except SpecsplitError as err:
                    conn.sendall(error_frame(err.code, err.message))
                    return
                except Exception as err:  # noqa: BLE001 (one connection's bug must not take the server down)
                    log.exception("local stream %s: handler failed", self.path)
                    conn.sendall(error_frame(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"))
                    return
                conn.sendall(message_frame(response))
        except OSError:
            pass  # the client went away; it reconnects for its next call
        finally:
            with self._lock:
                self._connections.pop(threading.current_thread(), None)
            conn.close()
            if self._thread_exit is not None:
                self._thread_exit()

    def _next_request(self, conn: socket.socket):
        """The connection's next request; None when the client closed it, the server drains or closes
        while it is idle, or after a bad frame (answered with its error status)."""
        while not select.select([conn], [], [], self.IDLE_POLL_S)[0]:
            if self._draining.is_set() or self._closed.is_set():
                return None
        header = recv_exactly(conn, HEADER.size)
        if not header:
            return None
        try:
            length = request_length(header, self._max_message_bytes)
            body = recv_exactly(conn, length)
            if len(body) < length:
                return None
            return parse_request(body, self._parse)
        except BadFrame as bad:
            conn.sendall(bad.frame)
            return None


def _join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    for thread in threads:
        thread.join(timeout_s)
