"""Automatic prefix caching through the three services, as a user sees it (docs/architecture.md, "Prefix caching"): a
request whose prompt shares full blocks with an earlier one starts on them, which its SDK result's `cached_tokens`,
the HTTP API's `usage.prompt_tokens_details.cached_tokens` and the `vllm:prefix_cache_*` counters of the coordinator
(`worker="verifier"`) and the drafter (`worker="drafter"`) report; greedy output over shared prefixes (sequential,
concurrent, diverging mid-block or right after a block, the next turn of a conversation) equals transformers'; a
drafter or verifier SIGKILLed under streams that started on cached blocks loses nothing, and the prefix is cached
again afterwards; with `--no-enable-prefix-caching` nothing is cached or counted.

Prompts are random tokens of a seed per test (none shared with the other tests of the session's cluster), the prefix
from ids 3..199 and what follows it from 200..299, so that each prompt diverges exactly where it is cut."""

import random
import signal
import time

import openai
import pytest
from transformers import AutoTokenizer

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.rpc.process import free_port

from .helpers import (
    BLOCK_SIZE,
    generate_concurrently,
    greedy_ignoring_eos,
    kill_under_streams,
    prefix_cache_counters,
)

N = 16  # tokens generated per request
QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


def prefix_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def tail(n: int, seed: int) -> list[int]:
    """Tokens that follow a prefix: none of them is a prefix token."""
    rng = random.Random(1000 + seed)
    return [rng.randrange(200, 300) for _ in range(n)]


def metered_cluster(checkpoint, logs, *coordinator_args) -> LocalCluster:
    """The tiny checkpoint at a fixed k of 3, with the HTTP API (whose /metrics has the coordinator's counters) and
    Prometheus ports (the drafter's on `metrics_port + 2`)."""
    return LocalCluster(
        checkpoint,
        num_speculative_tokens=3,
        log_dir=logs,
        coordinator_args=["--no-adaptive", *coordinator_args],
        metrics_port=free_port(),
        http_port=free_port(),
    )


@pytest.fixture(scope="module")
def metered(tiny_checkpoint, tmp_path_factory):
    with metered_cluster(tiny_checkpoint, tmp_path_factory.mktemp("logs-prefix-on")) as c:
        yield c


@pytest.fixture(scope="module")
def uncached(tiny_checkpoint, tmp_path_factory):
    with metered_cluster(
        tiny_checkpoint, tmp_path_factory.mktemp("logs-prefix-off"), "--no-enable-prefix-caching"
    ) as c:
        yield c


def counters(cluster) -> dict[tuple[str, str], float]:
    """The coordinator's prefix cache counters (its HTTP API's /metrics) and the drafter's (its --metrics-port)."""
    drafter = prefix_cache_counters(f"http://127.0.0.1:{cluster.metrics_port + 2}/metrics")
    return prefix_cache_counters(f"{cluster.http_url}/metrics") | drafter


def three_requests(cluster, prefix: list[int], tiny_checkpoint, hf_greedy) -> list[int]:
    """Three prompts sharing `prefix`, one after the other: two on the SDK, the third on the HTTP API's completions
    (token ids); each greedy output equals transformers'. Returns their cached_tokens."""
    prompts = [prefix + tail(6, seed) for seed in range(3)]
    cached = []
    with Client(cluster.address, timeout=60) as client:
        for prompt in prompts[:2]:
            out = client.generate(prompt_token_ids=prompt, max_tokens=N, ignore_eos=True)
            assert out.token_ids == greedy_ignoring_eos(hf_greedy, prompt, N)
            cached.append(out.cached_tokens)
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as oai:
        model = oai.models.list().data[0].id
        kw = dict(model=model, prompt=prompts[2], max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
        http = oai.completions.create(**kw)
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    want = tok.decode(greedy_ignoring_eos(hf_greedy, prompts[2], N), skip_special_tokens=True)
    assert http.choices[0].text == want
    assert http.usage.prompt_tokens == len(prompts[2])
    cached.append(http.usage.prompt_tokens_details.cached_tokens)
    return cached


def test_a_shared_prefix_is_reported_cached_by_the_sdk_the_http_api_and_both_workers_metrics(
    metered, tiny_checkpoint, hf_greedy
):
    """A 50-token prefix (3 full blocks and 2 tokens): the first request computes it, the next two start on its 3
    blocks (48 tokens) in the verifier's KV and the drafter's MTP KV alike; the verifier's counters count every prompt
    token looked up and the 48 found of each of the two, the drafter's the 48 tokens of each of the two it was asked
    for and found (the first came with no keys: it asked for none)."""
    before = counters(metered)
    assert before, "no prefix cache counters served with caching on"
    cached = three_requests(metered, prefix_tokens(50, seed=1), tiny_checkpoint, hf_greedy)
    assert cached == [0, 3 * BLOCK_SIZE, 3 * BLOCK_SIZE]
    want = {
        (QUERIES, "verifier"): 3 * (50 + 6),  # every prompt token of the three
        (HITS, "verifier"): 2 * 3 * BLOCK_SIZE,
        (QUERIES, "drafter"): 2 * 3 * BLOCK_SIZE,
        (HITS, "drafter"): 2 * 3 * BLOCK_SIZE,
    }
    after = counters(metered)
    assert {key: after.get(key, 0) - before.get(key, 0) for key in want} == want


def test_with_caching_off_nothing_is_cached_or_counted(uncached, tiny_checkpoint, hf_greedy):
    """`--no-enable-prefix-caching`: the same three requests report no cached tokens, and the counters are absent or
    stay at 0 (the drafter is never asked to start a request on cached blocks)."""
    cached = three_requests(uncached, prefix_tokens(50, seed=1), tiny_checkpoint, hf_greedy)
    assert cached == [0, 0, 0]
    after = counters(uncached)
    keys = [(series, worker) for series in (QUERIES, HITS) for worker in ("verifier", "drafter")]
    assert {key: after.get(key, 0) for key in keys} == dict.fromkeys(keys, 0)


def test_greedy_over_shared_prefixes_equals_transformers_sequential_and_concurrent(cluster, hf_greedy):
    """The session's cluster (64-token prefill chunks): a 70-token prefix computed once in two chunks, then prompts
    sharing some of it one after the other and then four at once, each equal to transformers' greedy output and
    started on the cached blocks the rule gives: the full blocks it shares with what is cached, leaving its last token
    to compute, one fewer where it goes on differently right after the last of them (the drafter's entries of that
    block pair it with another next token)."""
    prefix = prefix_tokens(70, seed=2)
    first = prefix + tail(5, 0)
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=first, max_tokens=N, ignore_eos=True)
        assert (out.cached_tokens, out.token_ids) == (0, greedy_ignoring_eos(hf_greedy, first, N))
        # The first request's 91 tokens (prompt and answer): its 5 full blocks below its last token are cached.
        sequential = {
            "diverging mid-block": (prefix[:40] + tail(8, 1), 2 * BLOCK_SIZE),
            "diverging right after a block": (prefix[:48] + tail(8, 2), 2 * BLOCK_SIZE),
            "the next turn (prompt, answer and more)": (first + out.token_ids + tail(4, 3), 5 * BLOCK_SIZE),
        }
        for name, (prompt, cached) in sequential.items():
            got = client.generate(prompt_token_ids=prompt, max_tokens=N, ignore_eos=True)
            assert (got.cached_tokens, got.token_ids) == (cached, greedy_ignoring_eos(hf_greedy, prompt, N)), name
    concurrent = {
        "the whole prefix (diverging mid-block at 70)": (prefix + tail(6, 4), 4 * BLOCK_SIZE),
        "diverging right after a block (at 64)": (prefix[:64] + tail(6, 5), 3 * BLOCK_SIZE),
        "diverging mid-block at 56": (prefix[:56] + tail(9, 6), 3 * BLOCK_SIZE),
        "diverging mid-block at 37": (prefix[:37] + tail(10, 7), 2 * BLOCK_SIZE),
    }
    outs = generate_concurrently(cluster.address, [p for p, _ in concurrent.values()], N)
    for i, (name, (prompt, cached)) in enumerate(concurrent.items()):
        assert (outs[i].cached_tokens, outs[i].token_ids) == (cached, greedy_ignoring_eos(hf_greedy, prompt, N)), name


def wait_for_drafts(address: str, timeout_s: float = 30.0) -> None:
    """Until a generation gets drafts: the verifier has found its drafter again (it probes a lost one with backoff)."""
    deadline = time.monotonic() + timeout_s
    with Client(address, timeout=60) as client:
        while client.generate(prompt_token_ids=[5, 6], max_tokens=8, ignore_eos=True).stats.num_draft_tokens == 0:
            assert time.monotonic() < deadline, f"no drafts {timeout_s} s after the restart"
            time.sleep(0.2)


@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_a_service_killed_under_streams_on_cached_blocks_loses_nothing_and_caches_again(cluster, hf_greedy, role):
    """Streams that started on a cached 50-token prefix (its 3 full blocks); the drafter (which loses its MTP cache)
    or the verifier (which loses its KV and its cache: the coordinator forgets its directory and every stream computes
    its prompt again) SIGKILLed mid-stream and restarted. Every stream equals transformers' greedy output. Then, with
    drafts back, the next request sharing the prefix computes it again where the drafter failed (the coordinator
    counts its blocks missing from the drafter's cache, so the drafter gets their hidden states and caches them anew),
    and requests sent together after it start on its 3 blocks again and equal transformers' output too."""
    prefix = prefix_tokens(50, seed=3 if role == "drafter" else 4)
    first = prefix + tail(6, 0)
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=first, max_tokens=N, ignore_eos=True)
    assert (out.cached_tokens, out.token_ids) == (0, greedy_ignoring_eos(hf_greedy, first, N))
    prompts = [prefix + tail(6, seed) for seed in range(1, 5)]
    finals = {}
    results = kill_under_streams(cluster, role, prompts, 40, finals)
    for i, prompt in enumerate(prompts):
        assert results[i] == greedy_ignoring_eos(hf_greedy, prompt, 40), f"stream {i}"
        assert finals[i].cached_tokens == 3 * BLOCK_SIZE, f"stream {i}"  # admitted on the prefix's blocks
    wait_for_drafts(cluster.address)
    # The next request sharing the prefix: where the drafter failed (it lost its MTP cache) it computes the prefix
    # again, so the drafter gets its hidden states and caches it anew.
    again = prefix + tail(6, 5)
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=again, max_tokens=40, ignore_eos=True)
    assert out.token_ids == greedy_ignoring_eos(hf_greedy, again, 40)
    if role == "drafter":
        assert out.cached_tokens == 0
    later = [prefix + tail(6, seed) for seed in range(6, 9)]
    outs = generate_concurrently(cluster.address, later, 40)
    for i, prompt in enumerate(later):
        want = greedy_ignoring_eos(hf_greedy, prompt, 40)
        assert (outs[i].cached_tokens, outs[i].token_ids) == (3 * BLOCK_SIZE, want), f"request {i} after the restart"
    assert sum(out.stats.num_draft_tokens for out in outs.values()) > 0  # drafted by the drafter of now


def test_a_verifier_restarted_between_requests_loses_its_cache_and_output_stays_exact(cluster, hf_greedy):
    """The verifier SIGKILLed and restarted while nothing runs: the coordinator's directory still lists blocks the new
    verifier does not hold when the next request sharing the prefix is admitted on them. That request still equals
    transformers' greedy output (the coordinator learns of the restart at its first Verify, forgets its directory and
    computes the prompt afresh), and the one after it starts on the 3 blocks that request cached again."""
    prefix = prefix_tokens(50, seed=5)
    prompts = [prefix + tail(6, seed) for seed in range(3)]
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=prompts[0], max_tokens=N, ignore_eos=True)
        assert (out.cached_tokens, out.token_ids) == (0, greedy_ignoring_eos(hf_greedy, prompts[0], N))
        cluster.kill("verifier", signal.SIGKILL)
        cluster.restart("verifier")
        out = client.generate(prompt_token_ids=prompts[1], max_tokens=N, ignore_eos=True)
        assert out.token_ids == greedy_ignoring_eos(hf_greedy, prompts[1], N)
        out = client.generate(prompt_token_ids=prompts[2], max_tokens=N, ignore_eos=True)
        assert (out.cached_tokens, out.token_ids) == (3 * BLOCK_SIZE, greedy_ignoring_eos(hf_greedy, prompts[2], N))
