"""One step of a model server timed on its own: the target's decode (or verify) step, its prefill step, or the
drafter's propose.

    PYTHONPATH=. python benchmarks/step.py --phase decode --batch-sizes 1,32 --out runs/decode.json   # H200
    PYTHONPATH=. python benchmarks/step.py --phase decode --model checkpoints/demo --batch-sizes 1,32
    PYTHONPATH=. python benchmarks/step.py --phase prefill --prompts 64,256 --context 1024 --steps 5
    PYTHONPATH=. python benchmarks/step.py --phase propose --batch-sizes 1,32 --k 3
    # the same with draft vocabularies of 16,384 and 32,768 ids beside the full one (a runner each)
    PYTHONPATH=. python benchmarks/step.py --phase propose --batch-sizes 1,32 --k 3 --draft-vocab-sizes 0,16384,32768
    # a 72B-shaped target's verify step at TP 2, 4 and 8 (8 GPUs; TP 1 does not fit one GPU in bf16)
    PYTHONPATH=. python benchmarks/step.py --phase decode --shape qwen2-72b --tp 2,4,8 --batch-sizes 1,8,32 --k 3
    PYTHONPATH=. python benchmarks/step.py --phase decode --device cpu --tiny --dtype float32   # smoke check

The model: `--shape` (benchmarks/lib/shapes.py; default qwen2-7b, Qwen2-7B's layout) with random weights built on
the device (the loader's dummy weights), `--model DIR` a checkpoint's weights, `--tiny` the qwen2-tiny shape.

Phases (`--phase`):
- `decode`: `--batch-sizes` requests holding `--context` tokens each run one step of k + 1 new tokens each (`--k`:
  0, a decode step, by default; k > 0 a verify step), logits of every row;
- `prefill`: one request's chunk of P prompt tokens (`--prompts`) after `--context` cached ones (a later chunk of
  a chunked prefill), logits of its last row;
- `propose`: the drafter's `DrafterRunner.propose` for `--batch-sizes` requests holding `--context` tokens of MTP
  KV, each bringing k + 1 hidden-state rows (a fully accepted iteration) and getting k drafts: host planning,
  uploads, MTP step 0 and steps 1..k-1, the drafts to the host, on the runner's own path (on CUDA the Triton
  attention and CUDA graphs); per row also the medians of step 0 and steps 1..k-1
  (`step0_ms`, `later_steps_ms`), and with `--draft-vocab-sizes` a runner per draft vocabulary size; proposes
  without structured output run steps 1..k-1 as one CUDA graph (`specsplit/drafter/later_steps.py`; path
  `graphs+later_graph`), and `--later-steps graph,steps` adds a runner per size launching a graph per later step
  (path `graphs`).
A target step is what the verifier does per iteration: metadata (`prepare_step`, one upload), input ids and
positions to the device, forward, logits, synchronize. Every step is rolled back after it, so the context stays
put. Paths of the target phases (`--paths`): `eager` (SDPA attention in one call over the step padded to its
longest request, what every CPU step and every GPU prefill step runs), `eager_loop` (the same with one SDPA call
per request), `kernel` (the Triton paged attention, eager), `graphs` (the Triton attention replayed from CUDA
graphs of up to `--max-graph-tokens` tokens, logits of every row; larger steps skip this path; on CPU the same
static-buffer path runs eagerly). Linears run the Triton GEMV (`specsplit/kernels/gemv.py`) for the shapes its
table measured faster than cuBLAS (the servers' default); `--gemv`: for every shape; `--no-gemv`: cuBLAS
everywhere; `--no-layer-kernels`: torch ops for residual-add + RMSNorm, rotary and silu-mul.

Tensor parallelism (`--tp 1,2,...`, the target phases): per size N the step runs on N spawned ranks (cuda:0 ..
cuda:N-1 over NCCL, gloo on the CPU), each building its shard, and every rank gives its own row; size 1 runs in
this process. A size needing more GPUs than the machine has is skipped with a line.

Per row, the median over `--steps` steps after `--warmup` untimed ones, the first (cold) step apart: `step_ms` on
the host clock; `gpu_ms` the GPU time of the device work alone (CUDA events around the forward + logits, around the
whole propose): the step's time less its GPU time is host work the GPU waited for; `collective_ms` and
`collective_share` the time inside the step's all-reduces and logits gather (CUDA events around each, waiting for
slower ranks included; TP > 1, eager paths); the HBM roofline: the bytes the step reads, its active weights
(`benchmarks/lib/weight_bytes.py`, a rank's share under TP; routed experts as the expected distinct number under
uniform routing) and the KV cache entries of its requests (context and new tokens, every layer, the rank's own
cache: MLA's latents, GQA's K and V), over the device's bandwidth (3.35 TB/s on an H100, 4.8 TB/s on an H200 and
as a reference elsewhere), divided by the step time and by its GPU time; on CUDA `gpu_ops_per_step`, the kernels
and copies of one step, and those kernels by GPU time (torch.profiler, the top 12 to stderr). `--profile`:
torch.profiler's top ops of one warm step by host (self CPU) time and by GPU time, to stderr. The table is printed;
`--out` (default $OUT/step-PHASE.json when $OUT is set) gets the arguments and the rows as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.lib.shapes import SHAPES, write_shape  # noqa: E402
from benchmarks.lib.step_timing import add_roofline, measure_step, print_row, print_table, write_rows  # noqa: E402
from benchmarks.lib.weight_bytes import cdiv, model_bytes  # noqa: E402

PHASES = ("decode", "prefill", "propose")
TARGET_PATHS = ("eager", "eager_loop", "kernel", "graphs")
BLOCK_SIZE = 16
RANK_TIMEOUT_S = 3600  # a rank's whole run: model load, graph capture and every step
# Per phase, the options left out: a step's usual shapes and enough steps for a stable median.
DEFAULTS = {
    "decode": dict(batch_sizes="1,8,32,64", context=512, k=0, paths="eager,kernel,graphs", steps=30, warmup=5),
    "prefill": dict(context=0, paths="eager,graphs", steps=10, warmup=2),
    "propose": dict(batch_sizes="1,32", context=256, k=3, steps=30, warmup=5),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", required=True, choices=PHASES)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b", help="random weights of this shape")
    model.add_argument("--model", type=Path, help="a checkpoint directory")
    model.add_argument("--tiny", action="store_true", help="the qwen2-tiny shape (a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch-sizes", help="decode, propose: comma-separated (default decode 1,8,32,64, propose 1,32)")
    p.add_argument("--prompts", default="16,64,256,512,1024", help="prefill: comma-separated chunk lengths")
    p.add_argument("--context", type=int, help="tokens each request holds (default decode 512, prefill 0, propose 256)")
    p.add_argument("--k", type=int, help="drafts per request: decode steps of k + 1 tokens (default 0), propose (3)")
    p.add_argument("--paths", help="target phases: comma-separated, from eager, eager_loop, kernel, graphs (see above)")
    p.add_argument("--max-graph-tokens", type=int, default=512, help="the CUDA graphs' largest token bucket")
    p.add_argument("--tp", default="1", help="target phases: comma-separated tensor-parallel sizes")
    p.add_argument(
        "--draft-vocab-sizes",
        default="0",
        help="propose: comma-separated draft vocabulary sizes (0: the full vocabulary), a runner each",
    )
    p.add_argument(
        "--later-steps",
        default="graph",
        help="propose: comma-separated, how the runner runs steps 1..k-1 of the proposes: graph (one CUDA graph "
        "for them all, the runner's default on CUDA), steps (a graph per step, launched by the host), a runner each",
    )
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--profile", action="store_true", help="torch.profiler's top ops of one step per row")
    p.add_argument("--out", type=Path, default=None, help="write the arguments and rows as JSON here")
    p.add_argument(
        "--layer-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Triton kernels for residual-add + RMSNorm, rotary and silu-mul (--no-layer-kernels: torch ops)",
    )
    p.add_argument(
        "--gemv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Triton GEMV for the linears of steps of <= 32 tokens: by default for the shapes measured faster "
        "than cuBLAS (specsplit/kernels/gemv_configs.py); --gemv: every shape; --no-gemv: cuBLAS",
    )
    args = p.parse_args(argv)
    args.shape = None if args.model is not None else "qwen2-tiny" if args.tiny else args.shape
    for key, value in DEFAULTS[args.phase].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.draft_vocab_sizes = [int(v) for v in args.draft_vocab_sizes.split(",")]
    args.later_steps = args.later_steps.split(",")
    if not set(args.later_steps) <= {"graph", "steps"}:
        p.error(f"--later-steps: graph or steps, got {','.join(args.later_steps)}")
    if args.phase == "propose":
        if args.paths is not None or args.tp != "1":
            p.error("--paths and --tp are the target phases': propose runs on the runner's own path, one device")
        if args.k < 1:
            p.error("--k: propose asks at least one draft per request")
    elif args.phase == "decode" and args.k < 0:
        p.error("--k: a decode step has k + 1 >= 1 new tokens per request")
    elif not set(args.paths.split(",")) <= set(TARGET_PATHS):
        p.error(f"--paths: choose from {', '.join(TARGET_PATHS)}")
    args.paths = args.paths.split(",") if args.paths else []
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else []
    args.prompts = [int(n) for n in args.prompts.split(",")]
    args.tp = [int(n) for n in args.tp.split(",")]
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / f"step-{args.phase}.json"
    return args


def apply_kernel_arguments(args: argparse.Namespace) -> None:
    from specsplit.models.layer_ops import enable_gemv, enable_layer_kernels

    enable_layer_kernels(args.layer_kernels)
    enable_gemv(args.gemv)


def row_of(args: argparse.Namespace, model: str, device, path: str, tp: int, rank: int, batch: int, new: int) -> dict:
    """A row's description; `measure_step`'s numbers and the roofline are added to it."""
    import torch

    return {
        "phase": args.phase,
        "model": model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "path": path,
        "tp": tp,
        "rank": rank,
        "batch": batch,  # requests in the step
        "new_tokens": new,  # per request
        "tokens": batch * new,
        "context": args.context,
        "k": args.k if args.phase != "prefill" else None,
        "layer_kernels": args.layer_kernels,
        "gemv": {None: "measured shapes", True: "every shape", False: "off"}[args.gemv],
    }


def measured_row(args, row: dict, step, after, device, weight_bytes: float, kv_bytes: float) -> dict:
    """`row` with the step measured (`measure_step`), its tokens per second and its roofline."""
    row.update(
        measure_step(
            step,
            after,
            device=device,
            steps=args.steps,
            warmup=args.warmup,
            profile=args.profile,
            show=row["rank"] == 0,
        )
    )
    row["tokens_per_s"] = row["tokens"] / (row["step_ms"] / 1e3)
    add_roofline(row, weight_bytes, kv_bytes)
    print_row(row, show_kernels=row["rank"] == 0)
    return row


@contextlib.contextmanager
def sdpa_per_request(on: bool):
    """The `eager_loop` path: no step is padded into one SDPA call (`specsplit.models.padded_batch`)."""
    from specsplit.models import padded_batch

    padded_max = padded_batch.PADDED_BATCH_MAX_PAIRS
    padded_batch.PADDED_BATCH_MAX_PAIRS = 0 if on else padded_max
    try:
        yield
    finally:
        padded_batch.PADDED_BATCH_MAX_PAIRS = padded_max


def rollback(cache, req_ids: list[str], context: int):
    def after() -> None:
        for rid in req_ids:
            cache.truncate(rid, context)

    return after


def target_step(model, cache, runner, req_ids: list[str], new: int, path: str, draws, positions, last_row_only: bool):
    """One target step of `new` tokens for each of `req_ids` on `path`; `draws` yields its input ids."""
    device = cache.device
    rows = slice(-1, None) if last_row_only else slice(None)

    def step(span) -> None:
        attn = cache.prepare_step(req_ids, [new] * len(req_ids), use_kernel=path in ("kernel", "graphs"))
        input_ids, on_device = next(draws).to(device), positions.to(device)
        with span():
            if path == "graphs":
                runner.run(input_ids, on_device, attn)
            else:
                model.compute_logits(model(input_ids, on_device, cache, attn)[rows])

    return step


def target_rows(args, name: str, model_dir: Path, load_format: str, device: str, tp: int = 1, rank: int = 0):
    """The rows of a target phase on `device` (one rank of `tp`)."""
    import torch

    from specsplit.models.attention import use_precompiled_sdpa
    from specsplit.models.loader import load_target
    from specsplit.runtime.cuda_graphs import CudaGraphRunner

    dtype = getattr(torch, args.dtype)
    model = load_target(model_dir, dtype=dtype, device=device, load_format=load_format)
    use_precompiled_sdpa()  # as the runners do
    decode = args.phase == "decode"
    shapes = [(batch, args.k + 1) for batch in args.batch_sizes] if decode else [(1, n) for n in args.prompts]
    cache = model.make_kv_cache(max(b * cdiv(args.context + n, BLOCK_SIZE) for b, n in shapes) + 1, BLOCK_SIZE)
    on_cuda = cache.device.type == "cuda"
    runner = None
    if "graphs" in args.paths and model.supports_cuda_graphs and model.supports_attention_kernel:
        t0 = time.perf_counter()
        max_len, max_tokens = args.context + max(n for _, n in shapes), max(b * n for b, n in shapes)
        runner = CudaGraphRunner(
            model, cache, max_model_len=max_len, max_num_tokens=min(max_tokens, args.max_graph_tokens), capture=on_cuda
        )
        print(f"{name}: graphs for {runner.buckets} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sizes = model_bytes(json.loads((model_dir / "config.json").read_text()), dtype.itemsize)
    kv_token = cache.bytes_per_token  # over every layer
    generator = torch.Generator().manual_seed(0)  # every rank the same tokens
    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        for batch, new in shapes:
            req_ids = [f"r{i}" for i in range(batch)]
            for rid in req_ids:  # the context, one request at a time (eager SDPA)
                if args.context:
                    attn = cache.prepare_step([rid], [args.context])
                    ids = torch.randint(0, vocab, (args.context,), generator=generator).to(cache.device)
                    model(ids, torch.arange(args.context, device=cache.device), cache, attn)
            draws = itertools.cycle([torch.randint(0, vocab, (batch * new,), generator=generator) for _ in range(4)])
            positions = torch.arange(args.context, args.context + new).repeat(batch)
            for path in args.paths:
                if path in ("kernel", "graphs") and not model.supports_attention_kernel:
                    print(f"  {name}: no {path} path (the model has no Triton attention)", file=sys.stderr)
                    continue
                if path == "graphs" and (runner is None or runner.bucket_for(batch * new) is None):
                    print(f"  {name}: {batch * new} tokens, no graph (up to {args.max_graph_tokens})", file=sys.stderr)
                    continue
                step = target_step(model, cache, runner, req_ids, new, path, draws, positions, not decode)
                row = row_of(args, name, cache.device, path, tp, rank, batch, new)
                # A rank reads its shard of the weights, and every request's cache entries (context and new) of
                # its own cache.
                weight_bytes, kv_bytes = sizes.verify_step(batch * new) / tp, batch * (args.context + new) * kv_token
                with sdpa_per_request(path == "eager_loop"):
                    rows.append(
                        measured_row(args, row, step, rollback(cache, req_ids, args.context), cache.device,
                                     weight_bytes, kv_bytes)
                    )  # fmt: skip
            for rid in req_ids:
                cache.free(rid)
    return rows


def propose_step(runner, draws, hidden, drafts: list, split_ns: list):
    """One propose of the next item list `draws` yields; its drafts replace `drafts`' contents and its (step 0,
    steps 1..k-1) times go onto `split_ns`."""

    def step(span) -> None:
        with span():
            out = runner.propose(next(draws), hidden)
        drafts[:] = out.drafts
        split_ns.append((out.step0_ns, out.later_steps_ns))

    return step


def propose_rows(args, name: str, model_dir: Path, load_format: str) -> list[dict]:
    import torch

    from specsplit.drafter.draft_vocab import draft_vocabulary
    from specsplit.drafter.runner import DrafterRunner
    from specsplit.models.loader import load_mtp

    dtype = getattr(torch, args.dtype)
    mtp = load_mtp(model_dir, dtype=dtype, device=args.device, load_format=load_format)
    k, context = args.k, args.context
    blocks = max(args.batch_sizes) * cdiv(context + 2 * k + 2, BLOCK_SIZE) + 8
    sizes = model_bytes(json.loads((model_dir / "config.json").read_text()), dtype.itemsize)
    hidden_size, vocab = mtp.config.hidden_size, mtp.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = []
    for vocab_size, later in itertools.product(args.draft_vocab_sizes, args.later_steps):
        mtp.draft_head = None  # the previous size's
        draft_vocab = draft_vocabulary(mtp, vocab_size, model_dir)
        runner = DrafterRunner(mtp, mtp.make_kv_cache(blocks, BLOCK_SIZE), draft_vocab=draft_vocab)
        if later == "steps":
            runner.later_steps = None  # `_propose`'s step-by-step loop
        path = "graphs" if runner.graphs is not None else "kernel" if runner.attention_kernel else "eager"
        if runner.later_steps is not None:
            path += "+later_graph"
        rows += propose_batches(args, name, runner, sizes, draft_vocab, path, hidden_size, vocab, generator)
        del runner
    return rows


def propose_batches(args, name: str, runner, sizes, draft_vocab, path: str, hidden_size, vocab, generator):
    """`propose_rows`' rows of one runner (one draft vocabulary), a row per batch size."""
    import torch

    from specsplit.drafter.runner import ProposeItem

    dtype, k, context = getattr(torch, args.dtype), args.k, args.context
    kv_token = runner.kv_cache.bytes_per_token
    head_rows = vocab if draft_vocab is None else draft_vocab.size
    rows = []
    with torch.inference_mode():
        for batch in args.batch_sizes:
            req_ids = [f"r{i}" for i in range(batch)]

            def items(start: int, n: int, spec: int, req_ids=req_ids) -> list[ProposeItem]:
                tokens = [torch.randint(0, vocab, (n,), generator=generator).tolist() for _ in req_ids]
                return [ProposeItem(rid, start, ids, spec) for rid, ids in zip(req_ids, tokens)]

            if context:  # one long accepted run per request, no drafts wanted
                runner.propose(
                    items(0, context, 0), torch.randn(batch * context, hidden_size, dtype=dtype).to(runner.device)
                )
            hidden = torch.randn(batch * (k + 1), hidden_size, dtype=dtype).to(runner.device)
            drafts: list[list[int]] = []
            split_ns: list[tuple[int, int]] = []
            draws = itertools.cycle([items(context, k + 1, k) for _ in range(4)])
            step = propose_step(runner, draws, hidden, drafts, split_ns)
            # Active weights: step 0 over every row, then k - 1 steps over one token per request; a draft
            # vocabulary's head reads its rows instead of the vocabulary's.
            head_saved = (vocab - head_rows) * hidden_size * dtype.itemsize
            weight_bytes = sizes.draft_step(batch * (k + 1)) + (k - 1) * sizes.draft_step(batch) - k * head_saved
            # MTP KV: step 0 sees context + k + 1 entries per request, later step j one more each.
            kv_bytes = batch * sum(context + k + 1 + j for j in range(k)) * kv_token
            row = measured_row(
                args,
                row_of(args, name, runner.device, path, 1, 0, batch, k + 1),
                step,
                rollback(runner.kv_cache, req_ids, context),
                runner.device,
                weight_bytes,
                kv_bytes,
            )
            row["drafts"] = sum(len(d) for d in drafts)  # of the last propose: k per request
            row["draft_vocab"] = head_rows
            timed = split_ns[-args.steps :]  # the measured steps' (warm-up and cold ones before them)
            row["step0_ms"] = statistics.median(s[0] for s in timed) / 1e6
            row["later_steps_ms"] = statistics.median(s[1] for s in timed) / 1e6
            print(
                f"  {path}, draft vocabulary {head_rows}: MTP step 0 {row['step0_ms']:.3f} ms, steps 1..{k - 1} "
                f"{row['later_steps_ms']:.3f} ms (medians)"
            )
            rows.append(row)
            runner.free(req_ids)
    return rows


def rank_main(rank: int, size: int, address: str, args, name: str, model_dir: Path, load_format: str, results) -> None:
    try:
        results.put((rank, run_rank(rank, size, address, args, name, model_dir, load_format)))
    except BaseException as err:  # noqa: BLE001 (reported by the parent)
        results.put((rank, f"{type(err).__name__}: {err}"))


def run_rank(rank: int, size: int, address: str, args, name: str, model_dir: Path, load_format: str) -> list[dict]:
    import torch

    from specsplit.models.parallel import destroy_tensor_parallel, init_tensor_parallel

    apply_kernel_arguments(args)
    cuda = args.device.startswith("cuda")
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    init_tensor_parallel(rank, size, address, backend="nccl" if cuda else "gloo", timeout_s=600, device=device)
    try:
        return target_rows(args, name, model_dir, load_format, device, size, rank)
    finally:
        destroy_tensor_parallel()


def run_ranks(size: int, args, name: str, model_dir: Path, load_format: str) -> list[dict]:
    """The rows of every rank of a tensor-parallel group of `size` spawned processes."""
    from specsplit.rpc.process import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=rank_main, args=(r, size, address, args, name, model_dir, load_format, results))
        for r in range(size)
    ]
    for proc in procs:
        proc.start()
    rows, failures, reported = [], [], set()
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while len(reported) < size and time.monotonic() < deadline:
        try:
            rank, out = results.get(timeout=5)
        except queue.Empty:  # a rank that died without a word ends the wait
            gone = [r for r, proc in enumerate(procs) if r not in reported and proc.exitcode not in (None, 0)]
            failures += [f"rank {r}: exit code {procs[r].exitcode}" for r in gone]
            reported.update(gone)
            continue
        reported.add(rank)
        (failures.append(f"rank {rank}: {out}") if isinstance(out, str) else rows.extend(out))
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if failures or len(reported) < size:
        raise SystemExit(f"TP {size} failed: " + ("; ".join(failures) or f"no answer in {RANK_TIMEOUT_S} s"))
    return sorted(rows, key=lambda r: (r["batch"], r["tokens"], TARGET_PATHS.index(r["path"]), r["rank"]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the Triton kernels interpreted
    import torch

    apply_kernel_arguments(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for a smoke run")
    if args.model is not None:
        name, model_dir, load_format = args.model.name, args.model, "auto"
    else:
        name, load_format = args.shape, "dummy"
        model_dir = write_shape(name, Path(tempfile.mkdtemp(prefix="specsplit-step-")) / name)
    if args.phase == "propose":
        rows = propose_rows(args, name, model_dir, load_format)
    else:
        rows = []
        for size in args.tp:
            if args.device.startswith("cuda") and size > torch.cuda.device_count():
                print(f"[TP {size}: skipped, {torch.cuda.device_count()} GPUs here]", file=sys.stderr)
                continue
            t0 = time.monotonic()
            if size == 1:
                rows += target_rows(args, name, model_dir, load_format, args.device)
                gc.collect()  # this process's model and graphs go before the ranks load theirs
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            else:
                rows += run_ranks(size, args, name, model_dir, load_format)
            print(f"[TP {size}: {time.monotonic() - t0:.0f} s]", file=sys.stderr)
    print(f"{args.phase}, {name}, {args.dtype}, median of {args.steps} steps")
    print_table(rows)
    if args.out is not None:
        write_rows(args.out, vars(args), rows)


if __name__ == "__main__":
    main()
