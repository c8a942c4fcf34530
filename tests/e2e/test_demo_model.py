"""With the trained demo checkpoint (real acceptance): greedy output equals transformers' generate,
and sampled output follows the target's distribution with sampled (sparse-q) drafts."""

import threading

import pytest
import torch

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import DEMO, assert_first_two_tokens_follow
from tests.e2e.helpers import DEMO_PROMPTS as PROMPTS


@pytest.fixture(scope="module")
def demo_cluster(tmp_path_factory):
    with LocalCluster(DEMO, num_speculative_tokens=3, log_dir=tmp_path_factory.mktemp("demo")) as c:
        yield c


@pytest.fixture(scope="module")
def hf_demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(DEMO)


def test_demo_greedy_with_real_acceptance_equals_transformers_generate(demo_cluster, hf_demo):
    model, tok = hf_demo
    outs: dict[int, object] = {}

    def run(i):
        with Client(demo_cluster.address, timeout=300) as client:
            outs[i] = client.generate(PROMPTS[i], max_tokens=48)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)  # the server adds special tokens to text as the tokenizer does
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, pad_token_id=1)
        assert outs[i].token_ids == ref[0, len(ids) :].tolist(), f"prompt {i}"
        accepted += outs[i].stats.num_accepted_tokens
    assert accepted > 100  # the drafts were mostly right, so the accept path carried most tokens


@pytest.mark.parametrize("seeded", [True, False], ids=["coupled", "rejection"])
def test_sampled_generation_follows_the_target_distribution(demo_cluster, hf_demo, seeded):
    """Tokens 1 and 2 of N sampled generations (temperature 1, k = 3 sampled drafts with sparse q)
    against the exact target marginals from transformers; chi-square, false-failure rate 1e-3 each. Seeded requests
    are verified by coupled sampling, unseeded ones by rejection sampling: both follow the target."""
    model, tok = hf_demo
    prompt = "def add(a, b):\n    return"
    ids = tok.encode(prompt, add_special_tokens=False)
    n = 600
    firsts, seconds, drafted, accepted = [], [], [0], [0]
    lock = threading.Lock()

    def worker(w):
        with Client(demo_cluster.address, timeout=300) as client:
            for seed in range(w, n, 12):
                out = client.generate(
                    prompt_token_ids=ids, max_tokens=4, temperature=1.0, seed=seed if seeded else None, ignore_eos=True
                )
                with lock:
                    firsts.append(out.token_ids[0])
                    seconds.append(out.token_ids[1])
                    drafted[0] += out.stats.num_draft_tokens
                    accepted[0] += out.stats.num_accepted_tokens

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(firsts) == n
    assert drafted[0] > 0 and 0 < accepted[0] < drafted[0]  # both accept and reject paths were taken

    assert_first_two_tokens_follow(model, ids, firsts, seconds)
