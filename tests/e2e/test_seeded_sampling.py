"""A seeded request's tokens do not depend on speculation: with the demo checkpoint (real acceptance), twelve seeded
sampled requests (3 seeds x temperature 0.7 and 1.0 x plain or filtered by top-p, top-k and the three penalties) give
the tokens they give with no drafts (per request num_speculative_tokens 0) with a fixed k of 3, sent alone; with
adaptive speculation in a batch beside unseeded requests, arriving in a shuffled order; with a pooled drafter; with
the drafter SIGKILLed while they stream, and once it is back. The drafts were really verified (accepted > 0) and the
seed really chooses the tokens (another seed, other tokens)."""

import itertools
import random
import signal
import threading
import time

import pytest

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import generate_concurrently, start_streams
from tests.e2e.test_demo_model import DEMO, PROMPTS

MAX_TOKENS = 32
SEEDS = (4021, 4022, 4023)  # consecutive: specsplit.LLM gives prompt i of a call the seed `seed + i`
TEMPERATURES = (0.7, 1.0)
FILTERED = dict(top_p=0.9, top_k=50, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)
# One text per seeded request (in KINDS' order), then one per unseeded request.
TEXTS = [
    *PROMPTS,
    "def add(a, b):\n    return",
    "import sys\nimport json\n\n\ndef main(argv):\n",
    "class Config(object):\n    def get(self, key, default=None):\n",
    "with open(filename) as f:\n",
    "def fib(n):\n",
    "    raise ValueError(",
    "from collections import defaultdict\n\n",
    "    def __repr__(self):\n",
]
# Each seeded request's sampling options: seed innermost, so each (temperature, filter) group is one LLM.generate call.
KINDS = [
    {"temperature": t, "seed": s, **(FILTERED if filtered else {})}
    for t in TEMPERATURES
    for filtered in (False, True)
    for s in SEEDS
]
UNSEEDED = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.0, **FILTERED},
    {"temperature": 0.7, **FILTERED},
]


def demo_prompts() -> list[list[int]]:
    """TEXTS as the checkpoint's tokenizer encodes them (with its special tokens, as the server adds them to text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO, local_files_only=True)
    return [tok.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return demo_prompts()


@pytest.fixture(scope="module")
def reference(demo_fixed_k, prompts) -> list[list[int]]:
    """Each seeded request's tokens with no speculation, sent alone."""
    out = []
    with Client(demo_fixed_k.address, timeout=120) as client:
        for prompt, kind in zip(prompts, KINDS):
            result = client.generate(
                prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=0, **kind
            )
            assert result.stats.num_draft_tokens == 0
            out.append(result.token_ids)
    assert all(len(ids) == MAX_TOKENS for ids in out)
    return out


def differing(got: list[list[int]], want: list[list[int]]) -> list[int]:
    """Indices of the seeded requests whose tokens are not the reference's."""
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]


def test_fixed_k_alone_equals_no_speculation_and_the_seed_chooses_the_tokens(demo_fixed_k, prompts, reference):
    got, accepted, other_seed = [], 0, []
    with Client(demo_fixed_k.address, timeout=120) as client:
        for prompt, kind in zip(prompts, KINDS):
            result = client.generate(
                prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=3, **kind
            )
            got.append(result.token_ids)
            accepted += result.stats.num_accepted_tokens
            # The same request with a seed none of the others has.
            another = {**kind, "seed": kind["seed"] + len(SEEDS)}
            other_seed.append(
                client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **another).token_ids
            )
    assert differing(got, reference) == []
    assert accepted > 0  # drafts were verified and some accepted: the speculative path made these tokens
    # Another seed, other tokens (a sampler that ignored the seed would give each request its reference tokens again).
    assert differing(other_seed, reference) == list(range(len(KINDS)))


def test_drafter_sigkilled_mid_stream_and_restarted_equals_no_speculation(demo_fixed_k, prompts, reference):
    """The 12 seeded requests streamed together, the drafter SIGKILLed once tokens have arrived: the verifier goes on
    without drafts. Then the drafter started again: once its drafts are verified again, a seeded request still gives
    its reference tokens."""
    progressed = threading.Event()
    threads, results, errors = start_streams(
        demo_fixed_k.address,
        prompts[: len(KINDS)],
        MAX_TOKENS,
        lambda n: n >= 4 and progressed.set(),
        per_prompt=KINDS,
    )
    try:
        assert progressed.wait(120)
        demo_fixed_k.kill("drafter", signal.SIGKILL)
        finished_before_the_kill = len(results)
    finally:
        for t in threads:
            t.join(240)
    assert demo_fixed_k.services["drafter"].proc.returncode == -signal.SIGKILL
    assert finished_before_the_kill < len(KINDS)  # the drafter died while requests were streaming
    assert not errors, errors
    assert differing([results[i] for i in range(len(KINDS))], reference) == []

    demo_fixed_k.restart("drafter")
    with Client(demo_fixed_k.address, timeout=120) as client:
        deadline = time.monotonic() + 30  # the verifier probes a lost drafter with backoff (<= 5 s)
        for i in itertools.count():
            kind = KINDS[i % len(KINDS)]
            out = client.generate(
                prompt_token_ids=prompts[i % len(KINDS)], max_tokens=MAX_TOKENS, ignore_eos=True, **kind
            )
            assert out.token_ids == reference[i % len(KINDS)], kind
            if out.stats.num_accepted_tokens > 0:
                break
            assert time.monotonic() < deadline, "no accepted drafts 30 s after the drafter restarted"


def test_adaptive_in_a_shuffled_batch_with_unseeded_requests_equals_no_speculation(tmp_path, prompts, reference):
    """Adaptive speculation (`--adaptive`), the 12 seeded requests and 4 unseeded sampled ones sent together, started
    in a shuffled order."""
    requests = [(i, prompts[i], kind) for i, kind in enumerate(KINDS)]
    requests += [(None, prompts[len(KINDS) + j], kind) for j, kind in enumerate(UNSEEDED)]
    random.Random(7).shuffle(requests)
    with LocalCluster(DEMO, num_speculative_tokens=3, log_dir=tmp_path, coordinator_args=["--adaptive"]) as cluster:
        outs = generate_concurrently(
            cluster.address, [p for _, p, _ in requests], MAX_TOKENS, per_prompt=[kind for _, _, kind in requests]
        )
    got = [None] * len(KINDS)
    for n, (i, _, _) in enumerate(requests):
        assert len(outs[n].token_ids) == MAX_TOKENS
        if i is not None:
            got[i] = outs[n].token_ids
    assert differing(got, reference) == []


def test_pooled_drafter_equals_no_speculation(tmp_path, prompts, reference):
    """A pooled drafter (gRPC between verifier and drafter), the 12 seeded requests sent together with k 3."""
    with LocalCluster(
        DEMO, num_speculative_tokens=3, log_dir=tmp_path, placement="pooled", coordinator_args=["--no-adaptive"]
    ) as cluster:
        outs = generate_concurrently(cluster.address, prompts[: len(KINDS)], MAX_TOKENS, per_prompt=KINDS)
    got = [outs[i].token_ids for i in range(len(KINDS))]
    assert differing(got, reference) == []
    assert sum(outs[i].stats.num_accepted_tokens for i in range(len(KINDS))) > 0
