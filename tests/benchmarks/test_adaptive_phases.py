"""benchmarks/adaptive_phases.py on the CPU with the demo checkpoint (a smoke run: the numbers are for the H200):
every mode's windows run lossless, a forced allocation verifies exactly its counts, and each phase is printed."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def phases(*args: str) -> str:
    """benchmarks/adaptive_phases.py's output with these arguments and 4 timed iterations per window (it must exit
    0: every window lossless)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "adaptive_phases.py"), *args, "--iterations", "4"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "failures: []" in proc.stdout
    return proc.stdout


def test_phases_of_fixed_forced_and_adaptive_allocations():
    out = phases("--batch", "4", "--alpha", "0.9", "--modes", "k1", "split:1/3", "adaptive", "--rounds", "2")
    header = next(line for line in out.splitlines() if line.strip().startswith("mode"))
    assert header.split()[3:] == ["schedule", "verify", "prepare", "forward", "sample", "propose", "step0"] + [
        "later_steps",
        "post_step",
        "iteration",
    ]
    rows = {m.group(1): m for m in re.finditer(r"^\s*(k1|split:1/3|adaptive)\s+(\d+) \[.*?\]\s+([0-9.]+)", out, re.M)}
    assert set(rows) == {"k1", "split:1/3", "adaptive"}
    assert float(rows["k1"].group(3)) == 1.0 and float(rows["split:1/3"].group(3)) == 2.0  # drafts per request
    # each round's own row under each mode's (which phase moves in a slow round)
    assert len(re.findall(r"^\s*round 2\s+\d+\s+[0-9.]+(\s+[0-9.]+){10}$", out, re.M)) == 3
    # 2 rounds x 4 timed iterations x 4 requests: half at 1 draft, half at 3 (counts 0..5: adaptive's k_max)
    assert "draft counts verified: [0, 16, 0, 16, 0, 0]" in out
    assert "draft counts verified: [0, 32, 0, 0, 0, 0]" in out  # k1


def test_the_mixed_cell_runs_lossless_with_its_acceptances_per_request():
    out = phases("--batch", "2", "--mixed", "1.0", "0.0", "--modes", "k2", "--rounds", "1")
    assert "mixed 1.0/0.0, batch 2" in out
    assert "draft counts verified: [0, 0, 8]" in out  # 4 iterations x 2 requests, 2 drafts each
    # request 0 accepts every draft (3 tokens per iteration), request 1 none (1): 4 tokens per iteration, not 6 or 2
    # (counted, not timed: tokens/s x ms per iteration moves with the machine)
    assert "tokens emitted per iteration: 4.00" in out
