"""End-to-end decode speed: target-only vs the three services over gRPC vs the same engine objects
in one process, at several batch sizes and k, side by side in one run.

(a) target_only  — the in-process engine with k = 0 (scheduler → verifier runner, no drafter)
(b) services_<placement> — coordinator, verifier and drafter as three processes (`specsplit up`'s
                   LocalCluster) placed by --placement: `colocated` (Unix sockets, CUDA IPC on a GPU, the
                   device hand-off: the default) or `pooled` (the drafter over gRPC, hidden states by
                   --hidden-transport, grpc by default); the coordinator beside its verifier in both. One
                   placement per invocation: a second cluster idle on the same GPU measured 20-30 % slower
                   at batch 32 (benchmarks/results/e2e_h200.md)
(c) in_process   — scheduler → verifier runner → drafter runner → post_step, no gRPC
Each cell: B concurrent greedy requests of --new-tokens tokens (ignore_eos) on one prompt set; the
--repeats go round the cells (repeat r of every mode runs side by side), after one untimed warm-up of each;
tokens/s = B * new_tokens / wall time; time per output token per request; median iteration
breakdown (verify stages, propose steps, each hop; `benchmarks/e2e_modes.py`). Every output is
checked against the target-only greedy output (lossless); a mismatch fails the run after printing.

--alpha forces acceptance (`benchmarks/forced_acceptance.py`): drafts are the target's own greedy
continuation kept with probability alpha per position, so speed vs acceptance is measured on
random-weight models whose own drafts mean nothing.

    # demo checkpoint, real drafts
    python benchmarks/e2e.py --model checkpoints/demo --device cuda --dtype bfloat16 \\
        --batches 1 8 32 64 --ks 1 2 3 [--out results.json]
    # Qwen2-7B shape, random weights built on the GPU, forced acceptance (about 6 minutes on an H200)
    python benchmarks/e2e.py --shape qwen2-7b --load-format dummy --alpha 0.8 --device cuda \\
        --dtype bfloat16 --batches 1 8 32 64 --ks 1 2 3 --new-tokens 64 --repeats 3 --out e2e_7b.json
    # a tensor-parallel verifier on cuda:0-1, its pooled drafter on cuda:2 (target-only and in-process on cuda:0)
    python benchmarks/e2e.py --shape qwen2-7b --load-format dummy --alpha 0.8 --device cuda --dtype bfloat16 \\
        --verifier-tp 2 --placement pooled --batches 1 8 32 --ks 1 3 --new-tokens 64 --out e2e_tp2.json
    # CPU smoke run
    python benchmarks/e2e.py --shape qwen2-tiny --load-format dummy --alpha 0.8 --batches 1 --ks 1 --new-tokens 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.e2e_modes import InProcessEngine, RunResult, run_services  # noqa: E402
from benchmarks.e2e_report import add_comparisons, cell_row, print_tables  # noqa: E402
from benchmarks.forced_acceptance import ForcedAcceptanceRunner, Oracle  # noqa: E402
from benchmarks.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.launcher import LocalCluster  # noqa: E402
from specsplit.placement import PLACEMENTS, POOLED_TRANSPORTS  # noqa: E402

PROMPT_LEN = 64
ENGINE_NUM_BLOCKS = 4096  # the in-process engine's KV cache without --num-blocks (room for any batch here)
UP_SHARE = 0.9  # what `specsplit up` lets its services use of a GPU by default


def make_prompts(model: Path, count: int, vocab_size: int) -> list[list[int]]:
    """PROMPT_LEN-token windows of the checkpoint's held-out stdlib files (code the drafter can
    predict) when it lists them, else seeded random tokens. Prompts for a smaller batch are a
    prefix of those for a larger one."""
    out: list[list[int]] = []
    listed = model / "heldout_files.txt"
    if listed.exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for name in listed.read_text().split():
            if (stdlib / name).is_file():
                ids = tok.encode((stdlib / name).read_text(errors="replace"), add_special_tokens=False)
                out += [ids[i : i + PROMPT_LEN] for i in range(0, len(ids) - 2 * PROMPT_LEN, 4 * PROMPT_LEN)]
        out = out[:: max(1, len(out) // count)]
    if len(out) < count:  # random tokens (low acceptance with real drafts)
        g = torch.Generator().manual_seed(count)
        out += [torch.randint(3, vocab_size, (PROMPT_LEN,), generator=g).tolist() for _ in range(count - len(out))]
    return out[:count]


def check_lossless(name: str, runs: list[RunResult], expected: list[list[int]], failures: list[str]) -> None:
    for r in runs:
        for i, (got, want) in enumerate(zip(r.outputs, expected)):
            if got != want:
                first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                failures.append(f"{name}: prompt {i} differs from target-only greedy output at token {first}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "demo", help="checkpoint directory")
    where.add_argument("--shape", choices=sorted(SHAPES), help="a model shape from benchmarks/shapes.py")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--alpha", type=float, default=None, help="forced acceptance rate per draft position")
    p.add_argument("--seed", type=int, default=0, help="seed of the forced-acceptance coin")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--repeats", type=int, default=3, help="median over this many runs per cell; they go round the cells"
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache blocks of every verifier and drafter, an exact count (default: the services size theirs from "
        "device memory as `specsplit up` does, the in-process engine has 4096; on the CPU the services have 1024)",
    )
    p.add_argument(
        "--placement",
        default="colocated",
        choices=PLACEMENTS,
        help="the drafter placement of (b) (mode services_<placement>)",
    )
    p.add_argument(
        "--hidden-transport", default=None, choices=POOLED_TRANSPORTS, help="the pooled drafter's (default grpc)"
    )
    p.add_argument(
        "--verifier-tp",
        type=int,
        default=1,
        help="(b)'s verifier tensor-parallel on this many ranks (cuda:0 ..; a pooled drafter on the next GPU); "
        "(a) and (c) stay on one device",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.shape and args.load_format != "dummy":
        p.error("--shape has no weights: add --load-format dummy")
    return args


def services_memory_share(device: str, num_blocks: int | None) -> float | None:
    """The services' `--gpu-memory-utilization` (`up`'s, split between verifier and drafter on one device): what
    `up` would use less what this process holds on the GPU (the in-process engine, after its largest run, plus its
    CUDA context, taken as 1 GiB); None on the CPU or with --num-blocks."""
    if not device.startswith("cuda") or num_blocks is not None:
        return None
    total = torch.cuda.mem_get_info(device)[1]
    held = (torch.cuda.max_memory_reserved(device) + (1 << 30)) / total
    share = round(UP_SHARE - held, 3)
    print(f"[services: --gpu-memory-utilization {share} ({UP_SHARE} less this process's {held:.3f})]", file=sys.stderr)
    if share <= 0.2:
        sys.exit(f"the in-process engine holds {held:.2f} of the GPU: too little is left for the services")
    return share


def main() -> None:
    args = parse_args()
    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specsplit-e2e-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    max_k, max_batch = max(args.ks), max(args.batches)
    engine = InProcessEngine(
        str(model),
        args.device,
        getattr(torch, args.dtype),
        args.load_format,
        args.num_blocks or ENGINE_NUM_BLOCKS,
        max_batch,
        max_k,
    )
    all_prompts = make_prompts(model, max_batch, engine.target.config.vocab_size)
    reference = engine.run(all_prompts, args.new_tokens, 0).outputs  # target-only greedy: the lossless oracle
    services_share = services_memory_share(args.device, args.num_blocks)
    role_commands, env = {}, {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.alpha is not None:
        oracle = Oracle([p + o for p, o in zip(all_prompts, reference)], engine.target.config.vocab_size)
        oracle.save(work / "oracle.json")
        engine.wrap_drafter = lambda runner: ForcedAcceptanceRunner(runner, oracle, args.alpha, args.seed)
        forced = ["-m", "benchmarks.forced_drafter", "--alpha", str(args.alpha), "--oracle", str(work / "oracle.json")]
        role_commands["drafter"] = [sys.executable, *forced, "--seed", str(args.seed)]
    rows, failures = [], []
    with contextlib.ExitStack() as stack:
        clusters = {
            f"services_{placement}": stack.enter_context(
                LocalCluster(
                    str(model),
                    num_speculative_tokens=max_k,
                    device=args.device,
                    dtype=args.dtype,
                    log_dir=work / f"logs-{placement}",
                    load_format=args.load_format,
                    role_commands=role_commands,
                    placement=placement,
                    hidden_transport=args.hidden_transport if placement == "pooled" else None,
                    env=env,
                    coordinator_args=[
                        *["--max-num-seqs", str(max_batch)],
                        *["--max-num-batched-tokens", str(max(2048, max_batch * (max_k + 1)))],
                        "--no-adaptive",  # each k as asked: this benchmark compares placements at a fixed k
                    ],
                    verifier_args=[
                        *([] if args.num_blocks is None else ["--num-blocks", str(args.num_blocks)]),
                        *["--tensor-parallel-size", str(args.verifier_tp)],
                    ],
                    drafter_device=(
                        f"cuda:{args.verifier_tp}"
                        if args.verifier_tp > 1 and placement == "pooled" and args.device.startswith("cuda")
                        else None
                    ),
                    drafter_args=[] if args.num_blocks is None else ["--num-blocks", str(args.num_blocks)],
                    gpu_memory_utilization=services_share,
                )
            )
            for placement in [args.placement]
        }
        print(f"[set-up {time.monotonic() - t_begin:.0f}s; logs in {work}]", file=sys.stderr)
        transports = {mode: c.hidden_transport for mode, c in clusters.items()}
        for batch in args.batches:
            ps, expected = all_prompts[:batch], reference[:batch]
            cells = [(0, "target_only")] + [(k, mode) for k in args.ks for mode in ("in_process", *clusters)]

            def run(k: int, mode: str, ps=ps):
                if mode in clusters:
                    return run_services(clusters[mode].address, ps, args.new_tokens, k)
                return engine.run(ps, args.new_tokens, k)

            t_batch = time.monotonic()
            # Warm-up: every cell once, untimed. Its shapes make Triton compile the kernel variants they
            # need (the first process to see them pays, later ones read the on-disk cache); that compile
            # time must not land in one mode's timed runs and not in another's.
            for k, mode in cells:
                run(k, mode)
            # The repeats go round the cells, so that a slow spell of the machine touches every mode alike
            # and repeat r of each mode ran side by side with repeat r of the others.
            runs: dict[tuple[int, str], list] = {cell: [] for cell in cells}
            for _ in range(args.repeats):
                for k, mode in cells:
                    runs[k, mode].append(run(k, mode))
            for k, mode in cells:
                check_lossless(f"batch {batch} k {k} {mode}", runs[k, mode], expected, failures)
                rows.append(cell_row(batch, k, mode, args.new_tokens, runs[k, mode]))
            print(f"[batch {batch}: {len(cells)} cells in {time.monotonic() - t_batch:.1f}s]", file=sys.stderr)
    add_comparisons(rows)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    alpha = f"forced acceptance alpha={args.alpha}" if args.alpha is not None else "real drafts"
    print(
        f"\nmodel {args.shape or model} ({args.load_format} weights) on {device} ({args.dtype}), prompts {PROMPT_LEN} "
        f"tokens, {args.new_tokens} new tokens, greedy, {alpha}, hidden states by "
        f"{', '.join(f'{t} ({m})' for m, t in transports.items())}; "
        f"median of {args.repeats}; total {time.monotonic() - t_begin:.0f}s\n"
    )
    print_tables(rows)
    print(f"\nlossless: {'yes' if not failures else 'NO'} (every output equals the target-only greedy output)")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "hidden_transports": transports,
                    "rows": rows,
                    "lossless_failures": failures,
                },
                indent=1,
            )
        )
    if failures:
        print("\n".join(failures[:20]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
