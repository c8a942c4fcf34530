"""Each spec's range over the invocations of benchmarks/h200_e2e.sh: per batch and mode, tokens/s and the speedup
over target-only decoding of the same invocation (the lowest and highest of the invocations), and whether every
invocation was lossless. Constrained modes (MODE+KIND, `e2e.py --structured`) are compared with the constrained
target-only run, and a second table gives their tokens/s against their unconstrained twin (`structured_cost`).

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
        modes = [(r, *r["mode"].partition("+")[::2]) for r in result["rows"]]  # (row, mode, kind)
        base = {(r["batch"], kind): r["tokens_per_s"] for r, mode, kind in modes if mode == "target_only"}
        for r, mode, kind in modes:
            if mode != "target_only" and (r["batch"], kind) in base:
                cells.setdefault((r["batch"], r["mode"]), []).append(
                    (r["tokens_per_s"], r["tokens_per_s"] / base[r["batch"], kind])
                )
    return cells, lossless, complete


def structured_costs(paths: list[Path]) -> dict[tuple[int, str], list[float]]:
    """(batch, constrained mode) -> its tokens/s against its unconstrained twin's, − 1, per invocation."""
    cells: dict[tuple[int, str], list[float]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            if r.get("structured_cost") is not None:
                cells.setdefault((r["batch"], r["mode"]), []).append(r["structured_cost"])
    return cells


def main(argv: list[str]) -> None:
    folder, names = Path(argv[0]), argv[1:]
    specs = {name: sorted(folder.glob(f"{name}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1])) for name in names}
    print("| spec | batch | mode | invocations | tokens/s | speedup vs target-only | lossless |")
    print("|---|---|---|---|---|---|---|")
    for name, paths in specs.items():
        cells, lossless, _ = ranges(paths)
        for (batch, mode), values in sorted(cells.items()):
            tps, speedups = [v[0] for v in values], [v[1] for v in values]
            print(
                f"| {name} | {batch} | {mode} | {len(values)} | {min(tps):,.0f}–{max(tps):,.0f} | "
                f"{min(speedups):.2f}–{max(speedups):.2f}x | {lossless}/{len(paths)} |"
            )
    costs = {name: structured_costs(paths) for name, paths in specs.items()}
    if any(costs.values()):
        print("\n| spec | batch | constrained mode | invocations | tokens/s against unconstrained |")
        print("|---|---|---|---|---|")
        for name, cells in costs.items():
            for (batch, mode), values in sorted(cells.items()):
                low, high = 100 * min(values), 100 * max(values)
                print(f"| {name} | {batch} | {mode} | {len(values)} | {low:+.1f} % – {high:+.1f} % |")


if __name__ == "__main__":
    main(sys.argv[1:])
