"""On a CUDA GPU: the code paths the CPU tests cannot reach. Exits 1 on any mismatch.

1. The compiled Triton paged attention against the torch reference on the same device: random
   ragged batches (1-8 requests, contexts up to 700, 1-5 new tokens or a 40-token chunk), GQA
   shapes of Qwen2-7B / Llama-3-8B / the demo, fp32 / bf16 / fp16, split-K on and off.
2. Target decode / verify steps: SDPA path vs Triton path vs captured CUDA graphs (replayed), on a
   tiny fp32 checkpoint and the demo checkpoint in bf16; same for the drafter's MTP steps.

    PYTHONPATH=. python benchmarks/check_paged_attention_cuda.py [--cases 60]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/check_paged_attention_cuda.py --device cpu --cases 6
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from drafter.runner import DrafterRunner, ProposeItem
from kernels.paged_attention import choose_num_splits, paged_attention_triton
from kernels.paged_attention_reference import paged_attention_reference
from models.cuda_graphs import CudaGraphRunner
from models.loader import load_mtp, load_target
from models.tiny import write_tiny_checkpoint

SHAPES = [(28, 4, 128), (32, 8, 128), (5, 5, 64), (8, 2, 64)]  # heads, kv heads, head_dim
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def kernel_case(gen: torch.Generator, i: int, dev: torch.device) -> float:
    heads, kv_heads, dim = SHAPES[i % len(SHAPES)]
    dtype = [torch.float32, torch.bfloat16, torch.float16][i % 3]
    block_size, num_reqs = 16, int(torch.randint(1, 9, (1,), generator=gen))
    ctx = torch.randint(1, 700, (num_reqs,), generator=gen).tolist()
    new = [min(c, 40 if i % 5 == 0 else int(torch.randint(1, 6, (1,), generator=gen))) for c in ctx]
    blocks = [-(-c // block_size) for c in ctx]
    perm = torch.randperm(sum(blocks) + 4, generator=gen).tolist()
    tables = torch.full((num_reqs, max(blocks) + 2), -1, dtype=torch.int32)
    for r, nb in enumerate(blocks):
        tables[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    k_cache = torch.randn(sum(blocks) + 4, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(sum(blocks) + 4, block_size, kv_heads, dim, generator=gen).to(dtype)
    req = [r for r, n in enumerate(new) for _ in range(n)]
    lens = [length for c, n in zip(ctx, new) for length in range(c - n + 1, c + 1)]
    q = torch.randn(len(req), heads, dim, generator=gen).to(dtype)
    args = [t.to(dev) for t in (q, k_cache, v_cache, tables, torch.tensor(req), torch.tensor(lens, dtype=torch.int32))]
    expected = paged_attention_reference(*args).float()
    worst = 0.0
    for splits in sorted({1, 5, choose_num_splits(len(req), kv_heads, dev)}):
        err = (paged_attention_triton(*args, num_splits=splits).float() - expected).abs().max().item()
        worst = max(worst, err / TOL[dtype])
    return worst  # > 1: outside tolerance


def decode_steps(model, cache, path: str, runner: CudaGraphRunner | None, seed: int = 0) -> list[torch.Tensor]:
    """Logits of a ragged prefill and then decode / verify steps of 1-4 tokens for three requests."""
    gen, dev = torch.Generator().manual_seed(seed), cache.device
    steps = [{"a": 37, "b": 5, "c": 20}, {"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 2}, {"c": 3, "a": 1}, {"b": 1}]
    out = []
    with torch.inference_mode():
        for i, step in enumerate(steps):
            ids = torch.randint(0, model.config.vocab_size, (sum(step.values()),), generator=gen).to(dev)
            positions = torch.cat([torch.arange(cache.num_tokens(r), cache.num_tokens(r) + n) for r, n in step.items()])
            attn = cache.prepare_step(list(step), list(step.values()), use_kernel=path != "sdpa" and i > 0)
            if path == "graphs" and runner.can_run(attn):
                out.append(runner.run(ids, positions.to(dev), attn)[1].clone())
            else:
                out.append(model.compute_logits(model(ids, positions.to(dev), cache, attn)))
    return out


def check_target(name: str, model, tol: float) -> bool:
    dev = model.embed_tokens.weight.device
    results = {}
    for path in ("sdpa", "kernel", "graphs"):
        cache = model.make_kv_cache(64, 16)
        runner = (
            CudaGraphRunner(model, cache, max_model_len=256, max_num_tokens=8, capture=dev.type == "cuda")
            if path == "graphs"
            else None
        )
        results[path] = decode_steps(model, cache, path, runner)
    ok = True
    for path in ("kernel", "graphs"):
        err = max((a - b).abs().max().item() for a, b in zip(results[path], results["sdpa"]))
        same_argmax = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(results[path], results["sdpa"]))
        print(f"{name}: {path} vs sdpa: max |logits diff| {err:.2e}, argmax equal: {same_argmax}")
        ok &= err <= tol
    return ok


def check_drafter(ckpt: Path, dev: torch.device) -> bool:
    target, mtp = load_target(ckpt, device=dev), load_mtp(ckpt, device=dev)
    tokens = list(range(11, 40))
    with torch.inference_mode():
        cache = target.make_kv_cache(16, 16)
        hidden = target(
            torch.tensor(tokens, device=dev),
            torch.arange(len(tokens), device=dev),
            cache,
            cache.prepare_step(["t"], [len(tokens)]),
        )
    drafts = {}
    for graphs in (False, True):
        cache = mtp.make_kv_cache(32, 16)
        runner = DrafterRunner(mtp, cache, attention_kernel=graphs, cuda_graphs=graphs and dev.type == "cuda")
        if graphs and dev.type != "cuda":  # CPU smoke run: the static-buffer path without capture
            runner.graphs = CudaGraphRunner(mtp, cache, max_model_len=256, max_num_tokens=8, capture=False)
        first = runner.propose([ProposeItem("r", 0, tokens[1:20], 3)], hidden[:19])
        second = runner.propose([ProposeItem("r", 19, tokens[20:22], 4)], hidden[19:21])
        drafts[graphs] = (first.drafts, second.drafts)
    print(f"drafter: eager {drafts[False]}, graphs {drafts[True]}")
    return drafts[False] == drafts[True]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=60)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1, no capture")
    args = p.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    worst = [kernel_case(gen, i, dev) for i in range(args.cases)]
    bad = sum(w > 1 for w in worst)
    print(f"kernel vs reference: {args.cases} cases, {bad} outside tolerance (worst {max(worst):.2f} x tolerance)")
    ok = bad == 0
    tiny = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", architecture="qwen3", max_position_embeddings=256)
    ok &= check_target("tiny qwen3 fp32", load_target(tiny, device=dev), tol=1e-3)
    demo = Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
    ok &= check_target("demo bf16", load_target(demo, dtype=torch.bfloat16, device=dev), tol=0.25)
    ok &= check_drafter(tiny, dev)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
