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


def _slots_of(cache: PagedKVCache, rid: str, indices: list[int]) -> list[int]:
    table, size = cache.block_table(rid), cache.block_size
    return [table[i // size] * size + i % size for i in indices]


def test_later_steps_planned_with_the_first_equal_planning_them_one_by_one():
    """The drafter's steps 1..k-1 planned with step 0 (`more_steps`, `StepPlan.later_steps`): the blocks of every
    step allocated at once, and each step's slots, context lengths and rows those of planning it on its own; a
    request with fewer steps leaves the later ones (a subset, its own block tables)."""
    one_by_one, at_once = _cache(16, 4), _cache(16, 4)
    for cache in (one_by_one, at_once):  # "a" starts mid-block, "b" at a block's end, "c" afresh
        cache.prepare_step(["a", "b"], [2, 3])
    ids, counts, more = ["a", "b", "c"], [2, 1, 3], [3, 1, 2]
    first = at_once.plan_step(ids, counts, more)
    expected = [one_by_one.plan_step(ids, counts)]
    rows = [0, 1, 2]
    for s in (1, 2, 3):
        rows = [r for r in rows if more[r] >= s]
        expected.append(one_by_one.plan_step([ids[r] for r in rows], [1] * len(rows)))
    later = first.later_steps()
    assert [r for r, _ in later] == [[0, 1, 2], [0, 2], [0]]
    assert first.slot_mapping == _slots_of(at_once, "a", [2, 3]) + _slots_of(at_once, "b", [3]) + _slots_of(
        at_once, "c", [0, 1, 2]
    )
    for (rows, plan), want in zip(later, expected[1:]):
        got_ids = [ids[r] for r in rows]
        assert plan.seq_lens == plan.token_context_lens == want.seq_lens
        assert plan.query_start_loc == want.query_start_loc and plan.token_req_index == want.token_req_index
        # each token's slot is its cache index's, in the blocks this cache gave the request
        assert plan.slot_mapping == [_slots_of(at_once, rid, [n - 1])[0] for rid, n in zip(got_ids, want.seq_lens)]
        assert plan.block_tables == [at_once.block_table(rid) for rid in got_ids]
        width = max(map(len, plan.block_tables))
        assert plan.int32_arrays[2] == [b for t in plan.block_tables for b in t + [-1] * (width - len(t))]
    assert [at_once.num_tokens(r) for r in ids] == [one_by_one.num_tokens(r) for r in ids] == [7, 5, 5]
    assert at_once.num_free_blocks == one_by_one.num_free_blocks


def test_later_steps_without_room_leave_the_cache_as_it_was():
    cache = _cache(3, 4)
    with pytest.raises(KVCacheFull):
        cache.plan_step(["a"], [8], [5])  # 13 tokens: 4 blocks
    assert cache.num_free_blocks == 3 and not cache.has("a")
    assert cache.plan_step(["a"], [8], [4]).later_steps()[-1][1].seq_lens == [12]
