"""A tensor-parallel drafter through the three services (`specsplit up --verifier-tp 2 --drafter-tp 2`'s command
line) for DeepSeek-V3, whose MTP layer (MLA, 8 routed experts) splits like its target: with a TP 2 verifier,
greedy output equals transformers' generate for k 1 and 3 at once; a drafter rank killed mid-generation stops
the drafter, the verifier carries on without drafts and takes the restarted drafter's again. The ranks are
spawned CPU processes joined over gloo."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from specsplit import Client
from tests.e2e.helpers import greedy_ignoring_eos, start_streams
from tests.e2e.test_tensor_parallel import check_greedy, followers_of, hf_greedy_of, proc_stat, tp_cluster
from tests.fixtures.tiny_deepseek_v3 import write_served_tiny_deepseek


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    """The tiny DeepSeek-V3 of tests/e2e/test_deepseek_v3_lossless.py (MLA, 8 routed experts: 4 per rank, its MTP
    layer imitating the target, so drafts are accepted)."""
    return write_served_tiny_deepseek(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v3")


@pytest.fixture(scope="module")
def deepseek_tp(deepseek_v3, tmp_path_factory):
    """TP 2 verifier and TP 2 drafter, pooled: the drafter's rank 0 takes the hidden states by the nccl transport
    (gloo here), a process group of its own beside its ranks'."""
    logs = tmp_path_factory.mktemp("logs-tp-deepseek")
    tp2 = ["--tensor-parallel-size", "2"]
    with tp_cluster(deepseek_v3, logs, drafter_args=tp2, placement="pooled", hidden_transport="nccl") as c:
        yield c


def test_deepseek_v3_tp2_greedy_equals_transformers_generate(deepseek_tp, deepseek_v3):
    """Verifier and drafter TP 2 each."""
    (drafter_follower,) = followers_of(deepseek_tp.services["drafter"].proc.pid)
    check_greedy(deepseek_tp.address, hf_greedy_of(deepseek_v3))
    assert "tensor-parallel rank 1 of 2" in deepseek_tp.services["drafter"].log_tail(200)
    assert proc_stat(drafter_follower)[0] != "Z"


def test_a_drafter_rank_killed_stops_the_drafter_and_the_verifier_carries_on(deepseek_tp, deepseek_v3):
    """The drafter's rank 1 SIGKILLed mid-generation: the drafter (rank 0) exits 1 with one line; the streams go
    on without drafts and complete as transformers' greedy; the restarted drafter's drafts are taken again."""
    hf_greedy = hf_greedy_of(deepseek_v3)
    drafter = deepseek_tp.services["drafter"]
    (follower,) = followers_of(drafter.proc.pid)
    ps = [[5 + i, 60 + i, 9] for i in range(3)]
    progressed = threading.Event()
    threads, results, errors = start_streams(deepseek_tp.address, ps, 24, lambda n: n >= 4 and progressed.set())
    assert progressed.wait(60)
    os.kill(follower, signal.SIGKILL)
    assert drafter.proc.wait(timeout=30) == 1
    assert "tensor-parallel rank 1 exited" in drafter.log_tail(200)
    for t in threads:
        t.join(240)
    assert not errors, errors
    for i, p in enumerate(ps):
        assert results[i] == greedy_ignoring_eos(hf_greedy, p, 24), f"stream {i}"

    deepseek_tp.restart("drafter")
    expected = greedy_ignoring_eos(hf_greedy, [7, 8, 9], 8)
    deadline = time.monotonic() + 20  # the verifier probes a lost drafter with backoff (<= 5 s)
    with Client(deepseek_tp.address, timeout=60) as client:
        while True:
            out = client.generate(prompt_token_ids=[7, 8, 9], max_tokens=8, ignore_eos=True)
            assert out.token_ids == expected
            if out.stats.num_draft_tokens > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert out.stats.num_draft_tokens > 0
