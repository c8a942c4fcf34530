"""`specsplit.LLM` with structured output: the drafter masks its drafts with the request's grammar (the verifier then
refuses none of them for the grammar, and they are accepted far more often than unmasked ones, which the grammar
often refuses); greedy output is the same either way, and follows the constraint."""

import re

import pytest

import specsplit
from tests.e2e.test_demo_model import DEMO, PROMPTS

REGEX = r"[a-z]+(_[a-z]+)*\([a-z]*\)"


@pytest.fixture(scope="module")
def llm():
    return specsplit.LLM(DEMO, num_speculative_tokens=3, adaptive=False)


def run(llm, masked: bool):
    drafter = llm.drafter.runner.grammars
    kept, drafter.tokenizer_dir = drafter.tokenizer_dir, (drafter.tokenizer_dir if masked else None)
    verifier = llm.step.worker.grammars
    checked, refused = verifier.checked, verifier.refused
    try:
        results = llm.generate(PROMPTS, max_tokens=32, structured_output={"regex": REGEX})
    finally:
        drafter.tokenizer_dir = kept
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    return results, verifier.checked - checked, verifier.refused - refused, accepted


def test_masked_drafts_follow_the_grammar_and_are_accepted_more_often(llm):
    masked, checked, refused, accepted = run(llm, masked=True)
    unmasked, checked_u, refused_u, accepted_u = run(llm, masked=False)
    assert checked > 0 and refused == 0  # every masked draft was one the grammar allows
    assert refused_u > 0  # unmasked, the drafter proposes what the grammar refuses
    assert accepted > accepted_u
    for a, b in zip(masked, unmasked):
        assert a.token_ids == b.token_ids  # drafts change how many tokens an iteration yields, never which
        assert a.finish_reason != "stop" or re.fullmatch(REGEX, a.text), a.text
