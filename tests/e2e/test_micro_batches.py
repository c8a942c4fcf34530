"""Two micro-batches in flight (`serve coordinator --micro-batches 2`): concurrent greedy requests
still equal transformers' generate, over the gRPC bytes transport and over nccl (gloo on CPU), whose
hidden-state sends a drafter pairs with Proposes by order; both micro-batches really ran."""

import threading

import grpc
import pytest

from protos import coordinator_pb2, coordinator_pb2_grpc
from specsplit import Client
from specsplit.launcher import LocalCluster

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


def _generate_all(address: str) -> dict[int, object]:
    outs, errors = {}, []

    def run(i):
        try:
            with Client(address, timeout=120) as client:
                outs[i] = client.generate(prompt_token_ids=PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return outs


def _greedy(hf_greedy, prompt, n):
    out = []
    while len(out) < n:  # ignore_eos: continue past an EOS the way the services do
        out.extend(hf_greedy(prompt + out, n - len(out)))
    return out[:n]


def test_two_micro_batches_are_lossless_and_both_run(micro_batched, hf_greedy):
    outs = _generate_all(micro_batched.address)
    for i, p in enumerate(PROMPTS):
        assert outs[i].token_ids == _greedy(hf_greedy, p, MAX_TOKENS), f"prompt {i}"
    assert sum(o.stats.num_draft_tokens for o in outs.values()) > 0  # the drafter answered both streams
    with grpc.insecure_channel(micro_batched.address) as ch:
        stats = coordinator_pb2_grpc.CoordinatorStub(ch).GetStats(
            coordinator_pb2.GetStatsRequest(include_iterations=True), timeout=30
        )
    iterations = [it for it in stats.iterations if it.batch_size]
    assert {it.micro_batch for it in iterations} == {0, 1}
    # The drafter answered every iteration's Propose: none was lost to the two streams' interleaving.
    assert all(it.verifier.drafter_received_ns for it in iterations)
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
