"""benchmarks/propose_roundtrip.py drives the verifier's DrafterClient against a real drafter process, on the
drafter's Unix socket and then on gRPC's stream (the benchmark fails if a run took the other one); it breaks whenever
either side changes shape, so a few iterations run here."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_round_trip_reports_each_part_and_profiles_the_drafter():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "propose_roundtrip.py"), "--iterations", "10", "--warmup", "3"]
        + ["--step", "real", "--batch", "2", "--tracing", "--profile", "drafter", "--rpc", "stream", "local"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^  (\S.*?)\s+(-?[0-9.]+)\s+(-?[0-9.]+)$", proc.stdout, re.M)
    times = {name: {"local": float(a), "stream": float(b)} for name, a, b in rows}  # a column per --rpc, local first
    parts = {"round trip less steps", "verifier -> drafter", "drafter handler", "drafter -> verifier", "verifier CPU"}
    assert set(times) >= parts | {"drafter CPU"}, proc.stdout
    for rpc in ("stream", "local"):
        assert times["round trip less steps"][rpc] > 0 and times["drafter CPU"][rpc] > 0
    assert "_serve_propose" in proc.stdout  # the drafter's handler shows in its profile
