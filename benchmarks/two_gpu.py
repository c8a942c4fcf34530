"""Verifier and drafter on two GPUs: what each hidden-state transport costs and what it buys.

(i)  transfer — per-iteration hidden-state transfer for each transport: rows = batch * (k + 1) of
     the demo model's and a 7B model's hidden size (3584), from "rows ready on the verifier GPU" to
     "the drafter answered with the rows usable on its GPU" (a real gRPC Propose round trip to a
     drafter process that only takes the rows); median over --iters. "moving the rows" is that
     round trip minus the median round trip of the same Propose without rows (the control message
     every transport pays): what the hidden states themselves cost.
(ii) e2e — tokens/s through LocalCluster, verifier on --verifier-device and drafter on
     --drafter-device, for each transport, plus the one-GPU three-service run (both on the verifier
     device, grpc) for comparison, with the acceptance each run saw; and a lossless check: greedy
     output of each transport equals the target-only output (k = 0), request by request, in
     --check-dtype.

--shape NAME runs (ii) on a model shape from benchmarks/shapes.py (e.g. qwen2-7b) with random
weights (--load-format dummy) instead of --model. Random weights draft garbage, so --alpha forces
acceptance (benchmarks/forced_acceptance.py, as in benchmarks/e2e.py): a target-only run on one
device (--dtype) gives each prompt's greedy continuation, the oracle of every measured cluster's
drafter (dummy weights are seeded per tensor name, so every process builds the same model). The
lossless check then compares every output of the measured runs (each batch and repeat) with that
target-only output, in --dtype (--check-dtype is not used): the verifier still decides each token.

    python benchmarks/two_gpu.py --out two_gpu.json                      # 2 GPUs: cuda:0 / cuda:1, bf16
    python benchmarks/two_gpu.py --shape qwen2-7b --load-format dummy --alpha 0.8 \\
        --transports cuda_ipc nccl --batches 1 32 --out two_gpu_7b.json  # the 7B shape on 2 GPUs
    python benchmarks/two_gpu.py --verifier-device cpu --drafter-device cpu --dtype float32 \\
        --transports grpc nccl --batches 1 --new-tokens 8 --iters 20     # reduced form on a CPU machine
    python benchmarks/two_gpu.py --verifier-device cpu --drafter-device cpu --dtype float32 \\
        --transports grpc nccl --batches 1 2 --new-tokens 8 --iters 20 --repeats 1 \\
        --shape qwen2-tiny --load-format dummy --alpha 0.8               # the shape path on a CPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from benchmarks.e2e_modes import RunResult, run_services, step_token_budget  # noqa: E402
from benchmarks.e2e_report import cell_row  # noqa: E402
from benchmarks.forced_acceptance import Oracle  # noqa: E402
from benchmarks.shapes import SHAPES, write_shape  # noqa: E402
from specsplit import Client  # noqa: E402
from specsplit.grpc_server import CHANNEL_OPTIONS  # noqa: E402
from specsplit.launcher import LocalCluster, free_port  # noqa: E402
from specsplit.proto import drafter_pb2, drafter_pb2_grpc  # noqa: E402
from specsplit.transport import make_sender  # noqa: E402

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

            stream = stub.ProposeStream(timeout=3600)  # one message each way per iteration, as the verifier's

            async def propose(msg: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
                await stream.write(msg)
                return await stream.read()

            control = []
            for i in range(args.warmup + args.iters):
                t0 = time.perf_counter()
                await propose(drafter_pb2.ProposeRequest(iteration=i))
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
                    resp = await propose(msg)
                    sender.finish(transfer, ok=True)
                    times.append(time.perf_counter() - t0)
                    assert resp.step0_ns == rows.shape[0]
                out[batch] = statistics.median(times[args.warmup :])
            await stream.done_writing()
        sender.close()
        return statistics.median(control[args.warmup :]), out
    finally:
        peer.stdin.close()
        peer.wait(30)


def _cluster(
    args,
    model: str | Path,
    transport: str,
    drafter_device: str,
    dtype: str,
    batch: int,
    *,
    k: int = K,
    with_drafter: bool = True,
    drafter_command: list[str] | None = None,
) -> LocalCluster:
    """drafter_command: the drafter's program instead of `specsplit serve drafter` (the forced drafter)."""
    return LocalCluster(
        str(model),
        num_speculative_tokens=k,
        dtype=dtype,
        # cuda_ipc: the co-located placement's (two GPUs of one host); grpc and nccl: a pooled drafter's.
        placement="colocated" if transport == "cuda_ipc" else "pooled",
        hidden_transport=None if transport == "cuda_ipc" else transport,
        verifier_device=args.verifier_device,
        drafter_device=drafter_device,
        log_dir=tempfile.mkdtemp(prefix=f"specsplit-two-gpu-{transport}-"),
        load_format=args.load_format,
        with_drafter=with_drafter,
        role_commands={"drafter": drafter_command} if drafter_command else None,
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},  # benchmarks.*
        coordinator_args=[
            *["--max-num-seqs", str(batch), "--max-num-batched-tokens", str(step_token_budget(batch, k))],
            "--no-adaptive",  # a fixed k: the transports are compared at it
        ],
        verifier_args=["--num-blocks", "4096"],
        drafter_args=["--num-blocks", "4096"],
    )


def _greedy_outputs(cluster: LocalCluster, ps: list[list[int]], new_tokens: int, k: int) -> list[list[int]]:
    """One request at a time, so every run sees the same batch shapes."""
    with Client(cluster.address, timeout=900) as client:
        return [
            client.generate(
                prompt_token_ids=p, max_tokens=new_tokens, ignore_eos=True, num_speculative_tokens=k, temperature=0.0
            ).token_ids
            for p in ps
        ]


def _measure(args, cluster: LocalCluster, mode: str, prompts_of) -> tuple[list[dict], list[tuple[int, RunResult]]]:
    """The e2e rows of one cluster (one per batch; prompts_of(batch) gives its prompts) and the runs behind them."""
    rows, runs_of = [], []
    for batch in args.batches:
        ps = prompts_of(batch)
        # Warm-up: the same cell once, untimed. Its shapes make Triton compile the kernel variants they need
        # (the first process to see them pays; later ones read the on-disk cache), which must not land in
        # the timed runs.
        run_services(cluster.address, ps, args.new_tokens, K)
        runs = [run_services(cluster.address, ps, args.new_tokens, K) for _ in range(args.repeats)]
        rows.append(cell_row(batch, K, mode, args.new_tokens, runs))
        runs_of.append((batch, runs))
    return rows, runs_of


def _placements(args) -> list[tuple[str, str, str]]:
    placements = [(t, args.drafter_device, f"two_devices/{t}") for t in args.transports]
    placements.append(("grpc", args.verifier_device, "one_device/grpc"))
    return placements


def run_e2e(args) -> tuple[list[dict], list[dict]]:
    if args.shape:
        return run_e2e_shape(args)
    rows, checks = [], []
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    check_prompts = make_prompts(Path(args.model), args.check_prompts, vocab_size)
    reference = None
    for transport, drafter_device, mode in _placements(args):
        with _cluster(args, args.model, transport, drafter_device, args.check_dtype, 1) as cluster:
            if reference is None:
                reference = _greedy_outputs(cluster, check_prompts, args.new_tokens, 0)  # target-only
            got = _greedy_outputs(cluster, check_prompts, args.new_tokens, K)
        same = sum(g == r for g, r in zip(got, reference))
        checks.append(dict(mode=mode, dtype=args.check_dtype, prompts=len(reference), identical=same))
        with _cluster(args, args.model, transport, drafter_device, args.dtype, max(args.batches)) as cluster:
            measured, _ = _measure(args, cluster, mode, lambda b: make_prompts(Path(args.model), b, vocab_size))
        rows += measured
    return rows, checks


def run_e2e_shape(args) -> tuple[list[dict], list[dict]]:
    """--shape: random weights, forced acceptance; the lossless check covers every measured output."""
    work = Path(tempfile.mkdtemp(prefix="specsplit-two-gpu-shape-"))
    model = write_shape(args.shape, work / args.shape)
    vocab_size, max_batch = SHAPES[args.shape]["vocab_size"], max(args.batches)
    prompts = make_prompts(model, max_batch, vocab_size)  # the batches' prompts are prefixes of these
    target_only = dict(k=0, with_drafter=False)
    with _cluster(args, model, "grpc", args.verifier_device, args.dtype, max_batch, **target_only) as cluster:
        reference = run_services(cluster.address, prompts, args.new_tokens, 0).outputs
    Oracle([p + o for p, o in zip(prompts, reference)], vocab_size).save(work / "oracle.json")
    forced = [sys.executable, "-m", "benchmarks.forced_drafter", "--alpha", str(args.alpha)]
    forced += ["--oracle", str(work / "oracle.json")]
    rows, checks = [], []
    for transport, drafter_device, mode in _placements(args):
        with _cluster(args, model, transport, drafter_device, args.dtype, max_batch, drafter_command=forced) as c:
            measured, runs_of = _measure(args, c, mode, lambda b: prompts[:b])
        rows += measured
        outputs = [(i, out) for batch, runs in runs_of for r in runs for i, out in enumerate(r.outputs)]
        differ = {i for i, out in outputs if out != reference[i]}
        checked = {i for i, _ in outputs}
        checks.append(
            dict(
                mode=mode, dtype=args.dtype, prompts=len(checked), identical=len(checked - differ), outputs=len(outputs)
            )
        )
    return rows, checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default=str(ROOT / "checkpoints" / "demo"), help="checkpoint of the e2e runs")
    where.add_argument("--shape", choices=sorted(SHAPES), help="e2e on a model shape from benchmarks/shapes.py")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--alpha", type=float, default=None, help="forced acceptance rate per draft position (--shape)")
    p.add_argument("--verifier-device", default="cuda:0")
    p.add_argument("--drafter-device", default="cuda:1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--check-dtype", default="float32", help="dtype of the lossless check runs (--model)")
    p.add_argument("--transports", nargs="+", default=["grpc", "cuda_ipc", "nccl"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=200, help="transfers per microbenchmark cell")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-transfer", action="store_true", help="only the e2e runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.shape and args.load_format != "dummy":
        p.error("--shape has no weights: add --load-format dummy")
    if args.shape and args.alpha is None:
        p.error("--shape drafts with random weights: add --alpha (forced acceptance)")
    if args.alpha is not None and not args.shape:
        p.error("--alpha forces acceptance on --shape runs only")
    if args.alpha is not None and not 0.0 <= args.alpha <= 1.0:
        p.error("--alpha must be in [0, 1]")
    sys.stdout.reconfigure(line_buffering=True)  # tables reach a redirected log as they are printed

    from transformers import AutoConfig

    demo_hidden = AutoConfig.from_pretrained(args.model).hidden_size
    transfer = []
    for hidden_size in () if args.skip_transfer else (demo_hidden, SEVEN_B_HIDDEN):
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
        if args.shape:
            print(
                f"\ne2e: {args.shape} ({args.load_format} weights), {args.dtype}, forced acceptance alpha={args.alpha}"
            )
        else:
            print(f"\ne2e: {args.model} ({args.load_format} weights), {args.dtype}, real drafts")
        print(
            "\n| placement / transport | batch | tokens/s | acceptance rate | accepted drafts per iteration "
            "| acceptance per position |\n|---|---|---|---|---|---|"
        )
        for r in e2e:
            per_position = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
            print(
                f"| {r['mode']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['acceptance_rate']:.2f} "
                f"| {r['accepted_per_iteration']:.2f} | {per_position} |"
            )
        print("\n| placement / transport | lossless check: greedy == target-only |\n|---|---|")
        for c in checks:
            every = f", {c['outputs']} outputs: every batch and repeat" if "outputs" in c else ""
            print(f"| {c['mode']} | {c['identical']}/{c['prompts']} prompts identical ({c['dtype']}{every}) |")
    if args.out:
        e2e_model = dict(model=None if args.shape else args.model, shape=args.shape, load_format=args.load_format)
        e2e_model.update(alpha=args.alpha, dtype=args.dtype)
        result = dict(transfer=transfer, e2e=e2e, e2e_model=e2e_model, lossless=checks, devices=names)
        args.out.write_text(json.dumps(result, indent=1))
    if any(c["identical"] != c["prompts"] for c in checks):
        sys.exit("lossless check failed: some greedy output differs from target-only")


if __name__ == "__main__":
    main()
