"""Draft picking: the exponential race hashes only the top-K ids, with the bits of the full-vocabulary clocks; a
coupled request's draft is raced with the verifier's noise, so it is the target's own sample wherever q equals p."""

import torch
from scipy.stats import binomtest

from specsplit.drafter.sampling import DRAFT_SALT, noise_seed, pick_drafts, race_clocks
from specsplit.kernels import rejection_sample
from specsplit.kernels.rng import GROUP_SIZE, row_key, vocab_clocks


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


def coupled_target_samples(logits: torch.Tensor, temperature: float, seeds: torch.Tensor, counters: torch.Tensor):
    """The verifier's own sample at each row (k = 0, coupled): what a coupled draft should hit."""
    n = logits.shape[0]
    return rejection_sample(
        logits, torch.empty(0, dtype=torch.int64), torch.zeros(n + 1, dtype=torch.int32),
        torch.full((n,), temperature), None, None, seeds, counters, coupled=torch.ones(n, dtype=torch.bool),
    ).sampled[:, 0]  # fmt: skip


def test_a_coupled_draft_from_the_targets_own_distribution_is_the_targets_sample():
    """Same distribution, same noise: the drafter's race picks what the verifier's coupled race picks, every time
    (ids across several race groups)."""
    g = torch.Generator().manual_seed(2)
    n, vocab = 400, 3 * GROUP_SIZE + 11
    logits = torch.randn(n, vocab, generator=g) * 3
    seeds, counters = torch.randint(0, 2**62, (n,), generator=g), torch.randint(0, 10**6, (n,), generator=g)
    drafts = pick_drafts(logits, torch.full((n,), 0.8), noise_seed_of(seeds, True), counters, vocab).tokens
    assert torch.equal(drafts, coupled_target_samples(logits, 0.8, seeds, counters))
    # An uncoupled request's draft comes from its own stream: it agrees only as often as two independent draws.
    own = pick_drafts(logits, torch.full((n,), 0.8), noise_seed_of(seeds, False), counters, vocab).tokens
    assert (own == drafts).float().mean() < 0.5


def noise_seed_of(seeds: torch.Tensor, coupled: bool) -> torch.Tensor:
    return torch.tensor([noise_seed(int(s), coupled) for s in seeds])


def test_coupled_drafts_agree_at_least_as_the_coupling_bound_says():
    """With q != p, the coupled draft equals the target's sample at least (1 - TV) / (1 + TV) of the time (the
    Gumbel coupling's bound), far more than independent draws (sum p q)."""
    g = torch.Generator().manual_seed(3)
    n, vocab = 4000, 50
    target = torch.randn(vocab, generator=g) * 2
    draft = target + torch.randn(vocab, generator=g) * 0.8
    seeds, counters = torch.arange(n) * 104729 + 5, torch.randint(0, 10**6, (n,), generator=g)
    picks = pick_drafts(draft.expand(n, -1), torch.ones(n), noise_seed_of(seeds, True), counters, vocab).tokens
    agree = (picks == coupled_target_samples(target.expand(n, -1).contiguous(), 1.0, seeds, counters)).double()
    p, q = target.double().softmax(-1), draft.double().softmax(-1)
    tv = 0.5 * (p - q).abs().sum()
    assert binomtest(int(agree.sum()), n, float((1 - tv) / (1 + tv)), alternative="less").pvalue > 1e-4
    assert agree.mean() > 2 * (p * q).sum()
