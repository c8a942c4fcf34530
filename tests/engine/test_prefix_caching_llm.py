"""Prefix caching in one process (`specsplit.LLM`, the services' iteration code): greedy output equals transformers and
the same LLM with caching off, with hits, under eviction, with concurrent requests sharing prefixes and prompts that
diverge mid-block; sampled tokens after a cached prefix follow the target (chi-square); the drafter starts on its own
cached MTP KV where it holds it."""

import pathlib

import pytest
import torch

import specsplit
from tests.e2e.helpers import assert_first_two_tokens_follow

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
BS = 16


def prompts_sharing(prefix_len: int, tails: list[list[int]]) -> list[list[int]]:
    prefix = [(7 * i + 3) % 3000 + 10 for i in range(prefix_len)]
    return [prefix + tail for tail in tails]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax decoding, n tokens, EOS not special (the requests ignore it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy(llm, prompts, max_tokens=12):
    return llm.generate(prompts, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def test_greedy_with_hits_equals_caching_off_and_transformers(one_thread, hf_model):
    cached = specsplit.LLM(DEMO, num_speculative_tokens=3, adaptive=False)
    plain = specsplit.LLM(DEMO, num_speculative_tokens=3, adaptive=False, enable_prefix_caching=False)
    # 40 shared tokens (two full blocks and half a third), then tails: one diverging mid-block, one at a block's
    # end, one identical prompt twice in the same batch.
    first = prompts_sharing(40, [[101, 102, 103]])
    second = prompts_sharing(40, [[201, 202, 203, 204, 205, 206, 207, 208, 209], [101, 102, 103], [101, 102, 103]])
    second.append(second[0][:37] + [55, 56, 57])  # diverges inside the third block
    for batch in (first, second):
        hits, misses = greedy(cached, batch), greedy(plain, batch)
        assert [r.token_ids for r in hits] == [r.token_ids for r in misses]
    assert all(r.cached_tokens == 0 for r in greedy(plain, second))
    again = greedy(cached, second)
    assert [r.cached_tokens for r in again] == [48, 32, 32, 32]  # whole blocks only, and never the last token
    for prompt, result in zip(second, again):
        assert result.token_ids == hf_greedy(hf_model, prompt, 12)
    runner = cached.drafter.runner
    assert runner.prefix_cache_hits > 0  # the drafter started requests on its own cached MTP KV
    assert sum(r.stats.num_accepted_tokens for r in again) > 0


def test_greedy_under_eviction_equals_caching_off(one_thread):
    """A cache of 24 blocks of 16 tokens against prompts of 5 blocks with four different prefixes, cycled: blocks are
    evicted and cached again all along."""
    kwargs = dict(num_speculative_tokens=3, adaptive=False, num_blocks=24, block_size=BS, max_num_seqs=3)
    cached = specsplit.LLM(DEMO, **kwargs)
    plain = specsplit.LLM(DEMO, **kwargs, enable_prefix_caching=False)
    families = [prompts_sharing(70 + 3 * f, [[f + 11, f + 12]]) for f in range(4)]
    hits = 0
    for round_ in range(3):
        for f, (prompt,) in enumerate(families):
            batch = [prompt, prompt[:60] + [round_ + 400, f + 500]]
            got, want = greedy(cached, batch, 8), greedy(plain, batch, 8)
            assert [r.token_ids for r in got] == [r.token_ids for r in want], (round_, f)
            hits += sum(r.cached_tokens for r in got)
            pool = cached.step.worker.kv_cache
            assert pool.num_cached_blocks <= pool.num_blocks
    assert hits > 0 and cached.scheduler.prefix_cache.num_blocks <= 24


def test_sampled_tokens_after_a_cached_prefix_follow_the_target(one_thread, hf_model):
    """Tokens 1 and 2 of 300 sampled generations (temperature 1, sampled drafts, rejection sampling) of a 35-token
    prompt whose first two blocks come from the cache: chi-square against transformers' exact marginals."""
    llm = specsplit.LLM(DEMO, num_speculative_tokens=3, adaptive=False)
    (prompt,) = prompts_sharing(35, [[]])
    greedy(llm, [prompt], 1)  # its blocks cached
    results = []
    for _ in range(10):
        results += llm.generate([prompt] * 30, max_tokens=2, temperature=1.0, ignore_eos=True, detokenize=False)
    assert all(r.cached_tokens == 32 for r in results)
    firsts = [r.token_ids[0] for r in results]
    seconds = [r.token_ids[1] for r in results]
    assert_first_two_tokens_follow(hf_model, prompt, firsts, seconds)


def test_seeded_tokens_after_a_cached_prefix_equal_those_computed_afresh(one_thread):
    """Coupled sampling makes a seeded request's tokens a function of the target's distribution alone: with the prefix
    from the cache they are those of the same requests with caching off."""
    kwargs = dict(num_speculative_tokens=3, adaptive=False)
    cached, plain = specsplit.LLM(DEMO, **kwargs), specsplit.LLM(DEMO, **kwargs, enable_prefix_caching=False)
    prompts = prompts_sharing(50, [[i + 20, i + 30] for i in range(6)])
    greedy(cached, prompts[:1], 1)
    options = dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, detokenize=False)
    got, want = cached.generate(prompts, **options), plain.generate(prompts, **options)
    assert all(r.cached_tokens == 48 for r in got)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
