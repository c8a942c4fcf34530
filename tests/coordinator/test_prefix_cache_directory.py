"""The coordinator's prefix cache: which blocks a request starts on, what enters the cache (verified full blocks only),
eviction before preemption, and the commands each iteration carries to the verifier."""

from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.prefix_cache import PrefixCache
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler

EOS = 999
BS = 4


def make(num_blocks=64, k=3, enable=True, budget=64, max_num_seqs=8):
    cfg = SchedulerConfig(
        max_model_len=256,
        block_size=BS,
        num_blocks=num_blocks,
        num_speculative_tokens=k,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        adaptive=False,
        enable_prefix_caching=enable,
    )
    return Scheduler(cfg, [EOS])


def req(rid, prompt, max_tokens=4):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s, sampled=None):
    """One iteration; every scheduled request that samples gets `sampled` (default: one new token, every draft
    rejected)."""
    out = s.schedule()
    res = []
    for item in out.scheduled:
        toks = ((sampled or {}).get(item.request.request_id, [7])) if item.sample else []
        rej = item.num_draft_tokens + 1 - len(toks) if item.sample else 0
        res.append(VerifyResult(item.request.request_id, toks, rej, item.num_draft_tokens))
    s.update_from_output(out, res)
    return out


def run_to_end(s, limit=50):
    outs = []
    for _ in range(limit):
        if not s.has_work():
            break
        outs.append(step(s))
    assert not s.has_work()
    return outs


PREFIX = list(range(100, 112))  # three full blocks


def test_second_request_starts_on_the_blocks_the_first_computed():
    s = make()
    s.add_request(req("a", PREFIX + [1, 2]))
    outs = run_to_end(s)
    registered = [c for o in outs for c in o.cache_commands.registered]
    assert [(rid, j) for rid, j, _, _ in registered][:3] == [("a", 0), ("a", 1), ("a", 2)]
    s.add_request(req("b", PREFIX + [1, 4, 5]))
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_cached_blocks == 3 and item.num_computed_tokens == 12
    assert item.token_ids == [1, 4, 5]  # only the tokens after the cached blocks run
    hashes, keys, tokens = item.cached_prefix
    assert hashes == [h for _, _, h, _ in registered[:3]]
    assert keys == [d for _, _, _, d in registered[:3]]
    assert tokens == PREFIX
    assert s.requests["b"].num_cached_tokens == 12
    assert s.prefix_cache.hits == 12 and s.prefix_cache.queries == 14 + 15


def test_a_prompt_going_on_differently_after_the_shared_blocks_recomputes_the_last_one_for_the_drafter():
    """The drafter's entries of a block pair its last position with the token after it: b's differs from a's, so b
    starts on one block fewer, whose hidden states the drafter then gets."""
    s = make()
    s.add_request(req("a", PREFIX + [1, 2]))
    run_to_end(s)
    s.add_request(req("b", PREFIX + [3, 4, 5]))
    (item,) = s.schedule().scheduled
    assert item.num_cached_blocks == 2 and item.token_ids == PREFIX[8:] + [3, 4, 5]


def test_drafter_keys_depend_on_the_token_after_the_block():
    """Same first block, different fifth token: same block hash, different drafter key."""
    cache = PrefixCache(BS)
    a, b = req("a", [1, 2, 3, 4, 5, 6]), req("b", [1, 2, 3, 4, 9, 6])
    for r in (a, b):
        cache.lookup(r)
    assert a.prefix.block_hashes[0] == b.prefix.block_hashes[0]
    assert a.prefix.drafter_keys[0] != b.prefix.drafter_keys[0]


def test_prompts_diverging_mid_block_share_only_the_whole_blocks_before():
    s = make()
    s.add_request(req("a", PREFIX + [1]))
    run_to_end(s)
    s.add_request(req("b", PREFIX[:6] + [55] + PREFIX[7:] + [1]))  # differs in block 1
    item = s.schedule().scheduled[0]
    assert item.num_cached_blocks == 1 and item.num_computed_tokens == 4


def test_a_prompt_of_whole_cached_blocks_still_computes_its_last_token():
    s = make()
    s.add_request(req("a", PREFIX + [1]))
    run_to_end(s)
    s.add_request(req("b", PREFIX))  # exactly three blocks, all cached
    item = s.schedule().scheduled[0]
    assert item.num_cached_blocks == 2 and item.token_ids == PREFIX[8:] and item.sample


def test_only_verified_tokens_enter_the_cache_never_drafts():
    s = make(k=3)
    s.add_request(req("a", [1, 2, 3], max_tokens=20))
    registered = []
    for _ in range(8):
        out = s.schedule()
        registered += out.cache_commands.registered
        item = out.scheduled[0]
        # every draft rejected: the request's verified length grows by one token per step
        toks = [50 + s.iteration] if item.sample else []
        s.update_from_output(
            out, [VerifyResult("a", toks, item.num_draft_tokens + 1 - len(toks), item.num_draft_tokens)]
        )
        r = s.requests["a"]
        for _, j, _, _ in registered:
            assert (j + 1) * BS <= r.num_computed_tokens  # a registered block holds verified tokens only
    assert registered  # blocks did fill up


def test_finished_requests_blocks_are_evicted_before_anyone_is_preempted():
    s = make(num_blocks=8)
    s.add_request(req("a", PREFIX + [1], max_tokens=2))
    run_to_end(s)
    cache = s.prefix_cache
    assert cache.num_blocks == cache.num_evictable > 0
    s.add_request(req("b", list(range(200, 224)), max_tokens=2))  # 6 blocks, nothing shared
    out = s.schedule()
    assert out.num_preempted == 0 and len(out.scheduled) == 1
    assert out.cache_commands.evicted  # the room came from cached blocks
    assert cache.num_blocks + 7 <= 8 + len(out.cache_commands.evicted)


def test_lru_evicts_the_tail_of_a_prefix_before_its_head():
    cache = PrefixCache(BS)
    r = req("a", PREFIX + [1])
    cache.register(r, 12)
    hashes = list(r.prefix.block_hashes)
    cache.release(r)
    assert cache.evict(1) == 1
    (evicted,) = cache.take_commands().evicted
    assert evicted == hashes[2]


def test_turned_off_nothing_is_cached_and_no_command_is_sent():
    s = make(enable=False)
    s.add_request(req("a", PREFIX + [1]))
    outs = run_to_end(s)
    s.add_request(req("b", PREFIX + [1]))
    out = s.schedule()
    assert s.prefix_cache is None
    assert not any(o.cache_commands for o in [*outs, out])
    assert out.scheduled[0].num_computed_tokens == 0 and out.scheduled[0].num_cached_blocks == 0


def test_a_new_directory_has_the_verifier_forget_its_cache_first():
    """A scheduler made anew beside a verifier that served another (the in-process engine's next scheduler) knows
    nothing of what the verifier caches: its first iteration resets it (the verifier refused its registrations of
    blocks it held already, and every request was prefilled twice), later ones do not."""
    s = make()
    s.add_request(req("a", PREFIX + [1]))
    first, second = step(s), step(s)
    assert first.cache_commands.reset and not second.cache_commands.reset


def test_reset_forgets_the_directory_and_tells_the_verifier():
    s = make()
    s.add_request(req("a", PREFIX + [1]))
    run_to_end(s)
    s.add_request(req("b", PREFIX + [1], max_tokens=10))
    step(s)
    s.reset_all()  # the verifier failed: what it holds is unknown
    out = s.schedule()
    assert out.cache_commands.reset and not out.cache_commands.evicted
    assert out.scheduled[0].num_cached_blocks == 0 and out.scheduled[0].num_computed_tokens == 0
    assert "b" in out.finished_request_ids


def test_a_preempted_request_resumes_on_its_own_cached_blocks():
    s = make(num_blocks=10, budget=64)
    s.add_request(req("a", PREFIX + [1], max_tokens=30))
    step(s)
    step(s)
    s.add_request(req("b", list(range(300, 320)), max_tokens=8))
    preempted, resumed = set(), []
    for _ in range(40):
        running = {r.request_id for r in s.running}
        out = step(s)
        resumed += [i for i in out.scheduled if i.request.request_id in preempted and i.num_cached_blocks]
        preempted |= running & {r.request_id for r in s.waiting}
        if resumed:
            break
    assert preempted and resumed
    item = resumed[0]
    assert item.num_computed_tokens == item.num_cached_blocks * BS >= 2 * BS


def test_concurrent_identical_prompts_register_each_block_once():
    s = make()
    s.add_request(req("a", PREFIX + [1]))
    s.add_request(req("b", PREFIX + [1]))
    outs = run_to_end(s)
    registered = [(rid, j) for o in outs for rid, j, _, _ in o.cache_commands.registered]
    blocks = [j for _, j in registered]
    assert len(blocks) == len(set(blocks))  # the second copy of each block stays its request's own
    assert s.prefix_cache.num_blocks == s.prefix_cache.num_evictable == len(blocks)


def test_a_request_stopping_mid_step_registers_only_the_tokens_it_kept():
    """A stop token among a step's accepted drafts ends the request there: its KV covers tokens it dropped, which no
    block hash can include."""
    s = make(k=3)
    s.add_request(Request("a", list(range(1, 14)), SamplingParams(max_tokens=20, stop_token_ids=(77,))))
    registered = step(s).cache_commands.registered  # prefill: 13 tokens + one sampled
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_draft_tokens == 3
    # drafts accepted, the first of them the stop token: the request ends with 15 tokens, its KV holds 18
    s.update_from_output(out, [VerifyResult("a", [77, 5, 6, 7], 0, 3)])
    assert s.requests.get("a") is None
    registered += out.cache_commands.registered + s.schedule().cache_commands.registered
    assert [j for _, j, _, _ in registered] == [0, 1, 2]  # block 3 would need token 16, which it dropped


def test_after_the_drafter_failed_the_next_request_computes_the_prefix_again_for_it():
    """A failed drafter may have lost its MTP cache: the next request sharing a cached prefix computes it again on the
    verifier (whose hidden states reach the drafter), which sends the drafter its keys of the blocks the verifier keeps
    (a registration without a block hash); the request after that starts on the whole prefix again."""
    s = make()
    s.add_request(req("a", PREFIX + [1]))
    run_to_end(s)
    s.drafter_failed()
    s.add_request(req("b", PREFIX + [1, 2]))
    out = s.schedule()
    assert out.scheduled[0].num_cached_blocks == 0 and out.scheduled[0].num_computed_tokens == 0
    registered = [c for o in [out, *run_to_end(s)] for c in o.cache_commands.registered]
    drafter_only = [(rid, j) for rid, j, h, key in registered if not h and key]
    assert drafter_only[:3] == [("b", 0), ("b", 1), ("b", 2)]
    assert s.prefix_cache.num_blocks == s.prefix_cache.num_evictable  # no block cached twice on the verifier
    s.add_request(req("c", PREFIX + [1, 3]))
    assert s.schedule().scheduled[0].num_cached_blocks == 3
