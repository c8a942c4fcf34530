"""benchmarks/step.py on the CPU, each phase run as the command a user runs (the qwen2-tiny shape, --tiny): a row per
batch size or prompt and path with its step timed, a verify step on two tensor-parallel ranks with the time inside
their collectives, and the drafter's propose giving every request its k drafts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["--device", "cpu", "--tiny", "--dtype", "float32", "--steps", "2", "--warmup", "1"]


def run_step(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step.py"), *SMOKE, *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(out.read_text())["rows"]


def test_decode_times_each_path_at_each_batch_size(tmp_path):
    _, rows = run_step(
        tmp_path, "--phase", "decode", "--batch-sizes", "1,4", "--context", "32", "--paths", "eager,eager_loop"
    )
    assert [(r["batch"], r["path"]) for r in rows] == [(1, "eager"), (1, "eager_loop"), (4, "eager"), (4, "eager_loop")]
    for r in rows:
        assert (r["phase"], r["model"], r["device"], r["tp"], r["context"]) == ("decode", "qwen2-tiny", "cpu", 1, 32)
        assert r["tokens"] == r["batch"]  # one new token per request (k 0)
        assert r["cold_ms"] > 0 and r["step_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["weight_gb"] > 0 and r["roofline_pct"] > 0
        # The KV the step reads: each request's context and new token, K and V of every layer (qwen2-tiny: 2 layers,
        # 2 KV heads of 32, float32).
        assert r["kv_gb"] == pytest.approx(r["batch"] * (32 + 1) * 2 * 2 * 2 * 32 * 4 / 1e9)
        assert r["gpu_ms"] is None and r["gpu_ops_per_step"] is None  # CUDA only
        assert r["collective_ms"] is None  # one rank


def test_decode_verify_step_on_two_ranks_times_their_collectives(tmp_path):
    _, rows = run_step(
        tmp_path, "--phase", "decode", "--tp", "1,2", "--batch-sizes", "2", "--k", "2", "--context", "16",
        "--paths", "eager",
    )  # fmt: skip
    assert [(r["tp"], r["rank"]) for r in rows] == [(1, 0), (2, 0), (2, 1)]
    assert all(r["tokens"] == 2 * 3 and r["path"] == "eager" and r["step_ms"] > 0 for r in rows)
    single, *ranks = rows
    assert single["collective_ms"] is None
    for r in ranks:
        assert r["collective_ms"] > 0
        assert 0 < r["collective_share"] <= 1  # inside the step: each step's collectives take part of it
        assert r["weight_gb"] == pytest.approx(single["weight_gb"] / 2)  # each rank reads its half of the weights


def test_prefill_times_each_prompt_and_skips_graphs_over_the_largest_bucket(tmp_path):
    proc, rows = run_step(
        tmp_path, "--phase", "prefill", "--prompts", "8,24", "--context", "16", "--paths", "eager,graphs",
        "--max-graph-tokens", "16", "--profile",
    )  # fmt: skip
    assert [(r["tokens"], r["path"]) for r in rows] == [(8, "eager"), (8, "graphs"), (24, "eager")]
    assert all(r["batch"] == 1 and r["context"] == 16 and r["cold_ms"] > 0 and r["step_ms"] > 0 for r in rows)
    assert "24 tokens, no graph (up to 16)" in proc.stderr
    assert proc.stderr.count("top ops of one step by host (self CPU) time") == len(rows)


def test_propose_gives_every_request_k_drafts(tmp_path):
    _, rows = run_step(tmp_path, "--phase", "propose", "--batch-sizes", "1,2", "--k", "2", "--context", "8")
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["drafts"] == 2 * r["batch"]
        assert r["new_tokens"] == 3 and r["tokens"] == 3 * r["batch"]
        assert r["cold_ms"] > 0 and r["step_ms"] > 0 and r["weight_gb"] > 0


def test_propose_refuses_tensor_parallelism():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step.py"), "--phase", "propose", "--tp", "2", *SMOKE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--tp" in proc.stderr.splitlines()[-1]
