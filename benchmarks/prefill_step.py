"""Target prefill-step time: one request's chunk of P prompt tokens in one step, as the verifier runs it.

    PYTHONPATH=. python benchmarks/prefill_step.py --out prefill.json                       # H200, Qwen2-7B shape
    PYTHONPATH=. python benchmarks/prefill_step.py --device cpu --tiny --prompts 16,64      # smoke check

A step is: metadata (`prepare_step`), input ids and positions to the device, forward, logits,
synchronize; the median over `--steps` steps is reported, the first (cold) step apart. `--context C`:
the request already holds C tokens (a later chunk of a chunked prefill). Paths (`--paths`):
- `eager`: SDPA attention, every op launched from Python, logits of the last row (the path prefill
  steps took before `specsplit.models.attention.KERNEL_MAX_PREFILL_PAIRS`);
- `graphs`: the Triton paged attention replayed from a CUDA graph of the step's token bucket, logits
  of every row (what the runners now do when `use_kernel_for` allows it); chunks over the graphs'
  largest bucket are skipped.
On CUDA the GPU time of the forward + logits alone (CUDA events) is reported too: the step's time less
its GPU time is host work the GPU waited for. `--profile` prints torch.profiler's top ops of one warm
eager step by host (self CPU) time and by GPU time, to stderr.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_step import parse_step_arguments, random_qwen2_7b, step_arguments  # noqa: E402


def one_step(model, cache, prompt_len: int, context: int = 0, graphs=None, events=None) -> float:
    """Seconds of one prefill step of `prompt_len` tokens after `context` cached ones (rolled back
    after it); `graphs`: replayed from the CUDA graph runner, else eager."""
    import torch

    device = cache.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist()
    sync()
    t0 = time.perf_counter()
    attn = cache.prepare_step(["p"], [prompt_len], use_kernel=graphs is not None)
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    positions = torch.arange(context, context + prompt_len, dtype=torch.int64, device=device)
    if events is not None:
        events[0].record()
    if graphs is not None:
        graphs.run(input_ids, positions, attn)
    else:
        hidden = model(input_ids, positions, cache, attn)
        model.compute_logits(hidden[-1:])
    if events is not None:
        events[1].record()
    sync()
    seconds = time.perf_counter() - t0
    cache.truncate("p", context)
    return seconds


def profile_step(model, cache, prompt_len: int, context: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cache.device.type == "cuda" else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        one_step(model, cache, prompt_len, context)
    table = prof.key_averages()
    print(f"--- prompt {prompt_len}: top ops by self CPU time", file=sys.stderr)
    print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60), file=sys.stderr)
    if cache.device.type == "cuda":
        print(f"--- prompt {prompt_len}: top ops by GPU time", file=sys.stderr)
        print(table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60), file=sys.stderr)


def bench(name: str, model, args) -> list[dict]:
    import torch

    from specsplit.models.cuda_graphs import CudaGraphRunner

    prompts = [int(p) for p in args.prompts.split(",")]
    paths = args.paths.split(",")
    block_size = 16
    max_len = args.context + max(prompts)
    cache = model.make_kv_cache(-(-max_len // block_size) + 1, block_size)
    on_cuda = cache.device.type == "cuda"
    graphs = None
    if "graphs" in paths:
        graphs = CudaGraphRunner(model, cache, max_model_len=max_len, max_num_tokens=args.max_graph_tokens,
                                 capture=on_cuda)  # fmt: skip
    rows = []
    with torch.inference_mode():
        if args.context:  # the chunks before: one eager step
            attn = cache.prepare_step(["p"], [args.context])
            ids = torch.randint(0, model.config.vocab_size, (args.context,), device=cache.device)
            model(ids, torch.arange(args.context, device=cache.device), cache, attn)
        for prompt_len in prompts:
            for path in paths:
                runner = graphs if path == "graphs" else None
                if runner is not None and runner.bucket_for(prompt_len) is None:
                    continue
                cold = one_step(model, cache, prompt_len, args.context, runner)
                times, gpu = [], []
                for i in range(args.warmup + args.steps):
                    events = None
                    if on_cuda and i >= args.warmup:
                        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    seconds = one_step(model, cache, prompt_len, args.context, runner, events)
                    if i >= args.warmup:
                        times.append(seconds)
                        if events is not None:
                            gpu.append(events[0].elapsed_time(events[1]) / 1e3)
                step = statistics.median(times)
                gpu_s = statistics.median(gpu) if gpu else None
                rows.append(
                    dict(
                        model=name,
                        path=path,
                        prompt=prompt_len,
                        context=args.context,
                        cold_ms=cold * 1e3,
                        step_ms=step * 1e3,
                        gpu_ms=gpu_s * 1e3 if gpu_s is not None else None,
                        tokens_per_s=prompt_len / step,
                        device=torch.cuda.get_device_name(cache.device) if on_cuda else "cpu",
                    )
                )
                on_gpu = f"  (GPU {gpu_s * 1e3:.3f} ms)" if gpu_s is not None else ""
                print(f"  {name} {path:6s} prompt {prompt_len:5d} after {args.context}: cold {cold * 1e3:9.3f} ms, "
                      f"step {step * 1e3:9.3f} ms{on_gpu}", file=sys.stderr)  # fmt: skip
            if args.profile and "eager" in paths:
                profile_step(model, cache, prompt_len, args.context)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = step_arguments(__doc__.splitlines()[0], "one tiny random model instead of the Qwen2-7B shape", 10, 2)
    p.add_argument("--prompts", default="16,64,256,512,1024", help="comma-separated chunk lengths")
    p.add_argument("--context", type=int, default=0, help="tokens the request holds before the chunk")
    p.add_argument("--paths", default="eager,graphs", help="comma-separated, from eager, graphs (see above)")
    p.add_argument("--max-graph-tokens", type=int, default=512, help="the graphs' largest token bucket")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top ops of one step per prompt")
    args, dtype = parse_step_arguments(p, argv)
    import torch

    from specsplit.models.loader import load_target
    from tests.fixtures.tiny import write_tiny_checkpoint

    if args.tiny:
        model = load_target(write_tiny_checkpoint(tempfile.mkdtemp()), dtype=dtype, device=args.device)
        name = "tiny"
    else:
        model, name = random_qwen2_7b(dtype, torch.device(args.device)), "qwen2-7b"
    rows = bench(name, model, args)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
