"""The sampler's launch grids fit CUDA's limits (axis 0 up to 2**31 - 1 programs, axes 1 and 2 up to 65,535)
whatever the batch size the verifier forms, and the folded (chunk, request) axis gives the reference's tokens.

The interpreter enforces no grid limit and runs a few dozen programs a second, far too slow for a batch past
65,535 requests; so those batches are launched with the kernels replaced by recorders (the grids are checked,
nothing runs), and a real run checks the folded grid on a small batch. ``tests/gpu/test_rejection_cuda.py`` runs
a batch past the limit on a real CUDA launch.
"""

import math

import pytest
import torch
import triton

from specsplit.kernels import SparseDraftProbs, triton_rejection
from specsplit.kernels.triton_rejection import rejection_sample_triton
from specsplit.kernels.triton_rejection_launch import Launch, default_launch

CUDA_MAX_GRID = (2**31 - 1, 65_535, 65_535)
PAST_THE_LIMIT = 65_600  # requests


@pytest.fixture
def launches(monkeypatch):
    """launches(run) -> {kernel name: [grid, ...]} of the sampler's launches from then on; each grid is checked
    against CUDA's limits. With ``run`` False the kernels do not run (their outputs stay unwritten)."""

    def record(run: bool) -> dict[str, list[tuple[int, ...]]]:
        grids: dict[str, list[tuple[int, ...]]] = {}
        for name in ("stats_accept_kernel", "race_kernel"):
            grids[name] = []
            monkeypatch.setattr(triton_rejection, name, _Recorder(getattr(triton_rejection, name), run, grids[name]))
        return grids

    return record


class _Recorder:
    def __init__(self, kernel, run: bool, grids: list[tuple[int, ...]]) -> None:
        self.kernel, self.run, self.grids = kernel, run, grids

    def __getitem__(self, grid: tuple[int, ...]):
        assert all(1 <= n <= limit for n, limit in zip(grid, CUDA_MAX_GRID, strict=False)), grid
        self.grids.append(tuple(grid))
        return self.kernel[grid] if self.run else lambda *args, **kwargs: None


def _batch(num_reqs: int, k: int, vocab_size: int, mode: str) -> dict:
    """Sampler inputs: ``k`` drafts per request, every third request greedy (all, for mode "greedy")."""
    gen = torch.Generator().manual_seed(num_reqs)
    num_draft = num_reqs * k
    drafts = torch.randint(0, vocab_size, (num_draft,), generator=gen)
    draft_probs = None
    if mode == "dense":
        draft_probs = torch.rand(num_draft, vocab_size, generator=gen).softmax(-1)
    elif mode == "sparse":
        ids = torch.stack([drafts, (drafts + 1) % vocab_size], dim=1)
        draft_probs = SparseDraftProbs(ids, torch.tensor([0.75, 0.25]).expand(num_draft, 2).contiguous())
    greedy = torch.ones(num_reqs, dtype=torch.bool) if mode == "greedy" else torch.arange(num_reqs) % 3 == 0
    return dict(
        target_logits=torch.randn(num_reqs * (k + 1), vocab_size, generator=gen) * 3,
        draft_token_ids=drafts,
        cu_num_draft=torch.arange(0, num_draft + 1, k, dtype=torch.int32),
        temperature=torch.where(greedy, 0.0, 0.8),
        top_k=None,
        top_p=None,
        seeds=torch.randint(0, 2**62, (num_reqs,), generator=gen),
        positions=torch.randint(0, 4096, (num_reqs,), generator=gen),
        draft_probs=draft_probs,
        max_num_draft=k,
        all_greedy=mode == "greedy",
    )


@pytest.mark.parametrize("mode", ["greedy", "one_hot", "dense", "sparse"])
@pytest.mark.parametrize("launch", ["default", "several_chunks", "race_in_stats"])
def test_batches_past_65535_requests_launch_within_cuda_grid_limits(launches, mode, launch):
    """Every (chunk, request, row) of the stats kernel and every (request, chunk) of the race kernel gets a
    program, and no grid axis exceeds CUDA's limit."""
    k, vocab_size = 2, 8
    inputs = _batch(PAST_THE_LIMIT, k, vocab_size, mode)
    shape = {
        "default": default_launch(PAST_THE_LIMIT, PAST_THE_LIMIT * (k + 1), vocab_size, mode),
        "several_chunks": Launch(2, 2, 4, 4, 4, 4),
        "race_in_stats": Launch(4, 4, 4, 4, 4, 4, race_in_stats=True),
    }[launch]
    grids = launches(run=False)
    rejection_sample_triton(**inputs, launch=shape)
    stats_chunks = triton.cdiv(vocab_size, shape.fit(vocab_size).stats_chunk)
    assert [math.prod(g) for g in grids["stats_accept_kernel"]] == [stats_chunks * PAST_THE_LIMIT * (k + 1)]
    races = grids["race_kernel"]
    if mode == "greedy" or (shape.race_in_stats and mode != "dense"):
        assert races == []
    else:
        race_chunks = triton.cdiv(vocab_size, shape.fit(vocab_size).race_chunk) if mode == "dense" else 1
        assert [math.prod(g) for g in races] == [race_chunks * PAST_THE_LIMIT]


@pytest.mark.parametrize("mode", ["one_hot", "dense", "sparse"])
def test_folded_chunk_and_request_axis_gives_the_reference_tokens(launches, batch_factory, same_output, mode):
    """Three chunks per row and per race, ragged requests (0 to 3 drafts): the stats grid's axis 0 holds
    (chunk, request) pairs and the tokens are the reference's."""
    batch = batch_factory(53, [3, 0, 2, 3, 1], 40, hit_rate=0.5)
    grids = launches(run=True)
    out = batch.sample(mode, launch=Launch(16, 16, 4, 16, 16, 4))
    same_output(out, batch.sample(mode, "reference"))
    assert grids["stats_accept_kernel"] == [(3 * 5, 4)]
    assert grids["race_kernel"] == [(5, 3 if mode == "dense" else 1)]
