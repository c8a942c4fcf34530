"""Adaptive speculation through the three services: greedy output stays the target's, each request's drafts verified
per iteration are in its stats, and the verifier sends no Propose when no request of the batch wants drafts."""

import grpc
import pytest

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.proto import coordinator_pb2, coordinator_pb2_grpc
from tests.e2e.helpers import generate_concurrently, greedy_ignoring_eos
from tests.e2e.test_lossless_greedy import prompts


@pytest.fixture(scope="module")
def adaptive_cluster(tiny_checkpoint, tmp_path_factory):
    """`--adaptive`: each request's draft count chosen per iteration, at most 3."""
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("logs-adaptive"),
        coordinator_args=["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--adaptive"],
    ) as c:
        yield c


def iterations_since(address: str, after: int) -> list[coordinator_pb2.IterationTiming]:
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stats = stub.GetStats(coordinator_pb2.GetStatsRequest(include_iterations=True), timeout=60)
    return [it for it in stats.iterations if it.iteration > after]


def last_iteration(address: str) -> int:
    return max((it.iteration for it in iterations_since(address, 0)), default=0)


def test_adaptive_greedy_equals_transformers_generate_and_stats_count_drafts_per_iteration(adaptive_cluster, hf_greedy):
    """Three rounds of 8 concurrent requests, so later rounds are chosen from what the first ones measured."""
    for seed in range(3):
        ps = prompts(8, seed=10 + seed)
        outs = generate_concurrently(adaptive_cluster.address, ps, 16)
        for i, p in enumerate(ps):
            assert outs[i].token_ids == greedy_ignoring_eos(hf_greedy, p, 16), f"round {seed} prompt {i}"
            stats = outs[i].stats
            histogram = stats.draft_count_histogram
            assert sum(histogram) == stats.num_iterations
            assert sum(d * n for d, n in enumerate(histogram)) == stats.num_draft_tokens
            assert len(histogram) <= 4  # at most --num-speculative-tokens 3 drafts


def test_no_propose_when_no_request_wants_drafts(cluster, hf_greedy):
    """A request asking for no drafts runs without the drafter (no Propose: the verifier reports no drafter stamps);
    one asking for two is proposed for (the control)."""
    ps = prompts(3, seed=7)
    for k, proposed in ((0, False), (2, True)):
        before = last_iteration(cluster.address)
        with Client(cluster.address, timeout=60) as client:
            out = client.generate(prompt_token_ids=ps[2], max_tokens=10, ignore_eos=True, num_speculative_tokens=k)
        assert out.token_ids == greedy_ignoring_eos(hf_greedy, ps[2], 10)
        # Each iteration reports the Propose whose drafts it verified: the first one's is not this request's.
        timings = [it for it in iterations_since(cluster.address, before) if it.batch_size][1:]
        assert timings
        assert any(it.verifier.drafter_received_ns > 0 for it in timings) == proposed, k
