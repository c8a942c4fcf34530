"""One model-server step timed on its own, for `benchmarks/step.py`: the median over the timed steps (the first,
cold step apart) on the host clock and on the GPU (CUDA events), the time inside its collectives, the kernels it
runs (torch.profiler), its HBM roofline, and the rows as a table and as JSON.

A step is a callable `step(span)` that runs one step and wraps its device work in `with span():` (CUDA events on a
timed CUDA step, else nothing); `after()` rolls back what the step added (untimed), so every step sees the same
state. Under tensor parallelism every rank calls `measure_step` alike: each step it runs (the cold one, the
profiled ones) is a step of every rank, their collectives matched.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from benchmarks.lib.weight_bytes import hbm_bytes_per_s
from specsplit.models.parallel import time_collectives

Step = Callable[[Callable], object]
TOP_KERNELS = 12  # kernels printed per row


class CollectiveTimes:
    """Times every device collective of a step (`specsplit.models.parallel.time_collectives`): CUDA events on
    CUDA, the host clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.spans = cuda, []

    @contextmanager
    def __call__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.append(time.perf_counter() - t0)

    def take_ms(self) -> float | None:
        """The time inside the collectives since the last call (after a synchronize), None if the step ran none
        from Python (one rank, or a CUDA graph's replay)."""
        spans, self.spans = self.spans, []
        if not spans:
            return None
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in spans)
        return 1000 * sum(spans)


def _span(events: tuple[torch.cuda.Event, torch.cuda.Event] | None):
    @contextmanager
    def span():
        if events is not None:
            events[0].record()
        yield
        if events is not None:
            events[1].record()

    return span


def measure_step(
    step: Step, after: Callable[[], None], *, device: torch.device, steps: int, warmup: int, profile: bool, show: bool
) -> dict:
    """Runs `step` once cold, `warmup` times untimed and `steps` times timed, each between two synchronizes and
    followed by `after()`. Returns cold_ms, step_ms (median host time), gpu_ms (median time between the span's
    events, CUDA only), collective_ms and collective_share (of the GPU time on CUDA, of the host time on the CPU;
    None where no collective ran), and on CUDA the kernels and copies of one more step: gpu_ops_per_step and
    kernels ([name, µs, calls], by GPU time). `profile`: one more step under torch.profiler, its top ops by host
    and GPU time printed to stderr where `show` (the step runs either way, as every rank must run it)."""
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    collectives = CollectiveTimes(on_cuda)
    cold, walls, gpus, inside = 0.0, [], [], []
    time_collectives(collectives)
    try:
        for i in range(1 + warmup + steps):
            timed = i > warmup
            events = None
            if on_cuda and timed:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            sync()
            t0 = time.perf_counter()
            step(_span(events))
            sync()
            seconds = time.perf_counter() - t0
            after()
            collective_ms = collectives.take_ms()
            if i == 0:
                cold = seconds
            if timed:
                walls.append(seconds)
                if events is not None:
                    gpus.append(events[0].elapsed_time(events[1]))
                if collective_ms is not None:
                    inside.append(collective_ms)
    finally:
        time_collectives(None)
    step_ms = 1e3 * statistics.median(walls)
    gpu_ms = statistics.median(gpus) if gpus else None
    collective_ms = statistics.median(inside) if inside else None
    kernels = gpu_kernels(step, after) if on_cuda else None
    if profile:
        print_top_ops(step, after, on_cuda, show)
    return {
        "cold_ms": 1e3 * cold,
        "step_ms": step_ms,
        "gpu_ms": gpu_ms,
        "collective_ms": collective_ms,
        "collective_share": collective_ms / (gpu_ms or step_ms) if collective_ms is not None else None,
        "gpu_ops_per_step": sum(calls for *_, calls in kernels) if kernels is not None else None,
        "kernels": kernels,
    }


def gpu_kernels(step: Step, after: Callable[[], None]) -> list[list]:
    """[name, µs, calls] of every kernel and copy one step puts on the GPU, by GPU time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(nullcontext)
        torch.cuda.synchronize()
    after()
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time_total)
    return sorted(([name, sum(us), len(us)] for name, us in per_name.items()), key=lambda r: -r[1])


def print_top_ops(step: Step, after: Callable[[], None], on_cuda: bool, show: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        step(nullcontext)
        if on_cuda:
            torch.cuda.synchronize()
    after()
    if not show:
        return
    table = prof.key_averages()
    orders = [("host (self CPU)", "self_cpu_time_total")] + ([("GPU", "self_device_time_total")] if on_cuda else [])
    for title, key in orders:
        print(f"--- top ops of one step by {title} time", file=sys.stderr)
        print(table.table(sort_by=key, row_limit=15, max_name_column_width=60), file=sys.stderr)


def add_roofline(row: dict, weight_bytes: float, kv_bytes: float = 0.0) -> None:
    """weight_gb and kv_gb: the weights and the KV cache the step reads; roofline_pct and gpu_roofline_pct: the
    time reading both at the device's bandwidth (`hbm_bytes_per_s` of `row["device"]`) takes, as a share of the
    step's host time and of its GPU time."""
    bandwidth = hbm_bytes_per_s(row["device"])
    ideal_ms = 1e3 * (weight_bytes + kv_bytes) / bandwidth
    row["weight_gb"] = weight_bytes / 1e9
    row["kv_gb"] = kv_bytes / 1e9
    row["hbm_tb_s"] = bandwidth / 1e12
    row["roofline_pct"] = 100 * ideal_ms / row["step_ms"]
    row["gpu_roofline_pct"] = 100 * ideal_ms / row["gpu_ms"] if row["gpu_ms"] else None


def print_row(row: dict, show_kernels: bool) -> None:
    """A row's progress line to stderr, and where `show_kernels` its top kernels by GPU time."""
    gpu = f", GPU {row['gpu_ms']:.3f} ms" if row["gpu_ms"] is not None else ""
    inside = f", collectives {row['collective_ms']:.3f} ms" if row["collective_ms"] is not None else ""
    print(
        f"  {row['model']} TP {row['tp']} rank {row['rank']} batch {row['batch']:3d} tokens {row['tokens']:5d} "
        f"{row['path']:10s}: cold {row['cold_ms']:9.3f} ms, step {row['step_ms']:9.3f} ms{gpu}{inside}",
        file=sys.stderr,
    )
    if show_kernels and row["kernels"]:
        total = sum(us for _, us, _ in row["kernels"])
        print(f"    GPU time of one step: {total:.0f} µs in {row['gpu_ops_per_step']} ops", file=sys.stderr)
        for name, us, calls in row["kernels"][:TOP_KERNELS]:
            print(f"    {us:8.0f} µs {calls:4d}× {name[:110]}", file=sys.stderr)


def _cell(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print(
        "| model | TP | rank | batch | tokens | path | cold ms | step ms | GPU ms | collective ms | tokens/s "
        "| weights + KV GB | % HBM roofline | % roofline (GPU) | GPU ops / step |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['tp']} | {r['rank']} | {r['batch']} | {r['tokens']} | {r['path']} "
            f"| {r['cold_ms']:.3f} | {r['step_ms']:.3f} | {_cell(r['gpu_ms'], '.3f')} "
            f"| {_cell(r['collective_ms'], '.3f')} | {r['tokens_per_s']:.0f} "
            f"| {r['weight_gb']:.3f} + {r['kv_gb']:.3f} | {r['roofline_pct']:.1f} "
            f"| {_cell(r['gpu_roofline_pct'], '.1f')} | {_cell(r['gpu_ops_per_step'])} |"
        )


def write_rows(path: Path, args: dict, rows: list[dict]) -> None:
    """{"args": the run's arguments, "rows": the rows} as JSON at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = {k: v if isinstance(v, (str, int, float, bool, list, type(None))) else str(v) for k, v in args.items()}
    path.write_text(json.dumps({"args": plain, "rows": rows}, indent=1) + "\n")
    print(f"[wrote {path}]", file=sys.stderr)
