"""benchmarks/rejection_launch_grid.py times launches on a GPU only; its CPU smoke run (Triton's interpreter)
checks every candidate's tokens against the reference and writes the JSON the launch table is read from."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_grid_checks_every_candidate_and_flips_the_race_in_stats(tmp_path):
    out = tmp_path / "grid.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rejection_launch_grid.py"), "--device", "cpu", "--tiny"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT / "benchmarks",
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "!!!" not in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert result["summary"]["failures"] == 0
    one_hot, dense = result["results"]
    assert (one_hot["mode"], dense["mode"]) == ("one_hot", "dense")
    assert {t["launch"]["race_in_stats"] for t in one_hot["times"]} == {False, True}  # flipped for one-hot
    assert {t["launch"]["race_in_stats"] for t in dense["times"]} == {False}  # never for dense
