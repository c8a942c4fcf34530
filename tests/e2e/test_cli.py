"""The `specsplit` command as a user runs it: generate --local --json, and up + SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time

from specsplit import Client
from specsplit.launcher import free_port


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


def test_up_starts_three_named_processes_and_stops_them_on_sigterm(tiny_checkpoint):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specsplit",
            "up",
            "--model",
            str(tiny_checkpoint),
            "--port",
            str(port),
            "--num-speculative-tokens",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        line = ""
        while time.monotonic() < deadline and not line.startswith("coordinator listening on"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "specsplit up exited early"
        assert line.strip() == f"coordinator listening on 127.0.0.1:{port}"
        children = _children(proc.pid)
        roles = sorted(
            r
            for r in ("coordinator", "verifier", "drafter")
            if any(f"specsplit serve {r}" in c for c in children.values())
        )
        assert roles == ["coordinator", "drafter", "verifier"]
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            assert client.generate(prompt_token_ids=[5, 6], max_tokens=4).token_ids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert not [p for p in children if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
