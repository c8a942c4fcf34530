"""Start-up and shutdown shared by the three services: health, reflection, graceful stop.

Each service builds its servicer, then calls `serve()`; the server reports NOT_SERVING on
`grpc.health.v1` until `mark_serving()` (weights loaded, dependencies reachable) and goes back to
NOT_SERVING as soon as SIGTERM/SIGINT arrives, before draining in-flight calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit.client.errors import UsageError
from specsplit.rpc.process import outlive_the_coordinator
from specsplit.rpc.security import TlsFiles

T = TypeVar("T")
log = logging.getLogger(__name__)

# Hidden states of a large batch exceed gRPC's 4 MiB default; this bounds every message.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

CHANNEL_OPTIONS = [
    # Reconnect quickly to a restarted peer (the default backoff grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        # A peer that vanished without closing its connection (a node lost, a partition) is noticed within
        # ~30 s: the server pings every 20 s and drops a connection that does not answer in 10 s. Its streams
        # end then, e.g. a dead coordinator's VerifyStream, which holds the verifier while open.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class _Malformed:
    """Stands in for a request whose bytes did not parse (bad UTF-8, garbage)."""

    def __init__(self, error: str):
        self.error = error


def _parser(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as err:
            return _Malformed(f"cannot parse {message_cls.DESCRIPTOR.full_name}: {err}")

    return parse


def _guard(fn, client_streaming: bool, server_streaming: bool):
    """Refuses a malformed request with INVALID_ARGUMENT before the servicer sees it."""
    if client_streaming:

        async def bidi_handler(request_iterator, context):
            async def checked():
                async for request in request_iterator:
                    if isinstance(request, _Malformed):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
                    yield request

            async for response in fn(checked(), context):
                yield response

        return bidi_handler
    if server_streaming:

        async def stream_handler(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            async for response in fn(request, context):
                yield response

        return stream_handler

    async def unary_handler(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await fn(request, context)

    return unary_handler


def add_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Registers `servicer` for `service` like the generated add_*_to_server, except that a request
    that does not parse (invalid UTF-8 in a string field, garbage bytes) gets INVALID_ARGUMENT
    rather than the UNKNOWN grpc answers by default."""
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        if method.client_streaming and method.server_streaming:
            make = grpc.stream_stream_rpc_method_handler
        elif method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client-streaming-only RPCs are not used")
        else:
            make = (
                grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
            )
        handlers[method.name] = make(
            _guard(getattr(servicer, method.name), method.client_streaming, method.server_streaming),
            request_deserializer=_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def insecure_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel to a peer service with the project's reconnect and size options."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def peer_channel(address: str, tls: TlsFiles | None) -> grpc.aio.Channel:
    """A channel to a peer service: mutual TLS when the service has TLS files, else plaintext."""
    if tls is None:
        return insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)


def check_can_listen(host: str, port: int, flag: str = "--port") -> None:
    """Raises UsageError, naming `flag`, when this process could not listen on host:port (0: any free
    port): a port out of range, one in use, a host that is not this machine's. Asked before gRPC binds,
    which would log its own lines and wrap a port past 65535 around."""
    any_port = " (0: any free port)" if flag == "--port" else ""
    if not 0 <= port <= 65535:
        raise UsageError(f"{flag} {port} is not a port number; give one in 0-65535{any_port}")
    bare = host.removeprefix("[").removesuffix("]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a port in TIME_WAIT is free
            probe.bind(address)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise UsageError(
                f"{host}:{port} is in use; stop what listens there or give another {flag}{any_port}"
            ) from err
        raise UsageError(
            f"cannot listen on {host}:{port} ({err.strerror or err}); give a --host of this machine "
            "(127.0.0.1, 0.0.0.0 or one of its addresses)"
        ) from err


class ServiceServer:
    """A grpc.aio server with health and reflection, bound to host:port (0 = pick a free port);
    a port it cannot bind raises UsageError.

    With `tls`, the port serves TLS and, when `require_client_cert`, mutual TLS (internal services).
    """

    def __init__(
        self,
        role: str,
        host: str,
        port: int,
        service_names: list[str],
        *,
        tls: TlsFiles | None = None,
        require_client_cert: bool = False,
        interceptors: list[grpc.aio.ServerInterceptor] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        check_can_listen(host, port)
        self.role = role
        self.server = grpc.aio.server(options=server_options(max_message_bytes), interceptors=interceptors or None)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self._service_names = service_names
        self._stopping = False
        self._stop_at_exit: asyncio.Future | None = None
        try:  # the port checked above may have been taken since
            if tls is None:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
            else:
                self.port = self.server.add_secure_port(f"{host}:{port}", tls.server_credentials(require_client_cert))
        except RuntimeError as err:
            raise UsageError(f"{role} cannot listen on {host}:{port}; give another --port (0: any free port)") from err
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        # Signals are caught from here on, so a SIGTERM during start-up also drains gracefully.
        self.stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        self._stop_at_exit = asyncio.ensure_future(self._stop_when_cancelled())

    async def _stop_when_cancelled(self) -> None:
        """Stops the server when cancelled, unless `stop()` does. `asyncio.run` cancels the tasks left
        before it closes the loop, so a start-up that raises still stops the server inside the loop (a
        grpc.aio server left running then prints "Event loop is closed" at exit)."""
        try:
            await asyncio.Event().wait()
        finally:
            if not self._stopping:
                await self.server.stop(0)

    async def unless_stopped(self, start_up: Awaitable[T]) -> T | None:
        """`start_up`'s result, or None where a SIGTERM or SIGINT comes first (`start_up` cancelled): a service
        waiting at start-up on another one (the coordinator on its verifier, up to --startup-timeout) stops when
        told to instead of when that wait ends."""
        task = asyncio.ensure_future(start_up)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            stop.cancel()
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def mark_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def _set_all(self, status: int) -> None:
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def set_not_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        self._stopping = True
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        if self._stop_at_exit is not None:
            self._stop_at_exit.cancel()


def freeze_start_up_heap() -> None:
    """A service process once loaded, before it serves: start-up's garbage collected, and every object
    left (modules, the weights' wrappers, kernels' metadata) moved out of the cyclic collector's
    generations, so that no collection while serving walks them."""
    gc.collect()
    gc.freeze()


def announce(role: str, address: str) -> None:
    """Prints the line `specsplit up` and operators wait for."""
    print(f"{role} listening on {address}", flush=True)
    sys.stdout.flush()


async def run_until_signal(
    server: ServiceServer,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    *,
    grace_s: float = 30.0,
    delay_s: float = 0.0,
    on_drain: Callable[[], None] | None = None,
) -> None:
    """Waits for SIGTERM/SIGINT, then drains: health NOT_SERVING at once; after delay_s (time for
    load balancers and probes to notice) no new calls are admitted; in-flight calls get grace_s to
    finish; then on_stop runs and this returns (the process exits 0)."""
    waiter = asyncio.ensure_future(server.server.wait_for_termination())
    stopper = asyncio.ensure_future(server.stop_requested.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    await outlive_the_coordinator()  # a model server whose `up` was killed serves its draining coordinator first
    log.info("%s: stopping (delay %.1fs, grace %.1fs)", server.role, delay_s, grace_s)
    await server.set_not_serving()
    if on_drain is not None:
        on_drain()  # e.g. end idle persistent streams, which would otherwise hold the grace period
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    await server.stop(grace_s)
    if on_stop is not None:
        await on_stop()
    waiter.cancel()
    stopper.cancel()


def add_common_arguments(p) -> None:
    """Flags every service takes: address, logging, metrics, TLS and message size."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--metrics-host",
        default=None,
        help="the address --metrics-port listens on (default: --host), e.g. 0.0.0.0 for a service on loopback that "
        "Prometheus scrapes from outside",
    )
    p.add_argument(
        "--tls-dir",
        default=None,
        help="directory with tls.crt, tls.key, ca.crt: TLS to clients, mutual TLS between services",
    )
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight calls get after SIGTERM")
    p.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        help="seconds between reporting NOT_SERVING and refusing new calls after SIGTERM",
    )
    p.add_argument(
        "--max-message-mb",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES // 2**20,
        help="largest gRPC message accepted or sent, MiB",
    )


def check_flag_ranges(config: object, **ranges: tuple[float | None, float | None]) -> None:
    """Raises UsageError for the first flag whose value, `config`'s attribute of the flag's name, lies outside
    its (low, high) range (None: no bound; a value None is not checked): values argparse's types let through."""
    for name, (low, high) in ranges.items():
        value = getattr(config, name)
        if value is None or ((low is None or value >= low) and (high is None or value <= high)):
            continue  # NaN fails both comparisons: refused
        flag = "--" + name.replace("_", "-")
        wanted = f">= {low}" if high is None else f"<= {high}" if low is None else f"in {low}-{high}"
        raise UsageError(f"{flag} {value} is out of range; give a value {wanted}")


@dataclass(frozen=True)
class ServerOptions:
    """What every `serve ROLE` takes (`--port` and `add_common_arguments`): address, logging, metrics, TLS,
    shutdown and message size."""

    host: str
    port: int  # 0: any free port
    log_level: str
    metrics_port: int | None
    metrics_host: str  # where --metrics-port listens: --metrics-host, else --host
    tls_dir: str | None
    shutdown_grace: float  # seconds in-flight calls get after SIGTERM
    shutdown_delay: float  # seconds between NOT_SERVING and refusing new calls
    max_message_mb: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        """The parsed command line's values; UsageError, before anything loads, for one out of range or a
        port taken (`ServiceServer` asks again when it binds)."""
        options = cls(
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            metrics_port=args.metrics_port,
            metrics_host=(args.metrics_host or args.host).removeprefix("[").removesuffix("]"),
            tls_dir=args.tls_dir,
            shutdown_grace=args.shutdown_grace,
            shutdown_delay=args.shutdown_delay,
            max_message_mb=args.max_message_mb,
        )
        check_flag_ranges(
            options,
            max_message_mb=(1, 2047),  # gRPC takes a signed 32-bit byte count
            shutdown_grace=(0, None),
            shutdown_delay=(0, None),
        )
        check_can_listen(options.host, options.port)
        if options.metrics_port:
            check_can_listen(options.metrics_host, options.metrics_port, "--metrics-port")
        return options

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 2**20


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
