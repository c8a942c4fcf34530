"""Client input validation: every bad field is rejected with INVALID_ARGUMENT and a clear message."""

import re

import grpc
import pytest

from specsplit.client.errors import InvalidArgument
from specsplit.coordinator.generation_config import GRPC_DEFAULTS, OPENAI_DEFAULTS, SamplingDefaults
from specsplit.coordinator.validation import build_request, build_requests
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
        (dict(prompt="a", sampling=common_pb2.SamplingParams(coupled=True)), "coupled is set by the coordinator"),
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


def test_a_users_seed_even_zero_makes_a_sampled_request_coupled():
    """Coupled verification (the seed reproduces whatever the speculation) is for the user's seed only; a drawn
    seed keeps rejection sampling, and greedy requests need neither."""
    drawn = build(prompt="a", sampling=common_pb2.SamplingParams(temperature=0.8)).sampling
    assert not drawn.seeded and not drawn.coupled
    for seed in (0, 7):
        given = build(prompt="a", sampling=common_pb2.SamplingParams(temperature=0.8, seed=seed)).sampling
        assert given.seeded and given.coupled and given.seed == seed
    greedy = build(prompt="a", sampling=common_pb2.SamplingParams(seed=7)).sampling
    assert greedy.seeded and not greedy.coupled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt="a", stop_token_ids=[100]), "stop_token_ids must be in the vocabulary [0, 100), got 100"),
        (dict(prompt="a", stop_token_ids=list(range(65))), "at most 64 stop_token_ids"),
        (dict(prompt="a", n=17), "n must be in [1, 16], got 17"),
        (dict(prompt="a", n=-1), "n must be in [1, 16]"),
    ],
)
def test_bad_request_options_are_invalid_argument(kwargs, message):
    msg = coordinator_pb2.GenerateRequest(max_tokens=8, **kwargs)
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        build_requests(msg, tokenizer=WordTokenizer(), vocab_size=100, max_model_len=16, num_speculative_tokens=3)


def test_n_completions_get_their_own_ids_and_consecutive_seeds():
    msg = coordinator_pb2.GenerateRequest(request_id="r", prompt="ab c", max_tokens=4, n=3, stop_token_ids=[7])
    msg.sampling.seed = 41
    reqs = build_requests(msg, tokenizer=WordTokenizer(), vocab_size=100, max_model_len=16, num_speculative_tokens=3)
    assert [r.request_id for r in reqs] == ["r-0", "r-1", "r-2"]
    assert [r.sampling.seed for r in reqs] == [41, 42, 43]
    assert all(r.sampling.seeded for r in reqs)
    msg.sampling.ClearField("seed")
    reqs = build_requests(msg, tokenizer=WordTokenizer(), vocab_size=100, max_model_len=16, num_speculative_tokens=3)
    assert not any(r.sampling.seeded for r in reqs) and len({r.sampling.seed for r in reqs}) == 3
    assert all(r.prompt_token_ids == [2, 1] and r.sampling.stop_token_ids == (7,) for r in reqs)
    assert reqs[0].prompt_token_ids is not reqs[1].prompt_token_ids


def test_unset_sampling_options_take_the_checkpoint_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9, "do_sample": true}')
    defaults = GRPC_DEFAULTS.with_generation_config(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=0)
    msg = coordinator_pb2.GenerateRequest(prompt="a", max_tokens=4)
    kw = dict(tokenizer=WordTokenizer(), vocab_size=100, max_model_len=16, num_speculative_tokens=3)
    s = build_request(msg, defaults=defaults, **kw).sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.9, 0)
    msg.sampling.temperature, msg.sampling.top_k = 0.0, 5  # set, even to 0: the request's value wins
    s = build_request(msg, defaults=defaults, **kw).sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.9, 5)
    assert OPENAI_DEFAULTS.with_generation_config(tmp_path / "none") == SamplingDefaults(temperature=1.0)


def test_the_verifier_hears_coupled_only_for_a_users_seed_that_samples():
    from specsplit.coordinator import wire
    from specsplit.coordinator.request import SamplingParams

    def coupled(**kw) -> bool:
        return wire._sampling(SamplingParams(max_tokens=4, **kw), frozenset()).coupled

    assert coupled(temperature=0.8, seed=3, seeded=True)
    assert not coupled(temperature=0.8, seed=3)  # a drawn seed
    assert not coupled(temperature=0.0, seed=3, seeded=True)  # greedy
