"""Bad client input gets INVALID_ARGUMENT with an actionable message; the server keeps serving."""

import grpc
import pytest

from protos import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specsplit import Client, SpecsplitError


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


def test_sdk_raises_specsplit_error_with_the_status_code(cluster):
    with Client(cluster.address, timeout=30) as client, pytest.raises(SpecsplitError) as err:
        client.generate("x", max_tokens=0)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
