"""Forced acceptance: drafts are the oracle's tokens with probability alpha per position, the same
in every process, and a request is recognised from the tokens the drafter sees."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from benchmarks.lib.forced_acceptance import (
    KEY_LEN,
    ForcedAcceptanceRunner,
    Oracle,
    index_of_request,
    prompt_request_id,
)
from specsplit.drafter.runner import ProposeItem
from specsplit.transport.base import DeviceTokens

VOCAB = 1000


class FakeRunner:
    """Stands in for DrafterRunner: always drafts token 0 (the 'MTP' output)."""

    def __init__(self):
        self.freed: list[str] = []
        self.kv_cache = "cache"

    def propose(self, items, hidden_states):
        return SimpleNamespace(drafts=[[0] * item.num_spec_tokens for item in items])

    def free(self, request_ids):
        self.freed.extend(request_ids)


def _oracle(n: int, length: int = 300) -> Oracle:
    rng = random.Random(0)
    return Oracle([[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)], VOCAB)


def _decode(runner, seq: list[int], prompt_len: int, k: int, rid: str) -> list[int]:
    """Greedy speculative decoding of `seq` (the target's own continuation): prefill, then each
    iteration verifies the drafts, accepts the matching prefix and proposes again. Returns, per
    iteration, the number of drafts accepted."""
    accepted_counts = []
    out = runner.propose([ProposeItem(rid, 0, seq[1 : prompt_len + 1], k)], None).drafts[0]
    n = prompt_len + 1  # tokens known (positions 0..n-1)
    while n + k + 1 < len(seq):
        accepted = next((i for i, d in enumerate(out) if d != seq[n + i]), k)
        accepted_counts.append(accepted)
        start = n - 1  # position of the last verified token's hidden state
        n += accepted + 1
        out = runner.propose([ProposeItem(rid, start, seq[start + 1 : n], k)], None).drafts[0]
    return accepted_counts


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_each_reached_position_is_accepted_with_probability_alpha(alpha):
    oracle, k = _oracle(40), 3
    runner = ForcedAcceptanceRunner(FakeRunner(), oracle, alpha, seed=1)
    reached, accepted = [0] * k, [0] * k
    for i, seq in enumerate(oracle.sequences):
        for n in _decode(runner, seq, 64, k, f"r{i}"):
            for pos in range(min(n + 1, k)):
                reached[pos] += 1
                accepted[pos] += pos < n
    rates = [a / r for a, r in zip(accepted, reached) if r]
    assert rates and all(abs(rate - alpha) < 0.05 for rate in rates), rates
    assert runner.num_lost == 0 and runner.num_forced > 0


def test_the_coin_is_the_same_in_another_runner_with_the_same_seed_and_differs_with_another_seed():
    oracle = _oracle(5)
    runs = [
        _decode(ForcedAcceptanceRunner(FakeRunner(), oracle, 0.5, seed=s), oracle.sequences[2], 64, 3, "x")
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1] != runs[2]


def test_a_positions_coin_does_not_depend_on_the_number_of_drafts_asked_for():
    """Common random numbers across modes: a position reached with k 1 and with k 3 is accepted in both or neither."""
    oracle = _oracle(6)
    kept: list[dict[int, bool]] = []
    for k in (1, 3):
        runner, outcome = ForcedAcceptanceRunner(FakeRunner(), oracle, 0.5, seed=4), {}
        for i, seq in enumerate(oracle.sequences):
            n = 17  # tokens known before the first iteration (as _decode: prompt_len + 1)
            for accepted in _decode(runner, seq, 16, k, f"r{i}"):
                for pos in range(min(accepted + 1, k)):
                    outcome[(i, n + pos)] = pos < accepted
                n += accepted + 1
        kept.append(outcome)
    both = kept[0].keys() & kept[1].keys()
    assert len(both) > 50 and all(kept[0][p] == kept[1][p] for p in both)
    assert 0.3 < sum(kept[0][p] for p in both) / len(both) < 0.7


def test_unknown_requests_keep_the_mtp_drafts_and_free_passes_through():
    runner = ForcedAcceptanceRunner(FakeRunner(), _oracle(3), 1.0)
    stranger = list(range(500, 500 + KEY_LEN + 5))
    assert runner.propose([ProposeItem("s", 0, stranger, 3)], None).drafts == [[0, 0, 0]]
    runner.free(["s"])
    assert runner.freed == ["s"] and runner.kv_cache == "cache"  # other attributes reach the runner


def test_a_request_first_proposed_for_after_its_prompt_is_matched_by_its_id_where_the_id_names_it():
    """Adaptive speculation can give a request no drafts in the iteration that ends its prefill: the drafter then
    first sees it further on, without its prompt's tokens. Named by `prompt_request_id`, its drafts still meet their
    coins; by its tokens alone (any other id) it cannot be matched and its drafts stay the MTP's own."""
    oracle = _oracle(3)
    seq, start = oracle.sequences[2], 80  # first seen at position 80: positions 1..KEY_LEN never observed
    named = prompt_request_id(2, "w7")
    assert index_of_request(named) == 2
    assert [index_of_request(r) for r in ("3f2a9c", "w-p", "w-p2-0", "x")] == [None] * 4
    for rid, want in ((named, seq[start + 2 : start + 5]), ("3f2a9c", [0, 0, 0])):
        runner = ForcedAcceptanceRunner(FakeRunner(), oracle, 1.0)
        assert runner.propose([ProposeItem(rid, start, seq[start + 1 : start + 2], 3)], None).drafts == [want]
        assert runner.num_lost == 0
    beyond = ForcedAcceptanceRunner(FakeRunner(), oracle, 1.0)  # an id naming no sequence: matched by tokens
    item = ProposeItem(prompt_request_id(9, "w"), start, seq[start + 1 : start + 2], 3)
    assert beyond.propose([item], None).drafts == [[0, 0, 0]]


def test_prompts_that_share_their_first_tokens_are_refused():
    with pytest.raises(ValueError, match="not unique"):
        Oracle([[1] * 40, [1] * 40], VOCAB)


class FakeDeviceRunner(FakeRunner):
    """FakeRunner that takes device hand-offs: the items' tokens come from the device tokens, as
    `DrafterRunner.propose` fills them."""

    def propose(self, items, hidden_states, device_tokens=None):
        if device_tokens is not None:
            rows, counts = device_tokens.tokens.tolist(), device_tokens.num_sampled.tolist()
            for item, row, n in zip(items, rows, counts):
                item.next_token_ids = row[:n]
        return super().propose(items, hidden_states)


def _decode_on_device(runner, seq: list[int], prompt_len: int, k: int, rid: str) -> list[int]:
    """`_decode`, each iteration after the prompt as a device hand-off: every row of the request, the
    sampled tokens padded with -1."""
    accepted_counts = []
    out = runner.propose([ProposeItem(rid, 0, seq[1 : prompt_len + 1], k)], None).drafts[0]
    n = prompt_len + 1
    while n + k + 1 < len(seq):
        accepted = next((i for i, d in enumerate(out) if d != seq[n + i]), k)
        accepted_counts.append(accepted)
        start = n - 1
        n += accepted + 1
        tokens = seq[start + 1 : n] + [-1] * (k - accepted)
        dev = DeviceTokens(torch.tensor([tokens]), torch.tensor([accepted + 1]))
        out = runner.propose([ProposeItem(rid, start, [], k, num_rows=k + 1)], None, dev).drafts[0]
    return accepted_counts


def test_device_hand_offs_force_the_same_drafts_as_the_host_path():
    oracle, k = _oracle(6), 3
    host = ForcedAcceptanceRunner(FakeRunner(), oracle, 0.8, seed=3)
    device = ForcedAcceptanceRunner(FakeDeviceRunner(), oracle, 0.8, seed=3)
    for i, seq in enumerate(oracle.sequences):
        want = _decode(host, seq, 64, k, f"r{i}")
        assert _decode_on_device(device, seq, 64, k, f"r{i}") == want and sum(want) > 0
    assert device.num_lost == 0 and device.num_kept == host.num_kept > 0


def test_a_request_started_on_cached_blocks_is_matched_by_the_tokens_it_shows():
    """Prefix caching: a request started on cached blocks shows the drafter only what follows them; where one sequence
    has those tokens there, its drafts meet their coins (an unnamed id, as `LLM.generate`'s)."""
    oracle = _oracle(3)
    seq, start = oracle.sequences[1], 32
    item = ProposeItem("llm-7", start, seq[start + 1 : start + 4], 3, cached_block_hashes=[b"k1", b"k2"])
    runner = ForcedAcceptanceRunner(FakeRunner(), oracle, 1.0)
    assert runner.propose([item], None).drafts == [seq[start + 4 : start + 7]]
    assert runner.num_lost == 0
