"""benchmarks/race_in_stats.py runs on a GPU only for real; its CPU smoke run (Triton's interpreter) checks
every candidate's tokens against the two launches' and writes the table."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_checks_every_candidate_and_writes_the_table(tmp_path):
    out = tmp_path / "race_in_stats.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "race_in_stats.py"), "--device", "cpu", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT / "benchmarks",
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failures"] == []
    assert [(r["batch"], r["k"]) for r in result["results"]] == [(1, 2), (3, 2)]
    for r in result["results"]:
        assert r["two_launches_us"] > 0 and r["default_us"] > 0
        assert list(r["in_stats_us"]) == ["in stats 256", "in stats 512"] and all(r["in_stats_us"].values())
        assert r["default"].startswith("in stats")  # 4 or 12 rows of 1,000 logits: far below the threshold
    assert len(result["table"]) == 2 + 2 and result["table"][0].startswith("| vocab |")
