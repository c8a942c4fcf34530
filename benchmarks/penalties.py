"""The verifier's penalties (repetition, frequency, presence: `logits_processors._apply_penalties`) at a batch of
penalized requests verifying k drafts, by the length of their history (prompt + output, as the verifier's worker
hands it over: a view of its `TokenHistory`): the median ms of one step's penalties. The [rows, vocabulary] tensor
ops a GPU runs are kept small here by a small vocabulary (`--vocab`), so that on the CPU the time is mostly the
host's, which grew with the history.

    python benchmarks/penalties.py [--batch 32] [--k 3] [--vocab 4096] [--repeats 10]
    python benchmarks/penalties.py --device cuda --vocab 151936   # on a GPU: the model's vocabulary
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specsplit.verifier.logits_processors import LogitsOptions, RequestRows, TokenHistory, _apply_penalties  # noqa: E402

HISTORIES = ((128, 64), (1024, 1024), (2048, 4096))  # (prompt, output) tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    options = LogitsOptions(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.5)
    print(f"{args.device}: batch {args.batch}, k {args.k}, vocabulary {args.vocab}, median of {args.repeats} steps")
    print("| prompt tokens | output tokens | ms per step |")
    print("|---|---|---|")
    for prompt, output in HISTORIES:
        rows = args.k + 1
        requests = []
        for i in range(args.batch):
            # As the worker hands it over: a view of the request's `TokenHistory`.
            history = TokenHistory(torch.randint(0, args.vocab, (prompt + output,), generator=gen).tolist())
            drafts = torch.randint(0, args.vocab, (args.k,), generator=gen).tolist()
            view = history.view(prompt + output)
            requests.append(RequestRows(i, i * rows, drafts, view, prompt, prompt + output, options))
        logits = torch.randn(args.batch * rows, args.vocab, generator=gen).to(args.device)
        times = []
        for _ in range(args.repeats):
            sync(args.device)
            t0 = time.perf_counter()
            _apply_penalties(logits, requests)
            sync(args.device)
            times.append(1e3 * (time.perf_counter() - t0))
        print(f"| {prompt} | {output} | {statistics.median(times):.2f} |", flush=True)


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
