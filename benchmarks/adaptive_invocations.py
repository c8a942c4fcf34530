"""Adaptive speculation's targets over separate invocations of benchmarks/adaptive.py (a claim holds only if it holds
in every one of them; each invocation a fresh process):

    python benchmarks/adaptive_invocations.py run1.json run2.json run3.json

Per cell (in one process and through the services, as the invocations measured them): adaptive / best fixed k
and adaptive / target-only in each invocation and their range, the best fixed k of each, adaptive's drafts per
request and iteration and the draft counts it verified most; then, for each place apart, whether each target held
in every invocation (adaptive >= 0.97x the best fixed k and >= 0.98x target-only in every cell; a mixed batch faster
than every fixed k).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BEST_FIXED, TARGET_ONLY = 0.97, 0.98


Key = tuple[str, str, int]  # (where, cell, batch)


def load(paths: list[Path]) -> list[dict[Key, dict]]:
    """Per invocation, its rows by (where, cell, batch); rows written before the services were measured beside the
    in-process engine name no place: one process."""
    return [
        {(r.get("where", "one process"), r["cell"], r["batch"]): r for r in json.loads(p.read_text())["rows"]}
        for p in paths
    ]


def summary(runs: list[dict[Key, dict]]) -> tuple[list[str], dict[str, dict[str, bool]]]:
    """The table's lines and, per place and target, whether it held in every invocation."""
    cells = [c for c in runs[0] if all(c in run for run in runs)]
    lines = [
        "| where | cell | B | adaptive / best fixed k | adaptive / target-only | best fixed k | drafts/it "
        "| draft counts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    held: dict[str, dict[str, bool]] = {}
    for cell in cells:
        where = held.setdefault(cell[0], {"best_fixed": True, "target_only": True})
        rows = [run[cell] for run in runs]
        best = [r["adaptive_vs_best_fixed"] for r in rows]
        to = [r["adaptive_vs_target_only"] for r in rows]
        where["best_fixed"] &= min(best) >= BEST_FIXED
        where["target_only"] &= min(to) >= TARGET_ONLY
        if cell[1].startswith("mixed"):
            speeds = [r["tokens_per_s"] for r in rows]
            faster = all(s["adaptive"] > max(v for m, v in s.items() if m != "adaptive") for s in speeds)
            where["mixed"] = where.get("mixed", True) and faster
        lines.append(
            f"| {cell[0]} | {cell[1]} | {cell[2]} | {fmt(best)} | {fmt(to)} | "
            f"{', '.join(r['best_fixed'] for r in rows)} | "
            f"{', '.join(format(r['mean_drafts']['adaptive'], '.2f') for r in rows)} | "
            f"{', '.join(counts(r.get('adaptive_draft_count_histogram', [])) for r in rows)} |"
        )
    return lines, held


def counts(histogram: list[int]) -> str:
    """The draft counts adaptive verified most, with their shares of request-iterations (a mean of 3.00 can be half
    1 and half 5, which costs as 5 does)."""
    total = sum(histogram)
    if not total:
        return "-"
    top = sorted(range(len(histogram)), key=lambda d: -histogram[d])[:2]
    return " ".join(f"{d}:{histogram[d] / total:.0%}" for d in top if histogram[d])


def fmt(values: list[float]) -> str:
    """Each invocation's value, then the range."""
    return f"{' / '.join(f'{v:.3f}' for v in values)} ({min(values):.3f}–{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="adaptive.json of each invocation")
    args = p.parse_args(argv)
    lines, held = summary(load(args.results))
    print(f"{len(args.results)} invocations\n")
    print("\n".join(lines))
    words = {
        "best_fixed": f"adaptive >= {BEST_FIXED}x the best fixed k in every cell",
        "target_only": f"adaptive >= {TARGET_ONLY}x target-only in every cell",
        "mixed": "the mixed batch faster than every fixed k",
    }
    for where, targets in held.items():
        print(f"\n{where}:")
        for key, ok in targets.items():
            print(f"{words[key]}: {'held in every invocation' if ok else 'NOT held in every invocation'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
