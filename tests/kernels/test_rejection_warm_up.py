"""The rejection sampler's warm-up: it makes `default_launch` pick every launch shape it can pick for greedy,
one-hot and sparse batches (so a serving GPU compiles them all at start-up), and its calls run."""

import dataclasses

import pytest
import torch

from specsplit.kernels.triton_rejection import warm_up, warm_up_plan
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


def test_the_warm_up_calls_run():
    # Small batches on the interpreter: the same calls as on the GPU, shapes aside.
    assert warm_up(100, torch.device("cpu"), num_drafts=2, num_q_ids=4) == len(warm_up_plan(100, 2)) >= 3
