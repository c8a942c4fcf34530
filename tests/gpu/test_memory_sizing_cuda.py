"""On a CUDA GPU, the KV cache sized from `--gpu-memory-utilization` (specsplit/runtime/memory_profile.py): a verifier's
and a drafter's start-up (weights, probe runner, real cache, graphs and warm-up) leave this process using at most
F × the device's memory and most of it; the start-up line says the size; a share smaller than the weights is refused
in one line (exit 2); `specsplit up`'s verifier and drafter on one GPU stay within 0.8 + 0.1 of it and serve.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_memory_sizing_cuda.py -s

Prints a table; with $OUT set, writes it to $OUT/memory_sizing.json too.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from specsplit.cli.commands import parse_args
from specsplit.cli.launcher import LocalCluster
from specsplit.client.sdk import Client
from specsplit.runtime.kv_cache_size import GIB
from specsplit.runtime.memory_profile import cache_bytes
from specsplit.runtime.serve_options import apply_eager_option
from tests.fixtures.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
F = 0.25
MAX_LEN = 4096
KV_LINE = re.compile(r"KV cache: (\d+) blocks × (\d+) tokens = (\d+) tokens \(([\d.e+-]+) GiB\), (.*)$")
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Qwen2-style checkpoint with one MTP layer: 6 KiB of target KV cache a token in bfloat16, 0.5 KiB of
    MTP cache (12 layers: with 0.8 and 0.1 of the device the drafter holds more tokens than the verifier, as for
    real models of 24 layers and more; a 4-layer one would hold fewer and the verifier would warn)."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("sizing"),
        architecture="qwen2",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
    )


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for name, row in RESULTS.items():
        print(f"\n{name:>22}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "memory_sizing.json"), "w") as f:
            json.dump(RESULTS, f, indent=2)


def _device_used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _kv_lines(text: str) -> list[re.Match]:
    return [m for m in map(KV_LINE.search, text.splitlines()) if m]


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_start_up_fills_the_share_and_stays_within_it(checkpoint, role, caplog):
    if role == "verifier":
        from specsplit.verifier.loading import load_and_size as _load_and_size
        from specsplit.verifier.server import VerifierConfig as Config
    else:
        from specsplit.drafter.loading import load_and_size as _load_and_size
        from specsplit.drafter.server import DrafterConfig as Config
    gc.collect()
    torch.cuda.empty_cache()
    before = _device_used()
    total = torch.cuda.mem_get_info()[1]
    argv = ["serve", role, "--model", str(checkpoint), "--device", "cuda:0", "--dtype", "bfloat16"]
    config = Config.from_args(parse_args([*argv, "--gpu-memory-utilization", str(F)]))
    with caplog.at_level(logging.INFO):
        loaded = _load_and_size(config, apply_eager_option(False))
    runner = loaded[2] if role == "verifier" else loaded[1]
    cache = runner.kv_cache
    used = _device_used() - before
    lines = _kv_lines(caplog.text)
    RESULTS[role] = {
        "blocks": cache.num_blocks,
        "tokens": cache.num_blocks * cache.block_size,
        "cache GiB": round(cache_bytes(cache) / GIB, 3),
        "process GiB": round(used / GIB, 3),
        "share GiB": round(F * total / GIB, 3),
        "left GiB": round((F * total - used) / GIB, 3),
    }
    del loaded, runner, cache
    gc.collect()
    torch.cuda.empty_cache()
    assert len(lines) == 1, caplog.text
    blocks, block_size, tokens, _, source = lines[0].groups()
    assert int(blocks) == RESULTS[role]["blocks"] > 0 and int(block_size) == 16
    assert int(tokens) >= MAX_LEN and source.startswith(f"from --gpu-memory-utilization {F:g}")
    assert used <= F * total, RESULTS[role]
    assert used >= 0.8 * F * total, RESULTS[role]  # the cache took the share, not a fixed count


def test_a_share_smaller_than_the_weights_is_refused_in_one_line(checkpoint):
    out = subprocess.run(
        [sys.executable, "-m", "specsplit", "serve", "verifier", "--model", str(checkpoint), "--port", "0"]
        + ["--device", "cuda:0", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.00001"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert lines[-1].startswith("specsplit serve verifier: the weights alone take "), out.stderr
    assert "more than --gpu-memory-utilization 1e-05 of" in lines[-1]
    assert "Traceback" not in out.stderr


def test_up_colocated_on_one_gpu_stays_within_its_shares_and_serves(checkpoint, tmp_path):
    gc.collect()
    torch.cuda.empty_cache()
    before = _device_used()
    total = torch.cuda.mem_get_info()[1]
    cluster = LocalCluster(checkpoint, device="cuda:0", dtype="bfloat16", log_dir=tmp_path)
    assert cluster.memory_shares == {"verifier": 0.8, "drafter": 0.1}
    with cluster:
        used = _device_used() - before
        with Client(cluster.address, timeout=120) as client:
            result = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=16, ignore_eos=True)
        after_requests = _device_used() - before
    logs = {role: (tmp_path / f"{role}.log").read_text() for role in ("verifier", "drafter")}
    sizes = {role: _kv_lines(text) for role, text in logs.items()}
    RESULTS["up colocated"] = {
        "verifier tokens": sizes["verifier"][0].group(3) if sizes["verifier"] else None,
        "drafter tokens": sizes["drafter"][0].group(3) if sizes["drafter"] else None,
        "processes GiB": round(used / GIB, 3),
        "after requests GiB": round(after_requests / GIB, 3),
        "0.9 of the device GiB": round(0.9 * total / GIB, 3),
    }
    assert len(result.token_ids) == 16 and result.stats.num_draft_tokens > 0
    assert all(len(found) == 1 for found in sizes.values()), logs
    assert sizes["verifier"][0].group(5).startswith("from --gpu-memory-utilization 0.8")
    assert sizes["drafter"][0].group(5).startswith("from --gpu-memory-utilization 0.1")
    assert int(sizes["drafter"][0].group(3)) >= int(sizes["verifier"][0].group(3))
    # Each service's CUDA context (outside its share, a few hundred MiB) comes on top of 0.8 + 0.1.
    assert max(used, after_requests) <= 0.9 * total + 2 * GIB, RESULTS["up colocated"]
    assert used >= 0.8 * 0.9 * total, RESULTS["up colocated"]
