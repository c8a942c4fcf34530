"""Turns the benchmark's runs into rows (medians per cell) and prints them as Markdown tables."""

from __future__ import annotations

import statistics

from benchmarks.lib.e2e_modes import BREAKDOWN, RunResult
from benchmarks.lib.weight_bytes import HBM_BYTES_PER_S, ModelBytes
from specsplit.client.results import SpecStats


def acceptance_per_position(stats: SpecStats) -> list[float]:
    """P(draft i accepted | drafts before it accepted): ≈ alpha at every position under forced acceptance."""
    out, reached = [], stats.num_drafts
    for accepted in stats.accepted_per_position:
        out.append(accepted / reached if reached else 0.0)
        reached = accepted
    return out


def cell_row(batch: int, k: int, mode: str, new_tokens: int, runs: list[RunResult]) -> dict:
    seconds = statistics.median(r.seconds for r in runs)
    stats = SpecStats()
    for r in runs:
        stats.merge(r.stats)
    iterations = [row for r in runs for row in r.breakdown]
    return {
        "batch": batch,
        "k": k,
        "mode": mode,
        "seconds": seconds,
        "tokens_per_s": batch * new_tokens / seconds,
        "ms_per_output_token": 1e3 * seconds / new_tokens,
        "iterations": statistics.median(r.num_iterations for r in runs),
        "acceptance_per_position": acceptance_per_position(stats),
        "acceptance_rate": stats.acceptance_rate,  # accepted / drafted
        "accepted_per_iteration": stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 0.0,
        "breakdown_ms": {key: statistics.median(row[key] for row in iterations) for key in BREAKDOWN},
        # Where a median hides time: the first iteration (the prompts' prefill) and the wall time no
        # iteration covers.
        "first_iteration_ms": statistics.median(r.breakdown[0]["iteration"] for r in runs),
        "outside_iterations_ms": statistics.median(r.outside_iterations_ms for r in runs),
        # The slowest iteration after the first, median over the runs; and the slowest of all, whole.
        "slowest_iteration_ms": statistics.median(
            max((b["iteration"] for b in r.breakdown[1:]), default=0.0) for r in runs
        ),  # fmt: skip
        "slowest_iteration": max(
            (b for r in runs for b in r.breakdown[1:]), key=lambda b: b["iteration"], default=None
        ),
        # Per repeat (the repeats go round the cells, so repeat r of every cell ran side by side).
        "tokens_per_s_runs": [batch * new_tokens / r.seconds for r in runs],
        "iteration_ms_runs": [statistics.median(b["iteration"] for b in r.breakdown) for r in runs],
        # Every iteration's breakdown, run by run (the JSON only): where one run's iterations differ.
        "breakdown_runs": [[{k: round(v, 3) for k, v in b.items() if v} for b in r.breakdown] for r in runs],
    }


def add_comparisons(rows: list[dict]) -> None:
    """speedup = target-only time / this time; overhead = services / in-process − 1 (wall time and
    median iteration time); a constrained mode (MODE+KIND, `e2e.py --structured`) is compared with the constrained
    ones, and its structured cost = its tokens/s / its unconstrained twin's (MODE) − 1, also repeat by repeat."""
    by = {(r["batch"], r["k"], r["mode"]): r for r in rows}
    for r in rows:
        mode, plus, kind = r["mode"].partition("+")
        base = by.get((r["batch"], 0, f"target_only{plus}{kind}"))
        r["speedup"] = base["seconds"] / r["seconds"] if base else None
        twin = by.get((r["batch"], r["k"], f"in_process{plus}{kind}"))
        plain = by.get((r["batch"], r["k"], mode)) if kind else None
        r["structured_cost"] = r["tokens_per_s"] / plain["tokens_per_s"] - 1 if plain else None
        r["structured_cost_runs"] = (
            [mine / theirs - 1 for mine, theirs in zip(r["tokens_per_s_runs"], plain["tokens_per_s_runs"])]
            if plain
            else []
        )
        r["overhead"] = r["iteration_overhead"] = None
        r["iteration_overhead_runs"] = []
        if mode.startswith("services") and twin:
            r["overhead"] = r["seconds"] / twin["seconds"] - 1
            r["iteration_overhead"] = r["breakdown_ms"]["iteration"] / twin["breakdown_ms"]["iteration"] - 1
            r["iteration_overhead_runs"] = [
                mine / theirs - 1 for mine, theirs in zip(r["iteration_ms_runs"], twin["iteration_ms_runs"])
            ]


def add_roofline(rows: list[dict], sizes: ModelBytes) -> None:
    """Each row's active weight bytes per decode iteration (`ModelBytes.iteration`: routed experts counted as the
    expected distinct ones under uniform routing), the time the HBM roofline allows them, and the median
    iteration's fraction of it."""
    for r in rows:
        active = sizes.iteration(r["batch"], r["k"], r["accepted_per_iteration"])
        r["active_weight_bytes"] = active
        r["roofline_ms"] = 1e3 * active / HBM_BYTES_PER_S
        iteration = r["breakdown_ms"]["iteration"]
        r["roofline_fraction"] = r["roofline_ms"] / iteration if iteration > 0 else None


def print_roofline(rows: list[dict], sizes: ModelBytes) -> None:
    print(
        f"Weights held: verifier {sizes.verifier_weights / 1e9:.4g} GB, drafter {sizes.drafter_weights / 1e9:.4g} GB. "
        f"Active weights per iteration: verify step over batch x (k + 1) tokens + drafter steps (routed experts: "
        f"expected distinct under uniform routing); roofline at {HBM_BYTES_PER_S / 1e12:g} TB/s. Verify forward "
        "and drafter steps: medians of their own (with the device hand-off the drafter's step 0 includes the wait "
        "for the verifier's step); what the iteration spends besides them is host work and hops (breakdown below).\n"
    )
    print(
        "| batch | k | mode | tokens/s | speedup vs (a) | iteration ms (median) | verify forward ms | drafter steps ms "
        "| active weights GB | roofline ms | % of roofline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        fraction = "-" if r["roofline_fraction"] is None else f"{100 * r['roofline_fraction']:.0f} %"
        print(
            f"| {r['batch']} | {r['k']} | {r['mode']} | {r['tokens_per_s']:.1f} | {speedup} | "
            f"{r['breakdown_ms']['iteration']:.1f} | {r['breakdown_ms']['forward']:.1f} | "
            f"{r['breakdown_ms']['step0'] + r['breakdown_ms']['later_steps']:.1f} | "
            f"{r['active_weight_bytes'] / 1e9:.3g} | {r['roofline_ms']:.3g} | "
            f"{fraction} |"
        )
    print()


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def print_tables(rows: list[dict]) -> None:
    print(
        "| batch | k | mode | tokens/s | ms per output token | iterations | acceptance per position | "
        "speedup vs (a) | overhead (b)/(c)−1 | per-iteration overhead | first iteration ms | "
        "slowest later iteration ms | wall − Σ iterations ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(
            f"| {r['batch']} | {r['k']} | {r['mode']} | {r['tokens_per_s']:.0f} | {r['ms_per_output_token']:.2f} | "
            f"{r['iterations']:.0f} | {acc} | {speedup} | {_pct(r['overhead'])} | {_pct(r['iteration_overhead'])} | "
            f"{r['first_iteration_ms']:.1f} | {r['slowest_iteration_ms']:.1f} | {r['outside_iterations_ms']:.1f} |"
        )
    constrained = [r for r in rows if r["structured_cost"] is not None]
    if constrained:
        print(
            "\nStructured output: each constrained cell's tokens/s against its unconstrained twin (same batch, k and "
            "mode; their repeats ran side by side), the change repeat by repeat, and how many of the batch's outputs "
            "reached the EOS (complete JSON; the others end at the new-token count, following the format):\n"
        )
        print("| batch | k | mode | tokens/s unconstrained | tokens/s constrained | change | per repeat | ended |")
        print("|---|---|---|---|---|---|---|---|")
        for r in constrained:
            plain = r["tokens_per_s"] / (1 + r["structured_cost"])
            each = ", ".join(_pct(x) for x in r["structured_cost_runs"])
            print(
                f"| {r['batch']} | {r['k']} | {r['mode']} | {plain:.0f} | {r['tokens_per_s']:.0f} | "
                f"{_pct(r['structured_cost'])} | {each} | {r.get('outputs_ended', '-')}/{r['batch']} |"
            )
    print("\nPer-iteration breakdown, median ms (hops are one-way; see benchmarks/lib/e2e_modes.py):\n")
    print("| batch | k | mode | " + " | ".join(BREAKDOWN) + " |")
    print("|---|---|---|" + "---|" * len(BREAKDOWN))
    for r in rows:
        cells = " | ".join(f"{r['breakdown_ms'][key]:.3f}" for key in BREAKDOWN)
        print(f"| {r['batch']} | {r['k']} | {r['mode']} | {cells} |")
    spread = [r for r in rows if r["iteration_overhead_runs"]]
    if spread:
        print("\nPer-iteration overhead repeat by repeat (each against the in-process run beside it), and its range:\n")
        for r in spread:
            runs = r["iteration_overhead_runs"]
            each = ", ".join(_pct(x) for x in runs)
            print(f"- batch {r['batch']} k {r['k']} {r['mode']}: {each} (from {_pct(min(runs))} to {_pct(max(runs))})")
    print("\nThe slowest iteration of each cell (all runs, the first iteration left out), ms:\n")
    print("| batch | k | mode | " + " | ".join(BREAKDOWN) + " |")
    print("|---|---|---|" + "---|" * len(BREAKDOWN))
    for r in rows:
        if r["slowest_iteration"] is not None:
            cells = " | ".join(f"{r['slowest_iteration'][key]:.3f}" for key in BREAKDOWN)
            print(f"| {r['batch']} | {r['k']} | {r['mode']} | {cells} |")
