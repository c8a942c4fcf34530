"""--slow-step-s end to end: a drafter whose first Propose stalls logs that Propose's stack while it runs
(`specsplit/runtime/slow_steps.py`), and the generation still completes and matches greedy."""

import os
import sys
from pathlib import Path

from specsplit import Client
from specsplit.cli.launcher import LocalCluster

from .helpers import greedy_ignoring_eos

ROOT = Path(__file__).resolve().parents[2]


def test_a_stalled_propose_is_logged_with_its_stack(tiny_checkpoint, tmp_path, hf_greedy):
    prompt = [3, 1, 4, 1, 5]
    cluster = LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=tmp_path,
        role_commands={"drafter": [sys.executable, "-m", "tests.e2e.slow_drafter", "1.0"]},
        drafter_args=["--slow-step-s", "0.3"],
        verifier_args=["--slow-step-s", "30"],  # the verifier waits for the drafts, its steps do not stall
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    with cluster, Client(cluster.address, timeout=120) as client:
        out = client.generate(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True)
    assert out.token_ids == greedy_ignoring_eos(hf_greedy, prompt, 16)
    drafter_log = (tmp_path / "drafter.log").read_text()
    assert "drafter: a propose has been running for" in drafter_log, drafter_log[-2000:]
    assert "over --slow-step-s 0.3" in drafter_log
    stack = drafter_log.split("its thread's stack, innermost last:")[1]
    assert "_sleeping_through_a_first_use" in stack and "_serve_propose" in stack
    assert "drafter: the slow propose finished after" in drafter_log
    assert drafter_log.count("has been running for") == 1  # later Proposes are quick
    assert "has been running for" not in (tmp_path / "verifier.log").read_text()
