"""benchmarks/service_start.py times a real verifier start on the demo checkpoint, and names a start that fails."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "service_start.py"


def test_one_verifier_start_is_timed_to_listening():
    out = subprocess.run([sys.executable, str(SCRIPT), "--starts", "1"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    first, summary = out.stdout.splitlines()
    assert 0 < float(first) < 120 and summary.startswith("verifier start to listening: median")


def test_a_service_that_exits_at_start_up_is_named(tmp_path):
    args = ["--starts", "1", "--role", "drafter", "--model", str(tmp_path)]  # no config.json: refused, exit 2
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "drafter exited with code 2 before listening" in out.stderr
