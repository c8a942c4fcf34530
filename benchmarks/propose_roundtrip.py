"""Host cost of one Propose round trip: the verifier's real `DrafterClient.propose` (a pooled drafter's path,
through the event loop) to a real drafter server process on this host (`specsplit serve drafter --placement
pooled`, a tiny checkpoint, the CPU, hidden transport grpc), for each `--rpc` in turn against the same drafter:
`local` (ProposeStream on the drafter's Unix socket, which the client takes because the socket is on its host) and
then `stream` (gRPC's ProposeStream on 127.0.0.1: the drafter's socket file is removed first, as if the drafter were
on another host). The co-located placement's step-thread path (`DirectProposer`) is not this benchmark's.

Each iteration proposes for `--batch` decoding requests (k + 1 hidden-state rows each, every draft
accepted), timed around `DrafterClient.propose`. The drafter's step is left out, so what remains is
what the two processes add around it (Python, protobuf, gRPC, the loopback):
    --step fake   (default) the drafter's runner returns drafts at once, without running the MTP
    --step real   the MTP runs on the CPU and its time (step0_ns + later_steps_ns) is subtracted
Printed, medians in µs: the round trip (less the steps); the verifier → drafter hop (sent →
drafter received_ns); the drafter's handler outside its steps (received_ns → replied_ns less the
steps); the drafter → verifier hop (replied_ns → answer back), from both processes' wall clocks
(one host); and the CPU time per Propose of each process, all its threads (less noisy than wall
time on a shared machine).

    python benchmarks/propose_roundtrip.py [--rpc stream local] [--batch 1] [--k 3] [--iterations 2000]
        [--step fake|real] [--tracing] [--profile verifier|drafter]
`--tracing` exports every span to files (what `SPECSPLIT_TRACE_DIR` does); without it no tracer
provider is installed (the services' default). `--profile drafter` runs cProfile in the drafter
process on the thread that serves the first timed Propose of the first `--rpc` (the socket connection's
thread for `local`; for `stream` the event loop, the steps inline on it, all of the handler visible);
`--profile verifier` profiles this process's loop.

Run from the repository root with it on PYTHONPATH; `--serve` is the drafter process it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.fixtures


def serve_drafter(argv: list[str]) -> None:
    """The drafter process: `specsplit serve drafter`, its step replaced (`--fake-step`) and its
    handler profiled from the `--profile-after`-th Propose on (`--profile-out`)."""
    p = argparse.ArgumentParser()
    p.add_argument("--fake-step", action="store_true")
    p.add_argument("--profile-out")
    p.add_argument("--profile-after", type=int, default=1)
    ours, rest = p.parse_known_args(argv)

    import specsplit.drafter.servicer
    from specsplit import telemetry
    from specsplit.cli import parse_args
    from specsplit.drafter.runner import ProposeOutput
    from specsplit.drafter.server import DrafterConfig, serve
    from specsplit.grpc_server import setup_logging

    config = DrafterConfig.from_args(parse_args(["serve", "drafter", *rest]))
    setup_logging("drafter", "WARNING")
    telemetry.setup("drafter")
    profiler = cProfile.Profile() if ours.profile_out else None
    if profiler is not None:
        specsplit.drafter.servicer.StepThread = InlineSteps

    class Runner:
        """The server's runner: its proposes counted (profiling starts after the warm-up) and, with
        --fake-step, answered at once."""

        def __init__(self, runner):
            self._runner, self._calls = runner, 0

        def __getattr__(self, name):
            return getattr(self._runner, name)

        def propose(self, items, hidden_states):
            self._calls += 1
            if profiler is not None and self._calls == ours.profile_after:
                profiler.enable()
            if not ours.fake_step:
                return self._runner.propose(items, hidden_states)
            now = time.time_ns()
            return ProposeOutput([[1] * item.num_spec_tokens for item in items], (now, now, now))

    try:
        asyncio.run(serve(config, wrap_runner=Runner))
    finally:
        telemetry.shutdown()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(ours.profile_out)


class InlineSteps:
    """Stands in for `specsplit.models.device.StepThread` when profiling: each step runs on the event loop."""

    def __init__(self, device, name: str):
        pass

    def run(self, fn, *args) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(fn(*args))
        except Exception as err:  # noqa: BLE001 - handed to the awaiting coroutine
            future.set_exception(err)
        return future


def start_drafter(checkpoint: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, __file__, "--serve", *extra, "--model", str(checkpoint), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("drafter listening on "):
            return proc, line.split()[-1]
    raise RuntimeError(f"the drafter exited with {proc.wait()} before listening")


def cpu_ns(pid: int) -> int:
    """CPU time so far of all of a process's threads (Linux schedstat)."""
    return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir())


async def round_trips(address: str, drafter_pid: int, args, rpc: str, profiler: cProfile.Profile | None):
    """Per timed iteration: round trip less steps, hop out, handler less steps, hop back (ns); and
    the CPU ns per iteration of this process and of the drafter's."""
    import torch
    from opentelemetry import trace

    from specsplit.grpc_server import insecure_channel
    from specsplit.proto import common_pb2, drafter_pb2, drafter_pb2_grpc
    from specsplit.verifier.drafter_client import DrafterClient, ProposeBatch

    async with insecure_channel(address) as channel:
        info = await drafter_pb2_grpc.DrafterStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
    rows, batch = args.k + 1, args.batch
    cycle = (info.max_model_len - 2 * rows) // rows  # positions wrap: the drafter rolls its MTP KV back
    plans = []
    for i in range(args.warmup + args.iterations):
        p = (i % cycle) * rows
        items = [
            drafter_pb2.ProposeItem(
                request_id=f"r{b}",
                start_position=p,
                next_token_ids=[(p + b + j) % info.vocab_size for j in range(rows)],
                num_spec_tokens=args.k,
            )
            for b in range(batch)
        ]
        hidden = torch.randn(batch * rows, info.hidden_size).to(getattr(torch, info.dtype))
        plans.append(ProposeBatch(i + 1, items, list(range(0, batch * rows + 1, rows)), hidden))
    client = DrafterClient(address)
    if rpc == "stream":  # the socket's path gone: the client finds no socket on this host and takes gRPC's stream
        os.unlink(info.propose_socket)
    tracer = trace.get_tracer("propose_roundtrip")
    out = []
    for i, plan in enumerate(plans):
        if i == args.warmup:
            cpu, drafter_cpu = time.process_time_ns(), cpu_ns(drafter_pid)
            if profiler is not None:
                profiler.enable()
        t0 = time.perf_counter_ns()
        with tracer.start_as_current_span("send_hidden_states"):  # the verifier's span around a Propose
            proposal = await client.propose(plan, batch)
        round_trip = time.perf_counter_ns() - t0
        if not proposal.ok:
            raise RuntimeError(proposal.error)
        steps = proposal.step0_ns + proposal.later_steps_ns
        out.append(
            (
                round_trip - steps,
                proposal.drafter_received_ns - proposal.sent_ns,
                proposal.drafter_replied_ns - proposal.drafter_received_ns - steps,
                proposal.received_ns - proposal.drafter_replied_ns,
            )
        )
    if profiler is not None:
        profiler.disable()
    ((_, stream),) = client._streams.values()
    if (type(stream).__name__ == "LocalStream") != (rpc == "local"):
        raise RuntimeError(f"--rpc {rpc} ran on {type(stream).__name__}")
    cpu = [(time.process_time_ns() - cpu) / args.iterations, (cpu_ns(drafter_pid) - drafter_cpu) / args.iterations]
    await client.close()
    return out[args.warmup :], cpu


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve_drafter(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rpc", nargs="+", choices=["local", "stream"], default=["local", "stream"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50, help="untimed iterations first")
    p.add_argument("--step", choices=["fake", "real"], default="fake")
    p.add_argument("--tracing", action="store_true", help="export every span to files")
    p.add_argument("--profile", choices=["verifier", "drafter"], help="cProfile one side")
    p.add_argument("--model", help="checkpoint directory (default: a tiny one written to a temporary directory)")
    args = p.parse_args()

    from specsplit import telemetry
    from tests.fixtures.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in os.environ if n.startswith("OTEL_")] + ["SPECSPLIT_TRACE_DIR"]:
            os.environ.pop(name, None)  # both processes: tracing exactly as asked
        if args.tracing:
            os.environ["SPECSPLIT_TRACE_DIR"] = str(Path(tmp) / "traces")
        telemetry.setup("verifier")
        checkpoint = Path(args.model) if args.model else write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        extra = ["--fake-step"] if args.step == "fake" else []
        extra += ["--placement", "pooled", "--socket-dir", tmp]
        profile_out = Path(tmp) / "drafter.prof"
        if args.profile == "drafter":
            extra += ["--profile-out", str(profile_out), "--profile-after", str(args.warmup + 1)]
        proc, address = start_drafter(checkpoint, extra)
        profiler = cProfile.Profile() if args.profile == "verifier" else None
        columns = []
        try:
            for rpc in sorted(args.rpc):  # local first: stream removes the socket's path
                out, cpu = asyncio.run(round_trips(address, proc.pid, args, rpc, profiler))
                columns.append([statistics.median(ns) / 1e3 for ns in zip(*out)] + [ns / 1e3 for ns in cpu])
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            telemetry.shutdown()
        print(
            f"batch {args.batch}, k {args.k}, step {args.step}, tracing {'on' if args.tracing else 'off'}: "
            f"µs per Propose (medians of {args.iterations}; CPU: mean)"
        )
        names = ["round trip less steps", "verifier -> drafter", "drafter handler", "drafter -> verifier"]
        print(f"  {'':22s} " + " ".join(f"{rpc:>8s}" for rpc in sorted(args.rpc)))
        for i, name in enumerate(names + ["verifier CPU", "drafter CPU"]):
            print(f"  {name:22s} " + " ".join(f"{column[i]:8.1f}" for column in columns))
        if args.profile:
            stats = pstats.Stats(profiler) if profiler is not None else pstats.Stats(str(profile_out))
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
