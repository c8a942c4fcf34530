"""The prefix cache of `PagedBlocks`: full blocks registered under keys, shared by reference count between requests,
evictable least recently released first once no request holds them, and evicted by allocation when nothing is free."""

from __future__ import annotations

import random

import pytest

from specsplit.models.kv_cache import KVCacheFull, PagedBlocks

BS = 4


def _pool(num_blocks: int = 8) -> PagedBlocks:
    return PagedBlocks(num_blocks, BS)


def _held(cache: PagedBlocks) -> set[int]:
    return {b for r in cache._requests.values() for b in r.blocks}


def _state(cache: PagedBlocks) -> tuple:
    """Everything observable about the pool, to check a refused call changed nothing."""
    requests = {rid: (r.num_tokens, list(r.blocks)) for rid, r in cache._requests.items()}
    return (
        requests,
        list(cache._free),
        list(cache._evictable),
        dict(cache._block_of),
        dict(cache._refs),
        cache.num_free_blocks,
    )


def test_two_requests_share_cached_blocks_and_append_after_them():
    cache = _pool()
    cache.plan_step(["a"], [10])  # blocks 0, 1 full, block 2 holds 2 tokens
    assert cache.cache_block("a", 0, b"k0") and cache.cache_block("a", 1, b"k1")
    assert not cache.cache_block("a", 2, b"k2")  # not full
    assert not cache.cache_block("a", 0, b"other")  # cached under k0 already
    assert not cache.cache_block("a", 1, b"k0")  # k0 names another block
    assert not cache.cache_block("a", -1, b"k9") and not cache.cache_block("nobody", 0, b"k9")
    assert cache.num_cached_blocks == 2 and cache.cached_prefix([b"k0", b"k1", b"k2"]) == 2

    a = cache.block_table("a")
    assert cache.attach("b", [b"k0", b"k1"])
    assert cache.block_table("b") == a[:2] and cache.num_tokens("b") == 2 * BS
    assert cache.num_free_blocks == 8 - 3  # sharing took no block

    plan = cache.plan_step(["b"], [1])  # b's next token goes after its cached blocks, into a block of its own
    new_block = cache.block_table("b")[2]
    assert new_block not in a and plan.slot_mapping == [new_block * BS]
    assert cache.num_free_blocks == 8 - 4


def test_a_cached_block_outlives_its_requests_until_evicted():
    cache = _pool()
    cache.plan_step(["a"], [9])
    cache.cache_block("a", 0, b"k0")
    cache.cache_block("a", 1, b"k1")
    cache.attach("b", [b"k0"])
    cache.free("a")  # k0 still held by b; k1 now held by none: evictable; a's third block free
    assert cache.num_free_blocks == 8 - 1 and cache.num_cached_blocks == 2
    cache.free("b")
    assert cache.num_free_blocks == 8 and cache.num_cached_blocks == 2
    # A later request starts on both; they are no longer evictable.
    assert cache.attach("c", [b"k0", b"k1"])
    assert cache.num_free_blocks == 8 - 2 and cache.num_tokens("c") == 2 * BS


def test_allocation_takes_free_blocks_first_then_evicts_least_recently_released():
    cache = _pool(4)
    for rid, key in (("a", b"ka"), ("b", b"kb"), ("c", b"kc")):
        cache.plan_step([rid], [BS])
        assert cache.cache_block(rid, 0, key)
    for rid in ("b", "a", "c"):  # released in this order: b's block is the least recently used
        cache.free(rid)
    assert cache.num_free_blocks == 4 and cache.num_cached_blocks == 3

    cache.plan_step(["x"], [BS])  # the one free block: nothing evicted
    assert cache.num_cached_blocks == 3
    cache.plan_step(["y"], [BS])
    assert cache.cached_prefix([b"kb"]) == 0 and cache.cached_prefix([b"ka"]) == 1
    cache.plan_step(["y"], [BS])
    assert cache.cached_prefix([b"ka"]) == 0 and cache.cached_prefix([b"kc"]) == 1
    assert cache.num_free_blocks == 1


def test_a_requests_later_blocks_are_evicted_before_its_earlier_ones():
    cache = _pool(3)
    cache.plan_step(["a"], [3 * BS])
    for j in range(3):
        cache.cache_block("a", j, bytes([j]))
    cache.free("a")
    cache.plan_step(["x"], [1])
    assert cache.cached_prefix([b"\0", b"\1", b"\2"]) == 2  # block 2 went first
    cache.plan_step(["x"], [BS])
    assert cache.cached_prefix([b"\0", b"\1"]) == 1


def test_attach_refuses_a_missing_key_or_a_request_with_tokens_changing_nothing():
    cache = _pool()
    cache.plan_step(["a"], [8])
    cache.cache_block("a", 0, b"k0")
    cache.cache_block("a", 1, b"k1")
    cache.free("a")
    cache.plan_step(["busy"], [2])
    before = _state(cache)
    assert not cache.attach("b", [b"k0", b"missing", b"k1"])
    assert not cache.attach("busy", [b"k0"])
    assert _state(cache) == before and not cache.has("b")
    cache.truncate("busy", 0)  # held with no tokens and no blocks: may start on cached blocks
    assert cache.attach("busy", [b"k0"]) and cache.num_tokens("busy") == BS


def test_evict_and_forget_cached():
    cache = _pool(4)
    cache.plan_step(["a"], [8])
    cache.cache_block("a", 0, b"k0")
    cache.cache_block("a", 1, b"k1")
    held = cache.block_table("a")[1]
    cache.attach("b", [b"k0"])
    cache.free("a")  # k0 held by b, k1 evictable

    cache.evict([b"k1", b"not cached"])
    assert cache.num_cached_blocks == 1 and cache.num_free_blocks == 3
    assert not cache.attach("c", [b"k0", b"k1"])
    cache.plan_step(["x"], [3 * BS])  # every free block, the one k1 had included
    assert held in cache.block_table("x")

    cache.forget_cached()  # k0 is still b's: it stays b's, freed when b lets go
    assert cache.num_cached_blocks == 0 and cache.block_table("b") and cache.num_free_blocks == 0
    cache.free("b")
    assert cache.num_free_blocks == 1 and cache.num_cached_blocks == 0
    cache.free("x")
    assert cache.num_free_blocks == 4


def test_truncate_of_a_shared_block_keeps_it_for_the_other_holder():
    cache = _pool()
    cache.plan_step(["a"], [8])
    cache.cache_block("a", 0, b"k0")
    cache.cache_block("a", 1, b"k1")
    a = cache.block_table("a")
    cache.attach("b", [b"k0", b"k1"])
    cache.plan_step(["b"], [2])
    free = cache.num_free_blocks

    cache.truncate("b", BS)  # drops k1's block and b's own third block from b
    assert cache.block_table("b") == a[:1] and cache.num_free_blocks == free + 1
    cache.truncate("b", 0)
    assert cache.block_table("a") == a and cache.num_free_blocks == free + 1
    cache.free("a")  # no holder left: both evictable, none lost
    assert cache.num_free_blocks == 8 and cache.attach("c", [b"k0", b"k1"])

    # Into the middle of a cached block: refused while shared (the request would write into the other's block)...
    cache.truncate("b", 0)
    assert cache.attach("b", [b"k0"])
    before = _state(cache)
    with pytest.raises(ValueError, match="is shared"):
        cache.truncate("c", 1)
    with pytest.raises(ValueError, match="is shared"):
        cache.truncate("b", 1)
    assert _state(cache) == before
    # ... and uncaches a block the request alone holds, which it then overwrites.
    cache.truncate("c", BS + 1)
    assert cache.block_table("c") == a and cache.cached_prefix([b"k0", b"k1"]) == 1
    cache.free("c")
    cache.free("b")
    assert cache.num_free_blocks == 8 and cache.num_cached_blocks == 1


def test_kv_cache_full_counts_evictable_blocks():
    cache = _pool(4)
    cache.plan_step(["a"], [4 * BS])
    for j in range(4):
        cache.cache_block("a", j, bytes([j]))
    cache.free("a")
    assert cache.num_free_blocks == 4 and cache.can_append(["x"], [4 * BS])
    assert not cache.can_append(["x"], [4 * BS + 1])
    before = _state(cache)
    with pytest.raises(KVCacheFull, match="needs 5 new KV blocks, only 4 free"):
        cache.plan_step(["x"], [2 * BS], more_steps=[2 * BS + 1])
    assert _state(cache) == before  # nothing evicted by a refused step
    cache.plan_step(["x"], [2 * BS], more_steps=[2 * BS])
    assert cache.num_free_blocks == 0 and cache.num_cached_blocks == 0


@pytest.mark.parametrize("seed", [1234, 7, 99])
def test_random_operations_match_a_model_of_the_pool(seed):
    """Random steps, rollbacks, frees, registrations, attaches and evictions; a fake cache tensor written through
    each step's slots. After every operation: every request reads back exactly what it wrote or attached, every
    cached block holds what was registered, no block is both free and held, and free + held + evictable blocks
    make the pool, with each held block's reference count its number of holders."""
    rng = random.Random(seed)
    num_blocks = 20
    cache = PagedBlocks(num_blocks, BS)
    memory = [None] * (num_blocks * BS)  # the cache tensor: one value per slot
    content: dict[str, list[int]] = {}  # per request, the values at its cache indices
    cached: dict[bytes, list[int]] = {}  # per key, the values of its block
    keys = [bytes([k]) for k in range(10)]
    counter = iter(range(10**9))

    def check():
        held = _held(cache)
        free, evictable = set(cache._free), set(cache._evictable)
        assert len(free) == len(cache._free)
        assert not free & held and not free & evictable and not held & evictable
        assert len(free) + len(held) + len(evictable) == num_blocks
        assert cache.num_free_blocks == len(free) + len(evictable)
        holders: dict[int, int] = {}
        for rid, values in content.items():
            assert cache.num_tokens(rid) == len(values)
            table = cache.block_table(rid)
            assert len(table) == -(-len(values) // BS)
            for block in table:
                holders[block] = holders.get(block, 0) + 1
            assert [memory[table[i // BS] * BS + i % BS] for i in range(len(values))] == values
        for block, n in holders.items():
            assert cache._refs.get(block, 1) == n
        assert all(block in cache._key_of or n > 1 for block, n in cache._refs.items())
        assert set(cache._block_of) == set(cached)
        for key, values in cached.items():
            block = cache._block_of[key]
            assert memory[block * BS : (block + 1) * BS] == values
            assert block in held or block in evictable

    for _ in range(4000):
        op = rng.random()
        rids = list(content)
        if op < 0.3 or not rids:  # a step of running requests and maybe a new one
            pool = rids + [f"r{next(counter)}"]
            ids = rng.sample(pool, rng.randint(1, min(3, len(pool))))
            new = [rng.randint(1, BS + 2) for _ in ids]
            more = [rng.randint(0, 2) for _ in ids]
            before = _state(cache)
            tables = {rid: len(cache.block_table(rid)) for rid in ids}
            lru = list(cache._evictable)
            try:
                plan = cache.plan_step(ids, new, more_steps=more)
            except KVCacheFull:
                assert _state(cache) == before
                continue
            # Free blocks first, then the least recently released cached ones, only as many as the step took.
            taken = sum(len(cache.block_table(rid)) - n for rid, n in tables.items())
            evicted = max(0, taken - len(before[1]))
            assert list(cache._evictable) == lru[evicted:]
            values = [next(counter) for _ in plan.slot_mapping]
            for slot, value in zip(plan.slot_mapping, values):
                memory[slot] = value
            offset = 0
            later = {}
            for rid, n, m in zip(ids, new, more):
                content.setdefault(rid, []).extend(values[offset : offset + n])
                offset += n
                later[rid] = m
            for rows, step in plan.later_steps():  # the later steps' tokens, each in its slot
                for r, slot in zip(rows, step.slot_mapping):
                    memory[slot] = value = next(counter)
                    content[ids[r]].append(value)
        elif op < 0.4:
            rid = rng.choice(rids)
            n = rng.randint(0, len(content[rid]))
            before = _state(cache)
            try:
                cache.truncate(rid, n)
            except ValueError as err:  # into a block another request holds too
                assert "shared" in str(err) and _state(cache) == before
                continue
            del content[rid][n:]
        elif op < 0.62:
            rid = rng.choice(rids)
            cache.free(rid)
            del content[rid]
        elif op < 0.8:
            rid, key = rng.choice(rids), rng.choice(keys)
            index = rng.randint(0, max(len(content[rid]) // BS, 1))
            full = (index + 1) * BS <= len(content[rid])
            block_cached = full and cache.block_table(rid)[index] in {cache._block_of[k] for k in cached}
            ok = cache.cache_block(rid, index, key)
            assert ok == (full and key not in cached and not block_cached)
            if ok:
                cached[key] = content[rid][index * BS : (index + 1) * BS]
        elif op < 0.92:
            rid = f"r{next(counter)}"
            known = list(cached) if cached and rng.random() < 0.8 else keys  # mostly keys that are cached
            chosen = rng.sample(known, rng.randint(1, min(3, len(known))))
            ok = cache.attach(rid, chosen)
            assert ok == all(k in cached for k in chosen)
            if ok:
                content[rid] = [v for k in chosen for v in cached[k]]
        elif op < 0.997:
            chosen = rng.sample(keys, rng.randint(1, 3))
            cache.evict(chosen)
            for k in chosen:
                cached.pop(k, None)
        else:
            cache.forget_cached()
            cached.clear()
        # keys allocation evicted, or a rollback into a block its request alone held
        cached = {k: v for k, v in cached.items() if k in cache._block_of}
        check()
