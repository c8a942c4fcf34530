"""The three services with the nccl hidden-state transport (backend gloo on CPU): greedy output
equals transformers' generate, bad handles are refused, a lost drafter costs only drafts, and a
drafter started with another transport is a start-up error."""

import signal
import time

import grpc
import pytest

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.proto import common_pb2, drafter_pb2, drafter_pb2_grpc

from .helpers import generate_concurrently, greedy_ignoring_eos

MAX_TOKENS = 20
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [40, 41, 42, 43, 44, 45] * 5]


@pytest.fixture(scope="module")
def nccl_cluster(tiny_checkpoint, tmp_path_factory):
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        placement="pooled",
        hidden_transport="nccl",
        log_dir=tmp_path_factory.mktemp("nccl"),
        verifier_args=["--transport-timeout", "10"],
        coordinator_args=["--no-adaptive"],  # drafts every iteration: the rows' transport is what is tested
    ) as c:
        yield c


def test_greedy_over_nccl_transport_equals_transformers_generate(nccl_cluster, hf_greedy):
    outs = generate_concurrently(nccl_cluster.address, PROMPTS, MAX_TOKENS)
    for i, p in enumerate(PROMPTS):
        assert outs[i].token_ids == greedy_ignoring_eos(hf_greedy, p, MAX_TOKENS), f"prompt {i}"
    assert sum(o.stats.num_draft_tokens for o in outs.values()) > 0  # the drafter did get the rows
    with grpc.insecure_channel(nccl_cluster.services["drafter"].address) as ch:
        info = drafter_pb2_grpc.DrafterStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
    assert info.hidden_transport == "nccl"


def test_bad_handles_are_refused_and_the_transport_stays_in_step(nccl_cluster, hf_greedy):
    with grpc.insecure_channel(nccl_cluster.services["drafter"].address) as ch:
        stub = drafter_pb2_grpc.DrafterStub(ch)
        hidden = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10).hidden_size
        item = drafter_pb2.ProposeItem(request_id="x", start_position=0, next_token_ids=[5, 6], num_spec_tokens=2)
        cases = [
            (dict(hidden_size=hidden + 3), grpc.StatusCode.INVALID_ARGUMENT, "hidden_size"),
            (dict(dtype=common_pb2.DTYPE_INT64), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
            (dict(num_rows=-2), grpc.StatusCode.INVALID_ARGUMENT, "num_rows"),
            (dict(generation=10**6), grpc.StatusCode.FAILED_PRECONDITION, "generation"),
        ]
        for change, code, words in cases:
            base = dict(generation=1, sequence=1, dtype=common_pb2.DTYPE_FLOAT32, num_rows=2, hidden_size=hidden)
            handle = drafter_pb2.HiddenStatesHandle(**{**base, **change})
            with pytest.raises(grpc.RpcError) as err:
                next(
                    stub.ProposeStream(
                        iter([drafter_pb2.ProposeRequest(requests=[item], hidden_states_handle=handle)]), timeout=10
                    )
                )
            assert err.value.code() is code and words in err.value.details(), change
        with pytest.raises(grpc.RpcError) as err:  # bytes to an nccl drafter: the verifier runs grpc
            next(
                stub.ProposeStream(
                    iter([drafter_pb2.ProposeRequest(requests=[item], hidden_states=common_pb2.Tensor())]), timeout=10
                )
            )
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "same --hidden-transport" in err.value.details()
    with Client(nccl_cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=PROMPTS[0], max_tokens=12, ignore_eos=True)
    assert out.token_ids == greedy_ignoring_eos(hf_greedy, PROMPTS[0], 12) and out.stats.num_draft_tokens > 0


def test_killing_the_nccl_drafter_keeps_output_and_a_restarted_one_is_opened_again(nccl_cluster, hf_greedy):
    prompt = [7, 8, 9, 10, 11]
    expected = greedy_ignoring_eos(hf_greedy, prompt, 40)
    with Client(nccl_cluster.address, timeout=120) as client:
        got = []
        for delta in client.stream(prompt_token_ids=prompt, max_tokens=40, ignore_eos=True):
            got.extend(delta.token_ids)
            if len(got) >= 8 and nccl_cluster.services["drafter"].proc.poll() is None:
                nccl_cluster.kill("drafter", signal.SIGKILL)
        assert got == expected
        nccl_cluster.restart("drafter")
        # The verifier probes the drafter with backoff (<= 5 s), then re-opens the transport (an NCCL rendezvous):
        # bounded by time, not by a count of requests, which a fast machine runs through before that.
        deadline = time.monotonic() + 90
        for _ in range(5000):
            out = client.generate(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True)
            assert out.token_ids == expected[:12]
            if out.stats.num_draft_tokens > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        logs = "\n".join(f"--- {r}:\n{nccl_cluster.services[r].log_tail(15)}" for r in ("verifier", "drafter"))
        assert out.stats.num_draft_tokens > 0, logs


def test_verifier_refuses_to_start_against_a_drafter_with_another_transport(tiny_checkpoint, tmp_path):
    """Drafter and verifier only: the refusal is the verifier's, at start-up (a coordinator waiting for it would
    take the 10 s of `LocalCluster.stop`'s grace to go)."""
    cluster = LocalCluster(
        tiny_checkpoint,
        placement="pooled",
        hidden_transport="nccl",
        log_dir=tmp_path,
        drafter_args=["--hidden-transport", "grpc"],  # the last flag wins: this drafter runs grpc
    )
    try:
        cluster.start_drafter()
        verifier = cluster.start_verifier()
        with pytest.raises(RuntimeError, match="verifier exited with code 2") as err:
            cluster.wait_ready([verifier], time.monotonic() + 120)
    finally:
        cluster.stop()
    assert "takes hidden states by grpc but this verifier sends them by nccl" in str(err.value)
