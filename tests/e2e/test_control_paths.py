"""The control paths on Unix sockets: the coordinator's VerifyStream on the verifier's
`--verify-socket` (`--verifier-rpc local`) and the verifier's ProposeStream on the drafter's
`--propose-socket` (`--drafter-rpc local`). A service asked for one refuses to start against a peer
without the socket, a server refuses a path no Unix socket can have, and gRPC's streams still serve
callers that ask for them (same output)."""

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


def test_coordinator_refuses_local_rpc_against_a_verifier_without_a_socket(tiny_checkpoint, tmp_path):
    cluster = LocalCluster(
        tiny_checkpoint,
        log_dir=tmp_path,
        with_drafter=False,
        verifier_rpc="stream",  # the verifier gets no --verify-socket
        coordinator_args=["--verifier-rpc", "local"],
    )
    with pytest.raises(RuntimeError, match="coordinator exited with code 2") as err:
        cluster.start(timeout_s=120)
    assert "--verifier-rpc local needs the verifier" in str(err.value) and "--verify-socket" in str(err.value)


@pytest.mark.parametrize(
    "role, flag", [("drafter", "--propose-socket"), ("verifier", "--verify-socket")], ids=["drafter", "verifier"]
)
def test_a_socket_path_too_long_is_refused_at_start_up(tiny_checkpoint, tmp_path, role, flag):
    args = {f"{role}_args": [flag, str(tmp_path / ("x" * 120))]}
    cluster = LocalCluster(tiny_checkpoint, log_dir=tmp_path, **args)
    with pytest.raises(RuntimeError, match=f"{role} exited with code 2") as err:
        cluster.start(timeout_s=120)
    assert "at most 107 bytes" in str(err.value)


@pytest.mark.parametrize("rpc", ["local", "stream"])
def test_both_control_paths_draft_and_match_greedy(tiny_checkpoint, tmp_path, hf_greedy, rpc):
    prompt = [3, 1, 4, 1, 5]
    cluster = LocalCluster(
        tiny_checkpoint, num_speculative_tokens=3, log_dir=tmp_path, verifier_rpc=rpc, drafter_rpc=rpc
    )
    with cluster, Client(cluster.address, timeout=120) as client:
        out = client.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
    assert out.token_ids == greedy_ignoring_eos(hf_greedy, prompt, 24)
    assert out.stats.num_draft_tokens > 0  # the drafter answered on this path
