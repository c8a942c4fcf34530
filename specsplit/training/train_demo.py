"""Train the demo checkpoint: `python -m specsplit.training.train_demo` (also `specsplit train-demo`).

Steps: build the data folder (tokenizer + split + token ids of this machine's Python standard library),
train a Llama target and one MTP module jointly, keep the state with the best validation loss, save a
bf16 checkpoint, reload it and measure it on held-out files.

Same seed, same device type and thread count -> same weights. GPU kernels (cuBLAS, SDPA backward) may
differ bit-wise from run to run. `--time-budget` chooses the number of steps from the speed measured
over the first steps and prints it: rerun with `--steps N` to repeat a run exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch

from specsplit.training.checkpoint import load_checkpoint, save_checkpoint
from specsplit.training.corpus import stdlib_root
from specsplit.training.dataset import DataParams, RandomWindows, fixed_windows, load_tokenizer, prepare_data
from specsplit.training.evaluate import SAMPLE_PROMPT, add_eval_args, measure, sample_text
from specsplit.training.joint_model import ModelShape, TargetWithMTP, add_residual_dropout, demo_config
from specsplit.training.model_card import write_model_card

CALIBRATION_STEPS = 40


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specsplit train-demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="checkpoint directory to write")
    p.add_argument("--data-dir", type=Path, default=Path("runs/demo-data"), help="prepared data (reused)")
    p.add_argument("--stdlib", type=Path, default=None, help="source root (default: this Python's stdlib)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (tests)")
    p.add_argument("--prepare-only", action="store_true", help="build the data folder and stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=ModelShape.hidden_size)
    p.add_argument("--layers", type=int, default=ModelShape.num_hidden_layers)
    p.add_argument("--heads", type=int, default=ModelShape.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=ModelShape.num_key_value_heads)
    p.add_argument("--intermediate-size", type=int, default=ModelShape.intermediate_size)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --time-budget)")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds of training if no --steps")
    p.add_argument("--max-epochs", type=float, default=40.0, help="cap on passes over the train tokens")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of each MTP step's loss")
    p.add_argument("--mtp-steps", type=int, default=3, help="unrolled MTP steps trained (1 = DeepSeek-V3)")
    p.add_argument("--eval-every", type=int, default=250, help="steps between validation losses")
    p.add_argument("--valid-max-tokens", type=int, default=200_000)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--no-measure", action="store_true", help="skip the held-out measurement at the end")
    add_eval_args(p)
    return p.parse_args(argv)


def lr_at(step: int, total: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at `total`."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: TargetWithMTP, args, device: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")


@torch.no_grad()
def validation_loss(model: TargetWithMTP, windows: torch.Tensor, args, device: str, autocast) -> tuple:
    """-> (next-token loss, [MTP loss per step]) averaged over batches of the validation windows."""
    model.eval()
    next_sum, mtp_sum, batches = 0.0, [0.0] * args.mtp_steps, 0
    for start in range(0, len(windows), args.batch_size):
        with autocast():
            next_loss, mtp_losses = model.losses(windows[start : start + args.batch_size].to(device), args.mtp_steps)
        next_sum += next_loss.item()
        mtp_sum = [a + b.item() for a, b in zip(mtp_sum, mtp_losses, strict=True)]
        batches += 1
    model.train()
    return next_sum / batches, [m / batches for m in mtp_sum]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(model: TargetWithMTP, data, args, device: str, log) -> dict:
    """The optimizer loop; leaves the best-validation weights in `model` and returns training facts."""
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else nullcontext
    batches = RandomWindows(data.tokens["train"], args.seq_len, args.batch_size, seed=args.seed + 1)
    valid = fixed_windows(data.tokens["valid"], args.seq_len, args.valid_max_tokens)
    tokens_per_step = args.batch_size * args.seq_len
    epoch_cap = max(1, int(args.max_epochs * len(data.tokens["train"]) / tokens_per_step))
    total = min(args.steps, epoch_cap) if args.steps else epoch_cap
    optimizer = make_optimizer(model, args, device)
    hooks = add_residual_dropout(model, args.dropout)
    best = {"score": math.inf}
    history, first_loss = [], None
    model.train()
    start = step_start = time.perf_counter()
    step = 0
    while step < total:
        if step == 5:  # the first steps pay for start-up; time the calibration steps without them
            synchronize(device)
            step_start = time.perf_counter()
        if not args.steps and step == CALIBRATION_STEPS:
            synchronize(device)
            per_step = (time.perf_counter() - step_start) / (CALIBRATION_STEPS - 5)
            affordable = int(0.93 * (args.time_budget - (time.perf_counter() - start)) / per_step) + step
            total = max(step + 1, min(epoch_cap, affordable))
            log(f"steps fixed at {total} ({per_step * 1e3:.1f} ms/step); rerun with --steps {total} to repeat")
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, args)
        ids = batches.next_batch().to(device, non_blocking=True)
        with autocast():
            next_loss, mtp_losses = model.losses(ids, args.mtp_steps)
            loss = next_loss + args.mtp_weight * sum(mtp_losses)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        first_loss = first_loss if first_loss is not None else next_loss.item()
        if step % args.log_every == 0 or step == total or step == 1:
            elapsed = time.perf_counter() - start
            rate = step * tokens_per_step / elapsed
            eta = (total - step) * elapsed / step
            mtp_text = " ".join(f"{m.item():.3f}" for m in mtp_losses)
            log(
                f"step {step}/{total} epoch {step * tokens_per_step / len(batches.tokens):.2f} "
                f"lr {lr_at(step - 1, total, args):.2e} loss {next_loss.item():.3f} mtp {mtp_text} "
                f"| {rate:,.0f} tok/s elapsed {elapsed:.0f}s ETA {eta:.0f}s"
            )
        if step % args.eval_every == 0 or step == total:
            v_next, v_mtp = validation_loss(model, valid, args, device, autocast)
            score = v_next + args.mtp_weight * sum(v_mtp)
            history.append({"step": step, "valid_next": v_next, "valid_mtp": v_mtp})
            log(f"valid @ {step}: next {v_next:.3f} mtp " + " ".join(f"{m:.3f}" for m in v_mtp))
            if score < best["score"]:
                state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                best = {"score": score, "step": step, "state": state, "next": v_next, "mtp": v_mtp}
    for hook in hooks:
        hook.remove()
    seconds = time.perf_counter() - start
    model.load_state_dict(best["state"])
    log(f"kept the weights of step {best['step']} (best validation next + mtp_weight * MTP: {best['score']:.3f})")
    return {
        "steps": total,
        "best_step": best["step"],
        "tokens_seen": total * tokens_per_step,
        "epochs": total * tokens_per_step / len(batches.tokens),
        "train_seconds": seconds,
        "first_train_next_loss": first_loss,
        "final_train_next_loss": next_loss.item(),
        "final_train_mtp_loss": [m.item() for m in mtp_losses],
        "best_valid_next_loss": best["next"],
        "best_valid_mtp_loss": best["mtp"],
        "valid_history": history,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m specsplit.training.train_demo " + shlex.join(sys.argv[1:] if argv is None else argv)

    def log(line: str) -> None:
        print(line, flush=True)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    params = DataParams(seed=args.seed, vocab_size=args.vocab_size, max_files=args.max_files)
    data = prepare_data(args.data_dir, params, args.stdlib or stdlib_root(), log)
    if args.prepare_only:
        return 0
    torch.manual_seed(args.seed)
    shape = ModelShape(
        args.hidden_size,
        args.layers,
        args.heads,
        args.kv_heads,
        args.intermediate_size,
        max(2048, args.seq_len),
    )
    config = demo_config(args.vocab_size, shape)
    model = TargetWithMTP(config).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    device_label = f"cuda ({torch.cuda.get_device_name()})" if device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    log(f"device {device_label} | {num_params:,} parameters | {asdict(shape)}")
    facts = train(model, data, args, device, log)
    heldout_files = data.split["heldout"]
    save_checkpoint(model, args.out, args.data_dir, heldout_files)
    log(f"checkpoint written to {args.out}")
    report = {"command": command, "device": device_label, "num_parameters": num_params, "args": vars(args), **facts}
    if not args.no_measure:
        shipped = load_checkpoint(args.out, device)  # measure the bf16 weights as saved
        report["heldout"] = measure(shipped, data.tokens["heldout"], args, device, log)
        report["heldout"]["measured_on"] = f"{device_label}, at the end of training"
        report["sample"] = sample_text(shipped, load_tokenizer(args.data_dir), SAMPLE_PROMPT, 96, args.num_drafts)
        log("sample (greedy, speculative):\n" + report["sample"])
    report["split"] = {k: v for k, v in data.split.items() if k not in ("train", "valid", "heldout")}
    report["split"].update({k: len(data.split[k]) for k in ("train", "valid", "heldout")})
    report["tokens"] = {k: len(v) for k, v in data.tokens.items()}
    (args.out / "metrics.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write_model_card(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
