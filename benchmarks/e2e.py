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
breakdown (verify stages, propose steps, each hop; `benchmarks/lib/e2e_modes.py`). Every output is
checked against the target-only greedy output (lossless); a mismatch fails the run after printing.

--alpha forces acceptance (`benchmarks/lib/forced_acceptance.py`): drafts are the target's own greedy
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
    # FP8 GLM-4.5-Air / DeepSeek-V3 (12 layers) on one H200, weights held once; results in $OUT/e2e-SHAPE.json, .md
    python benchmarks/e2e.py --shape glm-4.5-air-fp8 --load-format dummy --services-only --alpha 0.8 --device cuda \
        --dtype bfloat16 --batches 1 32 --ks 1 3 --new-tokens 32
    # ... their CPU smoke runs: --shape glm-tiny-fp8 / deepseek-v3-tiny-fp8 --services-only (device and dtype left out)

--structured json: every cell also runs with every request constrained to benchmarks/structured_output.py's JSON
schema (the SDK's `structured_output=`), as mode MODE+json beside MODE, its repeats going round with the others';
its outputs are checked against the constrained target-only run (lossless; with --alpha its outputs are the oracle of
the constrained requests, `benchmarks/lib/forced_acceptance.py`) and must follow the schema (complete JSON where they
reached the EOS). A table gives each constrained cell's tokens/s against its unconstrained twin. With --shape the
checkpoint's tokenizer is the synthetic 151,936-id vocabulary of the mask benchmark (`benchmarks/lib/structured.py`),
in the unconstrained modes too.

    python benchmarks/e2e.py --shape qwen2-7b --load-format dummy --alpha 0.8 --device cuda --dtype bfloat16 \
        --batches 1 32 --ks 3 --new-tokens 64 --structured json

--draft-vocab-sizes N ... (with --services-only): a set of services per drafter --draft-vocab-size, one after the other
(target-only on the first), as modes services_PLACEMENT:full and :dvN (benchmarks/results/draft_vocab.md).

    python benchmarks/e2e.py --shape qwen2-7b --load-format dummy --services-only --alpha 0.8 --device cuda \
        --dtype bfloat16 --batches 1 32 --ks 3 --new-tokens 64 --repeats 3 --warmup-tokens 64 \
        --draft-vocab-sizes 0 32768

--services-only: the in-process engine holds a second copy of the weights, which the FP8 GLM-4.5-Air and DeepSeek-V3
shapes do not leave room for. There (a) is the services with every request at 0 drafts (no Propose is sent), run at
every batch before the speculative cells; its outputs are the lossless reference and the oracle of forced acceptance
(the forced drafter reads it once written). The verifier's and drafter's --gpu-memory-utilization come from the
weights' bytes (`benchmarks/lib/weight_bytes.py.plan_shares`: up's 0.8 / 0.1, the drafter's raised where its MTP layer
needs more); a shape that would not fit stops in one line before anything loads.

Every run with --shape prints the roofline table: the median iteration against the time its active weights take
at 4.8 TB/s (verify step over batch x (k + 1) tokens, drafter steps, routed experts as the expected distinct count
under uniform routing; `benchmarks/lib/weight_bytes.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.lib.e2e_modes import InProcessEngine, RunResult, run_services, step_token_budget  # noqa: E402
from benchmarks.lib.e2e_report import add_comparisons, add_roofline, cell_row, print_roofline, print_tables  # noqa: E402
from benchmarks.lib.forced_acceptance import ForcedAcceptanceRunner, Oracle  # noqa: E402
from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402
from benchmarks.lib.structured import SPECS, OutputCheck, write_tokenizer  # noqa: E402
from benchmarks.lib.weight_bytes import ModelBytes, model_bytes, plan_shares  # noqa: E402
from specsplit.cli.launcher import LocalCluster  # noqa: E402
from specsplit.rpc.placement import PLACEMENTS, POOLED_TRANSPORTS  # noqa: E402
from specsplit.runtime.kv_cache_size import COLOCATED_DRAFTER_SHARE  # noqa: E402

PROMPT_LEN = 64
ENGINE_NUM_BLOCKS = 4096  # the in-process engine's KV cache without --num-blocks (room for any batch here)
UP_SHARE = 0.9  # what `specsplit up` lets its services use of a GPU by default
LOAD_TIMEOUT_S = 600  # --services-only: ~110 GB of FP8 dummy weights drawn, kernels compiled on a fresh machine


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
    where.add_argument("--shape", choices=sorted(SHAPES), help="a model shape from benchmarks/lib/shapes.py")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--alpha", type=float, default=None, help="forced acceptance rate per draft position")
    p.add_argument("--seed", type=int, default=0, help="seed of the forced-acceptance coin")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="median over this many runs per cell; they go round the cells (default 3)",
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
    p.add_argument(
        "--services-only",
        action="store_true",
        help="hold the weights once, in the services: (a) is the services with 0 drafts, run first (its outputs are "
        "the lossless reference and the forced-acceptance oracle), (c) is left out; the shares of verifier and "
        "drafter are planned from the weights' bytes (benchmarks/lib/weight_bytes.py), failing in one line if they do "
        "not fit. For shapes whose second copy does not fit the GPU (glm-4.5-air-fp8, deepseek-v3-fp8). Defaults "
        "then: --repeats 1, --warmup-tokens 8",
    )
    p.add_argument(
        "--structured",
        choices=sorted(SPECS),
        default=None,
        help="also run every cell with every request constrained to this response format (mode MODE+KIND), checked "
        "against the constrained target-only output and the format; with --shape the checkpoint gets the synthetic "
        "151,936-id tokenizer the grammar masks run over (benchmarks/lib/structured.py)",
    )
    p.add_argument(
        "--draft-vocab-sizes",
        type=int,
        nargs="+",
        default=None,
        help="--services-only: one set of services per drafter --draft-vocab-size (0: the full vocabulary), one "
        "after the other, as modes services_PLACEMENT:dvN / :full (default: one set, the drafter's default)",
    )
    p.add_argument("--warmup-tokens", type=int, default=None, help="new tokens of each cell's untimed warm-up run")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default with $OUT: $OUT/e2e-NAME.json)")
    args = p.parse_args()
    if args.shape and args.load_format != "dummy":
        p.error("--shape has no weights: add --load-format dummy")
    if args.services_only and args.verifier_tp != 1:
        p.error("--services-only plans one GPU: leave out --verifier-tp")
    if args.services_only and args.structured:
        p.error("--structured runs beside the in-process engine: leave out --services-only")
    if args.draft_vocab_sizes and not args.services_only:
        p.error("--draft-vocab-sizes starts a set of services per size: add --services-only")
    if args.repeats is None:
        args.repeats = 1 if args.services_only else 3
    if args.warmup_tokens is None:
        args.warmup_tokens = min(8, args.new_tokens) if args.services_only else args.new_tokens
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / f"e2e-{args.shape or args.model.name}.json"
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


def make_cluster(
    args, model: Path, work: Path, role_commands: dict, share: float | None, verifier_args=(), drafter_args=()
):
    """(b)'s services, placed by --placement (not started)."""
    max_k, max_batch = max(args.ks), max(args.batches)
    placement = args.placement
    return LocalCluster(
        str(model),
        num_speculative_tokens=max_k,
        device=args.device,
        dtype=args.dtype,
        log_dir=work / f"logs-{placement}",
        load_format=args.load_format,
        role_commands=role_commands,
        placement=placement,
        hidden_transport=args.hidden_transport if placement == "pooled" else None,
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        coordinator_args=[
            *["--max-num-seqs", str(max_batch)],
            *["--max-num-batched-tokens", str(step_token_budget(max_batch, max_k))],
            "--no-adaptive",  # each k as asked: this benchmark compares placements at a fixed k
        ],
        verifier_args=[
            *([] if args.num_blocks is None else ["--num-blocks", str(args.num_blocks)]),
            *["--tensor-parallel-size", str(args.verifier_tp)],
            *verifier_args,
        ],
        drafter_device=(
            f"cuda:{args.verifier_tp}"
            if args.verifier_tp > 1 and placement == "pooled" and args.device.startswith("cuda")
            else None
        ),
        drafter_args=[*([] if args.num_blocks is None else ["--num-blocks", str(args.num_blocks)]), *drafter_args],
        gpu_memory_utilization=share,
    )


def forced_drafter_command(args, oracle_path: Path) -> dict[str, list[str]]:
    """The drafter's command under --alpha: `benchmarks.lib.forced_drafter` (reads the oracle once it is written)."""
    if args.alpha is None:
        return {}
    forced = ["-m", "benchmarks.lib.forced_drafter", "--alpha", str(args.alpha), "--oracle", str(oracle_path)]
    return {"drafter": [sys.executable, *forced, "--seed", str(args.seed)]}


def save_oracle(oracle: Oracle, path: Path) -> None:
    """Written whole, then renamed into place: a drafter started before may look for it at any moment."""
    partial = path.with_suffix(".partial")
    oracle.save(partial)
    os.replace(partial, path)


def copy_logs(source: Path, target: Path) -> None:
    """The services' logs into `target` (a convenience: nothing fails for it)."""
    with contextlib.suppress(OSError):
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)


def write_results(out: Path, args, result: dict, markdown: str) -> None:
    """The run's JSON (with its arguments) at `out` and its tables as Markdown beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}} | result, indent=1))
    out.with_suffix(".md").write_text(markdown)


def run_cells(cells, run, repeats: int, warmup_tokens: int, new_tokens: int) -> dict:
    """Every cell once, untimed (`warmup_tokens` new tokens), then `repeats` rounds of every cell."""
    # Warm-up: its shapes make Triton compile the kernel variants they need (the first process to see them pays,
    # later ones read the on-disk cache); that compile time must not land in one mode's timed runs and not in
    # another's.
    for k, mode in cells:
        run(k, mode, warmup_tokens)
    # The repeats go round the cells, so that a slow spell of the machine touches every mode alike and repeat r
    # of each mode ran side by side with repeat r of the others.
    runs: dict[tuple[int, str], list] = {cell: [] for cell in cells}
    for _ in range(repeats):
        for k, mode in cells:
            runs[k, mode].append(run(k, mode, new_tokens))
    return runs


def check_structured(check: OutputCheck, name: str, runs: list[RunResult]) -> dict:
    """A constrained cell's row entries: what in its runs' outputs does not follow the response format
    (`OutputCheck`), and how many of its first run's outputs reached the EOS (complete JSON texts)."""
    problems, ended = [], []
    for r in runs:
        wrong, finished = check.problems(name, r.outputs)
        problems += wrong
        ended.append(finished)
    return {"format_problems": problems, "outputs_ended": ended[0]}


def with_engine(args, model: Path, work: Path, t_begin: float):
    """(a) and (c) on the in-process engine, (b) beside it: two copies of the weights on the device. With
    --structured every mode also runs constrained (MODE+KIND) beside it."""
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
    kinds = ["", *([args.structured] if args.structured else [])]  # "": unconstrained
    # Target-only greedy, per kind: the lossless oracle (of the constrained runs: under the same response format).
    reference = {kind: engine.run(all_prompts, args.new_tokens, 0, SPECS.get(kind)).outputs for kind in kinds}
    check = OutputCheck(model, args.structured) if args.structured else None
    services_share = services_memory_share(args.device, args.num_blocks)
    role_commands = forced_drafter_command(args, work / "oracle.json")
    if args.alpha is not None:
        sequences = {kind: [p + o for p, o in zip(all_prompts, reference[kind])] for kind in kinds}
        oracle = Oracle(sequences[""], engine.target.config.vocab_size, sequences.get(args.structured))
        save_oracle(oracle, work / "oracle.json")
        engine.wrap_drafter = lambda runner: ForcedAcceptanceRunner(runner, oracle, args.alpha, args.seed)
    rows, failures = [], []
    with make_cluster(args, model, work, role_commands, services_share) as cluster:
        print(f"[set-up {time.monotonic() - t_begin:.0f}s; logs in {work}]", file=sys.stderr)
        mode_b = f"services_{args.placement}"
        for batch in args.batches:
            ps = all_prompts[:batch]
            modes = [(0, "target_only")] + [(k, mode) for k in args.ks for mode in ("in_process", mode_b)]
            cells = [(k, f"{mode}+{kind}" if kind else mode) for k, mode in modes for kind in kinds]

            def run(k: int, mode: str, new_tokens: int, ps=ps):
                base, _, kind = mode.partition("+")
                if base == mode_b:
                    return run_services(cluster.address, ps, new_tokens, k, SPECS.get(kind))
                return engine.run(ps, new_tokens, k, SPECS.get(kind))

            t_batch = time.monotonic()
            runs = run_cells(cells, run, args.repeats, args.warmup_tokens, args.new_tokens)
            for k, mode in cells:
                name, kind = f"batch {batch} k {k} {mode}", mode.partition("+")[2]
                check_lossless(name, runs[k, mode], reference[kind][:batch], failures)
                rows.append(cell_row(batch, k, mode, args.new_tokens, runs[k, mode]))
                if kind:
                    rows[-1] |= check_structured(check, name, runs[k, mode])
            print(f"[batch {batch}: {len(cells)} cells in {time.monotonic() - t_batch:.1f}s]", file=sys.stderr)
    return rows, failures, {mode_b: cluster.hidden_transport}


def services_only(args, model: Path, work: Path, t_begin: float, sizes: ModelBytes, partial):
    """(a) and (b) through one set of services, the weights held once: target-only (every request at 0 drafts) at
    every batch first, its outputs the lossless reference of the speculative cells and (max batch) the oracle of
    forced acceptance, which the drafter reads once written."""
    max_k, max_batch = max(args.ks), max(args.batches)
    max_model_len = max(1024, PROMPT_LEN + args.new_tokens + max_k + 1)  # requests need less
    verifier_args = ["--max-model-len", str(max_model_len)]
    drafter_args: list[str] = []
    if args.device.startswith("cuda") and args.num_blocks is None:
        total = torch.cuda.get_device_properties(args.device).total_memory
        plan = plan_shares(
            sizes,
            total,
            UP_SHARE,
            COLOCATED_DRAFTER_SHARE,
            kv_tokens=max(max_model_len, max_batch * (PROMPT_LEN + args.new_tokens + max_k + 1)),
            max_step_tokens=step_token_budget(max_batch, max_k),
        )
        print(plan.describe(), file=sys.stderr)
        if not plan.fits:
            sys.exit(plan.refusal())
        verifier_args += ["--gpu-memory-utilization", f"{plan.verifier:g}"]
        drafter_args += ["--gpu-memory-utilization", f"{plan.drafter:g}"]
    all_prompts = make_prompts(model, max_batch, sizes.vocab_size)
    oracle_path = work / "oracle.json"
    rows, failures, reference, transports = [], [], {}, {}
    # One set of services per draft vocabulary size, one after the other (a second set idle on the GPU slows the
    # first); target-only runs on the first.
    for index, vocab in enumerate(args.draft_vocab_sizes or [None]):
        mode_b = f"services_{args.placement}" + ("" if vocab is None else f":dv{vocab}" if vocab else ":full")
        extra = [] if vocab is None else ["--draft-vocab-size", str(vocab)]
        cluster = make_cluster(
            args,
            model,
            work / mode_b,
            forced_drafter_command(args, oracle_path),
            None,
            verifier_args,
            [*drafter_args, *extra],
        )
        with contextlib.ExitStack() as stack:
            if args.out:  # the services' logs beside the results, once they are stopped (also after a failed start)
                logs = args.out.with_name(f"{args.out.stem}-logs{'' if vocab is None else '-' + mode_b}")
                stack.callback(copy_logs, cluster.log_dir, logs)
            cluster.start(timeout_s=LOAD_TIMEOUT_S)  # (its __enter__ would start it with the default 300 s)
            stack.callback(cluster.stop)
            print(f"[{mode_b} loaded in {time.monotonic() - t_begin:.0f}s; logs in {work}]", file=sys.stderr)
            transports[mode_b] = cluster.hidden_transport

            def run(k: int, mode: str, new_tokens: int, ps, cluster=cluster):
                return run_services(cluster.address, ps, new_tokens, k)

            phases = ([([0], ["target_only"])] if index == 0 else []) + [(args.ks, [mode_b])]
            for ks, modes in phases:
                for batch in args.batches:
                    ps, cells = all_prompts[:batch], [(k, mode) for k in ks for mode in modes]
                    t_batch = time.monotonic()
                    runs = run_cells(
                        cells,
                        lambda k, mode, n, ps=ps: run(k, mode, n, ps),
                        args.repeats,
                        args.warmup_tokens,
                        args.new_tokens,
                    )
                    for k, mode in cells:
                        if mode == "target_only":  # the reference: its first run, which its repeats must equal
                            reference[batch] = runs[k, mode][0].outputs
                        check_lossless(f"batch {batch} k {k} {mode}", runs[k, mode], reference[batch], failures)
                        rows.append(cell_row(batch, k, mode, args.new_tokens, runs[k, mode]))
                    t = time.monotonic() - t_batch
                    print(f"[batch {batch}: {len(cells)} cells in {t:.1f}s]", file=sys.stderr)
                    partial(rows, failures, transports)
                if args.alpha is not None and not oracle_path.exists():
                    sequences = [p + o for p, o in zip(all_prompts, reference[max_batch])]
                    save_oracle(Oracle(sequences, sizes.vocab_size), oracle_path)
    return rows, failures, transports


def publish(args, model, rows: list[dict], failures: list[str], transports: dict, sizes, t_begin: float, final: bool):
    """The tables (printed when `final`) and, with --out, the JSON and the tables as Markdown beside it: written
    after every batch by --services-only, so that a run cut short keeps what it measured."""
    rows = sorted(rows, key=lambda r: (args.batches.index(r["batch"]), r["k"]))
    add_comparisons(rows)
    if sizes is not None:
        add_roofline(rows, sizes)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    alpha = f"forced acceptance alpha={args.alpha}" if args.alpha is not None else "real drafts"
    if args.structured:
        alpha += f"; modes +{args.structured}: every request constrained to the {args.structured} response format"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(
            f"model {args.shape or model} ({args.load_format} weights) on {device} ({args.dtype}), prompts "
            f"{PROMPT_LEN} tokens, {args.new_tokens} new tokens, greedy, {alpha}, hidden states by "
            f"{', '.join(f'{t} ({m})' for m, t in transports.items())}; "
            f"median of {args.repeats}; {'total' if final else 'so far (the run goes on)'} "
            f"{time.monotonic() - t_begin:.0f}s\n"
        )
        if sizes is not None:
            print_roofline(rows, sizes)
        print_tables(rows)
        print(f"\nlossless: {'yes' if not failures else 'NO'} (every output equals the target-only greedy output)")
        if args.structured:
            wrong = any(r.get("format_problems") for r in rows)
            print(f"{args.structured}: {'NO' if wrong else 'yes'} (every constrained output follows its format)")
    if final:
        print("\n" + out.getvalue(), end="")
    if args.out:
        result = {"hidden_transports": transports, "rows": rows, "lossless_failures": failures, "complete": final}
        write_results(args.out, args, result, out.getvalue())


def stop_on_sigterm(script: str) -> None:
    """A time limit's SIGTERM (`timeout`) unwinds `script`, so that its services are stopped before the process exits
    (what it measured so far is in --out)."""

    def stop(signum, frame) -> None:
        raise SystemExit(f"{script}: SIGTERM: the services are stopped; what was measured is in --out ($OUT)")

    signal.signal(signal.SIGTERM, stop)


def main() -> None:
    args = parse_args()
    stop_on_sigterm("e2e.py")
    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specsplit-e2e-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    if args.shape and args.structured:  # the grammar masks' vocabulary (the shape's copy of the demo's is 4096 ids)
        write_tokenizer(model, json.loads((model / "config.json").read_text())["vocab_size"])
    sizes = (
        model_bytes(
            json.loads((model / "config.json").read_text()),
            torch.tensor([], dtype=getattr(torch, args.dtype)).element_size(),
        )
        if args.shape
        else None
    )

    def partial(rows: list[dict], failures: list[str], transports: dict) -> None:
        publish(args, model, rows, failures, transports, sizes, t_begin, final=False)

    if args.services_only:
        if sizes is None:
            sys.exit("--services-only plans the services' memory from a shape's bytes: give --shape")
        rows, failures, transports = services_only(args, model, work, t_begin, sizes, partial)
    else:
        rows, failures, transports = with_engine(args, model, work, t_begin)
    publish(args, model, rows, failures, transports, sizes, t_begin, final=True)
    failures += [problem for r in rows for problem in r.get("format_problems", [])]
    if failures:
        print("\n".join(failures[:20]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
