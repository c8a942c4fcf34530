"""benchmarks/gemv.py's CPU smoke mode: every candidate configuration for the tiny shapes runs under
the Triton interpreter, matches F.linear and lands in the JSON (no timing on CPU)."""

import json

from benchmarks.gemv import main


def test_gemv_benchmark_checks_every_candidate_on_cpu(tmp_path, capsys):
    out = tmp_path / "gemv.json"
    assert main(["--device", "cpu", "--tiny", "--m", "1,5", "--out", str(out)]) == 0
    assert "0 configurations failed their check" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["failed"] == 0
    assert {(r["shape"], r["m"]) for r in result["rows"]} == {("qkv", 1), ("qkv", 5), ("odd", 1), ("odd", 5)}
    configs = [c for r in result["rows"] for c in r["configs"]]
    assert all(c["ok"] and c["deterministic"] and c["us"] is None for c in configs)
    kinds = {(c["config"]["dot"], c["config"]["split_k"] > 1) for c in configs}
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}  # both paths, split or not
