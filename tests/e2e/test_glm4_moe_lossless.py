"""Lossless for GLM-4.5 (`Glm4MoeForCausalLM`) through the three services: greedy output equals transformers'
generate for k = 1 and 3, and sampled output follows the target's distribution (chi-square).

The verifier serves the GQA + MoE target (partial rotary, q/k/v bias), the drafter the checkpoint's MTP layer
(`model.layers.{num_hidden_layers}`, an MoE block); nothing in the services is GLM-specific. The tiny
checkpoint's MTP layer imitates its one-layer target (`mtp_mimics_target`), so most drafts are accepted and
the accept, bonus and partial-rollback paths all run, not only full rejections.
"""

import random
import threading

import pytest
import torch

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import assert_first_two_tokens_follow, generate_concurrently
from tests.fixtures.tiny_glm4_moe import write_served_tiny_glm4_moe

MAX_TOKENS = 16
PROMPT_LENGTHS = [1, 3, 9, 24, 70]  # 70 takes two prefill chunks (budget 64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_served_tiny_glm4_moe(tmp_path_factory.mktemp("ckpt") / "tiny-glm4-moe")


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    with LocalCluster(
        checkpoint,
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("logs"),
        # k drafts every iteration, so every position's accept path runs
        coordinator_args=["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--no-adaptive"],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """transformers' own Glm4MoeForCausalLM on the same checkpoint: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    return model


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("k", [1, 3])
def test_concurrent_greedy_equals_transformers_generate(cluster, hf_model, k):
    rng = random.Random(k)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in PROMPT_LENGTHS]
    outs = generate_concurrently(cluster.address, prompts, MAX_TOKENS, num_speculative_tokens=k, ignore_eos=False)
    results = {i: out.token_ids for i, out in outs.items()}
    spec_stats = {i: out.stats for i, out in outs.items()}
    for i, prompt in enumerate(prompts):
        assert results[i] == _hf_greedy(hf_model, prompt, MAX_TOKENS), f"prompt {i} (len {len(prompt)})"
    accepted = [sum(s.accepted_per_position[j] for s in spec_stats.values()) for j in range(k)]
    drafted = sum(s.num_draft_tokens for s in spec_stats.values())
    assert all(accepted), accepted  # drafts accepted at every position (k = 3: bonus tokens too)
    assert sum(accepted) < drafted  # and some rejected: the paged caches were rolled back


def test_sampled_generation_follows_the_target_distribution(cluster, hf_model):
    """Tokens 1 and 2 of N sampled generations (temperature 1, k = 3 sampled drafts with sparse q) against
    the exact target marginals from transformers; chi-square, false-failure rate 1e-3 each (as for the demo
    checkpoint, tests/e2e/test_demo_model.py)."""
    ids = [17, 99, 250, 3, 41]
    n, workers = 480, 8
    firsts, seconds, drafted, accepted = [], [], [0], [0]
    lock = threading.Lock()

    def worker(w):
        with Client(cluster.address, timeout=300) as client:
            for seed in range(w, n, workers):
                out = client.generate(prompt_token_ids=ids, max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
                with lock:
                    firsts.append(out.token_ids[0])
                    seconds.append(out.token_ids[1])
                    drafted[0] += out.stats.num_draft_tokens
                    accepted[0] += out.stats.num_accepted_tokens

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(firsts) == n
    assert drafted[0] > 0 and 0 < accepted[0] < drafted[0]  # both accept and reject paths were taken

    assert_first_two_tokens_follow(hf_model, ids, firsts, seconds, min_bins=3)
