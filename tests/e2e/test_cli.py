"""The `specsplit` command as a user runs it: generate --local --json. (`up`, its three services and SIGTERM:
tests/e2e/test_up_supervision.py.)"""

import json
import subprocess
import sys


def test_generate_local_json_prints_one_object(tiny_checkpoint, hf_greedy, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specsplit",
            "generate",
            "--local",
            "--model",
            str(tiny_checkpoint),
            "--max-tokens",
            "10",
            "--num-speculative-tokens",
            "2",
            "--log-dir",
            str(tmp_path),
            "--json",
            "def f(x):",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"token_ids", "text", "finish_reason", "stats"}
    assert out["stats"]["num_iterations"] >= 1
    assert 1 <= len(out["token_ids"]) <= 10
