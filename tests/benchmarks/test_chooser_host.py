"""benchmarks/chooser_host.py runs and times what it says: a filled cost model, record + choose per iteration."""

import subprocess
import sys
from pathlib import Path

from benchmarks.chooser_host import filled_chooser

ROOT = Path(__file__).resolve().parents[2]


def test_the_cost_model_is_filled_as_a_long_run_fills_it():
    chooser, counts = filled_chooser(batch=8, k=3, num_runs=30, alpha=0.6)
    assert chooser.costs.ready and chooser.costs.propose_s is not None and len(counts) == 8
    assert {later for _, later in chooser.costs.measured_runs} == {0, 1, 2}
    assert chooser.acceptance.version > 0


def test_the_script_prints_one_line_per_cell():
    args = ["--batches", "4", "16", "--k", "3", "--runs", "10", "--iterations", "20", "--repeats", "2"]
    script = ROOT / "benchmarks" / "chooser_host.py"
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("runs")]
    assert [line.split("batch")[1].split(":")[0].strip() for line in lines] == ["4", "16"]
    assert all(float(line.split(":")[1].split("ms")[0]) > 0 for line in lines)
