"""Losslessness: the sampled tokens follow the target's (filtered) distribution.

Each test verifies many independent copies of one request (different seeds) and compares token
counts with the target distribution by a chi-square test. Seeds are fixed, so every test is
deterministic; the threshold 1e-4 is the false-failure rate a fresh seed choice would have. The
acceptance rate is checked too (an always-reject sampler is lossless but useless).
"""

import pytest
import torch
from scipy.stats import binomtest, chisquare

from specsplit.kernels import SparseDraftProbs, rejection_sample
from specsplit.kernels.rng import GROUP_SIZE

P_VALUE = 1e-4


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Target distribution after top-k then top-p, written independently of specsplit/kernels/filtering.py."""
    probs = (logits.double() / temperature).softmax(-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep &= logits >= logits.topk(top_k).values[-1]
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    if top_p < 1:
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        kept_ids = order[mass_before < top_p]
        keep &= logits >= logits[kept_ids].min()
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts[~support]}"
    if support.sum() == 1:
        return
    expected = probs[support] * counts.sum()
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > P_VALUE, f"counts {counts.tolist()} vs expected {(probs * counts.sum()).tolist()}"


def truncate(q: torch.Tensor, num_ids: int) -> SparseDraftProbs:
    ids = q.topk(num_ids, dim=-1).indices
    probs = q.gather(1, ids)
    return SparseDraftProbs(ids, probs / probs.sum(-1, keepdim=True))


def verify_copies(
    target_logits: torch.Tensor,  # [k + 1, V]: one request's rows
    drafts: torch.Tensor,  # [n, k]
    draft_probs,  # None, [k, V] dense q or SparseDraftProbs [k, K]; the same for every copy
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    backend: str = "reference",
    coupled: bool = False,  # every copy verified by coupled sampling
):
    n, k = drafts.shape
    if isinstance(draft_probs, SparseDraftProbs):
        draft_probs = SparseDraftProbs(draft_probs.ids.repeat(n, 1), draft_probs.probs.repeat(n, 1))
    elif draft_probs is not None:
        draft_probs = draft_probs.repeat(n, 1)
    return rejection_sample(
        target_logits.repeat(n, 1),
        drafts.flatten(),
        torch.arange(n + 1, dtype=torch.int32) * k,
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), top_p),
        torch.arange(n, dtype=torch.int64) * 7919 + 1,
        torch.randint(0, 2**20, (n,), generator=torch.Generator().manual_seed(n)),
        draft_probs=draft_probs,
        backend=backend,
        coupled=torch.ones(n, dtype=torch.bool) if coupled else None,
    )


def sample_drafts(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:  # q [k, V] -> [n, k]
    return torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(seed)).T


def problem(vocab_size: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, vocab_size, generator=gen) * 1.5
    q = (torch.randn(k, vocab_size, generator=gen) * 1.5).softmax(-1)
    return target_logits, q


@pytest.mark.parametrize("mode", ["one_hot_sampled", "one_hot_greedy", "dense", "sparse"])
def test_first_and_later_tokens_follow_target(mode):
    n, vocab_size, k = 40_000, 12, 2
    target_logits, q = problem(vocab_size, k, seed=1)
    draft_probs = {"dense": q, "sparse": truncate(q, 5)}.get(mode)
    if mode == "sparse":
        q = torch.zeros_like(q).scatter_(1, draft_probs.ids, draft_probs.probs)
    if mode == "one_hot_greedy":
        drafts = q.argmax(-1).expand(n, k)
    else:
        drafts = sample_drafts(q, n, seed=2)
    out = verify_copies(target_logits, drafts, draft_probs)

    p = target_logits.double().softmax(-1)
    assert_follows(out.sampled[:, 0], p[0])
    second = out.num_sampled >= 2
    assert_follows(out.sampled[second, 1], p[1])
    third = out.num_sampled >= 3
    assert_follows(out.sampled[third, 2], p[2])

    if mode == "one_hot_greedy":
        accept_rate = p[0, q[0].argmax()]
    elif mode == "one_hot_sampled":
        accept_rate = (p[0] * q[0]).sum()  # a one-hot draft d is kept with probability p(d)
    else:
        accept_rate = torch.minimum(p[0], q[0].double()).sum()
    assert binomtest(int(second.sum()), n, float(accept_rate)).pvalue > P_VALUE


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 3, 1.0), (1.3, 0, 0.6), (1.0, 5, 0.75), (0.4, 0, 0.95)]
)
@pytest.mark.parametrize("k", [0, 1])
def test_top_k_top_p_sampling_follows_filtered_target(temperature, top_k, top_p, k):
    n, vocab_size = 30_000, 10
    target_logits, q = problem(vocab_size, k, seed=3)
    drafts = sample_drafts(q, n, seed=4) if k else torch.zeros(n, 0, dtype=torch.int64)
    out = verify_copies(target_logits, drafts, q if k else None, temperature, top_k, top_p)
    for row in range(k + 1):
        reached = out.num_sampled > row
        assert_follows(out.sampled[reached, row], filtered_probs(target_logits[row], temperature, top_k, top_p))


def test_kernel_follows_target():
    """A small-sample check of the kernels themselves (they equal the reference exactly elsewhere)."""
    n, vocab_size, k = 200, 4, 1  # the interpreter takes ~20 ms per row: few copies
    target_logits, q = problem(vocab_size, k, seed=5)
    out = verify_copies(target_logits, sample_drafts(q, n, seed=6), q, backend="triton")
    p = target_logits.double().softmax(-1)
    assert_follows(out.sampled[:, 0], p[0])
    assert_follows(out.sampled[out.num_sampled == 2, 1], p[1])


@pytest.mark.parametrize("mode", ["one_hot_sampled", "dense", "sparse"])
def test_tokens_follow_target_across_race_groups(mode):
    """The recovered / bonus token's race runs over groups of GROUP_SIZE ids, then within one: mass spread
    over three groups (the last one partial), the rest filtered out by top-k."""
    n, k = 6000, 1
    vocab_size = 2 * GROUP_SIZE + 50
    support = torch.tensor([3, 700, GROUP_SIZE - 1, GROUP_SIZE, GROUP_SIZE + 5, 2 * GROUP_SIZE - 2, 2 * GROUP_SIZE])
    support = torch.cat([support, torch.tensor([vocab_size - 1])])
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.full((k + 1, vocab_size), -20.0)
    target_logits[:, support] = torch.randn(k + 1, support.numel(), generator=gen) * 1.5
    q = torch.zeros(k, vocab_size)
    q[:, support] = (torch.randn(k, support.numel(), generator=gen) * 1.5).softmax(-1)
    draft_probs = {"dense": q, "sparse": truncate(q, 5)}.get(mode)
    if mode == "sparse":
        q = torch.zeros_like(q).scatter_(1, draft_probs.ids, draft_probs.probs)
    out = verify_copies(target_logits, sample_drafts(q, n, seed=8), draft_probs, top_k=support.numel())
    assert_follows(out.sampled[:, 0], filtered_probs(target_logits[0], 1.0, support.numel()))
    assert_follows(out.sampled[out.num_sampled == 2, 1], filtered_probs(target_logits[1], 1.0, support.numel()))
    assert 300 < int((out.num_sampled == 2).sum()) < n - 300  # both rows raced many times
