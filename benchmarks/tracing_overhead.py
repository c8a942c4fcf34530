"""Iteration time with tracing on vs off, measured side by side on the demo checkpoint.

Two three-service clusters run at once (idle while the other works): one with
OTEL_SDK_DISABLED=true, one exporting every span to files. Rounds alternate between them; each
round is one greedy request of --max-tokens tokens; time per iteration = wall time / iterations.

    .venv/bin/python benchmarks/tracing_overhead.py [--model checkpoints/demo] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specsplit import Client  # noqa: E402
from specsplit.launcher import LocalCluster  # noqa: E402

PROMPT = 'import os\n\n\ndef read_lines(path):\n    """Return the lines of a text file."""\n'


def one_round(address: str, max_tokens: int) -> float:
    with Client(address, timeout=300) as client:
        t0 = time.perf_counter()
        out = client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return (time.perf_counter() - t0) / out.stats.num_iterations * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/demo")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("-k", type=int, default=3)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-tracing-"))
    envs = {
        "off": {"OTEL_SDK_DISABLED": "true"},
        "on": {"OTEL_TRACES_EXPORTER": "file", "SPECSPLIT_TRACE_DIR": str(tmp / "traces")},
    }
    clusters = {
        name: LocalCluster(args.model, num_speculative_tokens=args.k, log_dir=tmp / name, env=env)
        for name, env in envs.items()
    }
    times: dict[str, list[float]] = {name: [] for name in envs}
    try:
        for c in clusters.values():
            c.start()
        for c in clusters.values():  # warm-up
            one_round(c.address, 16)
        for r in range(args.rounds):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            for name in order:
                times[name].append(one_round(clusters[name].address, args.max_tokens))
    finally:
        for c in clusters.values():
            c.stop()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"model {args.model}, k={args.k}, {args.rounds} rounds x {args.max_tokens} tokens, batch 1")
    print("| tracing | median ms / iteration | min | max |")
    print("|---|---|---|---|")
    for name in ("off", "on"):
        t = times[name]
        print(f"| {name} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} |")
    print(f"overhead: {100 * (on / off - 1):+.1f} % of iteration time")


if __name__ == "__main__":
    main()
