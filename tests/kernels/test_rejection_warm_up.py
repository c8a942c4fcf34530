"""The rejection sampler's warm-up: it makes `default_launch` pick every launch shape of its table for
greedy, one-hot and sparse batches (so a serving GPU compiles them all at start-up), and its calls run."""

import torch

from kernels.triton_rejection import warm_up, warm_up_plan
from kernels.triton_rejection_launch import LAUNCH_TABLE, default_launch


def test_the_plan_reaches_every_launch_shape_of_each_mode():
    plan = warm_up_plan()
    for mode in ("greedy", "one_hot", "sparse"):
        table = LAUNCH_TABLE["greedy" if mode == "greedy" else "random"]
        picked = {default_launch(n, 4 * n, 151936, m) for m, n in plan if m == mode}
        assert picked == {launch for _, launch in table}, mode


def test_the_warm_up_calls_run(monkeypatch):
    # Small batches on the interpreter: the same calls as on the GPU, shapes aside.
    monkeypatch.setitem(LAUNCH_TABLE, "greedy", LAUNCH_TABLE["greedy"][:1] + ((3, LAUNCH_TABLE["greedy"][-1][1]),))
    monkeypatch.setitem(LAUNCH_TABLE, "random", LAUNCH_TABLE["random"][:1] + ((2, LAUNCH_TABLE["random"][-1][1]),))
    assert warm_up(100, torch.device("cpu"), num_drafts=2, num_q_ids=4) == len(warm_up_plan()) == 2 + 2 * 2
