"""The rejection sampler's warm-up: it makes `default_launch` pick every launch shape it can pick for greedy,
one-hot and sparse batches (so a serving GPU compiles them all at start-up), and its calls run."""

import dataclasses

import pytest
import torch

from specsplit.kernels.triton_rejection import (
    WARM_UP_MAX_DRAFTS,
    block_cols,
    warm_up,
    warm_up_draft_counts,
    warm_up_plan,
)
from specsplit.kernels.triton_rejection_launch import LARGE_BATCH_TABLE, LAUNCH_TABLE, default_launch


@pytest.mark.parametrize("vocab_size", [32000, 151936])
def test_the_plan_reaches_every_launch_shape_of_each_mode(vocab_size):
    plan = warm_up_plan(vocab_size)
    for mode in ("greedy", "one_hot", "sparse"):
        picked = {default_launch(n, 4 * n, vocab_size, m).fit(vocab_size) for m, n in plan if m == mode}
        assert len(picked) == sum(m == mode for m, _ in plan), "one call per launch shape"
        for num_reqs in (*range(1, 300), 511, 512, 513, 4096, 100_000):
            assert default_launch(num_reqs, 4 * num_reqs, vocab_size, mode).fit(vocab_size) in picked, (mode, num_reqs)
        rows = LAUNCH_TABLE["greedy" if mode == "greedy" else "random"] + LARGE_BATCH_TABLE.get(mode, ())
        table = {dataclasses.replace(launch, race_in_stats=False).fit(vocab_size) for _, launch in rows}
        assert {dataclasses.replace(launch, race_in_stats=False) for launch in picked} == table
        # One-hot and small sparse batches race in the stats kernel: their own compiled variants.
        assert any(launch.race_in_stats for launch in picked) == (mode != "greedy")


def test_every_draft_count_up_to_the_maximum_has_its_column_width_warmed_up():
    """The kernels compile a variant per BLOCK_COLS (drafts + 1, to a power of two): a warm-up for 3 drafts left the
    first batch verifying 5 to compile mid-run (~250 ms on the H200)."""
    counts = warm_up_draft_counts()
    assert counts == [3, 7] and WARM_UP_MAX_DRAFTS == 7
    warmed = {block_cols(n) for n in counts}
    assert all(block_cols(n) in warmed for n in range(1, WARM_UP_MAX_DRAFTS + 1))
    assert block_cols(WARM_UP_MAX_DRAFTS + 1) not in warmed  # (the next width is the first one not covered)
    assert warm_up_draft_counts(12) == [3, 7, 12]


def calls(plan: list[tuple[str, int]]) -> int:
    """The warm-up's calls for a plan: random modes twice, with and without coupled requests."""
    return sum(1 if mode == "greedy" else 2 for mode, _ in plan)


def test_the_warm_up_calls_run():
    # Small batches on the interpreter: the same calls as on the GPU, shapes aside.
    assert warm_up(100, torch.device("cpu"), max_drafts=2, num_q_ids=4) == calls(warm_up_plan(100, 2)) >= 5
    both = calls(warm_up_plan(100, 3)) + calls(warm_up_plan(100, 5))
    assert warm_up(100, torch.device("cpu"), max_drafts=5, num_q_ids=4) == both


def test_the_warm_up_compiles_the_coupled_variants(monkeypatch):
    """A seeded request's batch launches the stats kernel's COUPLED variant: warmed up for one-hot and sparse q."""
    import specsplit.kernels.triton_rejection as module

    seen = []
    real = module.rejection_sample_triton

    def spy(*args, **kwargs):
        seen.append((kwargs["all_greedy"], kwargs.get("draft_probs") is not None, kwargs.get("coupled") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "rejection_sample_triton", spy)
    warm_up(100, torch.device("cpu"), max_drafts=1, num_q_ids=4)
    assert {(False, False, True), (False, True, True)} <= set(seen)  # one-hot and sparse q, coupled
    assert not any(greedy and coupled for greedy, _, coupled in seen)
