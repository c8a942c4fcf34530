"""`specsplit.LLM`: a seeded request's tokens do not depend on speculation. The seeded requests of
tests/e2e/test_seeded_sampling.py (3 seeds x temperature 0.7 and 1.0 x plain or filtered by top-p and top-k: the
options LLM.generate takes) with the demo checkpoint give the same tokens with 3 drafts every iteration as with none."""

import pytest
import torch

import specsplit
from tests.e2e.test_seeded_sampling import DEMO, KINDS, MAX_TOKENS, SEEDS, demo_prompts


@pytest.fixture(scope="module")
def llm():
    """One thread, as tests/training/conftest.py: the demo model runs several times faster so on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield specsplit.LLM(DEMO, num_speculative_tokens=3, adaptive=False)
    torch.set_num_threads(threads)


def groups(prompts: list[list[int]]):
    """(prompts, options) per LLM.generate call: one call per temperature and filter, its prompt i seeded seed + i."""
    for start in range(0, len(KINDS), len(SEEDS)):
        kind = KINDS[start]
        assert [k["seed"] for k in KINDS[start : start + len(SEEDS)]] == [kind["seed"] + i for i in range(len(SEEDS))]
        options = {"temperature": kind["temperature"], "seed": kind["seed"]}
        options |= {name: kind[name] for name in ("top_p", "top_k") if name in kind}
        yield prompts[start : start + len(SEEDS)], options


def test_seeded_tokens_with_three_drafts_equal_those_with_none(llm):
    prompts = demo_prompts()
    accepted = 0
    for group, options in groups(prompts):
        drafted = llm.generate(group, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, **options)
        plain = llm.generate(
            group, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, num_speculative_tokens=0, **options
        )
        assert [r.token_ids for r in drafted] == [r.token_ids for r in plain], options
        assert all(r.stats.num_draft_tokens == 0 for r in plain)
        accepted += sum(r.stats.num_accepted_tokens for r in drafted)
    assert accepted > 0  # the drafts were verified and some accepted
