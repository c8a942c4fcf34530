"""`specsplit.LLM`: the services' iteration in one process (the coordinator's loop over the verifier's step over
the drafter's runner, drafts held on the verifier's side). Greedy output equals transformers' greedy decoding and
target-only decoding; the drafter's drafts are really verified; sampling is seeded; bad options
are refused as the coordinator refuses them."""

import pytest
import torch

import specsplit
from specsplit.client.errors import InvalidArgument
from tests.fixtures.tiny import write_tiny_checkpoint

# Ids from 3 on: 0-2 are the tiny tokenizer's special tokens (transformers would mask a pad id in a prompt).
PROMPTS = [[3, 11, 4, 14, 5], [9], [12, 6, 5, 3, 5, 8, 9, 7, 9, 3, 20, 3, 8, 4, 6, 22, 6, 4, 3, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", architecture="qwen3", seed=3)


@pytest.fixture(scope="module")
def llm(checkpoint):
    # A token budget of 8: the 20-token prompt prefills in three chunks while the others decode beside it.
    return specsplit.LLM(checkpoint, num_speculative_tokens=3, max_num_batched_tokens=8)


def hf_greedy(checkpoint, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_batch_equals_transformers_and_target_only_with_drafts_accepted(llm, checkpoint):
    results = llm.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    target_only = specsplit.LLM(checkpoint, num_speculative_tokens=0).generate(PROMPTS, max_tokens=12, ignore_eos=True)
    for prompt, result, reference in zip(PROMPTS, results, target_only):
        assert result.token_ids == reference.token_ids == hf_greedy(checkpoint, prompt, 12)
        assert result.completion_tokens == 12 and result.finish_reason == "length"
    assert sum(r.stats.num_draft_tokens for r in results) > 0  # the drafter's drafts were verified
    assert sum(r.stats.num_draft_tokens for r in target_only) == 0
    assert llm.iteration_timings
    for t in llm.iteration_timings:  # where each iteration's time went, as the benchmark reads it
        v = t.verifier
        assert t.schedule_start_ns <= t.verify_sent_ns <= v.received_ns <= v.replied_ns <= t.verify_received_ns
        assert t.verify_received_ns <= t.post_step_end_ns
        assert 0 < v.prepare_ns + v.forward_ns + v.drafts_wait_ns <= v.replied_ns - v.received_ns


def test_sampling_is_seeded_and_k_per_call_is_capped(llm):
    a = llm.generate(PROMPTS[:2], max_tokens=10, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    b = llm.generate(PROMPTS[:2], max_tokens=10, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    none = llm.generate(PROMPTS[:1], max_tokens=6, num_speculative_tokens=0, ignore_eos=True)
    assert none[0].stats.num_draft_tokens == 0
    with pytest.raises(InvalidArgument, match="num_speculative_tokens must be in"):
        llm.generate(PROMPTS[:1], max_tokens=6, num_speculative_tokens=4)


def test_text_prompts_stop_strings_and_bad_options(llm):
    (plain,) = llm.generate(["hello world"], max_tokens=8, ignore_eos=True)
    assert plain.prompt_tokens > 0 and plain.completion_tokens == 8 and isinstance(plain.text, str)
    if plain.text.strip():  # a stop string taken from what greedy decoding writes ends the request there
        stop = plain.text.strip()[:1]
        (stopped,) = llm.generate(["hello world"], max_tokens=8, ignore_eos=True, stop=[stop])
        assert stopped.finish_reason == "stop" and stop not in stopped.text
    for kwargs, message in [
        (dict(max_tokens=0), "max_tokens must be > 0"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(structured_output={"choice": "yes"}), "structured_output.choice must be a list of strings"),
        (dict(structured_output={"regex": "a("}), "structured_output.regex is not a valid regex"),  # the coordinator's
    ]:
        with pytest.raises(InvalidArgument, match=message):
            llm.generate([[1, 2]], **kwargs)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        llm.generate([[10**7]])
