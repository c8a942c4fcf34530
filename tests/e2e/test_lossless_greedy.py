"""Lossless: greedy output through three processes equals transformers' generate, token for token."""

import random
import threading
import time

import pytest

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import hide_drafter_socket

MAX_TOKENS = 24


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 5, 9, 17, 33, 70, 130][:n]  # 70 and 130 take several prefill chunks (budget 64)
    return [[rng.randrange(3, 300) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def grpc_stream_cluster(tiny_checkpoint, tmp_path_factory):
    """Verify and Propose on gRPC's streams (a pooled drafter whose socket is not on the verifier's host, a
    coordinator with `--verifier-rpc stream`), not the Unix sockets."""
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("logs-stream"),
        placement="pooled",
        coordinator_args=["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--verifier-rpc", "stream"]
        + ["--no-adaptive"],  # drafts every iteration (the tiny model's are mostly rejected: adaptive drops them)
    ) as c:
        hide_drafter_socket(c.services["drafter"].address)
        yield c


@pytest.mark.parametrize(("k", "rpc"), [(1, "local"), (3, "local"), (3, "stream")])
def test_concurrent_greedy_with_joins_equals_transformers_generate(request, hf_greedy, k, rpc):
    cluster = request.getfixturevalue("cluster" if rpc == "local" else "grpc_stream_cluster")
    ps = prompts(8, seed=k)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    first_tokens = threading.Event()

    def run(i: int) -> None:
        try:
            with Client(cluster.address, timeout=120) as client:
                ids = []
                for delta in client.stream(prompt_token_ids=ps[i], max_tokens=MAX_TOKENS, num_speculative_tokens=k):
                    ids.extend(delta.token_ids)
                    first_tokens.set()
                results[i] = ids
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads[:4]:
        t.start()
    assert first_tokens.wait(60)  # the rest join while the first four are mid-generation
    for t in threads[4:]:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i, p in enumerate(ps):
        assert results[i] == hf_greedy(p, MAX_TOKENS), f"prompt {i} (len {len(p)})"
    with Client(cluster.address, timeout=60) as client:  # speculation ran: drafts were verified
        assert client.generate(prompt_token_ids=ps[0], max_tokens=12).stats.num_draft_tokens > 0


def test_text_prompt_streams_text_and_stats(cluster, hf_greedy, tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    with Client(cluster.address, timeout=60) as client:
        out = client.generate("def add(a, b):", max_tokens=12)
    ids = tok.encode("def add(a, b):")  # the tokenizer's default: BOS first, as transformers and vLLM add it
    assert ids[0] == tok.bos_token_id
    assert out.token_ids == hf_greedy(ids, 12)
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason in ("length", "stop")
    assert out.stats.num_iterations >= 1 and out.stats.num_draft_tokens > 0
    assert out.prompt_tokens == len(ids) and out.completion_tokens == len(out.token_ids)
