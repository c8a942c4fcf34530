"""benchmarks/adaptive.py on the CPU with the demo checkpoint (a smoke run: the numbers are for the H200): every mode
of every cell runs its steady-state windows lossless, in rounds, and the comparison table and its JSON come out."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_adaptive_benchmark_compares_every_mode_in_each_cell(tmp_path):
    out = tmp_path / "adaptive.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "adaptive.py"), "--batches", "1", "--mixed-batches", "2"]
        + ["--alphas", "0.9", "--ks", "1", "2", "--rounds", "2", "--iterations", "3", "--warm-iterations", "1"]
        + ["--request-iterations", "1", "--learn-iterations", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cell"], r["batch"]) for r in rows] == [("alpha=0.9", 1), ("mixed 0.9/0.2", 2)]
    for r in rows:
        assert set(r["tokens_per_s"]) == {"target_only", "k1", "k2", "adaptive"}
        assert all(v > 0 for v in r["tokens_per_s"].values())
        assert r["adaptive_vs_best_fixed"] == r["tokens_per_s"]["adaptive"] / r["tokens_per_s"][r["best_fixed"]]
        # the median and the min-max over the rounds (a mode pruned after round 1 has one)
        for mode, speeds in r["rounds"].items():
            assert len(speeds) in (1, 2) and r["range"][mode] == [min(speeds), max(speeds)]
        assert len(r["rounds"]["target_only"]) == len(r["rounds"]["adaptive"]) == 2
        assert len(r["adaptive_draft_count_histogram"]) <= 3  # at most max(--ks) drafts
    assert re.search(r"worst cell: adaptive / best fixed [0-9.]+, adaptive / target_only [0-9.]+", proc.stdout)
