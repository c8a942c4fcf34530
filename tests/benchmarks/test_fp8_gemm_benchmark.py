"""benchmarks/fp8_gemm.py's CPU smoke mode: every candidate configuration for the tiny shapes runs under the
Triton interpreter and matches the torch reference; the JSON lands in --out."""

import json

from benchmarks.fp8_gemm import main


def test_fp8_gemm_benchmark_checks_every_candidate_on_cpu(tmp_path, capsys):
    assert main(["--device", "cpu", "--tiny", "--m", "1,16", "--shapes", "split", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fp8_gemm.json").read_text())["rows"]
    assert [(r["shape"], r["m"]) for r in rows] == [("split", 1), ("split", 16)]
    configs = [c for r in rows for c in r["configs"]]
    assert all(c["ok"] and c["err"] < 1e-2 for c in configs)
    assert any(c["config"]["split_k"] > 1 for c in configs)  # the split-K path ran too
    assert any(c["config"]["prequantize"] for c in configs)  # and the separate activation quantization
    assert "0 configurations failed" in capsys.readouterr().out
