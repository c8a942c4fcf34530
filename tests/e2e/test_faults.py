"""Faults with nothing lost: the verifier or drafter SIGKILLed under concurrent streams, restarts,
and a verifier that never comes back within a request's deadline. (The session's cluster: a service a test
leaves stopped is restarted for the next test that takes it; tests/e2e/conftest.py.)"""

import signal
import time

import grpc
import pytest

from specsplit import Client, SpecsplitError

from .helpers import assert_kv_all_free, greedy_ignoring_eos, kill_under_streams

N_TOKENS = 60


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_sigkill_under_concurrent_streams_loses_and_repeats_nothing(cluster, hf_greedy, role):
    _sigkill_under_concurrent_streams(cluster, hf_greedy, role)


def _sigkill_under_concurrent_streams(cluster, hf_greedy, role):
    prompts = [[3 + i, 40 + i, 7] for i in range(6)]
    results = kill_under_streams(cluster, role, prompts, N_TOKENS)
    for i, p in enumerate(prompts):
        assert results[i] == greedy_ignoring_eos(hf_greedy, p, N_TOKENS), f"stream {i}"
    with Client(cluster.address, timeout=60) as client:  # the restarted service is used again
        deadline = time.monotonic() + 20  # the verifier probes a lost drafter with backoff (<= 5 s)
        while True:
            out = client.generate(prompt_token_ids=[5, 6], max_tokens=12, ignore_eos=True)
            if out.stats.num_draft_tokens > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert out.stats.num_draft_tokens > 0
    # Nothing is left on either cache: a restarted verifier's drafter freed what the old one had placed on it.
    assert_kv_all_free(cluster)


def test_no_verifier_within_the_deadline_is_unavailable_with_a_clear_message(cluster):
    cluster.kill("verifier", signal.SIGKILL)
    with Client(cluster.address) as client:
        t0 = time.monotonic()
        with pytest.raises(SpecsplitError) as err:
            client.generate(prompt_token_ids=[5, 6], max_tokens=8, timeout=3.0)
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert "verifier unreachable" in err.value.message
    assert time.monotonic() - t0 < 3.0
