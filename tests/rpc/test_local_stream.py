"""specsplit.rpc.local_stream: a request/response stream over a Unix socket with BidiStream's interface
and failure semantics (in order, statuses as a unary call would have them, reconnect after any
failure), refusing bad frames, ending idle connections when the server drains. Every server test
runs against both servers: the event loop's (`LocalStreamServer`) and the one with a thread per
connection (`ThreadedLocalStreamServer`, given the same handlers run synchronously)."""

import asyncio
import os
import socket
import stat
import struct

import grpc
import pytest

from specsplit.client.errors import FailedPrecondition
from specsplit.proto import common_pb2
from specsplit.rpc.bidi_stream import StreamError
from specsplit.rpc.frames import HEADER
from specsplit.rpc.local_stream import LocalStream, LocalStreamServer, served_socket
from specsplit.rpc.threaded_stream import ThreadedLocalStreamServer

Req = common_pb2.SamplingParams  # any message: seed in, seed out


@pytest.fixture
def socket_path(tmp_path_factory):
    # pytest's tmp_path can be longer than a Unix socket path may be.
    short = tmp_path_factory.getbasetemp() / "s"
    short.mkdir(exist_ok=True)
    path = short / f"t{os.getpid()}.sock"
    assert len(str(path)) < 100
    return str(path)


async def echo(request):
    if request.seed == 13:
        raise FailedPrecondition("thirteen is refused")
    if request.seed == 7:
        await asyncio.sleep(0.5)
    return Req(seed=request.seed + 1)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture(params=["loop", "threads"])
def serving(request):
    """`await serving(path, handle=echo)` -> (a started server, its draining event)."""
    threaded = request.param == "threads"
    inits = []  # one per connection thread started

    async def start(path, handle=echo, max_bytes=1 << 20):
        draining = asyncio.Event()
        if threaded:

            def handle_here(req):  # the connection's thread runs the handler itself
                return asyncio.run(handle(req))

            server = ThreadedLocalStreamServer(
                path, Req.FromString, handle_here, draining, max_bytes, thread_init=lambda: inits.append(1)
            )
        else:
            server = LocalStreamServer(path, Req.FromString, handle, draining, max_bytes)
        await server.start()
        return server, draining

    start.threaded, start.thread_inits = threaded, inits
    return start


def client(path, timeout_s=5.0):
    async def connect():
        return path

    return LocalStream(connect, Req.FromString, timeout_s, "test server")


def test_answers_in_order_on_one_connection_and_the_socket_is_private(socket_path, serving):
    async def main():
        server, _ = await serving(socket_path)
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        stream = client(socket_path)
        got = [(await stream.call(Req(seed=i))).seed for i in range(20, 70)]
        await stream.send(Req(seed=100))  # send and receive apart, as the verifier does
        got.append((await stream.receive()).seed)
        stream.close()
        await server.close()
        return got

    assert run(main()) == list(range(21, 71)) + [101]
    assert not os.path.exists(socket_path)  # close() removes the socket file
    if serving.threaded:
        assert serving.thread_inits == [1]  # one connection: its thread ran thread_init once


def test_a_handler_error_is_the_callers_status_and_the_next_call_reconnects(socket_path, serving):
    async def main():
        server, _ = await serving(socket_path)
        stream = client(socket_path)
        with pytest.raises(StreamError) as err:
            await stream.call(Req(seed=13))
        after = await stream.call(Req(seed=1))
        await server.close()
        return err.value, after

    err, after = run(main())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and err.details() == "thirteen is refused"
    assert after.seed == 2


def test_no_answer_in_time_is_deadline_exceeded(socket_path, serving):
    async def main():
        server, _ = await serving(socket_path)
        stream = client(socket_path, timeout_s=0.1)
        with pytest.raises(StreamError) as err:
            await stream.call(Req(seed=7))
        after = await stream.call(Req(seed=2))  # a fresh connection: the late answer is not read as this one's
        await server.close()
        return err.value, after

    err, after = run(main())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after.seed == 3


def test_no_server_and_a_server_gone_are_unavailable(socket_path, serving):
    async def main():
        stream = client(socket_path)
        with pytest.raises(StreamError) as nobody:
            await stream.call(Req(seed=1))
        server, _ = await serving(socket_path)
        first = await stream.call(Req(seed=1))
        await server.close()
        with pytest.raises(StreamError) as gone:
            await stream.call(Req(seed=2))
        server, _ = await serving(socket_path)  # the server back on the same path
        again = await stream.call(Req(seed=3))
        await server.close()
        return nobody.value, first, gone.value, again

    nobody, first, gone, again = run(main())
    assert nobody.code() == gone.code() == grpc.StatusCode.UNAVAILABLE
    assert (first.seed, again.seed) == (2, 4)


async def raw_exchange(path, payload: bytes) -> tuple[int, int, bytes]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(payload)
    length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    body = await reader.readexactly(length)
    closed = await reader.read(1) == b""  # the server ends the connection after an error
    writer.close()
    assert closed
    return kind, struct.unpack_from("<I", body)[0], body[4:]


@pytest.mark.parametrize(
    "payload, code, says",
    [
        (HEADER.pack(3, 0) + b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "cannot parse"),
        (HEADER.pack(0, 9), grpc.StatusCode.INVALID_ARGUMENT, "unknown frame kind 9"),
        (HEADER.pack(2**20 + 1, 0), grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit"),
    ],
    ids=["garbage", "bad-kind", "too-big"],
)
def test_a_bad_frame_is_refused_with_its_status_and_the_server_keeps_serving(socket_path, payload, code, says, serving):
    async def main():
        server, _ = await serving(socket_path)
        kind, got_code, details = await raw_exchange(socket_path, payload)
        after = await client(socket_path).call(Req(seed=5))
        await server.close()
        return kind, got_code, details.decode(), after

    kind, got_code, details, after = run(main())
    assert kind == 1 and got_code == code.value[0] and says in details
    assert after.seed == 6


def test_a_handler_bug_is_internal_and_does_not_stop_the_server(socket_path, serving):
    async def buggy(request):
        if request.seed == 0:
            raise RuntimeError("boom")
        return Req(seed=request.seed)

    async def main():
        server, _ = await serving(socket_path, handle=buggy)
        stream = client(socket_path)
        with pytest.raises(StreamError) as err:
            await stream.call(Req(seed=0))
        after = await stream.call(Req(seed=4))
        await server.close()
        return err.value, after

    err, after = run(main())
    assert err.code() == grpc.StatusCode.INTERNAL and "boom" in err.details()
    assert after.seed == 4


def test_draining_ends_an_idle_connection_but_not_a_call_in_flight(socket_path, serving):
    async def main():
        server, draining = await serving(socket_path)
        stream = client(socket_path)
        await stream.call(Req(seed=1))  # connected, now idle
        slow = client(socket_path)
        await slow.send(Req(seed=7))  # in flight for 0.5 s
        await asyncio.sleep(0.05)
        draining.set()
        answered = await slow.receive()
        with pytest.raises(StreamError) as ended:
            await stream.call(Req(seed=2))  # its connection was closed while idle
        await server.close()
        return answered, ended.value

    answered, ended = run(main())
    assert answered.seed == 8
    assert ended.code() == grpc.StatusCode.UNAVAILABLE


def test_a_path_too_long_for_a_unix_socket_is_refused(tmp_path, serving):
    async def main():
        await serving(str(tmp_path / ("x" * 120)))

    with pytest.raises(ValueError, match="at most 107 bytes"):
        run(main())


def test_a_file_that_is_not_a_socket_or_a_live_server_is_never_replaced(socket_path, serving):
    async def main():
        with open(socket_path, "w") as f:
            f.write("keep me")
        with pytest.raises(ValueError, match="is not a socket"):
            await serving(socket_path)
        os.unlink(socket_path)
        live, _ = await serving(socket_path)
        with pytest.raises(ValueError, match="another server is listening"):
            await serving(socket_path)
        got = await client(socket_path).call(Req(seed=1))  # the live one still serves its path
        await live.close()
        return got

    assert run(main()).seed == 2


def test_a_stale_socket_file_is_replaced(socket_path, serving):
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(socket_path)  # a process that died: its socket file stays, nobody listens
    dead.close()

    async def main():
        server, _ = await serving(socket_path)
        got = await client(socket_path).call(Req(seed=9))
        await server.close()
        return got

    assert run(main()).seed == 10


class _Stub:
    """Stands in for a gRPC stub: GetModelInfo answers `info`, counting the calls."""

    def __init__(self, info):
        self.info, self.calls = info, 0

    async def GetModelInfo(self, request, timeout):  # noqa: N802 (the gRPC method's name)
        self.calls += 1
        return self.info


def test_the_path_is_asked_of_the_server_at_each_connection_and_none_is_failed_precondition(socket_path, serving):
    async def main():
        server, _ = await serving(socket_path)
        stub = _Stub(common_pb2.ModelInfo(verify_socket=socket_path))
        stream = LocalStream(served_socket(stub, "verify_socket", "verifier", 5), Req.FromString, 5, "verifier")
        await stream.call(Req(seed=1))
        await stream.call(Req(seed=2))  # same connection: not asked again
        asked_once = stub.calls
        stream.close()
        await stream.call(Req(seed=3))  # a new connection asks again
        none = LocalStream(served_socket(_Stub(common_pb2.ModelInfo()), "verify_socket", "verifier", 5), Req, 5, "v")
        with pytest.raises(StreamError) as err:
            await none.call(Req(seed=1))
        await server.close()
        return asked_once, stub.calls, err.value

    asked_once, asked, err = run(main())
    assert (asked_once, asked) == (1, 2)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no verify_socket" in err.details()
