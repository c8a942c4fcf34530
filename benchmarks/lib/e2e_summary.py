"""Each spec's range over the invocations of benchmarks/h200_e2e.sh: per batch and mode, tokens/s and the speedup
over target-only decoding of the same invocation (the lowest and highest of the invocations), and whether every
invocation was lossless.

    python benchmarks/lib/e2e_summary.py DIR NAME ...     # reads DIR/NAME-1.json, DIR/NAME-2.json, ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ranges(paths: list[Path]) -> tuple[dict[tuple[int, str], list[tuple[float, float]]], int, int]:
    """(batch, mode) -> [(tokens/s, speedup over target-only)] per invocation; invocations lossless, complete."""
    cells: dict[tuple[int, str], list[tuple[float, float]]] = {}
    lossless = complete = 0
    for path in paths:
        result = json.loads(path.read_text())
        lossless += not result.get("lossless_failures")
        complete += bool(result.get("complete", True))
        base = {r["batch"]: r["tokens_per_s"] for r in result["rows"] if r["mode"] == "target_only"}
        for r in result["rows"]:
            if r["mode"] != "target_only" and r["batch"] in base:
                cells.setdefault((r["batch"], r["mode"]), []).append(
                    (r["tokens_per_s"], r["tokens_per_s"] / base[r["batch"]])
                )
    return cells, lossless, complete


def main(argv: list[str]) -> None:
    folder, names = Path(argv[0]), argv[1:]
    print("| spec | batch | mode | invocations | tokens/s | speedup vs target-only | lossless |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        paths = sorted(folder.glob(f"{name}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        cells, lossless, _ = ranges(paths)
        for (batch, mode), values in sorted(cells.items()):
            tps, speedups = [v[0] for v in values], [v[1] for v in values]
            print(
                f"| {name} | {batch} | {mode} | {len(values)} | {min(tps):,.0f}–{max(tps):,.0f} | "
                f"{min(speedups):.2f}–{max(speedups):.2f}x | {lossless}/{len(paths)} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
