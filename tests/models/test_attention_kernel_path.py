"""The target forward on the Triton attention path (`use_kernel`) equals the SDPA path (DeepSeek-V3: the eager MLA
path) and transformers, and the CUDA-graph runner's static-buffer path (run eagerly here) equals the plain forward."""

from __future__ import annotations

import pytest
import torch

from specsplit.models.loader import load_target
from specsplit.runtime.cuda_graphs import CudaGraphRunner, token_buckets
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint

# Steps over two requests: a ragged prefill, then decode / verify steps of 1 .. 4 new tokens each.
STEPS = [{"a": 7, "b": 5}, {"a": 1, "b": 4}, {"b": 1, "a": 3}, {"a": 1}, {"a": 2, "b": 1}]


def _run_steps(model, runner=None, use_kernel=False, seed=0):
    """Hidden states and logits of every step, and the cache afterwards."""
    g = torch.Generator().manual_seed(seed)
    cache = runner.kv_cache if runner is not None else model.make_kv_cache(num_blocks=16, block_size=4)
    outputs = []
    for i, step in enumerate(STEPS):
        ids = torch.randint(0, model.config.vocab_size, (sum(step.values()),), generator=g)
        positions = torch.cat([torch.arange(cache.num_tokens(r), cache.num_tokens(r) + n) for r, n in step.items()])
        attn = cache.prepare_step(list(step), list(step.values()), use_kernel=use_kernel and i > 0)
        with torch.inference_mode():
            if runner is not None and runner.can_run(attn):
                hidden, logits = runner.run(ids, positions, attn)
                hidden, logits = hidden.clone(), logits.clone()
            else:
                hidden = model(ids, positions, cache, attn)
                logits = model.compute_logits(hidden)
        outputs.append((hidden, logits))
    return outputs, cache


@pytest.fixture(scope="module")
def load(checkpoint_dir, tmp_path_factory):
    """load(architecture) → a tiny target; "deepseek_v3" (MLA over a latent cache) and "deepseek_v3 q_proj" (no
    q LoRA, rotate-half RoPE) from tests/fixtures/tiny_deepseek_v3.py."""

    def make(architecture: str):
        if architecture.startswith("deepseek_v3"):
            plain_q = {"q_lora_rank": None, "rope_interleave": False} if architecture.endswith("q_proj") else {}
            return load_target(write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("dsv3"), **plain_q))
        return load_target(checkpoint_dir(architecture))

    return make


def _cache_tensors(cache) -> list[torch.Tensor]:
    """What a cache holds: K and V, or MLA's latents."""
    return [cache.latent] if hasattr(cache, "latent") else [cache.k, cache.v]


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "deepseek_v3", "deepseek_v3 q_proj"])
def test_kernel_path_equals_sdpa_path_over_decode_and_verify_steps(load, architecture):
    model = load(architecture)
    expected, expected_cache = _run_steps(model)
    got, cache = _run_steps(model, use_kernel=True)
    for (h, logits), (h_ref, logits_ref) in zip(got, expected):
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=1e-4)
    for got_cache, expected_cache_tensor in zip(_cache_tensors(cache), _cache_tensors(expected_cache)):
        torch.testing.assert_close(got_cache, expected_cache_tensor, atol=1e-5, rtol=1e-5)


def test_kernel_path_prefill_logits_match_transformers(checkpoint_dir, hf_model):
    path = checkpoint_dir("qwen2")
    model = load_target(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (6, 1, 9)]
    cache = model.make_kv_cache(num_blocks=16, block_size=4)
    attn = cache.prepare_step(["x", "y", "z"], [len(p) for p in prompts], use_kernel=True)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        ours = model.compute_logits(model(torch.cat(prompts), positions, cache, attn))
        theirs = torch.cat([hf_model(path)(p[None]).logits[0].float() for p in prompts])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_token_buckets_are_powers_of_two_up_to_the_maximum():
    assert token_buckets(1) == [1]
    assert token_buckets(8) == [1, 2, 4, 8]
    assert token_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize("architecture", ["llama", "deepseek_v3"])
def test_static_buffer_path_with_padding_equals_the_plain_forward(load, architecture):
    model = load(architecture)
    expected, expected_cache = _run_steps(model)
    # Largest bucket 4: the 5-token step goes eager; 3-token steps are padded to 4 (two of them).
    runner = CudaGraphRunner(model, model.make_kv_cache(16, 4), max_model_len=64, max_num_tokens=4, capture=False)
    got, cache = _run_steps(model, runner=runner, use_kernel=True)
    assert [runner.bucket_for(sum(s.values())) for s in STEPS] == [None, None, 4, 1, 4]
    for (h, logits), (h_ref, logits_ref) in zip(got, expected):
        assert h.shape == h_ref.shape and logits.shape == logits_ref.shape
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=1e-4)
    # Padding tokens wrote nothing: the whole cache (free blocks included) equals the plain run's.
    for got_cache, expected_cache_tensor in zip(_cache_tensors(cache), _cache_tensors(expected_cache)):
        torch.testing.assert_close(got_cache, expected_cache_tensor, atol=1e-5, rtol=1e-5)


def test_steps_outside_the_graphs_are_refused(checkpoint_dir):
    model = load_target(checkpoint_dir("llama"))
    cache = model.make_kv_cache(16, 4)
    runner = CudaGraphRunner(model, cache, max_model_len=8, max_num_tokens=4, capture=False)
    assert not runner.can_run(cache.prepare_step(["a"], [2]))  # the SDPA path
    assert not runner.can_run(cache.prepare_step(["b"], [5], use_kernel=True))  # more tokens than a bucket
    assert not runner.can_run(cache.prepare_step(["b"], [4], use_kernel=True))  # 9 tokens > max_model_len 8
    attn = cache.prepare_step(["a"], [1], use_kernel=True)
    assert runner.can_run(attn)
    with pytest.raises(ValueError, match="does not fit the CUDA graph buckets"):
        runner.run(torch.zeros(5, dtype=torch.int64), torch.arange(5), cache.prepare_step(["c"], [5], use_kernel=True))


def test_steps_take_the_kernel_by_query_length_then_by_attention_pairs():
    from specsplit.models.attention import KERNEL_MAX_PREFILL_PAIRS, KERNEL_MAX_QUERY_LEN, use_kernel_for

    assert not use_kernel_for(False, [1], [10], 512)
    assert use_kernel_for(True, [KERNEL_MAX_QUERY_LEN, 1], [10**6, 10**6], 0)  # verify steps: always
    assert use_kernel_for(True, [512], [512], 512)  # a 512-token prompt from its start: 131,328 pairs
    assert not use_kernel_for(True, [512], [512], 256)  # no CUDA graph that large: eager SDPA
    assert not use_kernel_for(True, [64, 64], [64, 64], 0)  # no graphs at all
    assert use_kernel_for(True, [388, *[4] * 31], [2048] * 32, 512)  # a chunk beside verify rows: 1.0M pairs
    assert not use_kernel_for(True, [512], [8192], 512)  # a late chunk of a long prompt: 4.1M pairs
    n = 64
    fits = (KERNEL_MAX_PREFILL_PAIRS + n * (n - 1) // 2) // n  # pairs n * s - n (n - 1) / 2: the longest s that fits
    assert use_kernel_for(True, [n], [fits], 512) and not use_kernel_for(True, [n], [fits + 1], 512)


def _greedy(model, prompt: list[int], new_tokens: int, use_kernel: bool) -> list[int]:
    """Greedy decoding, one token per step after the prompt's prefill; the decode steps on the kernel path through
    the CUDA-graph runner's static buffers (run eagerly on CPU) when `use_kernel`."""
    cache = model.make_kv_cache(16, 4)
    runner = CudaGraphRunner(model, cache, max_model_len=64, max_num_tokens=1, capture=False) if use_kernel else None
    tokens = list(prompt)
    with torch.inference_mode():
        attn = cache.prepare_step(["g"], [len(prompt)])
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), cache, attn))
        for _ in range(new_tokens):
            tokens.append(int(logits[-1].argmax()))
            ids, positions = torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1])
            attn = cache.prepare_step(["g"], [1], use_kernel=use_kernel)
            if runner is not None:
                logits = runner.run(ids, positions, attn)[1]
            else:
                logits = model.compute_logits(model(ids, positions, cache, attn))
    return tokens[len(prompt) :]


def test_deepseek_greedy_decoding_on_the_kernel_and_graph_buffers_equals_the_eager_mla_path(load):
    model = load("deepseek_v3")
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(9)]
    eager = _greedy(model, prompt, 20, use_kernel=False)
    assert _greedy(model, prompt, 20, use_kernel=True) == eager
    assert len(set(eager)) > 3  # a real continuation, not one token repeated
