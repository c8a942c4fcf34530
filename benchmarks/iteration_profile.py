"""Where an iteration's time goes, on one clock across the services' processes: the GPU work of the
verifier and of the drafter (every kernel and copy, from the torch profiler's CUPTI trace of each process)
laid over the coordinator's and verifier's wall-clock stamps of each iteration, next to the same
iteration in one process (the in-process engine, `benchmarks/e2e_modes.py`).

    python benchmarks/iteration_profile.py --shape qwen2-7b --load-format dummy --alpha 0.8 \\
        --device cuda --dtype bfloat16 --batch 1 --k 3 --new-tokens 128 --svg docs/iteration_profile.svg
    # CPU smoke run (no GPU trace: every GPU column is 0)
    python benchmarks/iteration_profile.py --shape qwen2-tiny --load-format dummy --alpha 0.8 --batch 1 --k 1 \\
        --new-tokens 8

The verifier and drafter run under `benchmarks/profiled_service.py` (the profiler on from SIGUSR1 to
SIGUSR2, around one timed run after a warm-up). All processes of a host share the wall clock, so a kernel's
time in its trace (`baseTimeNanoseconds` + `ts`) and the coordinator's stamps of an iteration
(`GetStats(include_iterations)`: schedule start, VerifyRequest sent, VerifyResponse received, post_step end;
the verifier's received / replied and its Propose's sent / drafter received / drafter replied / received)
are comparable to a microsecond or so. Per iteration (schedule start to post_step end) it reports, as the
median over the run's iterations:

    iteration        the coordinator's iteration (`iteration unprofiled`: the same in the warm-up run, without
                     the profiler, whose CUPTI tracing stretches host work a little)
    gpu_verifier     time some verifier kernel or copy ran (the union of their intervals)
    gpu_drafter      the same for the drafter
    gpu_both         time both processes had work on the GPU at once (time-slicing: without MPS the two
                     contexts take turns, so this stretches both)
    gpu_idle         time no kernel of either ran: what host work and hops cost the iteration
    idle: <phase>    gpu_idle split by the host phase that was running then (`PHASES`, first match wins)

and for one process the same over the profiled run (GPU busy and idle per iteration, no phases). The
difference of the two rows is the services' overhead, split into GPU time the split adds and GPU idle it adds.
--svg draws the median services iteration: host phases per process over both GPU lanes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.e2e import make_prompts  # noqa: E402
from benchmarks.e2e_modes import InProcessEngine, recent_iterations, run_services  # noqa: E402
from benchmarks.forced_acceptance import ForcedAcceptanceRunner, Oracle  # noqa: E402
from benchmarks.shapes import SHAPES, write_shape  # noqa: E402
from specsplit.launcher import LocalCluster  # noqa: E402

Interval = tuple[int, int]  # [start, end) wall-clock ns

# Host phases of an iteration, in the order idle GPU time is attributed to them (the first one running
# at an instant takes it). The drafter's phases come first: with async scheduling they overlap the
# coordinator's and the hops of the next iteration.
PHASES = (
    "drafter",
    "hop v->d",
    "hop d->v",
    "verifier: drafts wait",
    "verifier",
    "hop c->v",
    "hop v->c",
    "coordinator: schedule",
    "coordinator: post_step",
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_intervals(trace: Path) -> list[Interval]:
    """Every kernel, copy and memset of a Chrome trace, on the wall clock, merged into disjoint intervals."""
    data = json.loads(trace.read_text())
    base = int(data.get("baseTimeNanoseconds", 0))
    spans = [
        (base + int(e["ts"] * 1000), base + int((e["ts"] + e.get("dur", 0)) * 1000))
        for e in data.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES
    ]
    return merge(spans)


def merge(spans: list[Interval]) -> list[Interval]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def clip(intervals: list[Interval], a: int, b: int) -> list[Interval]:
    return [(max(x, a), min(y, b)) for x, y in intervals if y > a and x < b]


def length(intervals: list[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def intersect(p: list[Interval], q: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(p) and j < len(q):
        a, b = max(p[i][0], q[j][0]), min(p[i][1], q[j][1])
        if a < b:
            out.append((a, b))
        if p[i][1] < q[j][1]:
            i += 1
        else:
            j += 1
    return out


def complement(intervals: list[Interval], a: int, b: int) -> list[Interval]:
    out, t = [], a
    for x, y in clip(intervals, a, b):
        if x > t:
            out.append((t, x))
        t = max(t, y)
    return out + ([(t, b)] if t < b else [])


def phases(timings) -> dict[str, list[Interval]]:
    """Host phases of every iteration of the run, by name (the Propose stamps may belong to an iteration's
    predecessor under async scheduling; as absolute intervals that does not matter)."""
    out: dict[str, list[Interval]] = {name: [] for name in PHASES}
    for it in timings:
        v = it.verifier
        out["coordinator: schedule"].append((it.schedule_start_ns, it.verify_sent_ns))
        out["hop c->v"].append((it.verify_sent_ns, v.received_ns))
        out["verifier: drafts wait"].append((v.received_ns, v.received_ns + v.drafts_wait_ns))
        out["verifier"].append((v.received_ns + v.drafts_wait_ns, v.replied_ns))
        out["hop v->c"].append((v.replied_ns, it.verify_received_ns))
        out["coordinator: post_step"].append((it.verify_received_ns, it.post_step_end_ns))
        if v.drafter_received_ns:
            out["hop v->d"].append((v.propose_sent_ns, v.drafter_received_ns))
            out["drafter"].append((v.drafter_received_ns, v.drafter_replied_ns))
            out["hop d->v"].append((v.drafter_replied_ns, v.propose_received_ns))
    return {name: merge([s for s in spans if s[1] > s[0]]) for name, spans in out.items()}


def attribute_idle(idle: list[Interval], by_phase: dict[str, list[Interval]]) -> dict[str, int]:
    """ns of `idle` per phase, each instant to the first phase of PHASES running then ("other": none)."""
    out, rest = {}, idle
    for name in PHASES:
        taken = intersect(rest, by_phase[name])
        out[name] = length(taken)
        rest = [piece for a, b in rest for piece in complement(taken, a, b)]
    out["other"] = length(rest)
    return out


def services_rows(timings, verifier_gpu: list[Interval], drafter_gpu: list[Interval]) -> list[dict[str, float]]:
    by_phase = phases(timings)
    both = intersect(verifier_gpu, drafter_gpu)
    rows = []
    for it in timings:
        a, b = it.schedule_start_ns, it.post_step_end_ns
        v, d = clip(verifier_gpu, a, b), clip(drafter_gpu, a, b)
        idle = complement(merge(v + d), a, b)
        row = {
            "iteration": b - a,
            "gpu_verifier": length(v),
            "gpu_drafter": length(d),
            "gpu_both": length(clip(both, a, b)),
            "gpu_idle": length(idle),
        }
        row |= {f"idle: {k}": ns for k, ns in attribute_idle(idle, by_phase).items()}
        rows.append({k: ns / 1e6 for k, ns in row.items()})
    return rows


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def profile_in_process(engine: InProcessEngine, prompts, new_tokens: int, k: int, trace: Path) -> dict[str, float]:
    activities = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
    wall0 = time.time_ns()
    with profile(activities=activities) as prof:
        result = engine.run(prompts, new_tokens, k)
    wall1 = time.time_ns()
    prof.export_chrome_trace(str(trace))
    gpu = clip(gpu_intervals(trace), wall0, wall1)
    n = max(1, result.num_iterations)
    busy = length(gpu) / 1e6 / n
    iteration = statistics.median(r["iteration"] for r in result.breakdown) if result.breakdown else 0.0
    return {"iteration": iteration, "gpu_verifier": busy, "gpu_idle": max(0.0, iteration - busy)}


def wait_for(paths: list[Path], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {', '.join(str(p) for p in paths if not p.exists())} after {seconds:.0f}s")
        time.sleep(0.1)


def median_iteration(timings, rows):
    order = sorted(range(len(rows)), key=lambda i: rows[i]["iteration"])
    return timings[order[len(order) // 2]]


def timeline(timings, verifier_gpu: list[Interval], drafter_gpu: list[Interval], rows) -> str:
    """The median services iteration as text: per lane, its intervals in ms from the schedule's start (GPU work
    closer than 20 µs merged)."""
    it = median_iteration(timings, rows)
    a, b = it.schedule_start_ns, it.post_step_end_ns
    by_phase = phases(timings)
    lines = []
    for name in PHASES:
        spans = clip(by_phase[name], a, b)
        if spans:
            lines.append(f"  {name:<24}" + " ".join(f"{(x - a) / 1e6:.2f}-{(y - a) / 1e6:.2f}" for x, y in spans))
    for name, gpu in (("verifier GPU", verifier_gpu), ("drafter GPU", drafter_gpu)):
        merged = merge([(x, y + 20_000) for x, y in clip(gpu, a, b)])
        lines.append(f"  {name:<24}" + " ".join(f"{(x - a) / 1e6:.2f}-{(y - 20_000 - a) / 1e6:.2f}" for x, y in merged))
    return "\n".join(lines)


def svg(timings, verifier_gpu: list[Interval], drafter_gpu: list[Interval], rows, title: str) -> str:
    """The median services iteration as lanes of host phases over the two GPU lanes."""
    it = median_iteration(timings, rows)
    a, b = it.schedule_start_ns, it.post_step_end_ns
    by_phase = phases(timings)
    lanes = [
        ("coordinator", ["coordinator: schedule", "coordinator: post_step"]),
        ("hops", ["hop c->v", "hop v->c", "hop v->d", "hop d->v"]),
        ("verifier host", ["verifier: drafts wait", "verifier"]),
        ("drafter host", ["drafter"]),
        ("verifier GPU", []),
        ("drafter GPU", []),
    ]
    colors = {
        "coordinator: schedule": "#fca5a5",
        "coordinator: post_step": "#86efac",
        "hop c->v": "#d1d5db",
        "hop v->c": "#9ca3af",
        "hop v->d": "#fde68a",
        "hop d->v": "#fcd34d",
        "verifier: drafts wait": "#e0e7ff",
        "verifier": "#93c5fd",
        "drafter": "#fb923c",
        "verifier GPU": "#2563eb",
        "drafter GPU": "#ea580c",
    }
    width, left, lane_h = 1000, 120, 28
    scale = (width - left - 10) / max(1, b - a)

    def x(t: int) -> float:
        return left + (t - a) * scale

    parts = [f'<text x="4" y="16" font-size="13">{escape(title)}</text>']
    for i, (lane, names) in enumerate(lanes):
        y = 30 + i * lane_h
        parts.append(f'<text x="4" y="{y + 17}" font-size="12">{lane}</text>')
        spans = (
            [(name, s) for name in names for s in clip(by_phase[name], a, b)]
            if names
            else [(lane, s) for s in clip(verifier_gpu if lane.startswith("verifier") else drafter_gpu, a, b)]
        )
        for name, (s, e) in spans:
            w = max(0.5, (e - s) * scale)
            label = f"{name} {(e - s) / 1e3:.0f} µs"
            parts.append(
                f'<rect x="{x(s):.1f}" y="{y}" width="{w:.1f}" height="{lane_h - 6}" fill="{colors[name]}">'
                f"<title>{escape(label)}</title></rect>"
            )
            if w > 60 and names:
                parts.append(f'<text x="{x(s) + 3:.1f}" y="{y + 15}" font-size="10">{escape(label)}</text>')
    y = 30 + len(lanes) * lane_h + 12
    for ms in range(int((b - a) / 1e6) + 1):
        parts.append(f'<text x="{x(a + ms * 1_000_000):.1f}" y="{y}" font-size="10">{ms} ms</text>')
    height = y + 10
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">'
        + "".join(parts)
        + "</svg>\n"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "demo")
    where.add_argument("--shape", choices=sorted(SHAPES))
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--alpha", type=float, default=None, help="forced acceptance rate per draft position")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--placement", default="colocated", choices=["colocated", "pooled"])
    p.add_argument("--svg", type=Path, default=None, help="write the median services iteration here")
    p.add_argument("--out", type=Path, default=None, help="JSON of every iteration's row")
    args = p.parse_args()
    if args.shape and args.load_format != "dummy":
        p.error("--shape has no weights: add --load-format dummy")
    return args


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="specsplit-profile-"))
    model = write_shape(args.shape, work / args.shape) if args.shape else args.model
    engine = InProcessEngine(
        str(model), args.device, getattr(torch, args.dtype), args.load_format, args.num_blocks, args.batch, args.k
    )
    prompts = make_prompts(model, args.batch, engine.target.config.vocab_size)
    reference = engine.run(prompts, args.new_tokens, 0).outputs
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    wrap = [sys.executable, "-m", "benchmarks.profiled_service"]
    traces = {role: work / f"{role}.json" for role in ("verifier", "drafter")}
    drafter = ["-m", "specsplit", "serve", "drafter"]
    if args.alpha is not None:
        oracle = Oracle([p + o for p, o in zip(prompts, reference)], engine.target.config.vocab_size)
        oracle.save(work / "oracle.json")
        engine.wrap_drafter = lambda runner: ForcedAcceptanceRunner(runner, oracle, args.alpha, 0)
        drafter = ["-m", "benchmarks.forced_drafter", "--alpha", str(args.alpha), "--oracle", str(work / "oracle.json")]
    role_commands = {
        "verifier": [*wrap, "--trace-out", str(traces["verifier"]), "--", "-m", "specsplit", "serve", "verifier"],
        "drafter": [*wrap, "--trace-out", str(traces["drafter"]), "--", *drafter],
    }
    warm = engine.run(prompts, args.new_tokens, args.k)  # warm-up, unprofiled
    one_process = profile_in_process(engine, prompts, args.new_tokens, args.k, work / "in_process.json")
    one_process["iteration unprofiled"] = statistics.median(r["iteration"] for r in warm.breakdown)
    with LocalCluster(
        str(model),
        num_speculative_tokens=args.k,
        device=args.device,
        dtype=args.dtype,
        log_dir=work / "logs",
        load_format=args.load_format,
        role_commands=role_commands,
        placement=args.placement,
        env=env,
        coordinator_args=["--max-num-seqs", str(args.batch)],
        verifier_args=["--num-blocks", str(args.num_blocks)],
        drafter_args=["--num-blocks", str(args.num_blocks)],
    ) as cluster:
        warm = run_services(cluster.address, prompts, args.new_tokens, args.k)  # warm-up, unprofiled
        pids = [cluster.services[role].proc.pid for role in traces]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(2.0)  # the profiler starts in each process's main thread, between its other work
        before = max((it.iteration for it in recent_iterations(cluster.address)), default=0)
        run = run_services(cluster.address, prompts, args.new_tokens, args.k)
        wall1 = time.time_ns()
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        wait_for([Path(f"{t}.done") for t in traces.values()], 300)
        timings = [it for it in recent_iterations(cluster.address) if it.iteration > before]
        timings = [it for it in timings if it.schedule_start_ns < wall1 and it.post_step_end_ns > 0]
    if run.outputs != reference:
        sys.exit("services' output differs from target-only greedy output")
    verifier_gpu, drafter_gpu = gpu_intervals(traces["verifier"]), gpu_intervals(traces["drafter"])
    rows = services_rows(timings, verifier_gpu, drafter_gpu)
    services = median_row(rows) | {"iteration unprofiled": statistics.median(r["iteration"] for r in warm.breakdown)}
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"model {args.shape or model} on {device} ({args.dtype}), batch {args.batch}, k {args.k}, alpha {args.alpha}, "
        f"{args.new_tokens} new tokens, placement {args.placement}; {len(rows)} iterations profiled; "
        f"median ms per iteration (in one process: GPU busy = the run's GPU time / iterations)\n"
    )
    keys = list(services)
    print(f"{'':<28}{'services':>10}{'one process':>13}")
    for key in keys:
        mine = one_process.get(key)
        print(f"{key:<28}{services[key]:>10.3f}{'' if mine is None else f'{mine:>13.3f}'}")
    if rows:
        print("\nthe median services iteration (ms from its schedule's start):")
        print(timeline(timings, verifier_gpu, drafter_gpu, rows))
    if args.out:
        args.out.write_text(
            json.dumps(
                {"args": vars(args) | {"model": str(model)}, "services": rows, "one_process": one_process},
                indent=1,
                default=str,
            )
        )
    if args.svg and rows:
        title = (
            f"median services iteration: {args.shape or model.name}, batch {args.batch}, k {args.k}, "
            f"alpha {args.alpha}, {device}"
        )
        args.svg.write_text(svg(timings, verifier_gpu, drafter_gpu, rows, title))


if __name__ == "__main__":
    main()
