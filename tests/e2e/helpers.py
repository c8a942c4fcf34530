"""Helpers shared by the end-to-end tests."""

import os
import pathlib
import random
import signal
import threading
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from specsplit import Client
from specsplit.proto import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"  # the trained demo checkpoint
BLOCK_SIZE = 16  # the services' default KV block size: prefix caching caches full blocks
PREFIX_CACHE_SERIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
# Code openings the demo checkpoint (trained on Python) continues with real acceptance.
DEMO_PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    'def _parse_header(line):\n    """Parse one header line."""\n',
    "try:\n    import zlib\nexcept ImportError:\n",
    "    @property\n    def name(self):\n",
    "if __name__ == '__main__':\n",
    "x = {",
]


def greedy_ignoring_eos(hf_greedy, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of n tokens, carried on past an EOS the way the services do
    with ignore_eos."""
    out: list[int] = []
    while len(out) < n:
        out.extend(hf_greedy(prompt + out, n - len(out)))
    return out[:n]


def generate_concurrently(
    address: str, prompts: list[list[int]], max_tokens: int, per_prompt: list[dict] | None = None, **options
) -> dict[int, object]:
    """One greedy Generate per prompt, all at once (one client thread each), ignoring EOS unless `options` say
    otherwise; `options` go to every request, `per_prompt[i]` to prompt i's alone (e.g. its
    num_speculative_tokens). Returns the GenerationResults by prompt index; raises the first failure."""
    outs, errors = {}, []
    options = {"ignore_eos": True} | options

    def run(i):
        try:
            with Client(address, timeout=120) as client:
                extra = per_prompt[i] if per_prompt else {}
                outs[i] = client.generate(prompt_token_ids=prompts[i], max_tokens=max_tokens, **options, **extra)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return outs


def start_streams(
    address: str,
    prompts: list[list[int]],
    max_tokens: int,
    on_progress=lambda n: None,
    per_prompt: list[dict] | None = None,
    finals: dict | None = None,
):
    """One greedy stream per prompt (ignoring EOS), each on a client thread of its own; on_progress(n) after
    each delta, n the stream's tokens so far; `per_prompt[i]`: prompt i's own options (e.g. its temperature and
    seed); `finals`, if given, gets each stream's last delta (its usage: prompt_tokens, cached_tokens) by prompt
    index. Returns (threads, results by prompt index, errors); join the threads before reading the other two."""
    results, errors = {}, []

    def run(i):
        try:
            with Client(address, timeout=240) as client:
                ids = []
                extra = per_prompt[i] if per_prompt else {}
                for delta in client.stream(
                    prompt_token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True, **extra
                ):
                    ids.extend(delta.token_ids)
                    on_progress(len(ids))
                results[i] = ids
                if finals is not None:
                    finals[i] = delta
        except Exception as err:  # noqa: BLE001 - surfaced by the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results, errors


def kill_under_streams(
    cluster, role: str, prompts: list[list[int]], max_tokens: int, finals: dict | None = None, per_prompt=None
):
    """Greedy streams of `prompts` (`start_streams`, with `per_prompt` options); once every stream has tokens (all
    admitted before the kill: on a loaded machine a stream admitted after it would start differently, e.g. without the
    prefix cache the failure dropped) and one has 8, `role` SIGKILLed and restarted; returns every stream's tokens by
    prompt index once all ended, and raises the first stream's failure."""
    progressed, lock = threading.Event(), threading.Lock()
    started: set[int] = set()  # the stream threads that have tokens
    most = 0

    def on_progress(n: int) -> None:
        nonlocal most
        with lock:
            started.add(threading.get_ident())  # each stream runs on a thread of its own
            most = max(most, n)
            if most >= 8 and len(started) == len(prompts):
                progressed.set()

    threads, results, errors = start_streams(
        cluster.address, prompts, max_tokens, on_progress, per_prompt=per_prompt, finals=finals
    )
    assert progressed.wait(60)
    cluster.kill(role, signal.SIGKILL)
    time.sleep(0.5)
    cluster.restart(role)
    for t in threads:
        t.join(240)
    assert not errors, errors
    return results


def wait_idle(client: Client, timeout_s: float = 10.0) -> None:
    """Until the coordinator has no request running or waiting; AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, pb = client.server_stats()
        if pb.num_running == 0 and pb.num_waiting == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still running: {pb}")


def free_kv_blocks(cluster) -> tuple[int, int, int, int]:
    """(free, total) KV cache blocks of the verifier, then of the drafter."""
    info = common_pb2.GetModelInfoRequest()
    with grpc.insecure_channel(cluster.services["verifier"].address) as ch:
        v = verifier_pb2_grpc.VerifierStub(ch)
        v_free, v_total = (
            v.Free(verifier_pb2.FreeRequest(), timeout=10).num_free_blocks,
            v.GetModelInfo(info, timeout=10).num_blocks,
        )
    with grpc.insecure_channel(cluster.services["drafter"].address) as ch:
        d = drafter_pb2_grpc.DrafterStub(ch)
        d_free = d.Free(drafter_pb2.DrafterFreeRequest(), timeout=10).num_free_blocks
        d_total = d.GetModelInfo(info, timeout=10).num_blocks
    return v_free, v_total, d_free, d_total


def assert_kv_all_free(cluster, timeout_s: float = 10.0) -> None:
    """Every KV block of verifier and drafter free within timeout_s (call once no request runs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v_free, v_total, d_free, d_total = free_kv_blocks(cluster)
        if (v_free, d_free) == (v_total, d_total) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    held = f"verifier {v_total - v_free} of {v_total}, drafter {d_total - d_free} of {d_total}"
    assert (v_free, d_free) == (v_total, d_total), f"KV blocks held after every request ended: {held}"


def assert_first_two_tokens_follow(model, ids: list[int], firsts: list[int], seconds: list[int], min_bins: int = 0):
    """Tokens 1 and 2 of sampled generations after `ids` against `model` (transformers, the target at temperature 1):
    token 1 against its exact distribution, token 2 against the sum over the generations of its distribution given
    each one's token 1 (one forward per distinct token 1, not per token of the support: a flat distribution has
    thousands); chi-square per token, false-failure rate 1e-3 each (at most: the second's counts vary less than a
    multinomial's); expected counts under 5 pooled."""
    import numpy as np
    import torch
    from scipy import stats

    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
        distinct = sorted(set(firsts))
        p2_given = torch.softmax(model(torch.tensor([ids + [t] for t in distinct])).logits[:, -1].double(), -1)
        row = {t: i for i, t in enumerate(distinct)}
        expected2 = p2_given[[row[t] for t in firsts]].sum(0)  # [V]
    for observed, expected in ((firsts, p1 * len(firsts)), (seconds, expected2)):
        counts = np.bincount(observed, minlength=expected.numel()).astype(float)
        expected = expected.numpy()
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        obs, exp = obs[exp > 0], exp[exp > 0]
        assert len(obs) >= min_bins  # enough bins that the test can tell distributions apart
        pvalue = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
        assert pvalue > 1e-3, f"chi-square p = {pvalue}"


def hide_drafter_socket(drafter_address: str) -> str:
    """Removes the file of the Unix socket the drafter at `drafter_address` serves ProposeStream on (its listening
    socket stays open): a verifier that looks for it next finds none on its host, as if the drafter ran on another
    host, and takes gRPC's stream. Returns the path."""
    with grpc.insecure_channel(drafter_address) as channel:
        info = drafter_pb2_grpc.DrafterStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
    os.unlink(info.propose_socket)
    return info.propose_socket


def prefix_cache_counters(metrics_url: str) -> dict[tuple[str, str], float]:
    """The prefix cache's counters a service serves on its Prometheus page `metrics_url` (.../metrics), by series
    (PREFIX_CACHE_SERIES) and `worker` label; none where caching is off."""
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels["worker"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in PREFIX_CACHE_SERIES
    }


def check_shared_prefix_greedy(address: str, hf_greedy, seed: int, max_tokens: int = 12) -> int:
    """Prefix caching through the services: a prompt of 50 random tokens (3 full blocks and 2 tokens), then three
    prompts sent together that share its first 50, 48 and 40 tokens. Each greedy output equals transformers', the
    first prompt's cached_tokens is 0 and each shared one's is what the cache holds of it (docs/architecture.md,
    "Prefix caching"): the first's 3 full blocks where the prompt goes on after them as the first did, one block fewer
    where it goes on differently right after them (the verifier computes that block again for the drafter), and the 2
    full blocks it shares where it diverges mid-block. Every prompt goes on with tokens of a range the prefix has
    none of, so each diverges exactly where it is cut. Returns the cached tokens of the three."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 200) for _ in range(50)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(200, 300) for _ in range(n)]

    first = prefix + tail(6)
    with Client(address, timeout=120) as client:
        out = client.generate(prompt_token_ids=first, max_tokens=max_tokens, ignore_eos=True)
    assert (out.cached_tokens, out.token_ids) == (0, greedy_ignoring_eos(hf_greedy, first, max_tokens))
    shared = [(prefix + tail(6), 3 * BLOCK_SIZE), (prefix[:48] + tail(8), 2 * BLOCK_SIZE)]
    shared.append((prefix[:40] + tail(10), 2 * BLOCK_SIZE))
    outs = generate_concurrently(address, [p for p, _ in shared], max_tokens)
    for i, (prompt, cached) in enumerate(shared):
        want = greedy_ignoring_eos(hf_greedy, prompt, max_tokens)
        assert (outs[i].cached_tokens, outs[i].token_ids) == (cached, want), f"prompt {i} sharing the prefix"
    return sum(cached for _, cached in shared)
