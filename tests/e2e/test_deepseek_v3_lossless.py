"""Lossless for DeepSeek-V3: greedy output through the three services equals transformers' generate.

The verifier serves the MLA + MoE target with its latent cache, the drafter the checkpoint's MTP
layer (`model.layers.{num_hidden_layers}`, an MoE block); nothing in the services is DeepSeek-specific.
The tiny checkpoint's MTP layer imitates its one-layer target (`mtp_mimics_target`), so most drafts
are accepted and the accept, bonus and partial-rollback paths all run, not only full rejections.
"""

import random

import pytest
import torch

from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import generate_concurrently
from tests.fixtures.tiny_deepseek_v3 import write_served_tiny_deepseek

MAX_TOKENS = 16
# 70 takes two prefill chunks (budget 64), the first on the expanded MLA path; the rest is absorbed.
PROMPT_LENGTHS = [1, 3, 9, 24, 70]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_served_tiny_deepseek(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v3")


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
def hf_greedy(checkpoint):
    """transformers' own DeepseekV3ForCausalLM.generate on the same checkpoint: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"

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


@pytest.mark.parametrize("k", [1, 3])
def test_concurrent_greedy_equals_transformers_generate(cluster, hf_greedy, k):
    rng = random.Random(k)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in PROMPT_LENGTHS]
    outs = generate_concurrently(cluster.address, prompts, MAX_TOKENS, num_speculative_tokens=k, ignore_eos=False)
    results = {i: out.token_ids for i, out in outs.items()}
    spec_stats = {i: out.stats for i, out in outs.items()}
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(prompt, MAX_TOKENS), f"prompt {i} (len {len(prompt)})"
    accepted = [sum(s.accepted_per_position[j] for s in spec_stats.values()) for j in range(k)]
    drafted = sum(s.num_draft_tokens for s in spec_stats.values())
    assert all(accepted), accepted  # drafts accepted at every position (k = 3: bonus tokens too)
    assert sum(accepted) < drafted  # and some rejected: the latent caches were rolled back
