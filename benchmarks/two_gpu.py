"""Verifier and drafter on two GPUs: what each hidden-state transport costs and what it buys.

(i)  transfer — per-iteration hidden-state transfer for each transport: rows = batch * (k + 1) of
     the demo model's and a 7B model's hidden size (3584), from "rows ready on the verifier GPU" to
     "the drafter answered with the rows usable on its GPU" (a real gRPC Propose round trip to a
     drafter process that only takes the rows); median over --iters. "moving the rows" is that
     round trip minus the median round trip of the same Propose without rows (the control message
     every transport pays): what the hidden states themselves cost.
(ii) e2e — tokens/s through LocalCluster, verifier on --verifier-device and drafter on
     --drafter-device, for each transport, plus the one-GPU three-service run (both on the verifier
     device, grpc) for comparison; and a lossless check: greedy output of each transport equals the
     target-only output (k = 0), request by request, in --check-dtype.

    python benchmarks/two_gpu.py --out two_gpu.json                      # 2 GPUs: cuda:0 / cuda:1, bf16
    python benchmarks/two_gpu.py --verifier-device cpu --drafter-device cpu --dtype float32 \\
        --transports grpc nccl --batches 1 --new-tokens 8 --iters 20     # reduced form on a CPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks.e2e import make_prompts  # noqa: E402
from benchmarks.e2e_modes import run_services  # noqa: E402
from models.transport import make_sender  # noqa: E402
from protos import drafter_pb2, drafter_pb2_grpc  # noqa: E402
from specsplit import Client  # noqa: E402
from specsplit.grpc_server import CHANNEL_OPTIONS  # noqa: E402
from specsplit.launcher import LocalCluster, free_port  # noqa: E402

K = 3
SEVEN_B_HIDDEN = 3584


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _transfer_times(transport: str, args, hidden_size: int, batches: list[int]) -> tuple[float, dict[int, float]]:
    """(median seconds of a Propose without rows, {batch: median seconds per transfer}), one drafter
    peer process for all of them."""
    port = free_port()
    peer = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "transport_peer.py"), transport, args.drafter_device]
        + [str(hidden_size), str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if peer.stdout.readline().strip() != "ready":
            raise RuntimeError(f"transport peer for {transport} did not start")
        backend = "nccl" if args.verifier_device.startswith("cuda") else "gloo"
        sender = make_sender(transport, rendezvous="127.0.0.1:0", backend=backend, timeout_s=60)
        device, dtype = torch.device(args.verifier_device), getattr(torch, args.dtype)
        out = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)

            def open_call(request):
                return stub.OpenHiddenTransport(request, timeout=120)

            control = []
            for i in range(args.warmup + args.iters):
                t0 = time.perf_counter()
                await stub.Propose(drafter_pb2.ProposeRequest(iteration=i), timeout=60)
                control.append(time.perf_counter() - t0)

            for batch in batches:
                rows = torch.randn(batch * (K + 1), hidden_size, device=device).to(dtype)
                times = []
                for i in range(args.warmup + args.iters):
                    _sync(device)  # the rows are ready on the verifier's device
                    t0 = time.perf_counter()
                    if sender.needs_open(rows):
                        await sender.open(rows, open_call)
                        t0 = time.perf_counter()  # opening happens once, not per iteration
                    msg = drafter_pb2.ProposeRequest(iteration=i)
                    transfer = sender.send(rows, msg)
                    resp = await stub.Propose(msg, timeout=60)
                    sender.finish(transfer, ok=True)
                    times.append(time.perf_counter() - t0)
                    assert resp.step0_ns == rows.shape[0]
                out[batch] = statistics.median(times[args.warmup :])
        sender.close()
        return statistics.median(control[args.warmup :]), out
    finally:
        peer.stdin.close()
        peer.wait(30)


def _cluster(args, transport: str, drafter_device: str, dtype: str, batch: int) -> LocalCluster:
    return LocalCluster(
        args.model,
        num_speculative_tokens=K,
        dtype=dtype,
        hidden_transport=transport,
        verifier_device=args.verifier_device,
        drafter_device=drafter_device,
        log_dir=tempfile.mkdtemp(prefix=f"specsplit-two-gpu-{transport}-"),
        coordinator_args=["--max-num-seqs", str(batch), "--max-num-batched-tokens", str(max(2048, batch * (K + 1)))],
        verifier_args=["--num-blocks", "4096"],
        drafter_args=["--num-blocks", "4096"],
    )


def _greedy_outputs(cluster: LocalCluster, ps: list[list[int]], new_tokens: int, k: int) -> list[list[int]]:
    """One request at a time, so every run sees the same batch shapes."""
    with Client(cluster.address, timeout=900) as client:
        return [
            client.generate(
                prompt_token_ids=p, max_tokens=new_tokens, ignore_eos=True, num_speculative_tokens=k
            ).token_ids
            for p in ps
        ]


def run_e2e(args) -> tuple[list[dict], list[dict]]:
    placements = [(t, args.drafter_device, f"two_devices/{t}") for t in args.transports]
    placements.append(("grpc", args.verifier_device, "one_device/grpc"))
    rows, checks = [], []
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    check_prompts = make_prompts(Path(args.model), args.check_prompts, vocab_size)
    reference = None
    for transport, drafter_device, mode in placements:
        with _cluster(args, transport, drafter_device, args.check_dtype, 1) as cluster:
            if reference is None:
                reference = _greedy_outputs(cluster, check_prompts, args.new_tokens, 0)  # target-only
            got = _greedy_outputs(cluster, check_prompts, args.new_tokens, K)
        same = sum(g == r for g, r in zip(got, reference))
        checks.append(dict(mode=mode, dtype=args.check_dtype, prompts=len(reference), identical=same))
        with _cluster(args, transport, drafter_device, args.dtype, max(args.batches)) as cluster:
            for batch in args.batches:
                ps = make_prompts(Path(args.model), batch, vocab_size)
                run_services(cluster.address, ps[:1], 8, K)  # warm-up (kernels, allocator)
                runs = [run_services(cluster.address, ps, args.new_tokens, K) for _ in range(args.repeats)]
                seconds = statistics.median(r.seconds for r in runs)
                rows.append(dict(mode=mode, batch=batch, k=K, tokens_per_s=batch * args.new_tokens / seconds))
    return rows, checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--verifier-device", default="cuda:0")
    p.add_argument("--drafter-device", default="cuda:1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--check-dtype", default="float32", help="dtype of the lossless check runs")
    p.add_argument("--transports", nargs="+", default=["grpc", "cuda_ipc", "nccl"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=200, help="transfers per microbenchmark cell")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # tables reach a redirected log as they are printed

    from transformers import AutoConfig

    demo_hidden = AutoConfig.from_pretrained(args.model).hidden_size
    transfer = []
    for hidden_size in (demo_hidden, SEVEN_B_HIDDEN):
        for transport in args.transports:
            control, times = asyncio.run(_transfer_times(transport, args, hidden_size, args.batches))
            for batch, seconds in times.items():
                nbytes = batch * (K + 1) * hidden_size * getattr(torch, args.dtype).itemsize
                transfer.append(
                    dict(
                        transport=transport, hidden_size=hidden_size, batch=batch, bytes=nbytes, s=seconds,
                        control_s=control, moving_s=max(seconds - control, 0.0),
                    )
                )  # fmt: skip
    names = {
        d: torch.cuda.get_device_name(d) if d.startswith("cuda") else "cpu"
        for d in (args.verifier_device, args.drafter_device)
    }
    print(
        f"verifier {args.verifier_device} ({names[args.verifier_device]}), drafter {args.drafter_device} "
        f"({names[args.drafter_device]}), {args.dtype}, k = {K}, median of {args.iters} transfers / {args.repeats} runs"
    )
    print(
        "\n| transport | hidden size | batch | rows | bytes | Propose round trip (ms) | without rows (ms) "
        "| moving the rows (ms) | vs grpc |\n|---|---|---|---|---|---|---|---|---|"
    )
    base = {(r["hidden_size"], r["batch"]): r["moving_s"] for r in transfer if r["transport"] == "grpc"}
    for r in transfer:
        ratio = base.get((r["hidden_size"], r["batch"]))
        speed = f"{ratio / max(r['moving_s'], 1e-6):.1f}x" if ratio else "-"
        print(
            f"| {r['transport']} | {r['hidden_size']} | {r['batch']} | {r['batch'] * (K + 1)} | {r['bytes']} | "
            f"{1e3 * r['s']:.3f} | {1e3 * r['control_s']:.3f} | {1e3 * r['moving_s']:.3f} | {speed} |"
        )
    if args.out:  # the transfer table survives an e2e failure
        args.out.write_text(json.dumps(dict(transfer=transfer, devices=names), indent=1))
    e2e, checks = ([], []) if args.skip_e2e else run_e2e(args)
    if e2e:
        print("\n| placement / transport | batch | tokens/s |\n|---|---|---|")
        for r in e2e:
            print(f"| {r['mode']} | {r['batch']} | {r['tokens_per_s']:.0f} |")
        print("\n| placement / transport | lossless check: greedy == target-only |\n|---|---|")
        for c in checks:
            print(f"| {c['mode']} | {c['identical']}/{c['prompts']} prompts identical ({c['dtype']}) |")
    if args.out:
        args.out.write_text(json.dumps(dict(transfer=transfer, e2e=e2e, lossless=checks, devices=names), indent=1))
    if any(c["identical"] != c["prompts"] for c in checks):
        sys.exit("lossless check failed: some greedy output differs from target-only")


if __name__ == "__main__":
    main()
