"""benchmarks/e2e.py end to end on CPU: the three modes, forced acceptance in a separate drafter
process, the lossless check and the per-iteration breakdown with every hop."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_the_matrix_losslessly_and_breaks_iterations_down(tmp_path):
    out = tmp_path / "e2e.json"
    args = ["--shape", "qwen2-tiny", "--load-format", "dummy", "--alpha", "0.8", "--batches", "2"]
    args += ["--ks", "2", "--new-tokens", "12", "--repeats", "2", "--num-blocks", "256", "--out", str(out)]
    args += ["--placement", "pooled"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lossless: yes" in proc.stdout
    assert "hidden states by grpc (services_pooled)" in proc.stdout
    result = json.loads(out.read_text())
    assert result["lossless_failures"] == [] and result["hidden_transports"] == {"services_pooled": "grpc"}
    rows = {r["mode"]: r for r in result["rows"]}
    assert [(r["batch"], r["k"], r["mode"]) for r in result["rows"]] == [
        (2, 0, "target_only"),
        (2, 2, "in_process"),
        (2, 2, "services_pooled"),
    ]
    services, in_process = rows["services_pooled"], rows["in_process"]
    for key in ("hop_c2v", "hop_v2d", "hop_d2v", "hop_v2c", "forward", "step0", "later_steps"):
        assert services["breakdown_ms"][key] > 0, key
    assert in_process["breakdown_ms"]["hop_v2d"] == 0 and in_process["breakdown_ms"]["step0"] > 0
    # Forced acceptance makes speculation pay: fewer iterations than tokens, in both modes.
    assert services["iterations"] < 12 and in_process["iterations"] < 12
    assert len(services["acceptance_per_position"]) == 2 and services["overhead"] is not None
    # The repeats went round the cells: each cell has its own, and the services' overhead is paired
    # repeat by repeat with the in-process run beside it.
    for row in rows.values():
        assert len(row["tokens_per_s_runs"]) == len(row["iteration_ms_runs"]) == 2
    paired = zip(services["iteration_ms_runs"], in_process["iteration_ms_runs"])
    assert services["iteration_overhead_runs"] == pytest.approx([mine / theirs - 1 for mine, theirs in paired])
    assert in_process["iteration_overhead_runs"] == []
    assert "- batch 2 k 2 services_pooled: " in proc.stdout
    # The first iteration is the prompts' prefill; one run's iterations cover its wall time but for gaps.
    for row in rows.values():
        assert row["first_iteration_ms"] > 0
        assert 0 <= row["outside_iterations_ms"] < 1e3 * row["seconds"]
        # The slowest later iteration: whole in the JSON, and no faster than the runs' median of theirs.
        assert row["slowest_iteration"]["iteration"] >= row["slowest_iteration_ms"] > 0
