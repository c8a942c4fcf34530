"""Target decode-step time at batch 1 / 8 / 32 / 64 with ~512 tokens of context per request.

    PYTHONPATH=. python benchmarks/decode_step.py --out runs/decode_step.json          # H200
    PYTHONPATH=. python benchmarks/decode_step.py --device cpu --tiny                  # smoke check

Models: the Qwen2-7B shape (hidden 3584, 28 layers, 28 heads / 4 kv heads, head_dim 128,
intermediate 18944, vocab 152064, untied) with random bf16 weights made on the device, and the demo
checkpoint (`checkpoints/demo`); `--tiny`: one tiny random checkpoint (`tests.fixtures.tiny`) instead.

Paths (`--paths`): `eager` (SDPA attention in one call over the step padded to its longest request,
what every CPU step and every GPU prefill step runs), `eager_loop` (the same with one SDPA call per
request, the path before), `kernel` (Triton paged attention, eager), `graphs` (Triton attention replayed
from CUDA graphs; on CPU the same static-buffer path runs eagerly).

    PYTHONPATH=. python benchmarks/decode_step.py --device cpu --tiny --batch-sizes 8,32 --paths eager,eager_loop
Linears run the Triton GEMV (`specsplit/kernels/gemv.py`) for the shapes its table measured faster than cuBLAS
(the servers' default); `--gemv`: for every shape; `--no-gemv`: cuBLAS everywhere.
A step is what the verifier does per decode iteration: metadata (`prepare_step`, one upload), input
ids and positions to the device, forward, logits of every row, synchronize; the median over
`--steps` steps is reported. Each request is rolled back after every step, so the context stays put.
Roofline: the bytes of weights one step reads (every parameter, the embedding only when it is the
LM head) over 4.8 TB/s, divided by the step time; on CUDA also divided by the GPU time of the forward
+ logits alone (CUDA events around them: no metadata, upload or synchronisation on the host).
On CUDA, `gpu_ops_per_step` counts the kernels and copies of one eager kernel-path step
(torch.profiler; a graph replay runs the same ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lib.shapes import SHAPES  # noqa: E402

HBM_BYTES_PER_S = 4.8e12


def random_qwen2_7b(dtype, device):
    import torch

    from specsplit.models.config import ModelConfig
    from specsplit.models.layers import fuse_projections
    from specsplit.models.target import TargetModel

    config = ModelConfig(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        rms_norm_eps=1e-6,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=True,
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=False,
        num_nextn_predict_layers=0,
        **SHAPES["qwen2-7b"],  # the shape benchmarks/e2e.py serves
    )
    with torch.device("meta"):
        model = fuse_projections(TargetModel(config).to(dtype))  # as the loader returns models
    model = model.to_empty(device=device).requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: all parameters but an untied input embedding."""
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def time_steps(
    model,
    cache,
    runner,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    path: str,
    count_ops: list | None = None,
    gpu_times: list | None = None,
) -> float:
    """Median seconds of one decode step over `batch` requests holding `context` tokens each; appends
    the GPU ops of one kernel-path step to `count_ops` when given (CUDA only), and the median GPU
    seconds of the forward + logits alone (CUDA events around it, no host work) to `gpu_times`."""
    import torch

    from specsplit.models.attention import use_kernel_for

    device = cache.device
    req_ids = [f"r{i}" for i in range(batch)]
    with torch.inference_mode():
        for rid in req_ids:  # prefill one request at a time (SDPA path)
            attn = cache.prepare_step([rid], [context])
            prompt = torch.randint(0, model.config.vocab_size, (context,), device=device)
            model(prompt, torch.arange(context, device=device), cache, attn)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        on_cuda = device.type == "cuda" and gpu_times is not None
        pairs = range(steps if on_cuda else 0)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in pairs]
        times = []
        for i in range(warmup + steps):
            ids = torch.randint(0, model.config.vocab_size, (batch,)).tolist()
            sync()
            t0 = time.perf_counter()
            eager = path in ("eager", "eager_loop")
            attn = cache.prepare_step(req_ids, [1] * batch, use_kernel=use_kernel_for(not eager, [1], [context + 1], 0))
            input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
            positions = torch.tensor([context] * batch, dtype=torch.int64, device=device)
            if on_cuda and i >= warmup:
                events[i - warmup][0].record()
            if path == "graphs":
                runner.run(input_ids, positions, attn)
            else:
                model.compute_logits(model(input_ids, positions, cache, attn))
            if on_cuda and i >= warmup:
                events[i - warmup][1].record()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            for rid in req_ids:
                cache.truncate(rid, context)
        if count_ops is not None and device.type == "cuda":
            count_ops.append(gpu_ops_of_one_step(model, cache, req_ids, context))
        if on_cuda:
            gpu_times.append(statistics.median(a.elapsed_time(b) / 1e3 for a, b in events))
    for rid in req_ids:
        cache.free(rid)
    return statistics.median(times)


def gpu_ops_of_one_step(model, cache, req_ids: list[str], context: int) -> int:
    """Kernels and copies one eager kernel-path decode step runs on the GPU (what a graph replays);
    prints the GPU time per kernel name (top 12) and its total to stderr."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    device = cache.device
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attn = cache.prepare_step(req_ids, [1] * len(req_ids), use_kernel=True)
        input_ids = torch.zeros(len(req_ids), dtype=torch.int64, device=device)
        positions = torch.full((len(req_ids),), context, dtype=torch.int64, device=device)
        model.compute_logits(model(input_ids, positions, cache, attn))
        torch.cuda.synchronize()
    for rid in req_ids:
        cache.truncate(rid, context)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in gpu:
        per_name[e.name].append(e.device_time_total)  # µs
    total = sum(sum(v) for v in per_name.values())
    batch = len(req_ids)
    print(f"    GPU time of one kernel-path step at batch {batch}: {total:.0f} µs in {len(gpu)} ops", file=sys.stderr)
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"    {sum(times):8.0f} µs {len(times):4d}× {name[:110]}", file=sys.stderr)
    return len(gpu)


def bench_model(name, model, args) -> list[dict]:
    import torch

    from specsplit.models import padded_batch as padded_batch_module
    from specsplit.models.cuda_graphs import CudaGraphRunner

    batches = [int(b) for b in args.batch_sizes.split(",")]
    block_size = 16
    max_len = args.context + 1
    blocks_per_req = -(-max_len // block_size)
    cache = model.make_kv_cache(max(batches) * blocks_per_req + 1, block_size)
    on_cuda = cache.device.type == "cuda"
    t0 = time.perf_counter()
    runner = CudaGraphRunner(model, cache, max_model_len=max_len, max_num_tokens=max(batches), capture=on_cuda)
    print(f"{name}: graphs for {runner.buckets} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ideal = weight_bytes(model) / HBM_BYTES_PER_S
    rows = []
    for batch in batches:
        gpu_ops: list[int] = []
        for path in args.paths.split(","):
            count_ops = gpu_ops if path == "kernel" else None
            gpu: list[float] = []
            # eager_loop: no step is padded into one SDPA call (specsplit.models.padded_batch.PADDED_BATCH_MAX_PAIRS).
            padded_max = padded_batch_module.PADDED_BATCH_MAX_PAIRS
            padded_batch_module.PADDED_BATCH_MAX_PAIRS = 0 if path == "eager_loop" else padded_max
            try:
                seconds = time_steps(
                    model, cache, runner, batch, args.context, args.steps, args.warmup, path, count_ops, gpu
                )
            finally:
                padded_batch_module.PADDED_BATCH_MAX_PAIRS = padded_max
            rows.append(
                dict(
                    model=name,
                    batch=batch,
                    context=args.context,
                    path=path if on_cuda or path != "graphs" else "graph-buffers (no capture on CPU)",
                    step_ms=seconds * 1e3,
                    tokens_per_s=batch / seconds,
                    roofline_pct=100 * ideal / seconds,
                    # The forward + logits on the GPU alone (graph replay from the first copy in to the
                    # last kernel), without the step's host work: what a pipelined engine would see.
                    gpu_ms=gpu[0] * 1e3 if gpu else None,
                    gpu_roofline_pct=100 * ideal / gpu[0] if gpu else None,
                    weight_gb=weight_bytes(model) / 1e9,
                    device=torch.cuda.get_device_name(cache.device) if on_cuda else "cpu",
                    gpu_ops_per_step=gpu_ops[0] if gpu_ops and path in ("kernel", "graphs") else None,
                    gemv={None: "measured shapes", True: "every shape", False: "off"}[args.gemv],
                )
            )
            ops = f"  ({gpu_ops[0]} GPU ops per step)" if gpu_ops and path == "kernel" else ""
            on_gpu = f"  (GPU {gpu[0] * 1e3:.3f} ms)" if gpu else ""
            print(f"  batch {batch:3d} {path:10s} {seconds * 1e3:9.3f} ms{on_gpu}{ops}", file=sys.stderr)
    return rows


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """--[no-]layer-kernels and --[no-]gemv: the layer kernels and the GEMV on or off, to measure each."""
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


def apply_kernel_arguments(args: argparse.Namespace) -> None:
    from specsplit.models.layer_ops import enable_gemv, enable_layer_kernels

    enable_layer_kernels(args.layer_kernels)
    enable_gemv(args.gemv)


def step_arguments(description: str, tiny_help: str, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The options the step benchmarks share (this one and `benchmarks/prefill_step.py`)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    add_kernel_arguments(p)
    return p


def parse_step_arguments(p: argparse.ArgumentParser, argv: list[str] | None):
    """-> (args, torch dtype); on CPU the Triton kernels run interpreted (set before triton is imported)."""
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    apply_kernel_arguments(args)
    return args, getattr(torch, args.dtype)


def main(argv: list[str] | None = None) -> None:
    p = step_arguments(__doc__.splitlines()[0], "one tiny random model instead of Qwen2-7B and the demo", 30, 5)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument(
        "--paths",
        default="eager,kernel,graphs",
        help="comma-separated, from eager, eager_loop, kernel, graphs (see above)",
    )
    args, dtype = parse_step_arguments(p, argv)
    import torch

    from specsplit.models.loader import load_target
    from tests.fixtures.tiny import write_tiny_checkpoint

    if args.tiny:
        tmp = tempfile.mkdtemp()
        models = [("tiny", lambda: load_target(write_tiny_checkpoint(tmp), dtype=dtype, device=args.device))]
    else:
        demo = Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
        models = [
            ("qwen2-7b-shape", lambda: random_qwen2_7b(dtype, args.device)),
            ("demo", lambda: load_target(demo, dtype=dtype, device=args.device)),
        ]
    rows = []
    for name, make in models:
        model = make()
        rows += bench_model(name, model, args)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print("| model | batch | path | step ms | tokens/s | % HBM roofline | GPU ms | % roofline (GPU) | GPU ops / step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gpu = f"{r['gpu_ms']:.3f} | {r['gpu_roofline_pct']:.1f}" if r["gpu_ms"] else "- | -"
        print(
            f"| {r['model']} | {r['batch']} | {r['path']} | {r['step_ms']:.3f} | {r['tokens_per_s']:.0f} "
            f"| {r['roofline_pct']:.1f} | {gpu} | {r['gpu_ops_per_step'] or ''} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
