"""The SDK's `structured_output` option (vLLM's `structured_outputs` shape): a bad shape is InvalidArgument naming
the option before any call, for the blocking and the asyncio client alike; a good one arrives at the coordinator as
the request's StructuredOutput, from generate, generate_n and stream."""

import asyncio
import json
from concurrent import futures

import grpc
import pytest

from specsplit import AsyncClient, Client
from specsplit.client.errors import InvalidArgument
from specsplit.proto import common_pb2, coordinator_pb2_grpc

BAD = [
    ("json", "structured_output must be a dict with exactly one of json, json_object, regex, choice, grammar"),
    ({}, "structured_output must give exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"regex": "a", "grammar": "b"}, "structured_output must give exactly one of json, json_object, regex, choice"),
    ({"json_schema": {}}, "structured_output has unknown key(s) json_schema"),
    ({"json": 5}, "structured_output.json must be a JSON schema (a dict or its JSON text), got 5"),
    ({"json": {"a": {1, 2}}}, "structured_output.json cannot be written as JSON"),
    ({"json_object": False}, "structured_output.json_object must be true, got False"),
    ({"choice": "yes"}, "structured_output.choice must be a list of strings, got 'yes'"),
    ({"choice": ["yes", 1]}, "structured_output.choice must be a list of strings"),
    ({"regex": b"a+"}, "structured_output.regex must be a string"),
    ({"grammar": None}, "structured_output must give exactly one of"),  # None: unset
]


@pytest.mark.parametrize("value, says", BAD, ids=[repr(v) for v, _ in BAD])
def test_a_bad_structured_output_is_invalid_argument_naming_it_before_any_call(value, says):
    """No server listens at the address: a call would fail with UNAVAILABLE instead."""
    with Client("127.0.0.1:1", timeout=5) as client, pytest.raises(InvalidArgument) as err:
        client.generate("hi", structured_output=value)
    assert err.value.message.startswith(says) and err.value.code == grpc.StatusCode.INVALID_ARGUMENT

    async def async_generate():
        async with AsyncClient("127.0.0.1:1", timeout=5) as client:
            await client.generate("hi", structured_output=value)

    with pytest.raises(InvalidArgument) as err:
        asyncio.run(async_generate())
    assert err.value.message.startswith(says)


class Recording(coordinator_pb2_grpc.CoordinatorServicer):
    """A coordinator that records each GenerateRequest and refuses it (the test needs no tokens)."""

    def __init__(self):
        self.requests = []

    def Generate(self, request, context):
        self.requests.append(request)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "recorded")


@pytest.fixture
def coordinator():
    servicer = Recording()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "value, spec",
    [
        ({"json": SCHEMA}, common_pb2.StructuredOutput(json=json.dumps(SCHEMA))),
        ({"json": '{"type": "string"}'}, common_pb2.StructuredOutput(json='{"type": "string"}')),
        ({"json_object": True}, common_pb2.StructuredOutput(json_object=True)),
        ({"regex": "[0-9]+", "json": None}, common_pb2.StructuredOutput(regex="[0-9]+")),
        ({"choice": ("yes", "no")}, common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["yes", "no"]))),
        ({"grammar": 'root ::= "x"'}, common_pb2.StructuredOutput(grammar='root ::= "x"')),
    ],
    ids=["json", "json-text", "json_object", "regex", "choice", "grammar"],
)
def test_a_structured_output_arrives_as_the_requests(coordinator, value, spec):
    address, servicer = coordinator
    with Client(address, timeout=10) as client:
        for call in (
            lambda: client.generate("hi"),
            lambda: client.generate("hi", structured_output=value),
            lambda: client.generate_n("hi", n=2, structured_output=value),
            lambda: list(client.stream("hi", structured_output=value)),
        ):
            with pytest.raises(InvalidArgument, match="recorded"):
                call()

    async def async_generate():
        async with AsyncClient(address, timeout=10) as client:
            await client.generate("hi", structured_output=value)

    with pytest.raises(InvalidArgument, match="recorded"):
        asyncio.run(async_generate())
    plain, *given = servicer.requests
    assert not plain.sampling.HasField("structured_output")
    assert [r.sampling.structured_output for r in given] == [spec] * 4
    assert [r.n for r in given] == [1, 2, 0, 1]  # stream leaves n unset
