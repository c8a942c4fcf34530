"""benchmarks/host_overhead.py drives the real coordinator engine, verifier input path and drafter reply
path with their GPU work stubbed out; it breaks whenever those change shape, so it runs here."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_reports_each_service():
    for extra in ([], ["--sampled"]):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--batch", "4", "--k", "2"]
            + ["--iterations", "5", *extra],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        times = dict(re.findall(r"^\s+(coordinator|verifier|drafter)\s+([0-9.]+)$", proc.stdout, re.M))
        assert set(times) == {"coordinator", "verifier", "drafter"}, proc.stdout
        assert all(float(t) > 0 for t in times.values())
