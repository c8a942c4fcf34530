"""Draft picking: the exponential race hashes only the top-K ids, with the bits of the full-vocabulary clocks."""

import torch

from specsplit.drafter.sampling import DRAFT_SALT, pick_drafts, race_clocks
from specsplit.kernels.rng import row_key, vocab_clocks


def test_race_clocks_equal_the_full_vocabulary_clocks_at_those_ids():
    g = torch.Generator().manual_seed(0)
    key = row_key(torch.randint(0, 2**62, (7,), generator=g), torch.randint(0, 5000, (7,), generator=g))
    ids = torch.randint(0, 1001, (7, 16), generator=g)
    assert torch.equal(race_clocks(key, ids), vocab_clocks(key, 1001).gather(1, ids))


def test_pick_drafts_with_a_host_flag_equals_reading_it_from_the_temperatures():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=g)
    temps, seeds, positions = torch.tensor([0.0, 0.7, 1.3, 0.0]), torch.arange(4) ^ DRAFT_SALT, torch.arange(4) + 9
    flagged = pick_drafts(logits, temps, seeds, positions, 8, any_sampled=True)
    read = pick_drafts(logits, temps, seeds, positions, 8)
    assert torch.equal(flagged.tokens, read.tokens) and torch.equal(flagged.q_probs, read.q_probs)
    assert flagged.tokens[0] == logits[0].argmax() and flagged.tokens[3] == logits[3].argmax()
