"""Faults with nothing lost: the verifier or drafter SIGKILLed under concurrent streams, restarts,
and a verifier that never comes back within a request's deadline."""

import signal
import threading
import time

import grpc
import pytest

from specsplit import Client, SpecsplitError
from specsplit.launcher import LocalCluster

from .helpers import greedy_ignoring_eos, start_streams

N_TOKENS = 60


@pytest.fixture
def own_cluster(tiny_checkpoint, tmp_path):
    with LocalCluster(tiny_checkpoint, num_speculative_tokens=3, log_dir=tmp_path) as c:
        yield c


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_sigkill_under_concurrent_streams_loses_and_repeats_nothing(own_cluster, hf_greedy, role):
    _sigkill_under_concurrent_streams(own_cluster, hf_greedy, role)


def _sigkill_under_concurrent_streams(own_cluster, hf_greedy, role):
    prompts = [[3 + i, 40 + i, 7] for i in range(6)]
    progressed = threading.Event()
    threads, results, errors = start_streams(
        own_cluster.address, prompts, N_TOKENS, lambda n: n >= 8 and progressed.set()
    )
    assert progressed.wait(60)
    own_cluster.kill(role, signal.SIGKILL)
    time.sleep(0.5)
    own_cluster.restart(role)
    for t in threads:
        t.join(240)
    assert not errors, errors
    for i, p in enumerate(prompts):
        assert results[i] == greedy_ignoring_eos(hf_greedy, p, N_TOKENS), f"stream {i}"
    with Client(own_cluster.address, timeout=60) as client:  # the restarted service is used again
        deadline = time.monotonic() + 20  # the verifier probes a lost drafter with backoff (<= 5 s)
        while True:
            out = client.generate(prompt_token_ids=[5, 6], max_tokens=12, ignore_eos=True)
            if out.stats.num_draft_tokens > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert out.stats.num_draft_tokens > 0


def test_no_verifier_within_the_deadline_is_unavailable_with_a_clear_message(own_cluster):
    own_cluster.kill("verifier", signal.SIGKILL)
    with Client(own_cluster.address) as client:
        t0 = time.monotonic()
        with pytest.raises(SpecsplitError) as err:
            client.generate(prompt_token_ids=[5, 6], max_tokens=8, timeout=3.0)
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert "verifier unreachable" in err.value.message
    assert time.monotonic() - t0 < 3.0
