"""A service process with the torch profiler switched on and off by signals (benchmarks only).

    python -m benchmarks.profiled_service --trace-out verifier.json -- -m specsplit serve verifier <args>
    python -m benchmarks.profiled_service --trace-out drafter.json -- -m benchmarks.forced_drafter <args>

SIGUSR1 starts `torch.profiler` (every CUDA kernel and copy of the process, through CUPTI; on a machine without
CUDA, host ops: recording every host op on a GPU machine would slow the host work that is being measured);
SIGUSR2 stops it and writes a Chrome trace to --trace-out, then an empty `<trace-out>.done`. Chrome
traces carry `baseTimeNanoseconds`: an event's wall-clock time is that plus its `ts` (microseconds), the
clock every process of the host shares, so `benchmarks/iteration_profile.py` can put two processes' GPU
work and the coordinator's stamps on one time line. The wrapped program runs unchanged (`runpy`).
"""

from __future__ import annotations

import argparse
import runpy
import signal
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace-out", type=Path, required=True)
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- -m module args...")
    args = p.parse_args()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if program[:1] != ["-m"] or len(program) < 2:
        p.error("give the wrapped program as: -- -m module [args...]")
    activities = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
    state: dict[str, profile] = {}

    def start(*_) -> None:
        if "prof" not in state:
            state["prof"] = profile(activities=activities)
            state["prof"].__enter__()

    def stop(*_) -> None:
        prof = state.pop("prof", None)
        if prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(args.trace_out))
            Path(f"{args.trace_out}.done").touch()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [program[1], *program[2:]]
    runpy.run_module(program[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
