"""Acceptance of the demo checkpoint's MTP drafts on held-out code, through the three services.

Held-out files (checkpoints/demo/heldout_files.txt, never seen in training) of this machine's
Python standard library give the prompts: a --prompt-len token window from each file's middle,
then --new-tokens greedy tokens. One cluster (k = 4) serves every k via the per-request
num_speculative_tokens; the table gives acceptance per draft position and tokens per verify
iteration (accepted + 1).

    .venv/bin/python benchmarks/acceptance.py [--num-files 16] [--prompt-len 192] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specsplit import Client, SpecStats  # noqa: E402
from specsplit.cli.launcher import LocalCluster  # noqa: E402


def heldout_prompts(model: Path, num_files: int, prompt_len: int, new_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in (model / "heldout_files.txt").read_text().split():
        path = stdlib / name
        if not path.is_file():
            continue
        ids = tok.encode(path.read_text(errors="replace"), add_special_tokens=False)
        if len(ids) < prompt_len + new_tokens:
            continue
        start = (len(ids) - prompt_len - new_tokens) // 2
        prompts.append(ids[start : start + prompt_len])
        if len(prompts) == num_files:
            break
    return prompts


def run_k(address: str, prompts: list[list[int]], k: int, new_tokens: int) -> SpecStats:
    total = SpecStats()
    lock = threading.Lock()

    def one(p):
        with Client(address, timeout=600) as client:
            s = client.generate(
                prompt_token_ids=p, max_tokens=new_tokens, ignore_eos=True, num_speculative_tokens=k, temperature=0.0
            ).stats
        with lock:
            total.merge(s)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--num-files", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    model = Path(args.model)
    prompts = heldout_prompts(model, args.num_files, args.prompt_len, args.new_tokens)
    print(f"{len(prompts)} held-out prompts x {args.prompt_len} tokens, {args.new_tokens} greedy tokens each")
    with LocalCluster(
        model,
        num_speculative_tokens=4,
        log_dir=tempfile.mkdtemp(prefix="specsplit-acc-"),
        coordinator_args=["--max-num-seqs", "16", "--no-adaptive"],  # acceptance at each k as asked
    ) as cluster:
        rows = [(k, run_k(cluster.address, prompts, k, args.new_tokens)) for k in (1, 2, 3, 4)]
    print("| k | acceptance per draft position | acceptance rate | tokens per verify iteration |")
    print("|---|---|---|---|")
    for k, s in rows:
        per_pos = ", ".join(f"{a:.3f}" for a in s.acceptance_per_position)
        print(f"| {k} | {per_pos} | {s.acceptance_rate:.3f} | {s.mean_accepted_length:.2f} |")


if __name__ == "__main__":
    main()
