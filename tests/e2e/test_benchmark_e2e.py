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
    # Forced acceptance makes speculation pay: fewer iterations than tokens in the one engine; per request in the
    # services (their batch's count also holds iterations where one request ran alone, its Generate late).
    assert in_process["iterations"] < 12 and services["accepted_per_iteration"] > 0.5
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


def test_services_only_takes_target_only_from_the_services_and_checks_every_output_against_it(tmp_path):
    """--services-only (the real FP8 shapes, weights held once) on DeepSeek-V3's cut tiny FP8 shape: target-only is
    the services at 0 drafts, run first; forced acceptance reads the oracle written after it; the roofline columns."""
    out = tmp_path / "e2e.json"
    args = ["--shape", "deepseek-v3-tiny-fp8", "--load-format", "dummy", "--alpha", "0.8", "--services-only"]
    args += ["--batches", "2", "--ks", "2", "--new-tokens", "10", "--warmup-tokens", "2", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lossless: yes" in proc.stdout and "% of roofline" in proc.stdout
    result = json.loads(out.read_text())
    assert result["args"]["repeats"] == "1" and result["complete"]  # --services-only's default; the final write
    assert [(r["batch"], r["k"], r["mode"]) for r in result["rows"]] == [
        (2, 0, "target_only"),
        (2, 2, "services_colocated"),
    ]
    target_only, speculative = result["rows"]
    # Speculation happened (drafts from the oracle, written after the drafter started, were accepted) and the
    # target-only run it is checked against went through the verifier alone. Per request: the batch's iteration
    # count also holds the iterations where one request ran alone (its Generate came late on a loaded machine).
    assert speculative["accepted_per_iteration"] > 0.5 and speculative["acceptance_rate"] > 0.3
    assert target_only["iterations"] >= 10 and target_only["breakdown_ms"]["step0"] == 0
    for row in result["rows"]:
        assert row["active_weight_bytes"] > 0 and row["roofline_fraction"] > 0
    assert speculative["active_weight_bytes"] > target_only["active_weight_bytes"]
    assert (tmp_path / "e2e.md").read_text().startswith("model deepseek-v3-tiny-fp8")
    assert {p.name for p in (tmp_path / "e2e-logs").iterdir()} >= {"verifier.log", "drafter.log", "coordinator.log"}


def test_the_lossless_check_reports_the_first_differing_token():
    from benchmarks.e2e import check_lossless
    from benchmarks.lib.e2e_modes import RunResult
    from specsplit.client.results import SpecStats

    expected = [[5, 6, 7, 8], [9, 10, 11]]
    failures: list[str] = []
    check_lossless("same", [RunResult(1.0, [list(o) for o in expected], SpecStats())], expected, failures)
    assert failures == []
    check_lossless("off", [RunResult(1.0, [[5, 6, 7, 8], [9, 12, 11]], SpecStats())], expected, failures)
    check_lossless("short", [RunResult(1.0, [[5, 6], [9, 10, 11]], SpecStats())], expected, failures)
    assert failures == [
        "off: prompt 1 differs from target-only greedy output at token 1",
        "short: prompt 0 differs from target-only greedy output at token 2",
    ]
