"""On a CUDA GPU: the Triton rejection sampler against the torch reference on the same device,
for random ragged batches of every mode (greedy, one-hot, dense, sparse q), k = 0..5, odd vocab
sizes and top-k / top-p. Prints the number of requests whose tokens differ (expected 0; rare
one-ulp ties are possible, see kernels/rng.py) and exits 1 on any mismatch.

    python benchmarks/check_rejection_cuda.py [--cases 200]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import SparseDraftProbs, rejection_sample  # noqa: E402


def case(gen: torch.Generator, i: int) -> dict:
    dev = "cuda"
    vocab = [100, 1000, 32000, 151936][i % 4]
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    ks = torch.randint(0, 6, (batch,), generator=gen)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = ks.cumsum(0)
    n_draft, n_logits = int(cu[-1]), int(cu[-1]) + batch
    logits = torch.randn(n_logits, vocab, generator=gen) * 3
    drafts = torch.randint(0, vocab, (n_draft,), generator=gen)
    mode = ["one_hot", "dense", "sparse"][i % 3]
    temperature = torch.where(torch.rand(batch, generator=gen) < 0.3, 0.0, 0.7 + torch.rand(batch, generator=gen))
    top_k = torch.where(torch.rand(batch, generator=gen) < 0.3, torch.randint(1, 50, (batch,), generator=gen), 0)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.3, 0.5 + 0.5 * torch.rand(batch, generator=gen), 1.0)
    q = None
    if mode == "dense" and n_draft:
        q = (torch.randn(n_draft, vocab, generator=gen) * 3).softmax(-1).to(dev)
    elif mode == "sparse" and n_draft:
        ids = torch.stack([torch.randperm(vocab, generator=gen)[:16] for _ in range(n_draft)])
        ids[:, 0] = drafts
        probs = torch.rand(n_draft, 16, generator=gen)
        q = SparseDraftProbs(ids.to(dev), (probs / probs.sum(-1, keepdim=True)).to(dev))
    return dict(
        target_logits=logits.to(dev),
        draft_token_ids=drafts.to(dev),
        cu_num_draft=cu.to(dev),
        temperature=temperature.float().to(dev),
        top_k=top_k.int().to(dev),
        top_p=top_p.float().to(dev),
        seeds=torch.randint(0, 2**62, (batch,), generator=gen).to(dev),
        positions=torch.randint(0, 4096, (batch,), generator=gen).to(dev),
        draft_probs=q,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=200)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    bad_reqs = total_reqs = 0
    for i in range(args.cases):
        inputs = case(gen, i)
        a = rejection_sample(**inputs, backend="triton")
        b = rejection_sample(**inputs, backend="reference")
        diff = (a.sampled != b.sampled).any(-1) | (a.num_sampled != b.num_sampled)
        bad_reqs += int(diff.sum())
        total_reqs += diff.numel()
    print(
        f"triton vs reference on {torch.cuda.get_device_name()}: {args.cases} batches, {total_reqs} requests, "
        f"{bad_reqs} differ"
    )
    sys.exit(1 if bad_reqs else 0)


if __name__ == "__main__":
    main()
