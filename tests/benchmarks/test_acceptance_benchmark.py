"""benchmarks/acceptance.py at a temperature above 0, at a tiny size on the demo checkpoint through the three services:
the table has a coupled (seeded) and a rejection (unseeded) line at every k, each with k acceptances per draft
position in [0, 1], a mean acceptance in [0, 1] and 1 to k + 1 tokens per verify iteration."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| (\d+) \| (\w+) \| ([0-9., ]+) \| ([0-9.]+) \| ([0-9.]+) \|$")


def test_sampled_run_prints_coupled_and_rejection_lines_at_every_k():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "acceptance.py"), "--temperature", "0.8"]
        + ["--num-files", "1", "--prompt-len", "64", "--new-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 held-out prompts x 64 tokens, 16 tokens sampled at temperature 0.8 each" in proc.stdout
    rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert [(int(k), sampler) for k, sampler, *_ in rows] == [
        (k, sampler) for k in (1, 2, 3, 4) for sampler in ("coupled", "rejection")
    ], proc.stdout
    for k, _, per_position, rate, tokens in rows:
        accepted = [float(a) for a in per_position.split(", ")]
        assert len(accepted) == int(k)
        assert all(0.0 <= a <= 1.0 for a in accepted)
        assert 0.0 <= float(rate) <= 1.0
        assert 1.0 <= float(tokens) <= int(k) + 1
