"""benchmarks/prefix_cache.py on the CPU with the demo checkpoint (a smoke run: the numbers are for the GPU): both
clusters run every cell in every round, in alternating order, the outputs with caching on equal those with it off,
and the cached tokens are accounted (none with caching off or without a shared prefix; the system prompt's blocks,
bar at most one, with it)."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.prefix_cache import check

ROOT = Path(__file__).resolve().parents[2]

PREFIX, USER, NEW, REQUESTS, ROUNDS = 64, 16, 6, 4, 2


def test_caching_on_and_off_give_the_same_outputs_and_the_shared_prefix_is_cached(tmp_path):
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prefix_cache.py"), "--batches", "1", "2"]
        + ["--requests", str(REQUESTS), "--prefix-tokens", str(PREFIX), "--user-tokens", str(USER)]
        + ["--new-tokens", str(NEW), "--rounds", str(ROUNDS), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "lossless and cached tokens: yes" in proc.stdout
    result = json.loads(out.read_text())
    assert result["complete"] and result["failures"] == []
    block = result["block_size"]
    rows = {(r["caching"], r["workload"], r["batch"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((c, w, b) for c in ("off", "on") for w in ("shared", "unshared") for b in (1, 2))
    for (caching, workload, batch), r in rows.items():
        assert len(r["outputs"]) == len(r["ttft_s"]) == REQUESTS * ROUNDS
        assert all(len(output) == NEW for output in r["outputs"])
        assert r["prompt_tokens"] == REQUESTS * ROUNDS * (PREFIX + USER)
        assert len(r["round_seconds"]) == ROUNDS and r["seconds"] == sum(r["round_seconds"])
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tokens_per_s"] > 0
        # Greedy: caching changes where the prompt's KV comes from, never the output.
        assert r["outputs"] == rows["off", workload, batch]["outputs"]
        if caching == "on" and workload == "shared":
            # Every request starts on the system prompt's full blocks, the last one perhaps computed again.
            assert all(PREFIX - block <= n <= PREFIX for n in r["cached_tokens_per_request"]), r
            assert r["cached_tokens"] == sum(r["cached_tokens_per_request"])
        else:
            assert r["cached_tokens"] == 0
    # The ratios on / off, per workload and batch.
    assert {(r["workload"], r["batch"]) for r in result["ratios"]} == {(w, b) for _, w, b in rows}
    shared = next(r for r in result["ratios"] if r["workload"] == "shared" and r["batch"] == 1)
    on, off = rows["on", "shared", 1], rows["off", "shared", 1]
    assert shared["ttft_p50_s"] == on["ttft_p50_s"] / off["ttft_p50_s"]
    assert shared["tokens_per_s_rounds"] == [a / b for a, b in zip(off["round_seconds"], on["round_seconds"])]
    assert f"\n| shared | 1 | {shared['ttft_p50_s']:.3f} | " in out.with_suffix(".md").read_text()
    # Each cell ran on both clusters in every round, which went first alternating from cell to cell and round to round.
    order = re.findall(r"\[round (\d) (\w+) batch (\d) caching (on|off):", proc.stderr)
    assert len(order) == ROUNDS * len(rows)
    firsts = [caching for i, (*_, caching) in enumerate(order) if i % 2 == 0]
    assert firsts == ["off", "on", "off", "on", "on", "off", "on", "off"]


def _row(caching: str, workload: str, cached: int, outputs: list[list[int]]) -> dict:
    return {"caching": caching, "workload": workload, "batch": 1, "cached_tokens": cached, "outputs": outputs}


def test_the_check_reports_a_changed_output_and_wrong_cached_token_counts():
    args = argparse.Namespace(requests=2, prefix_tokens=64)
    outputs = [[5, 6, 7], [8, 9, 10]]
    good = [
        _row("off", "shared", 0, outputs),
        _row("off", "unshared", 0, outputs),
        _row("on", "shared", 2 * 48, outputs),
        _row("on", "unshared", 0, outputs),
    ]
    assert check(good, args, block_size=16) == []
    bad = [
        _row("off", "shared", 16, outputs),  # cached tokens with caching off
        _row("off", "unshared", 0, outputs),
        _row("on", "shared", 2 * 48 - 1, outputs),  # fewer than the system prompt's blocks less one
        _row("on", "unshared", 32, [[5, 6, 7], [8, 11, 10]]),  # cached without a shared prefix; an output changed
    ]
    failures = check(bad, args, block_size=16)
    assert failures == [
        "caching off shared batch 1: 16 cached tokens reported with caching off",
        "caching on shared batch 1: 95 cached tokens reported, expected at least 96",
        "caching on unshared batch 1: 32 cached tokens reported where no prompt shares a block",
        "caching on unshared batch 1: request 1 differs from caching off at token 1: [11, 10] against [9, 10]",
    ]
