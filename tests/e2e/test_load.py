"""Bounded load: 64 concurrent streams, a few hundred requests with random cancellations — zero
errors, every KV block free again afterwards, no memory growth; a full queue answers
RESOURCE_EXHAUSTED instead of growing."""

import random
import statistics
import threading
import time

import grpc
import pytest

from specsplit import Client, SpecsplitError
from specsplit.cli.launcher import LocalCluster

from .helpers import assert_kv_all_free, wait_idle


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _load(address: str, num_requests: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    jobs = [(rng.randint(1, 40), rng.randint(1, 24), rng.random() < 0.2) for _ in range(num_requests)]
    latencies, errors, cancelled = [], [], [0]
    lock = threading.Lock()

    def worker(wid: int) -> None:
        with Client(address, timeout=120) as client:
            for i in range(wid, num_requests, concurrency):
                plen, max_tokens, cancel = jobs[i]
                prompt = [3 + (i * 7 + j) % 200 for j in range(plen)]
                t0 = time.perf_counter()
                try:
                    stream = client.stream(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
                    for n, _ in enumerate(stream):
                        if cancel and n == 1:
                            stream.close()
                            with lock:
                                cancelled[0] += 1
                            break
                except SpecsplitError as err:
                    with lock:
                        errors.append(err)
                    continue
                with lock:
                    latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return {"latencies": latencies, "errors": errors, "cancelled": cancelled[0]}


@pytest.fixture(scope="module")
def load_cluster(tiny_checkpoint, tmp_path_factory):
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("load"),
        coordinator_args=["--max-num-seqs", "32", "--max-num-batched-tokens", "256"],
    ) as c:
        yield c


def test_64_concurrent_streams_with_cancellations_lose_nothing_and_leak_nothing(load_cluster):
    pids = [s.proc.pid for s in load_cluster.services.values()]
    _load(load_cluster.address, 64, 16, seed=0)  # warm-up: allocator pools, caches
    rss_before = [_rss_mb(p) for p in pids]
    result = _load(load_cluster.address, 320, 64, seed=1)
    assert result["errors"] == []
    lat = sorted(result["latencies"])
    print(
        f"\nload: {len(lat)} completed, {result['cancelled']} cancelled, "
        f"p50 {statistics.median(lat) * 1e3:.0f} ms, p99 {lat[int(0.99 * (len(lat) - 1))] * 1e3:.0f} ms"
    )
    with Client(load_cluster.address, timeout=30) as client:
        wait_idle(client, 30)
    assert_kv_all_free(load_cluster)
    growth = [_rss_mb(p) - b for p, b in zip(pids, rss_before)]
    assert max(growth) < 64, f"RSS grew by {growth} MB"


def test_full_waiting_queue_is_resource_exhausted(tiny_checkpoint, tmp_path):
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=1,
        log_dir=tmp_path,
        coordinator_args=["--max-num-seqs", "1", "--max-waiting", "2"],
    ) as cluster:
        codes = []

        def one():
            try:
                with Client(cluster.address, timeout=120) as client:
                    client.generate(prompt_token_ids=[5, 6], max_tokens=40, ignore_eos=True)
                codes.append(grpc.StatusCode.OK)
            except SpecsplitError as err:
                codes.append(err.code)

        threads = [threading.Thread(target=one) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert codes.count(grpc.StatusCode.OK) >= 3
        with Client(cluster.address, timeout=60) as client:
            assert client.generate(prompt_token_ids=[5], max_tokens=3).token_ids
