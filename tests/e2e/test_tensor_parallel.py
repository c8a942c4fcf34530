"""A tensor-parallel verifier through the three services (`specsplit up --verifier-tp 2`'s command line): greedy output
equals transformers' generate (so TP 1's, which equals it too) for Llama and GLM-4.5 at TP 2 (the drafter running
the model's MTP layer) and Qwen3 at TP 4 (its 2 KV heads replicated over 4 ranks), k 1 and 3 at once (DeepSeek-V3's,
with a TP 2 drafter too: test_tensor_parallel_drafter.py); sampled output follows the target distribution
(chi-square); seeded sampled output does not depend on k; a verifier rank killed mid-generation stops the verifier,
whose restart loses nothing. The ranks are spawned CPU processes joined over gloo."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import numpy as np
import pytest
import torch
from scipy import stats

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import check_shared_prefix_greedy, generate_concurrently, greedy_ignoring_eos, start_streams
from tests.e2e.test_lossless_greedy import prompts
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_glm4_moe import write_served_tiny_glm4_moe

MAX_TOKENS = 12


def tp_cluster(path, logs, size: int = 2, **placement) -> LocalCluster:
    return LocalCluster(
        path,
        num_speculative_tokens=3,
        log_dir=logs,
        verifier_args=["--tensor-parallel-size", str(size)],
        # a fixed k: the tests count on drafts (adaptive speculation may choose none for a tiny random model)
        coordinator_args=["--max-num-seqs", "10", "--max-num-batched-tokens", "64", "--no-adaptive"],
        **placement,
    )


@pytest.fixture(scope="module")
def llama_tp(tiny_checkpoint, tmp_path_factory):
    """A pooled drafter taking rank 0's hidden states by the nccl transport (gloo here): a process group of its
    own beside the ranks' (the Qwen3 cluster runs the default co-located placement)."""
    logs = tmp_path_factory.mktemp("logs-tp-llama")
    with tp_cluster(tiny_checkpoint, logs, placement="pooled", hidden_transport="nccl") as c:
        yield c


def hf_greedy_of(path):
    """transformers' own generate on the checkpoint at `path`: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.generation_config.eos_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()

    return generate


def check_greedy(address: str, hf_greedy) -> None:
    """k 1 and 3 served at once, in the same batches: 5 prompts each (up to 17 tokens)."""
    ks = (1, 3)
    jobs = [(p, k) for k in ks for p in prompts(5, seed=k)]
    outs = generate_concurrently(
        address, [p for p, _ in jobs], MAX_TOKENS, per_prompt=[{"num_speculative_tokens": k} for _, k in jobs]
    )
    for k in ks:  # each k's drafts were verified
        assert sum(outs[i].stats.num_draft_tokens for i, (_, job_k) in enumerate(jobs) if job_k == k) > 0, k
    for i, (p, k) in enumerate(jobs):
        assert outs[i].token_ids == greedy_ignoring_eos(hf_greedy, p, MAX_TOKENS), (k, p)


def test_llama_tp2_greedy_equals_transformers_generate(llama_tp, hf_greedy):
    check_greedy(llama_tp.address, hf_greedy)


def test_llama_tp2_greedy_over_shared_prefixes_equals_transformers_generate(llama_tp, hf_greedy):
    """Prefix caching at TP 2: every rank starts a request on the same cached blocks of its own KV cache."""
    check_shared_prefix_greedy(llama_tp.address, hf_greedy, seed=41)


def test_qwen3_tp4_greedy_equals_transformers_generate(tmp_path_factory):
    """4 ranks, 1 query head each, over the checkpoint's 2 KV heads: each KV head replicated on 2 ranks."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", architecture="qwen3", seed=2)
    with tp_cluster(path, tmp_path_factory.mktemp("logs-tp-qwen3"), size=4) as c:
        check_greedy(c.address, hf_greedy_of(path))


def test_glm4_moe_tp2_greedy_equals_transformers_generate(tmp_path_factory):
    """The tiny GLM-4.5 of tests/e2e/test_glm4_moe_lossless.py: 2 KV heads, 8 routed experts, partial rotary."""
    path = write_served_tiny_glm4_moe(tmp_path_factory.mktemp("ckpt") / "tiny-glm4-moe")
    with tp_cluster(path, tmp_path_factory.mktemp("logs-tp-glm")) as c:
        check_greedy(c.address, hf_greedy_of(path))


def test_sampled_generation_through_tp2_follows_the_target_distribution(llama_tp, tiny_checkpoint):
    """Token 2 of N sampled generations (temperature 0.4, k = 3: drafted from token 1 on) against its exact
    marginal under transformers' model of the checkpoint; chi-square, false-failure rate 1e-3."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    ids, n, workers = [11, 42, 7], 240, 8
    T = 0.4  # the tiny model's distributions are flat: sharper, several tokens get expected counts >= 5
    seconds, drafted = [], [0]
    lock = threading.Lock()

    def worker(w):
        with Client(llama_tp.address, timeout=300) as client:
            for seed in range(w, n, workers):
                out = client.generate(prompt_token_ids=ids, max_tokens=4, temperature=T, seed=seed, ignore_eos=True)
                with lock:
                    seconds.append(out.token_ids[1])
                    drafted[0] += out.stats.num_draft_tokens

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(seconds) == n and drafted[0] > 0

    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / T, -1)
        support = torch.nonzero(p1 > 1e-7).flatten()
        logits2 = model(torch.tensor([ids + [int(t)] for t in support])).logits[:, -1].double()
        p2_given = torch.softmax(logits2 / T, -1)
        p2 = (p1[support, None] * p2_given).sum(0)
    counts = np.bincount(seconds, minlength=p2.numel()).astype(float)
    expected = p2.numpy() * n
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    assert len(obs) > 2  # a distribution, not one token
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def followers_of(pid: int) -> list[int]:
    """The tensor-parallel follower processes `pid` spawned (not multiprocessing's resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(proc_stat(int(entry))[1])
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, ..."""
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if proc_stat(pid)[0] == "Z":  # exited, not yet reaped
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_seeded_tokens_through_tp2_do_not_depend_on_speculation(llama_tp):
    """Coupled verification at TP 2: seeded sampled requests give the same tokens with k 3 as with no drafts (both
    concurrently, in the same batches). The tiny random model's drafts are verified and rejected: rejection sampling
    would emit a token of the residual there, not the target's own sample."""
    jobs = [(p, seed, k) for k in (0, 3) for seed, p in enumerate(prompts(6, seed=5))]
    options = [dict(temperature=1.0, seed=100 + seed, num_speculative_tokens=k) for _, seed, k in jobs]
    outs = generate_concurrently(llama_tp.address, [p for p, _, _ in jobs], MAX_TOKENS, per_prompt=options)
    half = len(jobs) // 2
    assert [outs[i].token_ids for i in range(half, len(jobs))] == [outs[i].token_ids for i in range(half)]
    assert sum(outs[i].stats.num_draft_tokens for i in range(half, len(jobs))) > 0


def test_a_rank_killed_stops_the_verifier_and_a_restart_loses_nothing(llama_tp, hf_greedy):
    """Rank 1 SIGKILLed mid-generation: rank 0 exits 1 with one line; restarted, every stream completes as
    transformers' greedy (nothing lost or repeated). Then rank 0 SIGKILLed: its follower exits."""
    verifier = llama_tp.services["verifier"]
    (follower,) = followers_of(verifier.proc.pid)
    ps = [[3 + i, 40 + i, 7] for i in range(4)]
    progressed = threading.Event()
    threads, results, errors = start_streams(llama_tp.address, ps, 30, lambda n: n >= 6 and progressed.set())
    assert progressed.wait(60)
    os.kill(follower, signal.SIGKILL)
    assert verifier.proc.wait(timeout=30) == 1
    assert "tensor-parallel rank 1 exited" in verifier.log_tail(200)
    llama_tp.restart("verifier")
    for t in threads:
        t.join(240)
    assert not errors, errors
    for i, p in enumerate(ps):
        assert results[i] == greedy_ignoring_eos(hf_greedy, p, 30), f"stream {i}"

    verifier = llama_tp.services["verifier"]
    (follower,) = followers_of(verifier.proc.pid)
    llama_tp.kill("verifier", signal.SIGKILL)
    assert wait_gone(follower, 10)
