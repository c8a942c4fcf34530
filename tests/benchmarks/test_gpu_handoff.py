"""benchmarks/gpu_handoff.py's turn-taking (its GPU rows need CUDA; the signal rows run anywhere):
two players alternate exactly `turns` times each, as threads and as spawned processes."""

import pytest

from benchmarks.gpu_handoff import one_trial


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_players_take_turns_and_finish(mode):
    us = one_trial(mode, turns=50, matmuls=0, host_us=20.0)
    assert 20.0 <= us < 1e6  # every turn did its host work; nobody waited for a turn that never came
