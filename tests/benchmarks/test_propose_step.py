"""benchmarks/propose_step.py on CPU: the drafter's propose over a tiny shape, every request given k drafts."""

import json

from benchmarks.propose_step import main


def test_propose_step_runs_and_reports_each_batch(tmp_path):
    out = tmp_path / "propose.json"
    main(["--shape", "qwen2-tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,2"]
         + ["--k", "2", "--context", "8", "--steps", "2", "--warmup", "1", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 2), (2, 2)]
    assert all(r["wall_ms"] > 0 and r["gpu_ms"] is None and r["kernels"] == [] for r in rows)
