"""Exact behaviour: hand-written cases, kernel == reference, seeded determinism."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specsplit.kernels import SparseDraftProbs, rejection_sample, triton_rejection
from specsplit.kernels.rng import GROUP_SIZE

BACKENDS = ["reference", "triton"]
MODES = ["one_hot", "dense", "sparse"]


def peaked_logits(argmax_per_row: list[int], vocab_size: int) -> torch.Tensor:
    """Rows of small noise with a clear maximum at the given ids."""
    gen = torch.Generator().manual_seed(len(argmax_per_row) * 1000 + vocab_size)
    logits = torch.randn(len(argmax_per_row), vocab_size, generator=gen)
    logits[torch.arange(len(argmax_per_row)), torch.tensor(argmax_per_row)] = 20.0
    return logits


def run(logits, drafts, num_draft, temperature, backend, top_k=None, top_p=None, draft_probs=None):
    num_reqs = len(num_draft)
    return rejection_sample(
        logits,
        torch.tensor(drafts, dtype=torch.int64),
        torch.tensor([0, *torch.tensor(num_draft).cumsum(0).tolist()], dtype=torch.int32),
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor(top_k or [0] * num_reqs, dtype=torch.int32),
        torch.tensor(top_p or [1.0] * num_reqs, dtype=torch.float32),
        torch.arange(num_reqs, dtype=torch.int64) + 11,
        torch.arange(num_reqs, dtype=torch.int64) * 50,
        draft_probs=draft_probs,
        backend=backend,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_hand_written_cases(backend):
    # request: drafts                -> target argmax per row   -> expected
    # 0 perfect match: [5, 7, 9]     -> [5, 7, 9, 11]           -> [5, 7, 9, 11]   (bonus 11)
    # 1 early mismatch: [5, 8, 9]    -> [5, 7, 9, 1]            -> [5, 7, -1, -1]  (recovered 7)
    # 2 no drafts (k = 0): []        -> [3]                     -> [3, -1, -1, -1]
    # 3 padded first: [-1, 7]        -> [4, 7, 2]               -> [4, -1, -1, -1]
    # 4 k = 1 mismatch at 0: [0]     -> [99, 0]                 -> [99, -1, -1, -1]
    argmax = [5, 7, 9, 11, 5, 7, 9, 1, 3, 4, 7, 2, 99, 0]
    drafts = [5, 7, 9, 5, 8, 9, -1, 7, 0]
    out = run(peaked_logits(argmax, 100), drafts, [3, 3, 0, 2, 1], [0.0] * 5, backend)
    assert out.sampled.tolist() == [
        [5, 7, 9, 11],
        [5, 7, -1, -1],
        [3, -1, -1, -1],
        [4, -1, -1, -1],
        [99, -1, -1, -1],
    ]
    assert out.num_sampled.tolist() == [4, 2, 1, 1, 1]
    assert out.num_rejected.tolist() == [0, 2, 0, 2, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_rows_with_certain_outcomes(backend):
    # A peaked row puts p = 1 on its argmax (exp(-20 - noise) underflows nothing, so use top_k = 1):
    # with top_k = 1 every random row behaves like greedy, whatever the noise.
    argmax = [5, 7, 9, 11, 5, 7, 9, 1, 3]
    drafts = [5, 7, 9, 5, 8, 9]
    out = run(peaked_logits(argmax, 100), drafts, [3, 3, 0], [0.8, 1.3, 2.0], backend, top_k=[1, 1, 1])
    assert out.sampled.tolist() == [[5, 7, 9, 11], [5, 7, -1, -1], [3, -1, -1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_q_equal_to_p_accepts_every_draft(backend):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    p = logits[:3].softmax(-1)
    drafts = [int(t) for t in p.argmin(-1)]  # even the least likely draft: p(d) / q(d) = 1
    out = run(logits, drafts, [3], [1.0], backend, draft_probs=p.contiguous())
    assert out.num_sampled.tolist() == [4]
    assert out.sampled[0, :3].tolist() == drafts


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_outside_sparse_support_or_filtered_is_rejected(backend):
    argmax = [5, 7]
    logits = peaked_logits(argmax, 100)
    sparse = SparseDraftProbs(ids=torch.tensor([[3, 4]]), probs=torch.tensor([[0.5, 0.5]]))
    out = run(logits, [5], [1], [1.0], backend, draft_probs=sparse)  # q(5) = 0
    assert out.num_sampled.tolist() == [1] and out.num_rejected.tolist() == [1]
    out = run(logits, [6], [1], [1.0], backend, top_k=[1])  # p(6) = 0 after top-k
    assert out.sampled.tolist() == [[5, -1]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "num_draft",
    [[3, 0, 2, 1, 4, 3], [1], [0], [0, 0, 0], [5, 5], [2, 0, 1, 1, 0, 3, 2, 4, 1, 2, 0, 1]],
)
def test_kernel_equals_reference(batch_factory, same_output, mode, num_draft):
    batch = batch_factory(sum(num_draft) * 31 + len(num_draft), num_draft, vocab_size=100)
    same_output(batch.sample(mode, "triton"), batch.sample(mode, "reference"))


@pytest.mark.parametrize("mode", MODES)
def test_kernel_equals_reference_with_top_k_top_p(batch_factory, same_output, mode):
    batch = batch_factory(
        7,
        [3, 1, 2, 0, 2, 3],
        vocab_size=37,
        greedy=[False] * 5 + [True],
        top_k=[0, 5, 0, 3, 10, 4],
        top_p=[0.8, 1.0, 0.5, 0.9, 1.0, 0.7],
    )
    same_output(batch.sample(mode, "triton"), batch.sample(mode, "reference"))


@pytest.mark.parametrize(("mode", "num_draft"), [("one_hot", [2, 0]), ("dense", [1]), ("sparse", [3])])
def test_kernel_equals_reference_large_odd_vocab(batch_factory, same_output, mode, num_draft):
    batch = batch_factory(5, num_draft, vocab_size=151_937, greedy=[False] * len(num_draft), hit_rate=0.9)
    same_output(batch.sample(mode, "triton"), batch.sample(mode, "reference"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("chunk", "race_in_stats"), [(16, False), (32, False), (16, True)])
def test_kernel_equals_reference_when_rows_span_many_programs(batch_factory, same_output, mode, chunk, race_in_stats):
    batch = batch_factory(11, [3, 0, 2, 1, 4], vocab_size=100, top_k=[0, 0, 7, 0, 0], hit_rate=0.8)
    same_output(batch.sample(mode, chunk=chunk, race_in_stats=race_in_stats), batch.sample(mode, "reference"))


@given(
    num_draft=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    vocab_size=st.integers(2, 70),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(MODES),
    chunk=st.sampled_from([None, 16]),
)
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_kernel_equals_reference_on_random_ragged_batches(
    batch_factory, same_output, num_draft, vocab_size, seed, mode, chunk
):
    batch = batch_factory(seed, num_draft, vocab_size, top_k=[seed % 3] * len(num_draft))
    triton_out = batch.sample(mode, "triton") if chunk is None else batch.sample(mode, chunk=chunk)
    same_output(triton_out, batch.sample(mode, "reference"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_layout(batch_factory, backend):
    batch = batch_factory(1, [3, 0, 2, 1, 4, 3, 2, 2], vocab_size=50)
    out = batch.sample("dense", backend)
    num_draft = torch.tensor(batch.num_draft)
    assert out.sampled.shape == (8, 5)
    assert torch.equal(out.num_sampled + out.num_rejected, (num_draft + 1).int())
    drafts = batch.drafts.tolist()
    cu = batch.cu_num_draft.tolist()
    for r, n in enumerate(out.num_sampled.tolist()):
        assert out.sampled[r, : n - 1].tolist() == drafts[cu[r] : cu[r] + n - 1]  # accepted drafts
        assert 0 <= out.sampled[r, n - 1] < 50
        assert (out.sampled[r, n:] == -1).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_request_output_does_not_depend_on_the_batch(batch_factory, same_output, backend, mode):
    batch = batch_factory(9, [2, 3, 0, 1, 2], vocab_size=64, greedy=[False] * 5, hit_rate=0.8)
    full = batch.sample(mode, backend)
    again = batch.sample(mode, backend)
    same_output(full, again)  # same seeds -> same output
    order = [3, 1, 4, 0]
    shuffled = batch.select(order).sample(mode, backend)
    width = shuffled.sampled.shape[1]
    for i, r in enumerate(order):
        assert shuffled.sampled[i].tolist() == full.sampled[r, :width].tolist()
        assert shuffled.num_sampled[i] == full.num_sampled[r]
    alone = batch.select([1]).sample(mode, backend)
    assert alone.sampled[0].tolist() == full.sampled[1].tolist()


def test_noise_comes_from_seed_and_position_only():
    uniform = torch.zeros(64, 1000)  # p uniform: the sample is the noise's choice
    args = [
        uniform,
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(65, dtype=torch.int32),
        torch.ones(64),
        torch.zeros(64, dtype=torch.int32),
        torch.ones(64),
    ]
    same = rejection_sample(*args, torch.full((64,), 7), torch.full((64,), 3))
    assert same.sampled.unique().numel() == 1
    by_seed = rejection_sample(*args, torch.arange(64), torch.full((64,), 3))
    by_position = rejection_sample(*args, torch.full((64,), 7), torch.arange(64))
    assert by_seed.sampled.unique().numel() > 50 and by_position.sampled.unique().numel() > 50


def test_host_hints_give_the_same_output(batch_factory, same_output):
    """What the verifier knows on the host (every request greedy, the longest draft list, no top-k /
    top-p) skips launches and syncs but must not change a token."""
    batch = batch_factory(13, [3, 0, 2, 4], vocab_size=100, greedy=[True] * 4, hit_rate=0.7)
    args = (batch.logits, batch.drafts, batch.cu_num_draft, batch.temperature)
    for backend in ("triton", "reference"):  # (the reference skips the random rows' work: the CPU path's sampler)
        hinted = rejection_sample(
            *args, None, None, batch.seeds, batch.positions, backend=backend, max_num_draft=4, all_greedy=True
        )
        same_output(hinted, batch.sample("one_hot", "reference"))


@pytest.mark.parametrize("mode", MODES)
def test_calls_of_different_shapes_in_a_row_stay_exact(batch_factory, same_output, mode):
    """Back-to-back calls of different shapes (the kernels count finished programs per request in
    scratch memory): small, larger, small again, all exact."""
    small = batch_factory(17, [2, 1], vocab_size=100, hit_rate=0.8)
    large = batch_factory(19, [3, 0, 2, 4, 1, 3, 2], vocab_size=300, hit_rate=0.8)
    for batch in (small, large, small, small):
        same_output(batch.sample(mode, chunk=32), batch.sample(mode, "reference"))


# race_in_stats: the same race in the stats kernel (one-hot and sparse q only).
@pytest.mark.parametrize(
    ("mode", "race_in_stats"),
    [("one_hot", False), ("one_hot", True), ("dense", False), ("sparse", False), ("sparse", True)],
)
def test_a_rejected_draft_takes_its_mass_out_of_its_group(monkeypatch, mode, race_in_stats):
    """The two-level race: a draft holding most of its group's mass is rejected now and then; its group's
    mass must then be the residual's, not p's (the kernels subtract min(p, q) from the statistics)."""
    launch = dataclasses.replace(triton_rejection.INTERPRETER_LAUNCH, race_in_stats=race_in_stats)
    monkeypatch.setattr(triton_rejection, "INTERPRETER_LAUNCH", launch)
    num_reqs, vocab_size, draft = 48, 2 * GROUP_SIZE + 3, 5  # ~1 in 4 rejected: 10 or more of 48
    logits = torch.randn(2 * num_reqs, vocab_size, generator=torch.Generator().manual_seed(3))
    logits[:, draft] = 9.5  # p(draft) ~ 0.66: the rest of the mass is spread over three groups
    q = torch.zeros(num_reqs, vocab_size)
    q[:, draft], q[:, GROUP_SIZE + 1] = 0.9, 0.1
    draft_probs = {"one_hot": None, "dense": q, "sparse": SparseDraftProbs(*q.topk(2, dim=-1)[::-1])}[mode]
    args = (logits, [draft] * num_reqs, [1] * num_reqs, [1.0] * num_reqs)
    reference = run(*args, "reference", draft_probs=draft_probs)
    triton_out = run(*args, "triton", draft_probs=draft_probs)
    assert torch.equal(triton_out.sampled, reference.sampled) and torch.equal(
        triton_out.num_sampled, reference.num_sampled
    )
    rejected = reference.num_sampled == 1
    assert 10 <= int(rejected.sum()) < num_reqs  # rejections happened, and their tokens left the draft's group
    assert (reference.sampled[rejected, 0] != draft).all()
    assert (reference.sampled[rejected, 0] >= GROUP_SIZE).float().mean() > 0.25  # ~0.5 (p's masses: ~0.17)
