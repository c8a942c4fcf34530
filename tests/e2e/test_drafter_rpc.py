"""`--drafter-rpc local`: the verifier's ProposeStream on the drafter's `--propose-socket`. A verifier
asked for it refuses to start against a drafter without one, a drafter refuses a path no Unix socket
can have, and gRPC's ProposeStream still serves a verifier that asks for it (same output)."""

import pytest

from specsplit import Client
from specsplit.launcher import LocalCluster

from .helpers import greedy_ignoring_eos


def test_verifier_refuses_local_rpc_against_a_drafter_without_a_socket(tiny_checkpoint, tmp_path):
    cluster = LocalCluster(
        tiny_checkpoint,
        log_dir=tmp_path,
        drafter_rpc="stream",  # the drafter gets no --propose-socket
        verifier_args=["--drafter-rpc", "local"],  # the last flag wins
    )
    with pytest.raises(RuntimeError, match="verifier exited with code 2") as err:
        cluster.start(timeout_s=120)
    assert "--drafter-rpc local needs drafter" in str(err.value) and "started with --propose-socket" in str(err.value)


def test_drafter_refuses_a_socket_path_too_long(tiny_checkpoint, tmp_path):
    cluster = LocalCluster(
        tiny_checkpoint, log_dir=tmp_path, drafter_args=["--propose-socket", str(tmp_path / ("x" * 120))]
    )
    with pytest.raises(RuntimeError, match="drafter exited with code 2") as err:
        cluster.start(timeout_s=120)
    assert "at most 107 bytes" in str(err.value)


@pytest.mark.parametrize("rpc", ["local", "stream"])
def test_both_control_paths_draft_and_match_greedy(tiny_checkpoint, tmp_path, hf_greedy, rpc):
    prompt = [3, 1, 4, 1, 5]
    cluster = LocalCluster(tiny_checkpoint, num_speculative_tokens=3, log_dir=tmp_path, drafter_rpc=rpc)
    with cluster, Client(cluster.address, timeout=120) as client:
        out = client.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
    assert out.token_ids == greedy_ignoring_eos(hf_greedy, prompt, 24)
    assert out.stats.num_draft_tokens > 0  # the drafter answered on this path
