"""Coupled verification (seeded requests): a draft is accepted iff it is the target's own sample at its row, so the
output is target-only sampling with the request's (seed, position), whatever the drafts; the kernel equals the
reference; the tokens follow the target."""

import pytest
import torch
from scipy.stats import binomtest

from specsplit.kernels import rejection_sample
from specsplit.kernels.rng import GROUP_SIZE
from specsplit.kernels.triton_rejection import rejection_sample_triton
from specsplit.kernels.triton_rejection_launch import Launch
from tests.kernels.test_rejection_stats import P_VALUE, assert_follows, filtered_probs, problem, verify_copies

BACKENDS = ["reference", "triton"]
MODES = ["one_hot", "dense", "sparse"]


def coupled_mask(num_reqs: int) -> torch.Tensor:
    """Most requests coupled, every fourth one not (rejection sampling beside them in one batch)."""
    return torch.tensor([r % 4 != 3 for r in range(num_reqs)])


def sample(batch, mode, backend, coupled, drafts=None, launch=None):
    args = (
        batch.logits, batch.drafts if drafts is None else drafts, batch.cu_num_draft, batch.temperature, batch.top_k,
        batch.top_p, batch.seeds, batch.positions,
    )  # fmt: skip
    if launch is not None:
        return rejection_sample_triton(*args, batch.draft_probs(mode), launch=launch, coupled=coupled)
    return rejection_sample(*args, draft_probs=batch.draft_probs(mode), backend=backend, coupled=coupled)


def row_samples(batch, backend) -> list[list[int]]:
    """Per request, the token target-only sampling (no drafts) gives at each of its rows: one k = 0 call per row."""
    cu = batch.cu_num_draft.tolist()
    out = []
    for r in range(len(cu) - 1):
        rows = []
        for j in range(cu[r + 1] - cu[r] + 1):
            at = cu[r] + r + j
            one = rejection_sample(
                batch.logits[at : at + 1], torch.empty(0, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                batch.temperature[r : r + 1], batch.top_k[r : r + 1], batch.top_p[r : r + 1], batch.seeds[r : r + 1],
                batch.positions[r : r + 1] + j, backend=backend, coupled=torch.ones(1, dtype=torch.bool),
            )  # fmt: skip
            rows.append(int(one.sampled[0, 0]))
        out.append(rows)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_coupled_output_is_target_only_sampling_whatever_the_drafts(batch_factory, backend, mode):
    num_draft = [3, 0, 2, 3, 1, 3, 2, 3]
    batch = batch_factory(21, num_draft, 300, greedy=[r == 2 for r in range(8)], top_k=[0, 0, 0, 0, 40, 0, 0, 7])
    targets = row_samples(batch, backend)
    cu = batch.cu_num_draft.tolist()
    # Drafts that hit the target's sample on some rows and miss it on others, from one draft to all of them.
    gen = torch.Generator().manual_seed(5)
    for trial in range(3):
        hits = torch.rand(len(batch.drafts), generator=gen) < (0.5, 0.85, 1.0)[trial]
        own = torch.tensor([t for r in range(len(num_draft)) for t in targets[r][: num_draft[r]]])
        drafts = torch.where(hits, own, (own + 1) % 300)
        out = sample(batch, mode, backend, torch.ones(len(num_draft), dtype=torch.bool), drafts)
        for r in range(len(num_draft)):
            mine = drafts[cu[r] : cu[r + 1]].tolist()
            accepted = next((j for j, (d, t) in enumerate(zip(mine, targets[r])) if d != t), len(mine))
            n = accepted + 1
            assert out.num_sampled[r] == n and out.num_rejected[r] == len(mine) - accepted, (trial, r)
            assert out.sampled[r, :n].tolist() == targets[r][:n], (trial, r)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_draft", [[3, 1, 0, 2, 3, 3], [0, 0, 0], [1]])
def test_kernel_equals_reference_with_coupled_requests(batch_factory, same_output, mode, num_draft):
    batch = batch_factory(31 + len(num_draft), num_draft, 257)
    coupled = coupled_mask(len(num_draft))
    same_output(sample(batch, mode, "triton", coupled), sample(batch, mode, "reference", coupled))


@pytest.mark.parametrize("mode", MODES)
def test_kernel_equals_reference_with_coupled_requests_top_k_top_p(batch_factory, same_output, mode):
    num_draft = [2, 3, 0, 3, 1]
    batch = batch_factory(41, num_draft, 300, top_k=[0, 5, 0, 30, 2], top_p=[0.9, 1.0, 0.5, 0.8, 1.0])
    coupled = coupled_mask(len(num_draft))
    same_output(sample(batch, mode, "triton", coupled), sample(batch, mode, "reference", coupled))


@pytest.mark.parametrize(("chunk", "race_in_stats"), [(64, False), (64, True), (2048, True)])
def test_kernel_equals_reference_when_coupled_rows_span_groups_and_programs(batch_factory, same_output, chunk,
                                                                             race_in_stats):  # fmt: skip
    """Rows of three race groups (the last partial), each cut into many programs: the coupled race reads the
    group masses the other programs published."""
    num_draft = [3, 2, 0, 3]
    batch = batch_factory(51, num_draft, 2 * GROUP_SIZE + 77, greedy=[False] * 4)
    coupled = coupled_mask(len(num_draft))
    for mode in ("one_hot", "sparse"):
        launch = Launch(chunk, min(chunk, 1024), 4, chunk, min(chunk, 1024), 4, race_in_stats)
        same_output(sample(batch, mode, "triton", coupled, launch=launch), sample(batch, mode, "reference", coupled))


def test_uncoupled_requests_keep_rejection_sampling(batch_factory, same_output):
    """A batch's uncoupled requests give the tokens they give without any coupled request beside them."""
    num_draft = [3, 2, 3, 1]
    batch = batch_factory(61, num_draft, 200, greedy=[False] * 4)
    coupled = torch.tensor([True, False, True, False])
    for backend in BACKENDS:
        mixed = sample(batch, "sparse", backend, coupled)
        plain = sample(batch, "sparse", backend, None)
        for r in (1, 3):
            assert torch.equal(mixed.sampled[r], plain.sampled[r])
        assert not torch.equal(mixed.sampled, plain.sampled)  # the coupled ones did change


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.7)])
def test_coupled_tokens_follow_the_target(temperature, top_k, top_p):
    """Chi-square over many seeds: every emitted token follows the target's processed distribution at its row,
    with drafts drawn from a different q by independent noise."""
    n, vocab_size, k = 30_000, 12, 2
    target_logits, q = problem(vocab_size, k, seed=8)
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(9)).T
    out = verify_copies(target_logits, drafts, None, temperature, top_k, top_p, coupled=True)
    for row in range(k + 1):
        reached = out.num_sampled > row
        assert_follows(out.sampled[reached, row], filtered_probs(target_logits[row], temperature, top_k, top_p))
    # A draft is kept iff it is the target's sample; drawn independently of it, that happens with sum(p q).
    p = filtered_probs(target_logits[0], temperature, top_k, top_p)
    assert binomtest(int((out.num_sampled >= 2).sum()), n, float((p * q[0].double()).sum())).pvalue > P_VALUE


def test_coupled_kernel_follows_the_target():
    """A small-sample check of the Triton kernel (it equals the reference exactly elsewhere)."""
    n, vocab_size, k = 200, 4, 1
    target_logits, q = problem(vocab_size, k, seed=10)
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(11)).T
    out = verify_copies(target_logits, drafts, None, backend="triton", coupled=True)
    p = target_logits.double().softmax(-1)
    assert_follows(out.sampled[:, 0], p[0])
    assert_follows(out.sampled[out.num_sampled == 2, 1], p[1])


def test_greedy_requests_ignore_the_coupled_flag(batch_factory, same_output):
    batch = batch_factory(71, [3, 2, 1], 100, greedy=[True] * 3)
    for backend in BACKENDS:
        same_output(
            sample(batch, "one_hot", backend, torch.ones(3, dtype=torch.bool)), sample(batch, "one_hot", backend, None)
        )


def test_sparse_q_changes_no_coupled_token(batch_factory, same_output):
    """Coupled acceptance reads neither q nor an acceptance uniform: one-hot, dense and sparse q give one output."""
    batch = batch_factory(81, [3, 3, 2, 1], 150, greedy=[False] * 4)
    coupled = torch.ones(4, dtype=torch.bool)
    for backend in BACKENDS:
        outs = [sample(batch, mode, backend, coupled) for mode in MODES]
        same_output(outs[0], outs[1])
        same_output(outs[0], outs[2])
