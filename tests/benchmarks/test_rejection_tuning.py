"""benchmarks/rejection_tuning.py runs on a GPU only for real; its CPU smoke runs (Triton's interpreter) go
through every step of both modes: compiling in a worker process, checking every candidate's tokens, timing,
the sweep's suggested table, the grid's race-in-stats flip."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.kernels.triton_rejection_launch import Launch

ROOT = Path(__file__).resolve().parents[2]


def run_tiny(mode: str, out: Path, *args: str) -> dict:
    """``rejection_tuning.py MODE --device cpu --tiny`` in the interpreter: it must exit 0, report no
    mismatch (!!!), and write its JSON to ``out``."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    script = ROOT / "benchmarks" / "rejection_tuning.py"
    proc = subprocess.run(
        [sys.executable, str(script), mode, "--device", "cpu", "--tiny", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT / "benchmarks",
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "!!!" not in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def test_tiny_sweep_checks_times_and_suggests_a_table(tmp_path):
    result = run_tiny("sweep", tmp_path / "sweep.json", "--jobs", "1")
    assert [r["mode"] for r in result["results"]] == ["greedy", "dense"]
    assert result["summary"]["failures"] == 0
    for r in result["results"]:
        assert len(r["stats_us"]) == 3  # the default and two candidates
        assert r["suggested_us"] > 0 and r["default_again_us"] > 0
    table: dict = {}
    exec(result["summary"]["launch_table"], {"sys": sys, "Launch": Launch}, table)
    assert set(table["LAUNCH_TABLE"]) == {"greedy", "random"}


def test_table_literal_merges_batch_buckets_with_the_same_launch(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from rejection_tuning import table_literal

    a, b = Launch(2048, 512, 4, 1024, 256, 2), Launch(8192, 1024, 8, 4096, 1024, 4)
    literal = "\n".join(table_literal({"random": {1: a, 8: a, 64: b, 256: b}, "greedy": {1: b}}))
    table: dict = {}
    exec(literal, {"sys": sys, "Launch": Launch}, table)
    assert table["LAUNCH_TABLE"] == {"random": ((8, a), (sys.maxsize, b)), "greedy": ((sys.maxsize, b),)}


def test_tiny_launch_grid_checks_every_candidate_and_flips_the_race_in_stats(tmp_path):
    result = run_tiny("grid", tmp_path / "grid.json", "--jobs", "1")
    assert result["summary"]["failures"] == 0
    one_hot, dense = result["results"]
    assert (one_hot["mode"], dense["mode"]) == ("one_hot", "dense")
    assert {t["launch"]["race_in_stats"] for t in one_hot["times"]} == {False, True}  # flipped for one-hot
    assert {t["launch"]["race_in_stats"] for t in dense["times"]} == {False}  # never for dense
    assert all(t["us"] > 0 for r in result["results"] for t in r["times"])  # each candidate was timed


@pytest.mark.parametrize("mode", ["sweep", "grid"])
def test_cpu_run_outside_the_interpreter_is_refused(tmp_path, mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "rejection_tuning.py", mode, "--device", "cpu", "--tiny", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT / "benchmarks",
        env=env,
    )
    assert proc.returncode == 1 and "TRITON_INTERPRET=1" in proc.stderr
    assert not (tmp_path / "x.json").exists()
