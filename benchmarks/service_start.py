"""Start-up time of a model service: from spawning `specsplit serve verifier` (or drafter) on a checkpoint to its
port accepting connections, which it opens once the model is loaded. What `up`, a restart after a crash and each e2e
test's cluster wait for.

    python benchmarks/service_start.py --role verifier --starts 5 [--model checkpoints/demo] [--device cpu]

prints each start's seconds, then their median and range.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specsplit.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]


def seconds_to_listen(role: str, model: str, device: str, timeout_s: float = 120.0) -> float:
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "specsplit", "serve", role, "--model", model, "--device", device]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"{role} exited with code {proc.returncode} before listening")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return time.perf_counter() - t0
            time.sleep(0.01)
        raise TimeoutError(f"{role} did not listen within {timeout_s:g} s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["verifier", "drafter"], default="verifier")
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--starts", type=int, default=5)
    args = p.parse_args(argv)
    times = [seconds_to_listen(args.role, args.model, args.device) for _ in range(args.starts)]
    print(" ".join(f"{t:.2f}" for t in times))
    median, low, high = statistics.median(times), min(times), max(times)
    print(f"{args.role} start to listening: median {median:.2f} s [{low:.2f}, {high:.2f}]")


if __name__ == "__main__":
    main()
