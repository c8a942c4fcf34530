"""Block accounting, metadata and rollback of PagedKVCache."""

from __future__ import annotations

import pytest
import torch

from specsplit.models.kv_cache import KVCacheFull, PagedKVCache


def _cache(num_blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_cache_tensors_have_the_documented_shape():
    cache = _cache()
    assert cache.k.shape == cache.v.shape == (2, 8, 4, 2, 8)
    assert cache.num_blocks == 8 and cache.block_size == 4 and cache.num_free_blocks == 8


def test_prepare_step_builds_metadata_and_advances_lengths():
    cache = _cache()
    attn = cache.prepare_step(["a", "b"], [5, 2])
    assert attn.query_start_loc.tolist() == [0, 5, 7]
    assert attn.seq_lens.tolist() == [5, 2]
    assert attn.block_tables.tolist() == [[0, 1], [2, -1]]
    assert attn.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert attn.query_start_loc.dtype == attn.seq_lens.dtype == attn.block_tables.dtype == torch.int32
    assert attn.slot_mapping.dtype == torch.int64
    assert cache.num_tokens("a") == 5 and cache.num_tokens("b") == 2 and cache.num_free_blocks == 5

    attn = cache.prepare_step(["b", "a"], [3, 1])
    assert attn.query_start_loc.tolist() == [0, 3, 4]
    assert attn.seq_lens.tolist() == [5, 6]
    assert attn.block_tables.tolist() == [[2, 3], [0, 1]]
    assert attn.slot_mapping.tolist() == [10, 11, 12, 5]
    assert attn.context_slots.tolist() == [8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5]
    assert attn.query_start_loc_host == [0, 3, 4] and attn.seq_lens_host == [5, 6]
    assert attn.num_reqs == 2 and attn.num_tokens == 4
    # The Triton path's view: each token's request and causal context length.
    assert attn.token_req_index.tolist() == [0, 0, 0, 1]
    assert attn.token_context_lens.tolist() == [3, 4, 5, 6]
    assert attn.token_req_index.dtype == attn.token_context_lens.dtype == torch.int32


def test_truncate_frees_whole_blocks_past_the_kept_tokens():
    cache = _cache()
    cache.prepare_step(["a"], [10])  # 3 blocks
    assert cache.num_free_blocks == 5
    cache.truncate("a", 9)
    assert cache.num_tokens("a") == 9 and cache.num_free_blocks == 5
    cache.truncate("a", 8)
    assert cache.num_free_blocks == 6
    cache.truncate("a", 3)
    assert cache.num_tokens("a") == 3 and cache.num_free_blocks == 7
    # Appending after a rollback reuses the kept block's tail, then fresh blocks.
    attn = cache.prepare_step(["a"], [2])
    assert attn.slot_mapping.tolist() == [3, attn.block_tables[0, 1].item() * 4]
    cache.truncate("a", 0)
    assert cache.has("a") and cache.num_tokens("a") == 0 and cache.num_free_blocks == 8


def test_truncate_beyond_cached_length_is_rejected():
    cache = _cache()
    cache.prepare_step(["a"], [3])
    with pytest.raises(ValueError, match="has 3 cached"):
        cache.truncate("a", 4)
    with pytest.raises(ValueError):
        cache.truncate("a", -1)
    with pytest.raises(ValueError):
        cache.truncate("unknown", 1)
    cache.truncate("unknown", 0)  # nothing cached, nothing to do
    assert not cache.has("unknown")


def test_free_returns_every_block_and_forgets_the_request():
    cache = _cache()
    cache.prepare_step(["a", "b"], [9, 4])
    cache.free("a")
    assert not cache.has("a") and cache.num_tokens("a") == 0 and cache.num_free_blocks == 7
    cache.free("a")  # unknown: no-op
    cache.free("b")
    assert cache.num_free_blocks == 8


def test_kv_cache_full_leaves_state_unchanged():
    cache = _cache(num_blocks=4)
    cache.prepare_step(["a", "b"], [6, 3])  # 2 + 1 blocks
    before = (cache.num_free_blocks, cache.num_tokens("a"), cache.num_tokens("b"), cache.block_table("a"))
    assert not cache.can_append(["a", "b", "c"], [2, 2, 1])  # a fits, b needs 1, c needs 1: 2 > 1
    with pytest.raises(KVCacheFull):
        cache.prepare_step(["a", "b", "c"], [2, 2, 1])
    assert (
        cache.num_free_blocks,
        cache.num_tokens("a"),
        cache.num_tokens("b"),
        cache.block_table("a"),
    ) == before
    assert not cache.has("c")
    assert cache.can_append(["a", "b"], [2, 2])
    cache.prepare_step(["a", "b"], [2, 2])
    assert cache.num_free_blocks == 0


def test_bad_step_arguments_raise_clear_errors():
    cache = _cache()
    with pytest.raises(ValueError, match="token counts"):
        cache.prepare_step(["a"], [1, 2])
    with pytest.raises(ValueError, match="duplicate"):
        cache.prepare_step(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match=">= 1 new token"):
        cache.prepare_step(["a"], [0])
    with pytest.raises(ValueError, match="at least one request"):
        cache.prepare_step([], [])
