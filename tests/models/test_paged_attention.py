"""paged_attention equals dense causal GQA attention over each request's whole sequence, on the
eager path in both its forms: one SDPA call over the step padded to its longest request, and the
per-request loop (where padding would cost too much)."""

from __future__ import annotations

import math

import pytest
import torch

from specsplit.models import padded_batch as padded_batch_module
from specsplit.models.attention import paged_attention
from specsplit.models.kv_cache import PagedKVCache
from specsplit.models.padded_batch import worth_padding


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [S, H, D], k/v: [S, Hkv, D] → [S, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    seq = q.shape[0]
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("padded", [True, False], ids=["one-padded-call", "per-request-loop"])
def test_paged_attention_matches_dense_causal_gqa_over_ragged_steps(monkeypatch, padded):
    if not padded:
        monkeypatch.setattr(padded_batch_module, "PADDED_BATCH_MAX_PAIRS", 0)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 6, 2, 8
    cache = PagedKVCache(1, kv_heads, dim, num_blocks=16, block_size=3, dtype=torch.float32, device="cpu")
    lengths = {"a": 11, "b": 5}
    full = {r: [torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)] for r, n in lengths.items()}
    steps = [{"a": 4, "b": 1}, {"b": 3, "a": 1}, {"a": 6, "b": 1}]
    done = {"a": 0, "b": 0}
    for step in steps:
        attn = cache.prepare_step(list(step), list(step.values()))
        assert (attn.padded_batch is not None) == padded  # these steps pad to at most twice their work
        q, k, v = (torch.cat([full[r][i][done[r] : done[r] + n] for r, n in step.items()]) for i in range(3))
        out = paged_attention(q, k, v, cache.k[0], cache.v[0], attn)
        row = 0
        for r, n in step.items():
            end = done[r] + n
            expected = _dense_causal(*(t[:end] for t in full[r]))[done[r] :]
            torch.testing.assert_close(out[row : row + n], expected, atol=1e-5, rtol=0)
            row, done[r] = row + n, end


def test_padding_rule_pads_every_multi_request_step_on_cuda_but_only_cheap_ones_on_cpu():
    assert worth_padding(3, real_pairs=1_000, padded_pairs=1_900, on_cuda=False)
    assert not worth_padding(3, real_pairs=1_000, padded_pairs=2_100, on_cuda=False)
    assert worth_padding(32, real_pairs=200_000, padded_pairs=1_000_000, on_cuda=True)  # a mixed prefill/decode step
    assert not worth_padding(1, real_pairs=100, padded_pairs=100, on_cuda=True)
    too_many = padded_batch_module.PADDED_BATCH_MAX_PAIRS + 1
    assert not worth_padding(2, real_pairs=too_many, padded_pairs=too_many, on_cuda=True)


def test_a_step_that_padding_would_double_keeps_the_loop():
    cache = PagedKVCache(1, 1, 4, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    attn = cache.prepare_step(["long", "d1", "d2"], [40, 1, 1])  # 40 x 40 pairs padded three times
    assert attn.padded_batch is None
    assert cache.prepare_step(["one"], [8]).padded_batch is None  # one request: nothing to batch
    batch = cache.prepare_step(["p", "q"], [6, 5]).padded_batch
    assert batch is not None and (batch.max_new, batch.max_len) == (6, 6)
    assert batch.out_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # q's 5 rows follow p's 6
    assert batch.query_index[1].tolist() == [6, 7, 8, 9, 10, 10]  # q's padded row repeats its last
