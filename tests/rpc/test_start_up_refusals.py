"""Start-up refusals that need no cluster: each service's check says what is wrong and how to fix it, and
a socket it cannot serve stops the service with exit code 2 (the e2e tests keep one refusal through real
processes: tests/e2e/test_hidden_transport.py)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from specsplit.coordinator.server import verifier_refusal
from specsplit.proto import common_pb2, drafter_pb2_grpc
from specsplit.rpc.local_stream import LocalStreamServer, serve_or_exit
from specsplit.rpc.server import ServiceServer
from specsplit.rpc.threaded_stream import ThreadedLocalStreamServer
from specsplit.verifier.channels import make_channel
from specsplit.verifier.drafter_channel import TransportConfigError
from specsplit.verifier.drafter_pool import DRAFTER_SERVICE


def test_the_coordinator_refuses_local_rpc_against_a_verifier_whose_socket_is_elsewhere(tmp_path):
    info = common_pb2.ModelInfo(verify_socket="/run/elsewhere/verifier.sock")
    refusal = verifier_refusal("local", "10.0.0.5:50052", info)
    assert "the verifier 10.0.0.5:50052 serves VerifyStream on '/run/elsewhere/verifier.sock'" in refusal
    assert "run the coordinator beside its verifier" in refusal and "or use --verifier-rpc stream" in refusal
    assert verifier_refusal("stream", "v:1", info) is None
    socket = tmp_path / "verify.sock"
    socket.touch()
    assert verifier_refusal("local", "v:1", common_pb2.ModelInfo(verify_socket=str(socket))) is None


@pytest.mark.parametrize("threaded", [False, True], ids=["verify-socket", "propose-socket"])
def test_a_socket_path_too_long_stops_the_service_with_exit_2(tmp_path, caplog, threaded):
    path = str(tmp_path / ("x" * 120))
    args = (path, bytes, None, asyncio.Event(), 1 << 20)
    server = ThreadedLocalStreamServer(*args, name="propose-socket") if threaded else LocalStreamServer(*args)
    stopped = []

    async def stop_server():
        stopped.append(True)

    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        asyncio.run(serve_or_exit(server, "--socket", stop_server))
    assert exit_.value.code == 2 and stopped == [True]
    assert "cannot serve --socket" in caplog.text and "at most 107 bytes" in caplog.text
    assert asyncio.run(serve_or_exit(None, "--socket", stop_server)) is None  # no flag, no socket


def test_a_transport_other_than_grpc_and_a_colocated_drafter_need_exactly_one_drafter():
    with pytest.raises(TransportConfigError, match="hidden states by nccl needs exactly one --drafter HOST:PORT"):
        make_channel("127.0.0.1:1,127.0.0.1:2", 2.0, transport=SimpleNamespace(name="nccl"))
    with pytest.raises(
        TransportConfigError, match="a co-located drafter needs exactly one --drafter.*--placement pooled"
    ):
        make_channel("dns:///drafters:50053", 2.0, rpc="local", transport=SimpleNamespace(name="grpc"))
    no_drafter = make_channel(None, 2.0, rpc="local", transport=SimpleNamespace(name="grpc"))
    assert no_drafter.name == "pooled"  # no socket to drive: Proposes fail at once, no drafts


class InfoOnlyDrafter(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, info: common_pb2.ModelInfo):
        self.info = info

    async def GetModelInfo(self, request, context):
        return self.info


@pytest.mark.parametrize(
    "rpc, transport, info, says",
    [
        ("local", "grpc", common_pb2.ModelInfo(), "a co-located drafter shares its verifier's host"),
        ("stream", "nccl", common_pb2.ModelInfo(hidden_transport="grpc"), "takes hidden states by grpc but"),
    ],
    ids=["no-socket-here", "other-transport"],
)
def test_the_verifier_refuses_a_drafter_that_cannot_serve_its_flags(rpc, transport, info, says):
    async def body():
        server = ServiceServer("drafter", "127.0.0.1", 0, [DRAFTER_SERVICE])
        drafter_pb2_grpc.add_DrafterServicer_to_server(InfoOnlyDrafter(info), server.server)
        await server.start()
        await server.mark_serving()
        fake_transport = SimpleNamespace(name=transport, close=lambda: None)
        client = make_channel(server.address, 2.0, rpc=rpc, transport=fake_transport)
        try:
            with pytest.raises(TransportConfigError, match=says):
                await client.open_transport(None, wait_s=5.0)
        finally:
            await client.close()
            await server.server.stop(0)

    asyncio.run(body())


def test_the_verifier_warns_of_a_drafter_holding_fewer_tokens_than_itself(caplog):
    """Not a refusal: the requests past the drafter's cache go without drafts (lossless, slower)."""
    ours = common_pb2.ModelInfo(num_blocks=100, block_size=16)

    async def warnings(drafter_blocks: int) -> list[str]:
        server = ServiceServer("drafter", "127.0.0.1", 0, [DRAFTER_SERVICE])
        info = common_pb2.ModelInfo(num_blocks=drafter_blocks, block_size=16)
        drafter_pb2_grpc.add_DrafterServicer_to_server(InfoOnlyDrafter(info), server.server)
        await server.start()
        await server.mark_serving()
        client = make_channel(server.address, 2.0, transport=SimpleNamespace(name="grpc", close=lambda: None))
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="specsplit.verifier.drafter_channel"):
                await client.open_transport(None, wait_s=5.0, model=ours)
        finally:
            await client.close()
            await server.server.stop(0)
        return [r.getMessage() for r in caplog.records if "MTP KV cache" in r.getMessage()]

    assert asyncio.run(warnings(100)) == []
    (line,) = asyncio.run(warnings(50))
    assert "holds 800 tokens of MTP KV cache, fewer than this verifier's 1600: requests past that go" in line
