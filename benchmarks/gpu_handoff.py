"""What it costs two workers to take turns on one GPU: two threads of one process (one CUDA context,
what `benchmarks/e2e.py`'s in-process mode does) against two processes (two contexts, what the
verifier and the drafter services on one GPU do).

    PYTHONPATH=. python benchmarks/gpu_handoff.py [--turns 2000] [--label mps]

Each turn: wait for the other worker's signal (one byte on a pipe), launch a small GPU job
(`--matmuls` bf16 GEMVs of 4096 x 4096, about 10 µs each on an H200), wait for it
(`torch.cuda.synchronize`) and signal back. Reported per mode: the median µs per turn over `--trials`
runs, with the GPU job and without it (`--matmuls 0`: the signal alone), so

    GPU hand-over cost = (processes, GPU − processes, signal) − (threads, GPU − threads, signal)

is what a second context adds to every turn beyond the job itself. The "host work" rows put
`--host-us` of host work (a service planning its step) before each job, without and with
`models.device.DeviceClaim` (a one-element kernel queued before that work, which starts the switch
early). Run it once plainly and once with an MPS control daemon started (`--label mps`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # models.device, in spawned players too


def _job(matmuls: int):
    import torch

    torch.cuda.set_device(0)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def run() -> None:
        y = x
        for _ in range(matmuls):
            y = y @ w
        torch.cuda.synchronize()

    run()
    return run


def _player(inbox, outbox, ready, turns: int, matmuls: int, host_us: float, claim: bool) -> None:
    """Says it is ready, then takes `turns` turns: waits for a message in `inbox`, (claims the GPU,)
    works `host_us` on the host (a service planning its step), runs the job, sends a message to
    `outbox` (one-way `multiprocessing` pipe ends, which threads and spawned processes share alike)."""
    run = _job(matmuls) if matmuls else (lambda: None)
    if claim:
        from models.device import DeviceClaim

        claim_device = DeviceClaim("cuda:0").claim
    ready.send_bytes(b"r")
    for _ in range(turns):
        inbox.recv_bytes()
        if claim:
            claim_device()
        end = time.perf_counter() + host_us / 1e6
        while time.perf_counter() < end:
            pass
        run()
        outbox.send_bytes(b"t")


def one_trial(mode: str, turns: int, matmuls: int, host_us: float = 0.0, claim: bool = False) -> float:
    """µs per turn of two players taking `turns` turns each, alternately."""
    ctx = mp.get_context("spawn")
    to_b_in, to_b_out = ctx.Pipe(duplex=False)  # (receiving end, sending end)
    to_a_in, to_a_out = ctx.Pipe(duplex=False)
    ready_in, ready_out = ctx.Pipe(duplex=False)
    args_a = (to_a_in, to_b_out, ready_out, turns, matmuls, host_us, claim)
    args_b = (to_b_in, to_a_out, ready_out, turns, matmuls, host_us, claim)
    if mode == "threads":
        workers = [threading.Thread(target=_player, args=a) for a in (args_a, args_b)]
    else:
        workers = [ctx.Process(target=_player, args=a) for a in (args_a, args_b)]
    for w in workers:
        w.start()
    ready_in.recv_bytes()
    ready_in.recv_bytes()
    t0 = time.perf_counter()
    to_a_out.send_bytes(b"s")  # A's first turn; B's last message to A is left unread
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    for conn in (to_b_in, to_b_out, to_a_in, to_a_out, ready_in, ready_out):
        conn.close()
    return seconds / (2 * turns) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=2000)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--matmuls", type=int, default=4)
    p.add_argument("--host-us", type=float, default=300.0, help="host work per turn before the job, for the claim rows")
    p.add_argument("--label", default="plain", help="a name for this run's set-up (e.g. mps)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = {}
    for mode in ("threads", "processes"):
        for matmuls in (0, args.matmuls):
            trials = [one_trial(mode, args.turns, matmuls) for _ in range(args.trials)]
            rows[f"{mode}, {'GPU' if matmuls else 'signal'}"] = statistics.median(trials)
    # A service's turn: host planning before its first kernel, with and without claiming the GPU first.
    for mode in ("threads", "processes"):
        for claim in (False, True):
            trials = [one_trial(mode, args.turns, args.matmuls, args.host_us, claim) for _ in range(args.trials)]
            rows[f"{mode}, GPU + host work{', claim' if claim else ''}"] = statistics.median(trials)
    cost = (rows["processes, GPU"] - rows["processes, signal"]) - (rows["threads, GPU"] - rows["threads, signal"])
    host = "GPU + host work"
    after_host = rows[f"processes, {host}"] - rows[f"threads, {host}"]
    claimed = rows[f"processes, {host}, claim"] - rows[f"threads, {host}, claim"]
    print(f"{args.label}: µs per turn (median of {args.trials} x {args.turns} turns, {args.matmuls} GEMVs per job, ")
    print(f"  {args.host_us:.0f} µs of host work per turn in the 'host work' rows)")
    for name, us in rows.items():
        print(f"  {name:36s} {us:8.1f}")
    print(f"  GPU hand-over cost between processes: {cost:+.1f} µs per turn")
    print(f"  ... after host work: {after_host:+.1f} µs; with the GPU claimed first: {claimed:+.1f} µs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"label": args.label, "us_per_turn": rows, "handover_us": cost, "after_host_us": after_host,
                       "claimed_us": claimed}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
