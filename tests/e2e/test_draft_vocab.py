"""A draft vocabulary through the three services (`serve drafter --draft-vocab-size`), on the demo checkpoint: greedy
output of concurrent requests equals transformers' while the drafter swaps its set between Proposes, and stays equal
when the drafter is killed mid-stream and restarted (it starts again from the seed order)."""

import pathlib

import pytest
import torch

from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import DEMO_PROMPTS, generate_concurrently, greedy_ignoring_eos, kill_under_streams

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
PROMPTS = DEMO_PROMPTS[:6]
NEW = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(
        DEMO,
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("draft-vocab"),
        coordinator_args=["--no-adaptive"],  # k drafts every iteration: the drafter sees every token
        drafter_args=["--draft-vocab-size", "256"],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """Each prompt's token ids and transformers' argmax continuation of NEW tokens (EOS not special: the requests
    ignore it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    ids = [tokenizer.encode(p) for p in PROMPTS]

    def generate(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=1)
        return out[0, len(prompt) :].tolist()

    return ids, [greedy_ignoring_eos(generate, prompt, NEW) for prompt in ids]


def test_greedy_equals_transformers_while_the_drafter_swaps_its_set(cluster, reference):
    """Two rounds of the six requests: about 500 tokens counted, a ranking every 256, each set installed by the first
    Propose after its ranking is done."""
    ids, want = reference
    accepted = 0
    for _ in range(2):
        got = generate_concurrently(cluster.address, ids, NEW)
        assert [got[i].token_ids for i in range(len(ids))] == want
        accepted += sum(r.stats.num_accepted_tokens for r in got.values())
    assert accepted > 0
    assert "draft vocabulary: swap" in (cluster.log_dir / "drafter.log").read_text()


def test_a_drafter_killed_mid_stream_and_restarted_changes_no_output(cluster, reference):
    ids, want = reference
    got = kill_under_streams(cluster, "drafter", ids, NEW)
    assert [got[i] for i in range(len(ids))] == want
