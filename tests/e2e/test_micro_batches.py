"""Two micro-batches in flight (`serve coordinator --micro-batches 2`): concurrent greedy requests
still equal transformers' generate, over the gRPC bytes transport and over nccl (gloo on CPU), whose
hidden-state sends a drafter pairs with Proposes by order; both micro-batches really ran."""

import grpc
import pytest

from protos import coordinator_pb2, coordinator_pb2_grpc
from specsplit.launcher import LocalCluster

from .helpers import generate_concurrently, greedy_ignoring_eos

MAX_TOKENS = 16
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [40, 41, 42, 43, 44, 45] * 5, [8, 9], [21] * 7]


@pytest.fixture(scope="module", params=["grpc", "nccl"])
def micro_batched(request, tiny_checkpoint, tmp_path_factory):
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        hidden_transport=request.param,
        log_dir=tmp_path_factory.mktemp(f"micro-{request.param}"),
        coordinator_args=["--micro-batches", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"],
        verifier_args=["--transport-timeout", "10"],
    ) as c:
        yield c


def test_two_micro_batches_are_lossless_and_both_run(micro_batched, hf_greedy):
    outs = generate_concurrently(micro_batched.address, PROMPTS, MAX_TOKENS)
    for i, p in enumerate(PROMPTS):
        assert outs[i].token_ids == greedy_ignoring_eos(hf_greedy, p, MAX_TOKENS), f"prompt {i}"
    assert sum(o.stats.num_draft_tokens for o in outs.values()) > 0  # the drafter answered both streams
    with grpc.insecure_channel(micro_batched.address) as ch:
        stats = coordinator_pb2_grpc.CoordinatorStub(ch).GetStats(
            coordinator_pb2.GetStatsRequest(include_iterations=True), timeout=30
        )
    iterations = [it for it in stats.iterations if it.batch_size]
    assert {it.micro_batch for it in iterations} == {0, 1}
    # The drafter answered every iteration's Propose: none was lost to the two streams' interleaving.
    # (Async scheduling: a response carries the stamps of its micro-batch's previous Propose, so the
    # first iteration of each micro-batch has none.)
    for micro_batch in (0, 1):
        ordered = sorted((it for it in iterations if it.micro_batch == micro_batch), key=lambda it: it.iteration)
        assert ordered[0].verifier.drafter_received_ns == 0
        assert all(it.verifier.drafter_received_ns for it in ordered[1:])
    # Never more than max-num-seqs / 2 requests in one micro-batch's iteration.
    assert max(it.batch_size for it in stats.iterations) <= 2


def test_micro_batches_must_be_positive(tiny_checkpoint):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "specsplit", "serve", "coordinator", "--model", str(tiny_checkpoint)]
        + ["--verifier", "127.0.0.1:1", "--micro-batches", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--micro-batches: must be >= 1" in proc.stderr
