"""Held-out measurements of a target + MTP checkpoint.

Two views of how well the MTP module drafts for the target:
- teacher-forced, over every held-out position: next-token accuracy, and how often MTP step j's top-1
  equals the target's greedy token at the same position (step 0 predicts greedy acceptance at draft
  position 1);
- a greedy speculative-decoding run with k drafts on held-out prompts: acceptance per draft position
  and tokens per verify iteration (accepted + 1). It recomputes every forward from scratch, which gives
  what a drafter with an MTP KV cache computes (see specsplit.training.mtp_head), only slower.

`python -m specsplit.training.evaluate CHECKPOINT_DIR --data-dir DIR` measures a saved checkpoint.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from specsplit.training.dataset import fixed_windows, load_data, load_tokenizer
from specsplit.training.joint_model import TargetWithMTP
from specsplit.training.tokenizer import EOS_ID

SAMPLE_PROMPT = "import os\n\n\ndef read_lines(path):"  # no trailing newline: "\n" + indent is one token


@dataclass
class TeacherForcedMetrics:
    tokens: int
    next_token_loss: float
    next_token_accuracy: float
    mtp_loss: list[float]  # per step j: CE of x_{p+2+j}
    mtp_accuracy: list[float]  # per step j: top-1 == x_{p+2+j}
    mtp_agreement: list[float]  # per step j: top-1 == the target's greedy token at that position


@torch.no_grad()
def teacher_forced_metrics(
    model: TargetWithMTP, windows: torch.Tensor, mtp_steps: int, batch_size: int, device: str
) -> TeacherForcedMetrics:
    """windows: [num_windows, seq + 1] token ids."""
    sums = {"tokens": 0, "loss": 0.0, "correct": 0}
    mtp = [{"n": 0, "loss": 0.0, "correct": 0, "agree": 0} for _ in range(mtp_steps)]
    for start in range(0, len(windows), batch_size):
        ids = windows[start : start + batch_size].to(device)
        seq = ids.shape[1] - 1
        hidden, logits = model.target_forward(ids[:, :-1])
        labels = ids[:, 1:]
        greedy = logits.argmax(-1)  # [b, seq]: greedy[:, q] is the target's pick for x_{q+1}
        sums["tokens"] += labels.numel()
        sums["loss"] += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
        ).item()
        sums["correct"] += (greedy == labels).sum().item()
        num_pairs = seq - 1
        unroll = model.mtp_unroll(hidden[:, :num_pairs])
        for j in range(mtp_steps):
            valid = num_pairs - j  # pairs whose input x_{p+1+j} and label x_{p+2+j} are in the window
            tokens = ids[:, 1 + j : 1 + j + num_pairs]
            if tokens.shape[1] < num_pairs:  # later steps run past the window: pad, never scored
                tokens = torch.nn.functional.pad(tokens, (0, num_pairs - tokens.shape[1]), value=EOS_ID)
            step_logits = model.mtp.logits(unroll.step(tokens))[:, :valid]
            step_labels = ids[:, 2 + j : 2 + j + valid]
            pick = step_logits.argmax(-1)
            mtp[j]["n"] += step_labels.numel()
            mtp[j]["loss"] += torch.nn.functional.cross_entropy(
                step_logits.flatten(0, 1).float(), step_labels.flatten(), reduction="sum"
            ).item()
            mtp[j]["correct"] += (pick == step_labels).sum().item()
            mtp[j]["agree"] += (pick == greedy[:, 1 + j : 1 + j + valid]).sum().item()
    n = sums["tokens"]
    return TeacherForcedMetrics(
        tokens=n,
        next_token_loss=sums["loss"] / n,
        next_token_accuracy=sums["correct"] / n,
        mtp_loss=[m["loss"] / m["n"] for m in mtp],
        mtp_accuracy=[m["correct"] / m["n"] for m in mtp],
        mtp_agreement=[m["agree"] / m["n"] for m in mtp],
    )


@dataclass
class SpeculativeStats:
    num_drafts: int
    iterations: int = 0  # verify iterations that carried drafts
    generated: int = 0  # tokens those iterations produced (accepted + 1 each)
    accepted_at: list[int] = field(default_factory=list)  # per draft position: accepted count

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.num_drafts

    @property
    def acceptance(self) -> list[float]:
        """Per draft position: fraction of iterations in which that draft was accepted."""
        return [a / max(1, self.iterations) for a in self.accepted_at]

    @property
    def tokens_per_iteration(self) -> float:
        return self.generated / max(1, self.iterations)

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance": self.acceptance,
            "tokens_per_iteration": self.tokens_per_iteration,
        }


@torch.no_grad()
def speculative_greedy(
    model: TargetWithMTP, prompt: list[int], max_new_tokens: int, num_drafts: int, stats: SpeculativeStats
) -> list[int]:
    """Greedy decoding with `num_drafts` MTP drafts per verify; returns the new tokens."""
    device = next(model.parameters()).device
    seq, drafts = list(prompt), []
    while len(seq) - len(prompt) < max_new_tokens:
        ids = torch.tensor([seq + drafts], device=device)
        hidden, logits = model.target_forward(ids)
        greedy = logits[0, len(seq) - 1 :].argmax(-1).tolist()  # target picks after seq, d1, .., dk
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        new_tokens = drafts[:accepted] + [greedy[accepted]]
        if drafts:  # the prompt's own forward verifies nothing
            stats.iterations += 1
            stats.generated += len(new_tokens)
            for pos in range(accepted):
                stats.accepted_at[pos] += 1
        seq += new_tokens
        if EOS_ID in new_tokens:
            break
        drafts = propose(model, hidden[:, : len(seq) - 1], seq, num_drafts)
    return seq[len(prompt) :]


def propose(model: TargetWithMTP, hidden: torch.Tensor, seq: list[int], num_drafts: int) -> list[int]:
    """hidden: [1, len(seq) - 1, H], the target states h_0..h_{n-2} of seq -> num_drafts draft ids."""
    ids = torch.tensor([seq], device=hidden.device)
    unroll = model.mtp_unroll(hidden)
    drafts: list[int] = []
    for j in range(num_drafts):
        tail = torch.tensor([drafts], dtype=ids.dtype, device=ids.device).view(1, -1)
        tokens = torch.cat([ids[:, 1 + j :], tail], dim=1)  # x_{p+1+j} for every pair p
        drafts.append(model.mtp.logits(unroll.step(tokens)[:, -1]).argmax(-1).item())
    return drafts


def heldout_prompts(tokens: np.ndarray, num_prompts: int, prompt_len: int, min_left: int) -> list[list[int]]:
    """Prompts from the middle of the longest-enough held-out files, one per file, deterministic."""
    starts = np.flatnonzero(tokens == EOS_ID).tolist() + [len(tokens)]
    files = [(a, b) for a, b in itertools.pairwise(starts) if b - a > prompt_len + min_left]
    step = max(1, len(files) // max(1, num_prompts))
    prompts = []
    for a, b in files[::step][:num_prompts]:
        middle = a + (b - a - prompt_len - min_left) // 2
        prompts.append([EOS_ID] + tokens[middle : middle + prompt_len].tolist())
    return prompts


def speculative_metrics(
    model: TargetWithMTP,
    tokens: np.ndarray,
    num_prompts: int,
    prompt_len: int,
    new_tokens: int,
    num_drafts: int,
) -> SpeculativeStats:
    stats = SpeculativeStats(num_drafts)
    for prompt in heldout_prompts(tokens, num_prompts, prompt_len, new_tokens):
        speculative_greedy(model, prompt, new_tokens, num_drafts, stats)
    return stats


def measure(model: TargetWithMTP, heldout: np.ndarray, args, device: str, log=print) -> dict:
    """All held-out numbers reported for a checkpoint, as a JSON-ready dict."""
    windows = fixed_windows(heldout, args.seq_len, args.heldout_max_tokens)
    tf = teacher_forced_metrics(model, windows, args.num_drafts, args.eval_batch_size, device)
    log(
        f"held-out teacher-forced ({tf.tokens:,} tokens): next-token loss {tf.next_token_loss:.3f} "
        f"acc {tf.next_token_accuracy:.3f} | MTP agreement with target greedy per step "
        + " ".join(f"{a:.3f}" for a in tf.mtp_agreement)
    )
    spec = speculative_metrics(
        model, heldout, args.spec_prompts, args.spec_prompt_len, args.spec_new_tokens, args.num_drafts
    )
    log(
        f"held-out greedy speculative decoding, k={args.num_drafts}, {args.spec_prompts} prompts: "
        f"acceptance per position "
        + " ".join(f"{a:.3f}" for a in spec.acceptance)
        + f", tokens per iteration {spec.tokens_per_iteration:.2f}"
    )
    return {"teacher_forced": asdict(tf), "speculative_greedy": spec.to_dict()}


def sample_text(model: TargetWithMTP, tokenizer, prompt: str, new_tokens: int, num_drafts: int) -> str:
    stats = SpeculativeStats(num_drafts)
    ids = tokenizer.encode(prompt).ids  # starts with <|endoftext|>
    return prompt + tokenizer.decode(speculative_greedy(model, ids, new_tokens, num_drafts, stats))


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-drafts", type=int, default=3, help="k, drafts per verify")
    parser.add_argument("--heldout-max-tokens", type=int, default=None, help="cap on teacher-forced tokens")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--spec-prompts", type=int, default=16)
    parser.add_argument("--spec-prompt-len", type=int, default=192)
    parser.add_argument("--spec-new-tokens", type=int, default=128)


def main(argv: list[str] | None = None) -> int:
    from specsplit.training.checkpoint import load_checkpoint
    from specsplit.training.model_card import write_model_card

    parser = argparse.ArgumentParser(prog="python -m specsplit.training.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--data-dir", type=Path, default=Path(".scratch/demo-data"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--update-card", action="store_true", help="write the numbers into metrics.json and README.md")
    add_eval_args(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = load_checkpoint(args.checkpoint, args.device)
    data = load_data(args.data_dir)
    heldout = (args.checkpoint / "heldout_files.txt").read_text().split()
    if heldout != data.split["heldout"]:
        print("error: the data dir's held-out files are not the checkpoint's", file=sys.stderr)
        return 2
    numbers = measure(model, data.tokens["heldout"], args, args.device)
    numbers["measured_on"] = f"{args.device} ({torch.get_num_threads()} threads), python -m specsplit.training.evaluate"
    sample = sample_text(model, load_tokenizer(args.data_dir), SAMPLE_PROMPT, 96, args.num_drafts)
    print(sample)
    if args.update_card:
        report_path = args.checkpoint / "metrics.json"
        report = json.loads(report_path.read_text())
        report.setdefault("heldout_at_training", report.get("heldout"))
        report.update(heldout=numbers, sample=sample)
        report_path.write_text(json.dumps(report, indent=1) + "\n")
        write_model_card(args.checkpoint, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
