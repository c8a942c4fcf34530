"""benchmarks/chooser_drift.py (the simulated H200, no model): one window per cell and pace offset, as a smoke run."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_drift_changes_what_adaptive_chooses_and_every_cell_is_reported():
    args = ["--pace", "none", "--pace", "square", "50", "1.25", "--windows", "1", "--offsets", "2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chooser_drift.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    none, square = proc.stdout.split("\npace square")
    assert "pace offsets [0, 50]" in square
    rows = [re.findall(r"^\s+(alpha|mixed) .*?k\d: (.*)$", part, re.M) for part in (none, square)]
    assert len(rows[0]) == len(rows[1]) == 17  # the grid and the mixed batch twice
    assert all(len(r.split("  ")) == 1 for _, r in rows[0]) and all(len(r.split("  ")) == 2 for _, r in rows[1])
    # the none pace's windows are the drift-free ones; the drift moves some of them (adaptive chose otherwise)
    assert [r.split("  ")[0] for _, r in rows[1]] != [r for _, r in rows[0]]
    assert "of 17 below 0.97" in none and "of 34 below 0.97" in square


def test_a_pace_without_its_period_and_level_is_refused():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chooser_drift.py"), "--pace", "square"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "square PERIOD SLOW" in proc.stderr
