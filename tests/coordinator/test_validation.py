"""Client input validation: every bad field is rejected with INVALID_ARGUMENT and a clear message."""

import grpc
import pytest

from specsplit.coordinator.validation import build_request
from specsplit.errors import InvalidArgument
from specsplit.proto import common_pb2, coordinator_pb2


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


def build(**kw):
    sampling = kw.pop("sampling", common_pb2.SamplingParams())
    msg = coordinator_pb2.GenerateRequest(max_tokens=kw.pop("max_tokens", 8), sampling=sampling, **kw)
    return build_request(msg, tokenizer=WordTokenizer(), vocab_size=100, max_model_len=16, num_speculative_tokens=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of prompt and prompt_token_ids"),
        (dict(prompt="a b", prompt_token_ids=[1]), "exactly one"),
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt="   "), "encodes to no tokens"),
        (dict(prompt_token_ids=[1, 100]), "outside the vocabulary"),
        (dict(prompt_token_ids=[-1]), "outside the vocabulary"),
        (dict(prompt_token_ids=list(range(16))), "max_model_len is 16"),
        (dict(prompt="a", max_tokens=0), "max_tokens must be > 0"),
        (dict(prompt="a", max_tokens=-3), "max_tokens must be > 0"),
        (dict(prompt="a", sampling=common_pb2.SamplingParams(temperature=-0.5)), "temperature"),
        (dict(prompt="a", sampling=common_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
        (dict(prompt="a", sampling=common_pb2.SamplingParams(top_p=0.0)), "top_p must be in (0, 1]"),
        (dict(prompt="a", sampling=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
        (dict(prompt="a", sampling=common_pb2.SamplingParams(top_k=-1)), "top_k"),
        (dict(prompt="a", stop=[""]), "stop strings"),
        (dict(prompt="a", num_speculative_tokens=4), "num_speculative_tokens"),
    ],
)
def test_bad_input_is_invalid_argument(kwargs, message):
    with pytest.raises(InvalidArgument) as err:
        build(**kwargs)
    assert message in str(err.value)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_defaults_top_p_one_and_draws_a_seed():
    r = build(prompt="ab c")
    assert r.prompt_token_ids == [2, 1]
    assert r.sampling.top_p == 1.0 and r.sampling.temperature == 0.0
    assert 0 <= r.sampling.seed < 2**63
    assert build(prompt="a", sampling=common_pb2.SamplingParams(seed=7)).sampling.seed == 7
