"""benchmarks/lib/e2e_summary.py, the table benchmarks/h200_e2e.sh ends with: per spec, batch and mode, the lowest and
highest tokens/s and speedup over the same invocation's target-only decoding, and how many invocations were lossless,
read from the JSON files benchmarks/e2e.py writes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, target_only: float, services: float, lossless: bool = True) -> None:
    rows = [
        {"batch": 1, "k": 0, "mode": "target_only", "tokens_per_s": target_only},
        {"batch": 1, "k": 3, "mode": "services_colocated", "tokens_per_s": services},
    ]
    failures = [] if lossless else ["batch 1 k 3 services_colocated: prompt 0 differs at token 5"]
    path.write_text(json.dumps({"rows": rows, "lossless_failures": failures, "complete": True}))


def test_each_invocation_is_compared_with_its_own_target_only_run(tmp_path):
    write(tmp_path / "after-1.json", 100.0, 180.0)
    write(tmp_path / "after-2.json", 120.0, 180.0, lossless=False)  # 1.50x: its own baseline, not the first's
    write(tmp_path / "after-10.json", 90.0, 171.0)
    write(tmp_path / "other-1.json", 50.0, 500.0)  # another spec: not mixed in
    out = subprocess.run(
        [sys.executable, "benchmarks/lib/e2e_summary.py", str(tmp_path), "after"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| after |")]
    assert rows == ["| after | 1 | services_colocated | 3 | 171–180 | 1.50–1.90x | 2/3 |"]
