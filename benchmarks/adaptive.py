"""Adaptive speculation against every fixed k: decode speed over a forced-acceptance x batch-size grid.

Per cell (alpha, batch B): --waves x B greedy requests of --new-tokens tokens (ignore_eos) through B slots
(continuous batching: a finished request's slot takes the next one, as on a server, so the speed is the batch's
steady state rather than a closed batch's last request; `--waves 1` is a closed batch), run as
    target_only  no drafter (also what fixed k = 0 is: no Propose runs when no request wants drafts)
    k1 .. kN     every request gets k drafts each iteration (`--no-adaptive`)
    adaptive     each request's draft count chosen per iteration, at most max(--ks) (the default)
and prints tokens/s per mode, then adaptive / best fixed (the best of target_only and k1..kN) and
adaptive / target_only. The mixed cell gives half the requests one acceptance and half another
(--mixed 0.9 0.2 at each of --mixed-batches).

All modes run in one process on the in-process engine (`specsplit.LLM`: the services' scheduler, verifier worker
and drafter runner, no gRPC), the model built once; each cell starts from a fresh adaptive state. `--services` runs
the uniform-alpha cells through the three services instead, as closed batches (B concurrent clients; `specsplit up`'s
colocated LocalCluster with a forced-acceptance drafter): per alpha one cluster with `--no-adaptive` for target_only
(requests asking for 0 drafts) and the fixed k, then one adaptive cluster, whose state carries over from cell to cell
of that alpha (a few cells: each alpha costs two cluster start-ups). Before each timed
run, one untimed run: for adaptive that run is its learning (a server keeps what it learned from earlier traffic;
`--cold` times a fresh state instead), for the others a short warm-up. Every output is checked against the
target-only greedy output (lossless); a mismatch fails the run after printing.

    # H200, 7B shape, random weights (about 5 minutes)
    python benchmarks/adaptive.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16
    # CPU, the demo checkpoint, batch 1 and 8
    python benchmarks/adaptive.py --batches 1 8 --mixed-batches 8
    # the services at a few cells
    python benchmarks/adaptive.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16 \
        --services --alphas 0.3 0.9 --batches 8 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.e2e import check_lossless, make_prompts  # noqa: E402
from benchmarks.e2e_modes import InProcessEngine, RunResult  # noqa: E402
from benchmarks.forced_acceptance import ForcedAcceptanceRunner, Oracle  # noqa: E402
from benchmarks.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.coordinator.draft_choice import DraftChooser  # noqa: E402

WARM_UP_TOKENS = 16


@dataclasses.dataclass
class Cell:
    name: str  # "alpha=0.6" or "mixed 0.9/0.2"
    batch: int
    alphas: list[float]  # per prompt of the oracle


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "demo", help="checkpoint directory")
    where.add_argument("--shape", choices=sorted(SHAPES), help="a model shape from benchmarks/shapes.py")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.6, 0.9], help="forced acceptance per cell")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="fixed k to compare (k > 0)")
    p.add_argument("--mixed", type=float, nargs=2, default=[0.9, 0.2], help="the mixed cell's two acceptances")
    p.add_argument("--mixed-batches", type=int, nargs="*", default=[32], help="batch sizes of the mixed cell")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--waves", type=int, default=4, help="requests per slot, one after the other")
    p.add_argument("--repeats", type=int, default=1, help="median of this many timed runs per mode and cell")
    p.add_argument("--cold", action="store_true", help="time adaptive from a fresh state (no learning run)")
    p.add_argument("--services", action="store_true", help="the uniform cells through the three services")
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0, help="seed of the forced-acceptance coin")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: $OUT/adaptive.json when set)")
    args = p.parse_args(argv)
    if args.shape and args.load_format != "dummy":
        p.error("--shape has no weights: add --load-format dummy")
    if any(k < 1 for k in args.ks) or not all(0.0 <= a <= 1.0 for a in [*args.alphas, *args.mixed]):
        p.error("--ks must be >= 1 (k = 0 is target_only) and every alpha in [0, 1]")
    return args


def cells(args: argparse.Namespace, num_prompts: int) -> list[Cell]:
    out = [Cell(f"alpha={a}", b, [a] * num_prompts) for a in args.alphas for b in args.batches]
    hi, lo = args.mixed
    mixed = [hi if i % 2 == 0 else lo for i in range(num_prompts)]
    out += [Cell(f"mixed {hi}/{lo}", b, mixed) for b in args.mixed_batches]
    return out


class Bench:
    def __init__(self, engine: InProcessEngine, prompts: list[list[int]], reference: list[list[int]], args):
        self.engine, self.prompts, self.reference, self.args = engine, prompts, reference, args
        self.oracle = Oracle([p + o for p, o in zip(prompts, reference)], engine.target.config.vocab_size)
        self.base_config = engine.llm.scheduler_config
        self.failures: list[str] = []

    def run(self, cell: Cell, mode: str, new_tokens: int, waves: int | None = None) -> RunResult:
        llm, max_k = self.engine.llm, max(self.args.ks)
        k = 0 if mode == "target_only" else max_k if mode == "adaptive" else int(mode[1:])
        llm.scheduler_config = dataclasses.replace(
            self.base_config, adaptive=mode == "adaptive", max_num_seqs=cell.batch
        )
        seed = self.args.seed
        self.engine.wrap_drafter = lambda runner: ForcedAcceptanceRunner(runner, self.oracle, cell.alphas, seed)
        result = self.engine.run(self.prompts[: cell.batch * (waves or self.args.waves)], new_tokens, k)
        reference = [r[:new_tokens] for r in self.reference]
        check_lossless(f"{cell.name} batch {cell.batch} {mode}", [result], reference, self.failures)
        return result

    def cell(self, cell: Cell, modes: list[str]) -> dict:
        row: dict = {"cell": cell.name, "batch": cell.batch, "tokens_per_s": {}, "mean_drafts": {}}
        for mode in modes:
            if mode == "adaptive":
                self.engine.llm.chooser = DraftChooser()  # each cell learns afresh
            if not (mode == "adaptive" and self.args.cold):
                if mode == "adaptive":  # learning: a run like the timed one
                    self.run(cell, mode, self.args.new_tokens)
                else:  # a warm-up: one wave of short requests
                    self.run(cell, mode, min(WARM_UP_TOKENS, self.args.new_tokens), waves=1)
            runs = [self.run(cell, mode, self.args.new_tokens) for _ in range(self.args.repeats)]
            seconds = statistics.median(r.seconds for r in runs)
            row["tokens_per_s"][mode] = cell.batch * self.args.waves * self.args.new_tokens / seconds
            stats = runs[-1].stats
            row["mean_drafts"][mode] = stats.num_draft_tokens / max(1, stats.num_iterations)
            if mode == "adaptive":
                row["adaptive_draft_count_histogram"] = stats.draft_count_histogram
        return ratios(row)


def ratios(row: dict) -> dict:
    speeds = row["tokens_per_s"]
    fixed = {m: v for m, v in speeds.items() if m != "adaptive"}
    row["best_fixed"] = max(fixed, key=fixed.get)
    row["adaptive_vs_best_fixed"] = speeds["adaptive"] / fixed[row["best_fixed"]]
    row["adaptive_vs_target_only"] = speeds["adaptive"] / speeds["target_only"]
    return row


def services_rows(args, model: Path, work: Path, prompts, reference, oracle: Oracle, modes: list[str]) -> list[dict]:
    """The uniform cells through the services: per alpha a fixed-k cluster, then an adaptive one."""
    from benchmarks.e2e_modes import run_services
    from specsplit.launcher import LocalCluster

    oracle.save(work / "oracle.json")
    max_k, max_batch = max(args.ks), max(args.batches)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    rows = {
        (a, b): {"cell": f"alpha={a}", "batch": b, "tokens_per_s": {}, "mean_drafts": {}}
        for a in args.alphas
        for b in args.batches
    }
    failures: list[str] = []
    for alpha in args.alphas:
        forced = ["-m", "benchmarks.forced_drafter", "--alpha", str(alpha), "--oracle", str(work / "oracle.json")]
        for adaptive in (False, True):
            scheduling = [
                "--max-num-seqs",
                str(max_batch),
                "--max-num-batched-tokens",
                str(max(2048, max_batch * (max_k + 1))),
            ]
            with LocalCluster(
                str(model),
                num_speculative_tokens=max_k,
                device=args.device,
                dtype=args.dtype,
                log_dir=work / f"logs-{alpha}-{'adaptive' if adaptive else 'fixed'}",
                load_format=args.load_format,
                role_commands={"drafter": [sys.executable, *forced, "--seed", str(args.seed)]},
                env=env,
                coordinator_args=scheduling if adaptive else [*scheduling, "--no-adaptive"],
                verifier_args=["--num-blocks", str(args.num_blocks)],
                drafter_args=["--num-blocks", str(args.num_blocks)],
            ) as cluster:
                for batch in args.batches:
                    row = rows[alpha, batch]
                    for mode in ["adaptive"] if adaptive else modes[:-1]:
                        k = 0 if mode == "target_only" else max_k if mode == "adaptive" else int(mode[1:])
                        warm_up = args.new_tokens if adaptive else min(WARM_UP_TOKENS, args.new_tokens)
                        run_services(cluster.address, prompts[:batch], warm_up, k)
                        result = run_services(cluster.address, prompts[:batch], args.new_tokens, k)
                        check_lossless(f"services alpha={alpha} batch {batch} {mode}", [result], reference, failures)
                        row["tokens_per_s"][mode] = batch * args.new_tokens / result.seconds
                        row["mean_drafts"][mode] = result.stats.num_draft_tokens / max(1, result.stats.num_iterations)
                        if adaptive:
                            row["adaptive_draft_count_histogram"] = result.stats.draft_count_histogram
                        print(
                            f"services alpha={alpha} B={batch} {mode}: {row['tokens_per_s'][mode]:.1f} tok/s",
                            flush=True,
                        )
    for failure in failures:
        print(f"LOSSLESS FAILURE: {failure}")
    return [ratios(r) for r in rows.values()], failures


def print_table(rows: list[dict], modes: list[str]) -> None:
    head = f"{'cell':<16}{'B':>5}" + "".join(f"{m:>12}" for m in modes)
    head += f"{'best fixed':>12}{'adapt/best':>11}{'adapt/t-o':>10}{'drafts/it':>10}"
    print("\ntokens/s per mode; drafts/it: adaptive's mean drafts verified per request and iteration")
    print(head)
    for r in rows:
        line = f"{r['cell']:<16}{r['batch']:>5}" + "".join(f"{r['tokens_per_s'][m]:>12.1f}" for m in modes)
        line += f"{r['best_fixed']:>12}{r['adaptive_vs_best_fixed']:>11.3f}{r['adaptive_vs_target_only']:>10.3f}"
        print(line + f"{r['mean_drafts']['adaptive']:>10.2f}")
    worst_best = min(r["adaptive_vs_best_fixed"] for r in rows)
    worst_to = min(r["adaptive_vs_target_only"] for r in rows)
    print(f"\nworst cell: adaptive / best fixed {worst_best:.3f}, adaptive / target_only {worst_to:.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specsplit-adaptive-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    max_k = max(args.ks)
    max_batch = max([*args.batches, *args.mixed_batches])
    engine = InProcessEngine(
        str(model), args.device, getattr(torch, args.dtype), args.load_format, args.num_blocks, max_batch, max_k
    )
    prompts = make_prompts(model, max_batch * args.waves, engine.target.config.vocab_size)
    reference = engine.run(prompts, args.new_tokens, 0).outputs  # target-only greedy: the lossless oracle
    bench = Bench(engine, prompts, reference, args)
    modes = ["target_only", *[f"k{k}" for k in args.ks], "adaptive"]
    rows = []
    if args.services:
        del engine, bench.engine  # the services load the model themselves
        rows, bench.failures = services_rows(args, model, work, prompts, reference, bench.oracle, modes)
    for cell in [] if args.services else cells(args, len(prompts)):
        rows.append(bench.cell(cell, modes))
        r = rows[-1]
        print(
            f"{r['cell']} B={r['batch']}: adaptive {r['tokens_per_s']['adaptive']:.1f} tok/s, "
            f"/best fixed ({r['best_fixed']}) {r['adaptive_vs_best_fixed']:.3f}, "
            f"/target_only {r['adaptive_vs_target_only']:.3f}",
            flush=True,
        )
    what = f"{args.shape or model.name} ({args.load_format} weights), {args.device} {args.dtype}"
    what += ", three services (colocated)" if args.services else ", one process"
    print(
        f"\nadaptive speculation: {what}, {args.waves} x B requests of {args.new_tokens} new tokens, "
        f"{time.monotonic() - t_begin:.0f} s"
    )
    print_table(rows, modes)
    out = args.out or (Path(os.environ["OUT"]) / "adaptive.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
        print(f"results: {out}")
    for failure in bench.failures:
        print(f"LOSSLESS FAILURE: {failure}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
