"""End-to-end decode speed: target-only vs the three services over gRPC vs the same engine objects
in one process, at several batch sizes and k, side by side in one run.

(a) target_only  — the in-process engine with k = 0 (scheduler → verifier runner, no drafter)
(c) in_process   — scheduler → verifier runner → drafter runner → post_step, no gRPC
(b) services     — coordinator, verifier and drafter as three processes on loopback gRPC
Each cell: B concurrent greedy requests of --new-tokens tokens (ignore_eos) on one prompt set;
tokens/s = B * new_tokens / wall time; time per output token per request; iterations.

    python benchmarks/e2e.py --model checkpoints/demo --device cuda --dtype bfloat16 \
        --batches 1 8 32 64 --ks 1 2 3 [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from coordinator.config import SchedulerConfig  # noqa: E402
from coordinator.request import Request, SamplingParams  # noqa: E402
from coordinator.scheduler import Scheduler, VerifyResult  # noqa: E402
from coordinator.wire import verify_request  # noqa: E402
from drafter.runner import DrafterRunner, ProposeItem  # noqa: E402
from models.loader import load_mtp, load_target  # noqa: E402
from models.step_upload import StepUpload  # noqa: E402
from specsplit import Client  # noqa: E402
from specsplit.launcher import LocalCluster  # noqa: E402
from verifier.input_batch import build_input_batch  # noqa: E402
from verifier.runner import VerifierRunner  # noqa: E402

PROMPT_LEN = 64


def prompts(model: str, batch: int) -> list[list[int]]:
    """PROMPT_LEN-token windows of the demo checkpoint's held-out stdlib files (code the drafter
    can predict), several windows per file when the batch needs more."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listed = Path(model) / "heldout_files.txt"
    names = listed.read_text().split() if listed.exists() else []
    out: list[list[int]] = []
    for name in names:
        if (stdlib / name).is_file():
            ids = tok.encode((stdlib / name).read_text(errors="replace"), add_special_tokens=False)
            out += [ids[i : i + PROMPT_LEN] for i in range(0, len(ids) - 2 * PROMPT_LEN, 4 * PROMPT_LEN)]
    if len(out) < batch:  # no held-out files here: random tokens (low acceptance)
        g = torch.Generator().manual_seed(batch)
        out += [torch.randint(3, tok.vocab_size, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]
    step = max(1, len(out) // batch)
    return out[::step][:batch]


class InProcessEngine:
    """The services' objects wired directly: what disaggregation is measured against."""

    def __init__(self, model: str, device: str, dtype: torch.dtype, num_blocks: int = 4096, block_size: int = 16):
        self.target = load_target(model, dtype=dtype, device=device)
        self.mtp = load_mtp(model, dtype=dtype, device=device)
        self.device, self.num_blocks, self.block_size = device, num_blocks, block_size

    def run(self, batch_prompts: list[list[int]], new_tokens: int, k: int) -> tuple[float, int]:
        cfg = self.target.config
        verifier = VerifierRunner(self.target, self.target.make_kv_cache(self.num_blocks, self.block_size))
        upload = StepUpload(self.device)
        drafter = DrafterRunner(self.mtp, self.mtp.make_kv_cache(self.num_blocks, self.block_size))
        sched = Scheduler(
            SchedulerConfig(
                max_model_len=cfg.max_position_embeddings,
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                num_speculative_tokens=k,
                max_num_seqs=len(batch_prompts),
                max_num_batched_tokens=max(2048, len(batch_prompts) * (k + 1)),
            ),
            eos_token_ids=[],
        )
        for i, p in enumerate(batch_prompts):
            sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=new_tokens, ignore_eos=True)))
        iterations = 0
        sync = torch.cuda.synchronize if self.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        while sched.running or sched.waiting:
            out = sched.schedule()
            batch = build_input_batch(
                verify_request(out, "bench"),
                vocab_size=cfg.vocab_size,
                max_model_len=cfg.max_position_embeddings,
                num_cached_tokens=verifier.kv_cache.num_tokens,
                device=self.device,
                upload=upload,
            )
            verifier.free(out.finished_request_ids)
            drafter.free(out.finished_request_ids)
            step = verifier.step(batch)
            drafts = [[] for _ in batch.req_ids]
            if k > 0:
                items = [
                    ProposeItem(rid, step.start_positions[i], step.next_token_ids[i], batch.num_spec_tokens[i])
                    for i, rid in enumerate(batch.req_ids)
                ]
                drafts = drafter.propose(items, step.hidden_states).drafts
            results = [
                VerifyResult(rid, step.sampled_token_ids[i], step.num_rejected[i], drafts[i])
                for i, rid in enumerate(batch.req_ids)
            ]
            sched.update_from_output(out, results)
            iterations += 1
        sync()
        return time.perf_counter() - t0, iterations


def run_services(cluster: LocalCluster, batch_prompts: list[list[int]], new_tokens: int, k: int) -> tuple[float, int]:
    iterations = []

    def one(p):
        with Client(cluster.address, timeout=900) as client:
            out = client.generate(prompt_token_ids=p, max_tokens=new_tokens, ignore_eos=True, num_speculative_tokens=k)
            iterations.append(out.stats.num_iterations)

    threads = [threading.Thread(target=one, args=(p,)) for p in batch_prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, max(iterations)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="median over this many runs per cell")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    engine = InProcessEngine(args.model, args.device, dtype)
    rows = []
    max_k = max(args.ks)
    with LocalCluster(
        args.model,
        num_speculative_tokens=max_k,
        device=args.device,
        dtype=args.dtype,
        log_dir=tempfile.mkdtemp(prefix="specsplit-e2e-"),
        coordinator_args=[
            "--max-num-seqs",
            str(max(args.batches)),
            "--max-num-batched-tokens",
            str(max(2048, max(args.batches) * (max_k + 1))),
        ],
        verifier_args=["--num-blocks", "4096"],
        drafter_args=["--num-blocks", "4096"],
    ) as cluster:
        for batch in args.batches:
            ps = prompts(args.model, batch)
            engine.run(ps[:1], 8, 1)  # warm-up (kernels, allocator)
            run_services(cluster, ps[:1], 8, 1)
            base = statistics.median(engine.run(ps, args.new_tokens, 0)[0] for _ in range(args.repeats))
            rows.append(dict(batch=batch, k=0, mode="target_only", seconds=base))
            for k in args.ks:
                for mode in ("in_process", "services"):
                    if mode == "in_process":
                        runs = [engine.run(ps, args.new_tokens, k) for _ in range(args.repeats)]
                    else:
                        runs = [run_services(cluster, ps, args.new_tokens, k) for _ in range(args.repeats)]
                    seconds = statistics.median(r[0] for r in runs)
                    rows.append(dict(batch=batch, k=k, mode=mode, seconds=seconds, iterations=runs[0][1]))
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"model {args.model} on {gpu} ({args.dtype}), prompts {PROMPT_LEN} tokens, {args.new_tokens} new tokens, "
        f"held-out code prompts, greedy; median of {args.repeats}"
    )
    print("| batch | k | mode | tokens/s | ms per output token | speedup vs target-only | services / in-process |")
    print("|---|---|---|---|---|---|---|")
    by = {(r["batch"], r["k"], r["mode"]): r["seconds"] for r in rows}
    for r in rows:
        tps = r["batch"] * args.new_tokens / r["seconds"]
        speedup = by[(r["batch"], 0, "target_only")] / r["seconds"]
        ratio = f"{r['seconds'] / by[(r['batch'], r['k'], 'in_process')]:.2f}" if r["mode"] == "services" else "-"
        print(
            f"| {r['batch']} | {r['k']} | {r['mode']} | {tps:.0f} | {1e3 * r['seconds'] / args.new_tokens:.1f} | "
            f"{speedup:.2f}x | {ratio} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
