"""The host timing probe (`benchmarks/host_probe/`): a process with it on its path times the grammar masks' host
functions and writes what it timed, `show.py` prints it, `PROBE_WIDE` sets the drafter's wide-row share,
`PROBE_INTURN` fills the drafter's masks row by row (the same masks), and without PROBE_OUT nothing is wrapped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "benchmarks" / "host_probe"

WORK = """
import numpy as np
import specsplit.drafter.runner as runner
from specsplit.runtime.grammar import DraftMasks, Grammars
grammars = Grammars("checkpoints/demo")
grammar = '{"grammars": [{"lark_grammar": "start: /[a-z]+/"}]}'
grammars.batch_masks([("r", grammar, [], [])])
masks = DraftMasks(grammars, {0: ("r", grammar, [], 0)})
words = np.zeros((1, grammars.words), dtype=np.int32)
masks.fill([(0, 0, [])], words)
masks.close()
print("WIDE_MASK", runner.WIDE_MASK, "wrapped", getattr(DraftMasks.fill, "_probed", False))
print("allowed", int(np.unpackbits(words.view(np.uint8)).sum()))
"""


def run(tmp_path: Path, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    environ["PYTHONPATH"] = os.pathsep.join([str(PROBE), str(ROOT)])
    out = subprocess.run(
        [sys.executable, "-c", WORK], cwd=ROOT, env=environ | env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_probe_times_the_masks_host_functions_and_show_prints_them(tmp_path):
    assert "WIDE_MASK -1.0 wrapped True" in run(tmp_path, PROBE_OUT=str(tmp_path), PROBE_WIDE="-1")
    (path,) = tmp_path.glob("probe-*.json")
    stats = json.loads(path.read_text())
    assert stats["verifier_batch_masks"]["count"] == 1 and stats["verifier_batch_masks"]["mean_rows"] == 1
    assert stats["draft_masks_fill"]["count"] == 1 and stats["draft_masks_close"]["count"] == 1
    assert stats["llguidance_fill"]["count"] == 2  # the verifier's row and the drafter's
    shown = subprocess.run(
        [sys.executable, str(PROBE / "show.py"), str(tmp_path)], capture_output=True, text=True, timeout=60
    ).stdout
    assert "draft_masks_fill" in shown and "calls       1" in shown


def test_in_turn_the_drafters_masks_skip_the_executor_and_stay_the_same(tmp_path):
    (tmp_path / "executor").mkdir()
    by_executor = run(tmp_path, PROBE_OUT=str(tmp_path / "executor"))
    in_turn = run(tmp_path, PROBE_OUT=str(tmp_path), PROBE_INTURN="1")
    allowed = [line for line in by_executor.splitlines() if line.startswith("allowed")]
    assert allowed and allowed[0] in in_turn and allowed[0] != "allowed 0"
    (path,) = tmp_path.glob("probe-*.json")
    stats = json.loads(path.read_text())
    assert stats["draft_masks_fill"]["count"] == 1
    assert stats["llguidance_fill"]["count"] == 1  # the verifier's row alone: the drafter's went in turn


def test_without_probe_out_nothing_is_wrapped(tmp_path):
    assert "WIDE_MASK 0.5 wrapped False" in run(tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_trace_of_the_services_constrained_proposes_is_laid_out_by_timeline(tmp_path):
    """PROBE_TRACE: the services' drafter traces its constrained Proposes 2 and 3, the verifier its steps meanwhile
    (the benchmark's own process none); timeline.py finds both Proposes and lays the verifier's ranges beside them."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    environ |= {"PYTHONPATH": os.pathsep.join([str(PROBE), str(ROOT)]), "PROBE_OUT": str(tmp_path)}
    args = ["--shape", "qwen2-tiny", "--load-format", "dummy", "--alpha", "0.8", "--batches", "2", "--ks", "3"]
    args += ["--new-tokens", "12", "--repeats", "1", "--warmup-tokens", "4", "--num-blocks", "256"]
    args += ["--structured", "json", "--out", str(tmp_path / "e2e.json")]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *args],
        cwd=ROOT,
        env=environ | {"PROBE_TRACE": "2,2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = sorted(path.name for path in tmp_path.glob("trace-*.json.gz"))
    assert len(traces) == 2 and not any("e2e.py" in name for name in traces), traces
    assert not (tmp_path / "trace.on").exists()  # the window was closed
    shown = subprocess.run(
        [sys.executable, str(PROBE / "timeline.py"), str(tmp_path), "--show", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "2 constrained Proposes" in shown.stdout
    assert "drafter:propose_constrained" in shown.stdout and "verifier:" in shown.stdout
