"""Lays the host probe's traces (`PROBE_TRACE`, sitecustomize.py beside this) side by side on one clock: per
constrained Propose of the drafting process, the device's busy time (kernels and copies of every traced process, on
one GPU) and its idle gaps, each gap named by the probe ranges the processes' host threads were in while it lasted;
then the total idle time per range over the window.

    python benchmarks/host_probe/timeline.py DIR [--gap-us 20] [--show 2]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> tuple[str, list[dict]]:
    """(process name, its events with absolute 'ts' in µs)."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    for e in events:
        e["ts"] = float(e["ts"]) + base
    name = os.path.basename(path).removeprefix("trace-").removesuffix(".json.gz")
    return name, events


def merge(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--gap-us", type=float, default=20.0, help="device idle gaps shorter than this count as busy")
    p.add_argument("--show", type=int, default=2, help="Proposes printed event by event")
    args = p.parse_args()
    procs = [load(path) for path in sorted(glob.glob(os.path.join(args.dir, "trace-*.json.gz")))]
    device, ranges = [], []
    for name, events in procs:
        names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
        name = "drafter" if "propose_constrained" in names else "verifier" if "verify_launch" in names else name
        for e in events:
            if e.get("cat") in DEVICE:
                device.append((e["ts"], e["ts"] + e["dur"]))
            elif e.get("cat") == "user_annotation":
                ranges.append((e["ts"], e["ts"] + e["dur"], f"{name}:{e['name']}"))
    proposes = sorted((a, b) for a, b, n in ranges if n.endswith(":propose_constrained"))
    if not proposes:
        raise SystemExit("no constrained Propose in the traces")
    busy = merge(device, args.gap_us)
    idle_by: collections.Counter = collections.Counter()
    total = collections.Counter()
    for index, (start, end) in enumerate(proposes):
        nxt = proposes[index + 1][0] if index + 1 < len(proposes) else end
        window = [(max(a, start), min(b, nxt)) for a, b in busy if b > start and a < nxt]
        gaps = [(a, b) for (_, a), (b, _) in zip([(start, start)] + window, window + [(nxt, nxt)]) if b - a > 0]
        total["propose ms"] += (end - start) / 1e3
        total["cycle ms"] += (nxt - start) / 1e3
        total["device busy ms"] += sum(b - a for a, b in window) / 1e3
        show = index < args.show
        if show:
            took, cycle = (end - start) / 1e3, (nxt - start) / 1e3
            print(f"\n== Propose {index}: {took:.3f} ms, next Propose after {cycle:.3f} ms")
            for a, b, n in sorted(r for r in ranges if start <= r[0] < nxt):
                print(f"  {(a - start) / 1e3:8.3f} +{(b - a) / 1e3:7.3f}  {n}")
        for a, b in gaps:
            # the innermost probe range of each process covering the gap's middle
            mid = (a + b) / 2
            inner: dict[str, tuple[float, str]] = {}
            for ra, rb, n in ranges:
                if ra <= mid <= rb:
                    proc = n.split(":", 1)[0]
                    if proc not in inner or rb - ra < inner[proc][0]:
                        inner[proc] = (rb - ra, n)
            label = " & ".join(n for _, n in sorted(inner.values(), key=lambda x: x[1])) or "(no range)"
            idle_by[label] += (b - a) / 1e3
            if show:
                print(f"  idle {(a - start) / 1e3:8.3f} +{(b - a) / 1e3:7.3f}  during {label}")
    n = len(proposes)
    print(f"\n{n} constrained Proposes; per Propose: " + ", ".join(f"{k} {v / n:.3f}" for k, v in total.items()))
    print("device idle per Propose, by the host ranges it fell in (ms):")
    for label, ms in idle_by.most_common(25):
        print(f"  {ms / n:7.3f}  {label}")


if __name__ == "__main__":
    main()
