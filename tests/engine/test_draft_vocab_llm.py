"""A draft vocabulary in one process (`specsplit.LLM`, the services' iteration code) on the demo checkpoint: greedy
output equals target-only while the set is swapped between iterations of concurrent requests; seeded output equals
target-only's (coupled sampling); unseeded sampled tokens follow the target (chi-square), the drafts' q having
support on the set only."""

import pathlib

import pytest
import torch

import specsplit
from tests.e2e.helpers import DEMO_PROMPTS, assert_first_two_tokens_follow

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
PROMPTS = DEMO_PROMPTS[:6]


@pytest.fixture(scope="module")
def target_only(one_thread):
    return specsplit.LLM(DEMO, num_speculative_tokens=0)


@pytest.fixture(scope="module")
def drafted(one_thread):
    """256 of the 4,096 ids: a set that swaps every 256 tokens counted."""
    return specsplit.LLM(DEMO, num_speculative_tokens=3, adaptive=False, draft_vocab_size=256)


def test_greedy_equals_target_only_while_the_set_is_swapped(target_only, drafted):
    vocab = drafted.drafter.runner.draft_vocab
    swaps, accepted = vocab.swaps, 0
    for round_ in range(2):
        got = drafted.generate(PROMPTS, max_tokens=40, ignore_eos=True)
        want = target_only.generate(PROMPTS, max_tokens=40, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], round_
        accepted += sum(r.stats.num_accepted_tokens for r in got)
    assert vocab.swaps >= swaps + 2  # sets swapped between the iterations of these requests
    assert accepted > 100  # the set's drafts were mostly right


def test_seeded_output_equals_target_only_seeded(target_only, drafted):
    """Coupled sampling: a seeded request's tokens are the target's sample with that seed, whatever q is."""
    kwargs = dict(max_tokens=24, temperature=0.9, ignore_eos=True)
    got = drafted.generate(PROMPTS, seed=11, **kwargs)
    want = target_only.generate(PROMPTS, seed=11, **kwargs)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert sum(r.stats.num_accepted_tokens for r in got) > 0


def test_sampled_tokens_follow_the_target_with_q_on_the_set(drafted):
    """Tokens 1 and 2 of 300 unseeded generations of 3 tokens at temperature 1: token 2 is a draft accepted by
    rejection sampling against q (top-K of the set's 256 ids) or the residual's sample; chi-square against
    transformers' marginals."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    prompt = drafted.tokenizer.encode(PROMPTS[1])
    results = []
    for _ in range(10):
        results += drafted.generate([prompt] * 30, max_tokens=3, temperature=1.0, ignore_eos=True, detokenize=False)
    assert sum(r.stats.num_draft_tokens for r in results) > 0
    firsts = [r.token_ids[0] for r in results]
    seconds = [r.token_ids[1] for r in results]
    assert_first_two_tokens_follow(model, prompt, firsts, seconds, min_bins=3)


def test_structured_output_with_the_set_equals_target_only(target_only, drafted):
    """The drafter masks the set's columns by their ids (the mask kernel's `column_ids`, tested against the full
    vocabulary's masks in tests/kernels/test_grammar_mask.py): drafts are verified under the grammar, and output equals
    the target's alone under the same constraint."""
    regex = {"regex": r"[a-z]+(_[a-z]+)*\([a-z]*\)"}
    verifier = drafted.step.worker.grammars
    checked = verifier.checked
    got = drafted.generate(PROMPTS, max_tokens=32, structured_output=regex)
    want = target_only.generate(PROMPTS, max_tokens=32, structured_output=regex)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert verifier.checked - checked > 0
