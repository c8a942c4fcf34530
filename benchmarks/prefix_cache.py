"""Automatic prefix caching through the three services: time to first token and tokens/s with caching on and off,
on prompts that share a long system prompt and on prompts that share nothing, and every output of one equal to the
other's.

Workloads, each request greedy with ignore_eos, its prompt as token ids through the SDK:

- `shared`: one system prompt of --prefix-tokens (P) tokens, then a user turn of --user-tokens (U) tokens of the
  request's own;
- `unshared`: prompts of P + U tokens of their own (nothing shared).

A cell is one workload at one batch B of --batches: --requests (N) requests, B in flight at a time (a semaphore, in
order), --new-tokens (T) each. Before its timed requests a cell sends one untimed request: the system prompt alone in
`shared` (it puts the prompt's blocks in the cache when caching is on), a prompt of P + U tokens of its own in
`unshared`; so the first request of a cell does not pay a warm-up the others do not. Every cell has prompts of its own
in every round (seeded by --seed, the workload, the batch and the round), so no cell starts on the blocks of another or
of its own earlier round. Per cell: the time to the first token (from sending a request to its first delta that carries
tokens, the SDK's stream) at p50 and p99 over every round's requests, tokens/s (rounds x N x T / the rounds' wall
time), the sum of the cached prompt tokens the requests' usage reports, and the outputs.

Two clusters up at once, `specsplit up`'s (`LocalCluster`: co-located drafter, k 3 (`--adaptive`: adaptive
speculation), the servers' token budget per step), one with `--no-enable-prefix-caching` and one with caching on (the
default), each with --max-num-seqs the largest batch; on CUDA each takes half of `up`'s share of the device
(`--gpu-memory-utilization` 0.45). Each of --rounds rounds runs every cell on both, the same prompts, the two clusters'
order alternating from cell to cell and round to round (off-on, on-off, ...): run one cluster after the other, a
cluster's place in the run moved its speed by as much as caching's cost was to be shown under (docs/performance.md).
Checks, which fail the run after the tables: every output with caching on equals the one with caching off (greedy:
lossless); off reports no cached tokens; on, `shared` reports at least N x (the system prompt's full blocks less one)
cached tokens per round (the last full block may be computed again, `specsplit/coordinator/prefix_cache.py`'s `lookup`)
and `unshared` none. The JSON (with every output) and the tables as Markdown go to --out (default with $OUT:
$OUT/prefix-cache-NAME.json, .md beside it), written after every round too, so that a run cut short keeps what it
measured; the services' logs beside them.

    # the Qwen2-7B shape, random weights built on the GPU: 64 requests per cell and cluster, in two rounds of 32
    python benchmarks/prefix_cache.py --shape qwen2-7b --load-format dummy --device cuda --dtype bfloat16 \\
        --batches 1 32 --requests 32 --rounds 2 --prefix-tokens 2048 --user-tokens 64 --new-tokens 32
    # the demo checkpoint on the CPU (2,048 positions: P + U + T must fit)
    python benchmarks/prefix_cache.py --batches 1 8 --requests 16 --prefix-tokens 1536
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.e2e import copy_logs, stop_on_sigterm, write_results  # noqa: E402
from benchmarks.lib.e2e_modes import step_token_budget  # noqa: E402
from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.cli.launcher import LocalCluster  # noqa: E402
from specsplit.client.results import Collector  # noqa: E402
from specsplit.client.sdk import AsyncClient  # noqa: E402
from specsplit.coordinator.server import scheduling_flags  # noqa: E402

WORKLOADS = ("shared", "unshared")
CACHING = {"off": False, "on": True}  # "off" is the reference of the lossless check
NUM_SPECULATIVE_TOKENS = 3  # `specsplit up`'s default k
CLUSTER_SHARE = 0.45  # of a CUDA device, each cluster's --gpu-memory-utilization: two share `up`'s 0.9
REQUEST_TIMEOUT_S = 900


@dataclass
class Cell:
    workload: str
    batch: int
    warmup: list[int]  # the untimed request's prompt
    prompts: list[list[int]]


@dataclass
class CellRun:
    seconds: float  # from the first request sent to the last one finished
    ttft: list[float]  # per request, seconds
    outputs: list[list[int]]
    cached_tokens: list[int]
    prompt_tokens: list[int]


def make_cells(args, vocab_size: int, round_: int) -> list[Cell]:
    """One round's cells, random token ids (ids 0-2 left out: special in the demo's vocabulary), seeded by --seed,
    the workload, the batch and the round: the same for both clusters and in every process, and no two cells (or
    rounds of a cell) alike."""
    cells = []
    for batch in args.batches:
        for workload in args.workloads:
            rng = random.Random(f"{args.seed}:{workload}:{batch}:{round_}")

            def draw(n: int, rng=rng) -> list[int]:
                return [rng.randrange(3, vocab_size) for _ in range(n)]

            if workload == "shared":
                system = draw(args.prefix_tokens)
                cells.append(
                    Cell(workload, batch, system, [system + draw(args.user_tokens) for _ in range(args.requests)])
                )
            else:
                length = args.prefix_tokens + args.user_tokens
                cells.append(Cell(workload, batch, draw(length), [draw(length) for _ in range(args.requests)]))
    return cells


def cluster_order(round_: int, cell_index: int) -> tuple[str, str]:
    """Which cluster runs a cell first: off-on and on-off in turn, cell by cell and round by round."""
    return ("off", "on") if (round_ + cell_index) % 2 == 0 else ("on", "off")


async def one_request(client: AsyncClient, prompt: list[int], new_tokens: int):
    """(seconds to the first delta with tokens, the GenerationResult)."""
    collector, ttft = Collector(), None
    sent = time.perf_counter()
    async for delta in client.stream(prompt_token_ids=prompt, max_tokens=new_tokens, ignore_eos=True, temperature=0.0):
        if ttft is None and delta.token_ids:
            ttft = time.perf_counter() - sent
        collector.add(delta)
    return ttft, collector.result()


async def run_cell(client: AsyncClient, cell: Cell, new_tokens: int) -> CellRun:
    """The cell's untimed request, then its requests, `cell.batch` in flight at a time, sent in order."""
    await one_request(client, cell.warmup, new_tokens)
    slots = asyncio.Semaphore(cell.batch)

    async def timed(prompt: list[int]):
        async with slots:
            return await one_request(client, prompt, new_tokens)

    t0 = time.perf_counter()
    done = await asyncio.gather(*(timed(p) for p in cell.prompts))
    seconds = time.perf_counter() - t0
    return CellRun(
        seconds,
        [ttft for ttft, _ in done],
        [r.token_ids for _, r in done],
        [r.cached_tokens for _, r in done],
        [r.prompt_tokens for _, r in done],
    )


async def run_round(clients: dict[str, AsyncClient], cells: list[Cell], round_: int, new_tokens: int):
    """Every cell of one round on both clusters, in `cluster_order`: {(caching, cell index): CellRun}."""
    runs = {}
    for i, cell in enumerate(cells):
        for caching in cluster_order(round_, i):
            t0 = time.monotonic()
            runs[caching, i] = await run_cell(clients[caching], cell, new_tokens)
            print(
                f"[round {round_} {cell.workload} batch {cell.batch} caching {caching}: {time.monotonic() - t0:.1f}s]",
                file=sys.stderr,
            )
    return runs


async def run_rounds(addresses: dict[str, str], rounds: list[list[Cell]], new_tokens: int, report) -> None:
    """Every round through one client per cluster (connected before the first cell); after each round
    `report(runs so far: {(caching, cell index): [CellRun per round]}, the verifier's block size)`."""
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            caching: await stack.enter_async_context(AsyncClient(address, timeout=REQUEST_TIMEOUT_S))
            for caching, address in addresses.items()
        }
        block_size = (await clients["on"].model_info()).block_size
        runs: dict[tuple[str, int], list[CellRun]] = {}
        for r, cells in enumerate(rounds):
            for key, run in (await run_round(clients, cells, r, new_tokens)).items():
                runs.setdefault(key, []).append(run)
            report(runs, block_size)


def make_cluster(args, model: Path, work: Path, caching: bool) -> LocalCluster:
    """`specsplit up`'s services (its defaults; --max-num-seqs the largest batch; on CUDA CLUSTER_SHARE of the
    device), prefix caching on or off."""
    max_batch = max(args.batches)
    return LocalCluster(
        str(model),
        num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
        device=args.device,
        dtype=args.dtype,
        log_dir=work / f"logs-caching-{'on' if caching else 'off'}",
        load_format=args.load_format,
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        gpu_memory_utilization=CLUSTER_SHARE if args.device.startswith("cuda") else None,
        coordinator_args=scheduling_flags(
            max_batch,
            step_token_budget(max_batch, NUM_SPECULATIVE_TOKENS),
            adaptive=args.adaptive,
            enable_prefix_caching=caching,
        ),
    )


def cell_row(caching: str, cell: Cell, runs: list[CellRun], new_tokens: int) -> dict:
    """One cluster's cell over its rounds so far (`runs`, in round order)."""
    seconds = sum(run.seconds for run in runs)
    ttft = [t for run in runs for t in run.ttft]
    cached = [n for run in runs for n in run.cached_tokens]
    requests = sum(len(run.outputs) for run in runs)
    return {
        "caching": caching,
        "workload": cell.workload,
        "batch": cell.batch,
        "requests": requests,
        "seconds": seconds,
        "round_seconds": [run.seconds for run in runs],
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tokens_per_s": requests * new_tokens / seconds,
        "cached_tokens": sum(cached),
        "prompt_tokens": sum(n for run in runs for n in run.prompt_tokens),
        "ttft_s": ttft,
        "cached_tokens_per_request": cached,
        "outputs": [output for run in runs for output in run.outputs],
    }


def pooled_rows(cells: list[Cell], runs: dict[tuple[str, int], list[CellRun]], new_tokens: int) -> list[dict]:
    """A row per cluster and cell (`cells`: one round's, for their workloads and batches) over its rounds."""
    return [
        cell_row(caching, cell, runs[caching, i], new_tokens) for caching in CACHING for i, cell in enumerate(cells)
    ]


def ratios(rows: list[dict]) -> list[dict]:
    """Caching on / off per workload and batch, over the rounds; and each round's tokens/s on / off."""
    by = {(r["caching"], r["workload"], r["batch"]): r for r in rows}
    out = []
    for (caching, workload, batch), on in by.items():
        off = by.get(("off", workload, batch))
        if caching == "on" and off:
            out.append(
                {
                    "workload": workload,
                    "batch": batch,
                    **{key: on[key] / off[key] for key in ("ttft_p50_s", "ttft_p99_s", "tokens_per_s")},
                    "tokens_per_s_rounds": [a / b for a, b in zip(off["round_seconds"], on["round_seconds"])],
                }
            )
    return out


def check(rows: list[dict], args, block_size: int) -> list[str]:
    """What is wrong: outputs with caching on that differ from those with it off, cached tokens off, too few cached
    tokens on in `shared` (the system prompt's full blocks less one per request), any in `unshared`."""
    failures = []
    by = {(r["caching"], r["workload"], r["batch"]): r for r in rows}
    per_request = max(0, (args.prefix_tokens // block_size - 1) * block_size)
    for (caching, workload, batch), r in by.items():
        name = f"caching {caching} {workload} batch {batch}"
        least = len(r["outputs"]) * per_request
        if caching == "off" and r["cached_tokens"]:
            failures.append(f"{name}: {r['cached_tokens']} cached tokens reported with caching off")
        if caching != "on":
            continue
        if workload == "shared" and r["cached_tokens"] < least:
            failures.append(f"{name}: {r['cached_tokens']} cached tokens reported, expected at least {least}")
        if workload == "unshared" and r["cached_tokens"]:
            failures.append(f"{name}: {r['cached_tokens']} cached tokens reported where no prompt shares a block")
        off = by.get(("off", workload, batch))
        for i, (got, want) in enumerate(zip(r["outputs"], off["outputs"] if off else [])):
            if got != want:
                first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                failures.append(
                    f"{name}: request {i} differs from caching off at token {first}: {got[first : first + 8]} "
                    f"against {want[first : first + 8]}"
                )
    return failures


def publish(args, rows: list[dict], failures: list[str], block_size: int, device: str, t_begin: float, final: bool):
    """The tables (printed when `final`) and, with --out, the JSON and the tables as Markdown beside it."""
    rounds = len(rows[0]["round_seconds"]) if rows else 0
    by_ratio = ratios(rows)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(
            f"model {args.shape or args.model} ({args.load_format} weights) on {device} ({args.dtype}); system prompt "
            f"{args.prefix_tokens} tokens, user turn {args.user_tokens}, {args.new_tokens} new tokens, greedy, "
            f"ignore_eos; {args.requests} requests per cell and round, {rounds} round(s); "
            f"KV block {block_size} tokens; "
            f"{'total' if final else 'so far (the run goes on)'} {time.monotonic() - t_begin:.0f}s\n"
        )
        print("| caching | workload | batch | TTFT p50 s | TTFT p99 s | tokens/s | cached tokens | prompt tokens |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['caching']} | {r['workload']} | {r['batch']} | {r['ttft_p50_s']:.4f} | {r['ttft_p99_s']:.4f} | "
                f"{r['tokens_per_s']:.1f} | {r['cached_tokens']} | {r['prompt_tokens']} |"
            )
        if by_ratio:
            print("\nCaching on / off (TTFT: lower is better; tokens/s: higher is better):\n")
            print("| workload | batch | TTFT p50 | TTFT p99 | tokens/s | tokens/s per round |")
            print("|---|---|---|---|---|---|")
            for r in by_ratio:
                per_round = ", ".join(f"{x:.3f}" for x in r["tokens_per_s_rounds"])
                print(
                    f"| {r['workload']} | {r['batch']} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                    f"{r['tokens_per_s']:.3f} | {per_round} |"
                )
        if final:
            print(
                f"\nlossless and cached tokens: {'yes' if not failures else 'NO'} (every output with caching on equals "
                "the one with caching off; cached tokens as expected)"
            )
    if final:
        print("\n" + out.getvalue(), end="")
    if args.out:
        result = {
            "device": device,
            "block_size": block_size,
            "rows": rows,
            "ratios": by_ratio,
            "failures": failures,
            "complete": final,
        }
        write_results(args.out, args, result, out.getvalue())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "demo", help="checkpoint directory")
    where.add_argument("--shape", choices=sorted(SHAPES), help="a model shape from benchmarks/lib/shapes.py")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="requests in flight at a time, per cell")
    p.add_argument("--requests", type=int, default=64, help="timed requests per cell")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="the shared system prompt's tokens (P)")
    p.add_argument("--user-tokens", type=int, default=64, help="each request's own user turn's tokens (U)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (T)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--rounds", type=int, default=2, help="rounds of every cell on both clusters, each on prompts of its own"
    )
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="cells to run")
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="adaptive speculation (`up --adaptive`; default: every request k drafts, as `up` runs, so that the two "
        "clusters' draft choices cannot differ)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON results (default with $OUT: $OUT/prefix-cache-NAME.json)"
    )
    args = p.parse_args()
    if args.shape and args.load_format != "dummy":
        p.error("--shape has no weights: add --load-format dummy")
    if min(args.batches) < 1 or min(args.requests, args.prefix_tokens, args.user_tokens, args.rounds) < 1:
        p.error("--batches, --requests, --prefix-tokens, --user-tokens and --rounds must be >= 1")
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / f"prefix-cache-{args.shape or args.model.name}.json"
    return args


def main() -> None:
    args = parse_args()
    stop_on_sigterm("prefix_cache.py")
    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specsplit-prefix-cache-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    config = json.loads((model / "config.json").read_text())
    longest, positions = args.prefix_tokens + args.user_tokens + args.new_tokens, config["max_position_embeddings"]
    if longest > positions:
        sys.exit(
            f"prefix_cache.py: P + U + T = {longest} tokens is more than the model's {positions} positions: lower "
            "--prefix-tokens, --user-tokens or --new-tokens"
        )
    device = "cpu"
    if args.device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name(args.device)
    rounds = [make_cells(args, config["vocab_size"], r) for r in range(args.rounds)]
    rows: list[dict] = []
    block_size = 0
    with contextlib.ExitStack() as stack:
        clusters = {}
        for caching, enabled in CACHING.items():  # one after the other: each measures its memory on its own
            cluster = make_cluster(args, model, work, enabled)
            if args.out:  # the services' logs beside the results, once they are stopped (also after a failed start)
                stack.callback(copy_logs, cluster.log_dir, args.out.with_name(f"{args.out.stem}-logs-{caching}"))
            clusters[caching] = stack.enter_context(cluster)
            print(
                f"[caching {caching}: services up at {time.monotonic() - t_begin:.0f}s; logs in {work}]",
                file=sys.stderr,
            )

        def report(runs: dict[tuple[str, int], list[CellRun]], size: int) -> None:
            nonlocal rows, block_size
            rows, block_size = pooled_rows(rounds[0], runs, args.new_tokens), size
            publish(args, rows, [], block_size, device, t_begin, final=False)

        addresses = {caching: cluster.address for caching, cluster in clusters.items()}
        asyncio.run(run_rounds(addresses, rounds, args.new_tokens, report))
    failures = check(rows, args, block_size)
    publish(args, rows, failures, block_size, device, t_begin, final=True)
    if failures:
        print("\n".join(failures[:20]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
