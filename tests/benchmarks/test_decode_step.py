"""benchmarks/decode_step.py on the CPU: its eager paths side by side (the step padded into one SDPA
call, and one SDPA call per request), each timed and reported."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_eager_and_eager_loop_run_side_by_side(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_step.py"), "--device", "cpu", "--tiny"]
        + ["--batch-sizes", "1,4", "--context", "32", "--paths", "eager,eager_loop", "--steps", "3", "--warmup", "1"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["path"]) for r in rows] == [(1, "eager"), (1, "eager_loop"), (4, "eager"), (4, "eager_loop")]
    assert all(r["step_ms"] > 0 for r in rows)
