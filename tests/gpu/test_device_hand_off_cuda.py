"""On a CUDA GPU, the services as `specsplit up` starts them (verifier and drafter on a bare `cuda`, co-located:
cuda_ipc) take the device hand-off (each greedy decode step's Propose sent as soon as the step is queued, the
drafter's GPU waiting for the verifier's on an IPC event), and their greedy output equals the target alone.

The hand-off used to stay off for a drafter on a bare `cuda`: it compared GPU indices, and a bare `cuda` has none.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
import torch

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.engine.llm import LLM
from specsplit.rpc.process import free_port

pytestmark = pytest.mark.gpu
DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
PROMPTS = [list(range(5, 40)), list(range(100, 160, 2)), [7, 8, 9, 10] * 8]


def test_colocated_services_on_bare_cuda_take_the_device_hand_off_and_stay_lossless(tmp_path):
    llm = LLM(str(DEMO), num_speculative_tokens=0, device="cuda", dtype=torch.float32)
    expected = [r.token_ids for r in llm.generate(PROMPTS, max_tokens=40, ignore_eos=True, detokenize=False)]
    del llm
    torch.cuda.empty_cache()
    port = free_port()
    cluster = LocalCluster(
        str(DEMO), num_speculative_tokens=3, device="cuda", dtype="float32", log_dir=tmp_path,
        drafter_args=["--metrics-port", str(port)],
        coordinator_args=["--no-adaptive"],  # drafts every iteration: the hand-offs are what is counted
    )  # fmt: skip
    with cluster, Client(cluster.address, timeout=300) as client:
        got = [
            list(client.generate(prompt_token_ids=p, max_tokens=40, ignore_eos=True, temperature=0.0).token_ids)
            for p in PROMPTS
        ]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    hand_offs = re.search(r"^specsplit_drafter_device_hand_offs_total(?:\{[^}]*\})? ([0-9.e+]+)$", metrics, re.M)
    drafter_log = (tmp_path / "drafter.log").read_text()
    assert "device hand-off on" in drafter_log, [line for line in drafter_log.splitlines() if "cuda_ipc" in line]
    assert hand_offs is not None and float(hand_offs.group(1)) >= 10, metrics[-2000:]
    assert got == expected
