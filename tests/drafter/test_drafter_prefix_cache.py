"""The drafter's prefix cache: full blocks of MTP KV registered under the verifier's drafter keys (`cache_blocks`), and
a request the verifier started on cached blocks starting on them (`ProposeItem.cached_block_hashes`): it drafts exactly
as a request that computed the whole prefix; a miss starts afresh (drafts still made). Through the servicer (the
Propose's blocks registered before its finished requests are freed, the counters on Prometheus' registry), the
validation of the keys, and a tensor-parallel drafter whose followers register the same blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import REGISTRY, generate_latest

from specsplit.client.errors import InvalidArgument
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.drafter.servicer import DrafterServicer, parse_items, prefix_cache_counters
from specsplit.models.loader import load_mtp, load_target
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.transport.grpc_bytes import GrpcReceiver
from specsplit.transport.wire import fill_tensor_proto
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.models.tensor_parallel_ranks import run_ranks

BS = 4  # the MTP cache's block size
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
N = 12  # pair positions 0 .. 11: (h_p, TOKENS[p + 1])
KEYS = [b"block 0", b"block 1"]  # the drafter keys of pair positions 0-3 and 4-7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("d") / "m", architecture="llama", seed=5)


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_target(checkpoint), load_mtp(checkpoint)


@pytest.fixture(scope="module")
def hidden(models):
    """The target's hidden states h_0 .. h_11 of TOKENS."""
    target, _ = models
    cache = target.make_kv_cache(32, BS)
    attn = cache.prepare_step(["r"], [len(TOKENS)])
    with torch.inference_mode():
        return target(torch.tensor(TOKENS), torch.arange(len(TOKENS)), cache, attn)[:N]


def item(rid: str, start: int, end: int, keys: list[bytes] | None = None) -> ProposeItem:
    """Pair positions start .. end - 1, 3 drafts."""
    return ProposeItem(rid, start, TOKENS[start + 1 : end + 1], 3, cached_block_hashes=list(keys or []))


def fresh(mtp) -> DrafterRunner:
    return DrafterRunner(mtp, mtp.make_kv_cache(32, BS))


def step0_outputs(runner: DrafterRunner, items, hidden_states) -> tuple[list[list[int]], torch.Tensor]:
    """The drafts, and the MTP outputs of step 0 (one row per pair)."""
    outputs = []
    hook = runner.mtp.register_forward_hook(lambda module, args, out: outputs.append(out.clone()))
    try:
        drafts = runner.propose(items, hidden_states).drafts
    finally:
        hook.remove()
    return drafts, outputs[0]


def kv_entries(runner: DrafterRunner, rid: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the request's cache indices 0 .. n - 1, every layer: [layers, n, heads, head_dim]."""
    cache, table = runner.kv_cache, runner.kv_cache.block_table(rid)
    blocks = torch.tensor([table[i // BS] for i in range(n)])
    offsets = torch.tensor([i % BS for i in range(n)])
    return cache.k[:, blocks, offsets], cache.v[:, blocks, offsets]


def prefilled(mtp, hidden) -> tuple[DrafterRunner, list[int]]:
    """A runner whose request "a" proposed over pair positions 0 .. 9, its blocks 0 and 1 registered, then freed
    (finished); and a's block table then."""
    runner = fresh(mtp)
    runner.propose([item("a", 0, 10)], hidden[:10])
    runner.cache_blocks([("a", 0, KEYS[0]), ("a", 1, KEYS[1])])
    assert runner.kv_cache.num_cached_blocks == 2
    table = runner.kv_cache.block_table("a")
    runner.free(["a"])
    return runner, table


def test_a_request_started_on_cached_blocks_drafts_as_one_that_computed_them(models, hidden):
    _, mtp = models
    runner, a_table = prefilled(mtp, hidden)
    got, got_out = step0_outputs(runner, [item("b", 8, N, KEYS)], hidden[8:N])
    c = fresh(mtp)
    want, want_out = step0_outputs(c, [item("c", 0, N)], hidden[:N])

    assert got == want and len(got[0]) == 3
    torch.testing.assert_close(got_out, want_out[8:])  # MTP outputs of pair positions 8 .. 11
    # b's first blocks are a's, holding the MTP KV c computes for pair positions 0 .. 7; its own entries follow.
    assert runner.kv_cache.block_table("b")[:2] == a_table[:2]
    assert runner.kv_cache.num_tokens("b") == N + 2  # 12 pairs and the speculative entries of drafts 2 and 3
    for got_kv, want_kv in zip(kv_entries(runner, "b", N), kv_entries(c, "c", N)):
        torch.testing.assert_close(got_kv, want_kv)
    assert (runner.prefix_cache_queries, runner.prefix_cache_hits) == (8, 8)


def test_a_key_not_cached_starts_the_request_afresh(models, hidden):
    _, mtp = models
    runner, a_table = prefilled(mtp, hidden)
    got = runner.propose([item("b", 8, N, [KEYS[0], b"not cached"])], hidden[8:N]).drafts
    afresh = fresh(mtp).propose([item("b", 8, N)], hidden[8:N]).drafts  # today's start without history
    assert got == afresh and len(got[0]) == 3
    assert runner.kv_cache.num_tokens("b") == 4 + 2  # its own pairs 8 .. 11 only
    assert not set(runner.kv_cache.block_table("b")) & set(a_table[:2])
    assert (runner.prefix_cache_queries, runner.prefix_cache_hits) == (8, 0)
    assert runner.kv_cache.num_cached_blocks == 2  # the miss changed nothing cached


def test_only_exact_blocks_of_requests_held_from_position_0_are_registered(models, hidden):
    _, mtp = models
    runner = fresh(mtp)
    runner.propose([item("late", 2, 10), item("a", 0, 6)], torch.cat([hidden[2:10], hidden[:6]]))
    assert runner.kv_cache.num_tokens("late") >= 2 * BS  # two full blocks, of pair positions 2 .. 9
    assert runner.kv_cache.num_tokens("a") == 2 * BS  # pairs 0 .. 5 and the speculative entries of drafts 2 and 3
    runner.cache_blocks([("late", 0, b"x"), ("late", 1, b"y"), ("a", 1, b"z"), ("unknown", 0, b"w")])
    # late starts at 2; a's block 1 is full only with speculative entries; unknown is not held.
    assert runner.kv_cache.num_cached_blocks == 0
    runner.cache_blocks([("a", 0, b"z")])
    assert runner.kv_cache.num_cached_blocks == 1 and runner.kv_cache.cached_prefix([b"z"]) == 1
    # A Propose lost (pairs 6 .. 7 never came): the next one's rollback keeps the speculative entries of 6 .. 7,
    # which are not the block's.
    runner.propose([item("a", 8, 10)], hidden[8:10])
    runner.cache_blocks([("a", 1, b"y")])
    assert runner.kv_cache.num_cached_blocks == 1
    # Once they come, exact, the block is registered.
    runner.propose([item("a", 6, 10)], hidden[6:10])
    runner.cache_blocks([("a", 1, b"y")])
    assert runner.kv_cache.num_cached_blocks == 2


def test_an_item_with_history_keeps_it_and_counts_no_query(models, hidden):
    _, mtp = models
    runner, _ = prefilled(mtp, hidden)
    runner.propose([item("b", 0, 8)], hidden[:8])
    table = runner.kv_cache.block_table("b")
    runner.propose([item("b", 8, N, KEYS)], hidden[8:N])  # b holds pairs 0 .. 7 already: rolls back, no attach
    assert runner.kv_cache.block_table("b")[:2] == table[:2]
    assert (runner.prefix_cache_queries, runner.prefix_cache_hits) == (0, 0)


def _proto_item(**kw) -> drafter_pb2.ProposeItem:
    base = dict(request_id="a", start_position=8, next_token_ids=[1, 2], num_spec_tokens=3)
    return drafter_pb2.ProposeItem(**{**base, **kw})


def test_parse_items_carries_the_keys_and_refuses_keys_that_do_not_cover_start_position():
    (parsed,) = parse_items(drafter_pb2.ProposeRequest(requests=[_proto_item(cached_block_hashes=KEYS)]), 100, BS)
    assert parsed.cached_block_hashes == KEYS
    device = drafter_pb2.ProposeRequest(requests=[_proto_item(next_token_ids=[], num_rows=2, cached_block_hashes=KEYS)])
    device.hidden_states_handle.tokens_on_device = True
    device.hidden_states_handle.token_width = 4
    assert parse_items(device, 100, BS)[0].cached_block_hashes == KEYS

    for keys in ([b"k"], [b"k", b"k", b"k"], [b"k", b""], [b"k", b"x" * 65]):
        msg = drafter_pb2.ProposeRequest(requests=[_proto_item(cached_block_hashes=keys)])
        with pytest.raises(InvalidArgument, match="request 'a': cached_block_hashes: "):
            parse_items(msg, 100, BS)
        device.requests[0].ClearField("cached_block_hashes")
        device.requests[0].cached_block_hashes.extend(keys)
        with pytest.raises(InvalidArgument, match="request 'a': cached_block_hashes: "):
            parse_items(device, 100, BS)


class Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, message):
        raise RuntimeError(f"{code.name}: {message}")


def _propose_request(items: list[drafter_pb2.ProposeItem], rows: torch.Tensor, **kw) -> drafter_pb2.ProposeRequest:
    msg = drafter_pb2.ProposeRequest(requests=items, **kw)
    fill_tensor_proto(msg.hidden_states, rows)
    return msg


def test_the_servicer_registers_a_finished_requests_blocks_before_freeing_it(models, hidden, monkeypatch):
    """One Propose registers a's blocks, frees a (finished) and starts b on them; the counters reach Prometheus'
    registry (what `--metrics-port` serves)."""
    _, mtp = models
    monkeypatch.setattr(prefix_cache_counters, "servicer", None)  # this test's servicer is exposed until it ends
    runner = fresh(mtp)
    servicer = DrafterServicer("cpu")
    info = common_pb2.ModelInfo(model="tiny-mtp", vocab_size=mtp.config.vocab_size, block_size=BS)
    servicer.ready(runner, info, GrpcReceiver("cpu", mtp.config.hidden_size))
    first = _propose_request([_proto_item(start_position=0, next_token_ids=TOKENS[1:11])], hidden[:10])
    second = _propose_request(
        [_proto_item(request_id="b", next_token_ids=TOKENS[9 : N + 1], cached_block_hashes=KEYS)],
        hidden[8:N],
        finished_request_ids=["a"],
        cached_blocks=[drafter_pb2.CachedBlock(request_id="a", block_index=j, block_hash=KEYS[j]) for j in (0, 1)],
    )

    async def run():
        async def incoming():
            for msg in (first, second):
                yield msg

        return [response async for response in servicer.ProposeStream(incoming(), Context())]

    responses = asyncio.run(run())
    want = fresh(mtp).propose([item("c", 0, N)], hidden[:N]).drafts[0]
    assert list(responses[1].drafts[0].token_ids) == want
    assert not runner.kv_cache.has("a") and (runner.prefix_cache_queries, runner.prefix_cache_hits) == (8, 8)
    labels = {"model_name": "tiny-mtp", "worker": "drafter"}
    assert REGISTRY.get_sample_value("vllm:prefix_cache_queries_total", labels) == 8
    assert REGISTRY.get_sample_value("vllm:prefix_cache_hits_total", labels) == 8
    text = generate_latest(REGISTRY).decode()
    assert 'vllm:prefix_cache_hits_total{model_name="tiny-mtp",worker="drafter"} 8.0' in text


def tp_drafts(path: str) -> list | None:
    """Rank 0: drafts of b (started on a's cached blocks) and c (computed from 0); a follower follows (None)."""
    from specsplit.drafter.ranks import follow
    from specsplit.models.parallel import tp_rank, tp_size
    from specsplit.runtime.tensor_parallel import end_followers

    mtp = load_mtp(path)
    runner = DrafterRunner(mtp, mtp.make_kv_cache(32, BS))
    if tp_rank() != 0:
        follow(runner)
        return None
    rows = torch.randn(N, mtp.config.hidden_size, generator=torch.Generator().manual_seed(0))
    runner.propose([item("a", 0, 10)], rows[:10])
    runner.cache_blocks([("a", 0, KEYS[0]), ("a", 1, KEYS[1])])
    runner.free(["a"])
    b = runner.propose([item("b", 8, N, KEYS)], rows[8:N]).drafts
    c = runner.propose([item("c", 0, N)], rows).drafts
    if tp_size() > 1:
        end_followers()
    return [b, c, runner.prefix_cache_hits]


def test_tensor_parallel_followers_register_the_same_blocks(checkpoint):
    """Were a follower's cache without the blocks, its b would start afresh and its share of b's MTP steps differ."""
    one = tp_drafts(str(checkpoint))
    two = run_ranks(2, tp_drafts, str(checkpoint))
    assert one[0] == one[1] and one[2] == 8
    assert two == one
