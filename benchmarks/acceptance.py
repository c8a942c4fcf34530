"""Acceptance of the demo checkpoint's MTP drafts on held-out code, through the three services.

Held-out files (checkpoints/demo/heldout_files.txt, never seen in training) of this machine's
Python standard library give the prompts: a --prompt-len token window from each file's middle,
then --new-tokens greedy tokens. One cluster (k = 4) serves every k via the per-request
num_speculative_tokens; the table gives acceptance per draft position and tokens per verify
iteration (accepted + 1).

With --temperature T > 0 the tokens are sampled at T and every prompt runs twice on the same
cluster, one table line per sampler: "coupled" sends a seed (the prompt's index), so the verifier
checks the drafts by coupled sampling; "rejection" sends none, so it checks them by rejection
sampling.

--draft-vocab-sizes N ...: one cluster per drafter --draft-vocab-size (0: the full vocabulary), its prompts in two
halves one after the other: the first half's requests meet a drafter whose counts start empty (the checkpoint's seed
order, then what it counted so far), the second half's one that counted the first half (other files), as a server
that ran for a while; a table line per half.

    .venv/bin/python benchmarks/acceptance.py [--num-files 16] [--prompt-len 192] [--new-tokens 128]
    .venv/bin/python benchmarks/acceptance.py --temperature 0.8   # coupled vs rejection sampling
    .venv/bin/python benchmarks/acceptance.py --ks 3 --draft-vocab-sizes 0 512 1024 2048   # draft vocabularies
    python benchmarks/acceptance.py --temperature 0.8 --device cuda   # the same drafts on a GPU
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


def samplers(temperature: float) -> list[tuple[str, bool]]:
    """(name, seeded) of the table's lines at each k: greedy at temperature 0; above it, seeded requests (verified
    by coupled sampling) and unseeded ones (verified by rejection sampling)."""
    return [("greedy", False)] if temperature == 0 else [("coupled", True), ("rejection", False)]


def run_k(
    address: str, prompts: list[list[int]], k: int, new_tokens: int, temperature: float, seeded: bool
) -> SpecStats:
    total = SpecStats()
    lock = threading.Lock()

    def one(i, p):
        with Client(address, timeout=600) as client:
            s = client.generate(
                prompt_token_ids=p,
                max_tokens=new_tokens,
                ignore_eos=True,
                num_speculative_tokens=k,
                temperature=temperature,
                seed=i if seeded else None,  # a fixed seed per prompt; None: the coordinator draws one
            ).stats
        with lock:
            total.merge(s)

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total


def run_sizes(args, model: Path, prompts: list[list[int]]) -> list[tuple]:
    """(k, line name, stats) of each cluster (a draft vocabulary size each, or the drafter's default), k and
    sampler; with draft vocabulary sizes, per half of the prompts."""
    rows = []
    for size in args.draft_vocab_sizes or [None]:
        halves = [("", prompts)] if size is None else [(" first half", prompts[: len(prompts) // 2])]
        if size is not None:
            halves.append((" second half", prompts[len(prompts) // 2 :]))
        with LocalCluster(
            model,
            num_speculative_tokens=max(args.ks),
            device=args.device,
            log_dir=tempfile.mkdtemp(prefix="specsplit-acc-"),
            coordinator_args=["--max-num-seqs", "16", "--no-adaptive"],  # acceptance at each k as asked
            drafter_args=[] if size is None else ["--draft-vocab-size", str(size)],
        ) as cluster:
            label = "" if size is None else f"vocab {size or 'full'}, "
            rows += [
                (k, f"{label}{name}{half}", run_k(cluster.address, ps, k, args.new_tokens, args.temperature, seeded))
                for half, ps in halves
                for k in args.ks
                for name, seeded in samplers(args.temperature)
            ]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--num-files", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: coupled vs rejection sampling")
    p.add_argument("--device", default="cpu", help="the verifier's and drafter's device (float32 weights)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4], help="drafts per iteration, a table line each")
    p.add_argument(
        "--draft-vocab-sizes", type=int, nargs="+", default=None, help="a cluster per drafter --draft-vocab-size"
    )
    args = p.parse_args()
    model = Path(args.model)
    prompts = heldout_prompts(model, args.num_files, args.prompt_len, args.new_tokens)
    tokens = "greedy tokens" if args.temperature == 0 else f"tokens sampled at temperature {args.temperature:g}"
    print(f"{len(prompts)} held-out prompts x {args.prompt_len} tokens, {args.new_tokens} {tokens} each")
    if args.temperature:
        print("coupled: seeded requests (seed = the prompt's index); rejection: unseeded requests")
    rows = run_sizes(args, model, prompts)
    print("| k | sampler | acceptance per draft position | acceptance rate | tokens per verify iteration |")
    print("|---|---|---|---|---|")
    for k, name, s in rows:
        per_pos = ", ".join(f"{a:.3f}" for a in s.acceptance_per_position)
        print(f"| {k} | {name} | {per_pos} | {s.acceptance_rate:.3f} | {s.mean_accepted_length:.2f} |")


if __name__ == "__main__":
    main()
