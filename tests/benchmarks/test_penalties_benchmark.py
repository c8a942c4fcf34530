"""`benchmarks/penalties.py` runs on the CPU: one row per history length, each a positive time."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_penalties_benchmark_times_a_step_at_each_history_length():
    script = ROOT / "benchmarks" / "penalties.py"
    args = ["--batch", "2", "--k", "1", "--vocab", "512", "--repeats", "2"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [(p, o) for p, o, _ in rows[1:]] == [("128", "64"), ("1024", "1024"), ("2048", "4096")]
    assert all(float(ms) > 0 for _, _, ms in rows[1:])
