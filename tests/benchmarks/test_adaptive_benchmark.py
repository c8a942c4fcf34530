"""benchmarks/adaptive.py on the CPU with the demo checkpoint (a smoke run: the numbers are for the H200): every mode
of every cell runs lossless, in rounds, in one process (steady-state windows) and through the services (closed
batches on two sets of services, fixed and adaptive), and the comparison tables and their JSON come out."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_adaptive_benchmark_compares_every_mode_in_each_cell_in_one_process_and_through_the_services(tmp_path):
    out = tmp_path / "adaptive.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "adaptive.py"), "--batches", "1", "--mixed-batches", "2"]
        + ["--alphas", "0.0", "--ks", "1", "2", "--rounds", "2", "--iterations", "3", "--warm-iterations", "1"]
        + ["--request-iterations", "1", "--learn-iterations", "4", "--out", str(out)]
        + ["--where", "in-process", "services", "--new-tokens", "6", "--learn-runs", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    cells = [("alpha=0.0", 1), ("mixed 0.9/0.2", 2)]
    assert [(r["where"], r["cell"], r["batch"]) for r in rows] == [
        (where, *cell) for where in ("one process", "services") for cell in cells
    ]
    for r in rows:
        assert set(r["tokens_per_s"]) == {"target_only", "k1", "k2", "adaptive"}
        assert all(v > 0 for v in r["tokens_per_s"].values())
        assert r["adaptive_vs_best_fixed"] == r["tokens_per_s"]["adaptive"] / r["tokens_per_s"][r["best_fixed"]]
        # the median and the min-max over the rounds (a mode pruned after round 1 has one)
        for mode, speeds in r["rounds"].items():
            assert len(speeds) in (1, 2) and r["range"][mode] == [min(speeds), max(speeds)]
        assert len(r["rounds"]["target_only"]) == len(r["rounds"]["adaptive"]) == 2
        assert len(r["adaptive_draft_count_histogram"]) <= 3  # at most max(--ks) drafts
        assert sum(r["adaptive_draft_count_histogram"]) > 0
        assert ("choose_ms_per_iteration" in r) == (r["where"] == "one process")  # the chooser's time: in-process
    services = [r for r in rows if r["where"] == "services"]
    # the services' drafters force acceptance from the oracle the fixed set's target-only runs wrote: at alpha 0 no
    # draft is the target's token (the demo model's own drafts are, most of the time); the mixed cell's are
    assert {"k1", "k2"} <= services[0]["acceptance"].keys() and set(services[0]["acceptance"].values()) == {0.0}
    assert services[1]["acceptance"]["k1"] > 0
    assert "LOSSLESS FAILURE" not in proc.stdout
    assert re.search(r"mixed 0.9/0.2\s+2\s+[0-9.]+ \| [0-9.]+\s+[0-9.]+ \| [0-9.]+", proc.stdout)  # side by side
    assert re.search(r"worst cell: adaptive / best fixed [0-9.]+, adaptive / target_only [0-9.]+", proc.stdout)
