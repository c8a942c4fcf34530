"""Bad client input gets INVALID_ARGUMENT with an actionable message; the server keeps serving."""

import grpc
import pytest

from specsplit import Client, SpecsplitError
from specsplit.client.errors import InvalidArgument
from specsplit.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc


def _call(address: str, msg: coordinator_pb2.GenerateRequest):
    with grpc.insecure_channel(address) as channel:
        return list(coordinator_pb2_grpc.CoordinatorStub(channel).Generate(msg, timeout=30))


def gen(**kw):
    return coordinator_pb2.GenerateRequest(max_tokens=kw.pop("max_tokens", 4), **kw)


@pytest.mark.parametrize(
    "msg, message",
    [
        (gen(prompt=""), "prompt is empty"),
        (gen(prompt_token_ids=[5] * 600), "max_model_len"),
        (gen(prompt="x", max_tokens=0), "max_tokens must be > 0"),
        (gen(prompt="x", max_tokens=-1), "max_tokens must be > 0"),
        (gen(prompt="x", sampling=common_pb2.SamplingParams(temperature=-1.0)), "temperature"),
        (gen(prompt="x", sampling=common_pb2.SamplingParams(top_p=0.0)), "top_p"),
        (gen(prompt="x", sampling=common_pb2.SamplingParams(top_p=1.01)), "top_p"),
        (gen(prompt_token_ids=[1, 10**6]), "outside the vocabulary"),
        (gen(prompt_token_ids=[-2]), "outside the vocabulary"),
        (gen(prompt="x", prompt_token_ids=[1]), "exactly one of prompt and prompt_token_ids"),
        (gen(), "exactly one of prompt and prompt_token_ids"),
    ],
)
def test_bad_request_is_invalid_argument_and_server_keeps_serving(cluster, msg, message):
    with pytest.raises(grpc.RpcError) as err:
        _call(cluster.address, msg)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    with Client(cluster.address, timeout=30) as client:
        assert len(client.generate(prompt_token_ids=[3, 4, 5], max_tokens=2).token_ids) >= 1


def test_prompt_and_max_tokens_past_the_model_length_are_invalid_argument_saying_both_and_the_limit(cluster):
    """The verifier's max_model_len bounds prompt + max_tokens: one token past it is refused, exactly it runs."""
    with Client(cluster.address, timeout=60) as client:
        limit = client.model_info().max_model_len
        prompt = [5] * (limit - 3)
        with pytest.raises(InvalidArgument) as err:
            client.generate(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True)
        assert f"prompt has {limit - 3} tokens and max_tokens is 4" in err.value.message
        assert f"maximum context length is {limit} tokens" in err.value.message
        out = client.generate(prompt_token_ids=prompt, max_tokens=3, ignore_eos=True)
    assert (len(out.token_ids), out.finish_reason) == (3, "length")


def test_sdk_raises_the_typed_error_with_the_status_code(cluster):
    with Client(cluster.address, timeout=30) as client, pytest.raises(InvalidArgument) as err:
        client.generate("x", max_tokens=0)
    assert isinstance(err.value, SpecsplitError) and err.value.code is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "role, method",
    [
        ("coordinator", "/specsplit.v1.Coordinator/Generate"),
        ("verifier", "/specsplit.v1.Verifier/VerifyStream"),
        ("drafter", "/specsplit.v1.Drafter/ProposeStream"),
    ],
)
@pytest.mark.parametrize("payload", [bytes([0x12, 3, 0xFF, 0xFE, 0x41, 0x20, 3]), b"\xff\xff\xff\xff"])
def test_unparseable_bytes_and_invalid_utf8_are_invalid_argument(cluster, role, method, payload):
    """Field 2 of GenerateRequest (prompt) / VerifyRequest / ProposeRequest with invalid UTF-8, or garbage;
    the internal services' messages go on their streams."""
    with grpc.insecure_channel(cluster.services[role].address) as ch:
        if role == "coordinator":
            call = ch.unary_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            result = call(payload, timeout=10)
        else:
            call = ch.stream_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            result = call(iter([payload]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(result)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot parse specsplit.v1." in err.value.details()
    with Client(cluster.address, timeout=30) as client:
        assert client.generate(prompt_token_ids=[3, 4], max_tokens=2).token_ids
