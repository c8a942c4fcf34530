"""Rejection sampler speed on one GPU: our Triton kernels vs the torch reference (and vLLM's).

    python benchmarks/rejection_sampler.py --out runs/rejection_sampler.json \
        [--vllm-src DIR] [--quick]

For every vocab in {32000, 151936}, batch in {1, 8, 64, 256}, drafts per request k in {1, 3, 5} and
mode in {greedy, one_hot, dense, sparse} it times one verification step two ways, for every sampler:

- ``graph``: the step captured in a CUDA graph and replayed (``triton.testing.do_bench_cudagraph``):
  GPU work only, as inside a CUDA-graphed engine step. The ratios and the bandwidth use this.
- ``eager``: plain calls (``triton.testing.do_bench``): includes Python and launch overhead, which
  on the H200 host (~8-25 µs per launch) dominates every small batch and moves run to run.

A sampler that cannot be captured (a host sync inside) is timed eagerly in both columns, marked *.
Bandwidth: the bytes the step must read, against 4.8 TB/s: each request's logits rows up to its stop row
(no output depends on a later row, and our kernels skip such rows once the rejection is known; the
JSON's ``bytes_all_rows`` is one read of every row), plus sparse q (dense q is read only at the draft
and, when it is rejected, on the stop row).

Drafts are the target's argmax: greedy rows accept all, random rows accept with p(argmax), which for
one-hot q is small (most requests stop at their first row; ``--alpha A``: also one-hot rows where p(draft)
is raised to A, so each draft is accepted with probability A, as in serving). top-k /
top-p are off and passed as None and ``max_num_draft`` is given, so our Triton path makes no host
sync (as inside a CUDA graph). Sparse q keeps the top 16 ids (the last one swapped for the draft
when missing).

``--coupled``: also the coupled verification of seeded requests (``specsplit/kernels/reference.py``) beside today's
rejection sampling, on the same logits and drafts: ``one_hot coupled`` and ``sparse coupled`` (drafts the target's
argmax, accepted where the target's sample is that argmax), and ``sparse coupled hit`` (drafts the target's own
samples: every row accepted and raced, the most work coupled verification does). Their ratio to the ``sparse`` /
``one_hot`` rows is the cost of the guarantee.

``--vllm-src DIR``: an unpacked vllm source tree (``pip download vllm==0.26.0 --no-deps
--only-binary :all:``, then unzip the wheel). Adds vLLM's V1 and V2 Triton rejection samplers, see
``benchmarks/lib/vllm_rejection_samplers.py`` for what their timings include. vLLM takes dense q only,
so its sparse rows are fed the densified q. A sampler whose file is missing or whose API differs is
reported and skipped.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.lib import vllm_rejection_samplers  # noqa: E402
from specsplit.kernels import SparseDraftProbs, rejection_sample  # noqa: E402

PEAK_BYTES_PER_S = 4.8e12
MODES = ("greedy", "one_hot", "dense", "sparse")
COUPLED_MODES = ("one_hot coupled", "sparse coupled", "sparse coupled hit")
SPARSE_K = 16


TEMPERATURE = 0.8  # random modes


def make_inputs(vocab_size: int, batch: int, k: int, mode: str, device: str, alpha: float | None = None) -> dict:
    """``alpha`` (one-hot only): the draft's p raised to ``alpha`` on every draft row, so that each draft is
    accepted with probability ``alpha`` (without it, p(draft) is small and most drafts are rejected). A mode of
    ``COUPLED_MODES``: its base mode's inputs, every request coupled."""
    if mode in COUPLED_MODES:
        inputs = make_inputs(vocab_size, batch, k, mode.split()[0], device)
        inputs["coupled"] = torch.ones(batch, dtype=torch.int32, device=device)  # as the verifier uploads it
        if mode.endswith("hit"):  # the target's own sample at each draft row: every draft accepted
            samples = rejection_sample(
                inputs["target_logits"], inputs["draft_token_ids"][:0], torch.zeros(batch * (k + 1) + 1,
                dtype=torch.int32, device=device), inputs["temperature"].repeat_interleave(k + 1), None, None,
                inputs["seeds"].repeat_interleave(k + 1), inputs["positions"].repeat_interleave(k + 1)
                + torch.arange(k + 1, device=device).repeat(batch), coupled=torch.ones(batch * (k + 1),
                dtype=torch.bool, device=device),
            ).sampled[:, 0]  # fmt: skip
            inputs["draft_token_ids"] = samples.view(batch, k + 1)[:, :k].reshape(-1).contiguous()
        return inputs
    gen = torch.Generator(device=device).manual_seed(vocab_size + batch * 10 + k)
    num_logits = batch * (k + 1)
    logits = torch.randn(num_logits, vocab_size, device=device, generator=gen) * 3
    draft_rows = torch.arange(num_logits, device=device).view(batch, k + 1)[:, :k].reshape(-1)
    drafts = logits[draft_rows].argmax(-1)
    if alpha is not None:
        if mode != "one_hot":
            raise ValueError("alpha applies to one-hot drafts only")
        x = logits[draft_rows] / TEMPERATURE
        x[torch.arange(drafts.numel(), device=device), drafts] = float("-inf")
        # softmax(x)[d] = alpha  <=>  x_d = log(alpha / (1 - alpha)) + logsumexp(x without d)
        x_d = torch.logsumexp(x, -1) + torch.log(torch.tensor(alpha / (1 - alpha), device=device))
        logits[draft_rows, drafts] = TEMPERATURE * x_d
    inputs = dict(
        target_logits=logits,
        draft_token_ids=drafts,
        cu_num_draft=torch.arange(batch + 1, device=device, dtype=torch.int32) * k,
        temperature=torch.full((batch,), 0.0 if mode == "greedy" else TEMPERATURE, device=device),
        top_k=None,
        top_p=None,
        seeds=torch.arange(batch, device=device, dtype=torch.int64),
        positions=torch.full((batch,), 1000, device=device, dtype=torch.int64),
        max_num_draft=k,
    )
    if mode == "greedy":  # what the verifier passes when every request is greedy (as vLLM's all_greedy)
        inputs["all_greedy"] = True
    if mode in ("dense", "sparse"):
        q = (torch.randn(batch * k, vocab_size, device=device, generator=gen) * 3).softmax(-1)
        if mode == "sparse":
            ids = q.topk(SPARSE_K, dim=-1).indices
            drafts = inputs["draft_token_ids"]
            missing = ~(ids == drafts[:, None]).any(-1)
            ids[missing, -1] = drafts[missing]  # the draft was sampled from q: it is in its support
            probs = q.gather(1, ids)
            q = SparseDraftProbs(ids, probs / probs.sum(-1, keepdim=True))
        inputs["draft_probs"] = q
    return inputs


def input_bytes(inputs: dict, num_sampled: torch.Tensor | None = None) -> int:
    """The logits rows up to each request's stop row (every row without ``num_sampled``), plus sparse q."""
    logits = inputs["target_logits"]
    rows = logits.shape[0] if num_sampled is None else int(num_sampled.sum())
    n = rows * logits.shape[1] * logits.element_size()
    q = inputs.get("draft_probs")
    if isinstance(q, SparseDraftProbs):
        n += q.ids.numel() * q.ids.element_size() + q.probs.numel() * q.probs.element_size()
    return n


def eager_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def graph_us(fn) -> tuple[float, bool]:
    """(median µs, captured?): replayed from a CUDA graph, or eager when fn cannot be captured."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3, True
    except Exception:  # a host sync or an allocation pattern capture refuses
        torch.cuda.synchronize()
        return eager_us(fn), False


def measure(vocab_size: int, batch: int, k: int, mode: str, vllm_samplers: dict, alpha: float | None = None) -> dict:
    inputs = make_inputs(vocab_size, batch, k, mode, "cuda", alpha)
    label = mode if alpha is None else f"{mode} alpha {alpha}"
    ours = lambda: rejection_sample(**inputs, backend="triton")  # noqa: E731
    num_sampled = ours().num_sampled
    row = dict(vocab=vocab_size, batch=batch, k=k, mode=label, alpha=alpha, bytes=input_bytes(inputs, num_sampled))
    row["bytes_all_rows"] = input_bytes(inputs)
    row["triton_us"], _ = graph_us(ours)
    row["triton_eager_us"] = eager_us(ours)
    row["reference_us"] = eager_us(lambda: rejection_sample(**inputs, backend="reference"))
    row["effective_gbps"] = row["bytes"] / (row["triton_us"] * 1e-6) / 1e9
    row["fraction_of_peak"] = row["effective_gbps"] * 1e9 / PEAK_BYTES_PER_S
    row["mean_num_sampled"] = num_sampled.float().mean().item()
    for name, builder in vllm_samplers.items():
        row[f"vllm_{name}_us"] = None
        if callable(builder):
            try:
                step = builder(inputs, batch, k, mode)
                row[f"vllm_{name}_us"], row[f"vllm_{name}_captured"] = graph_us(step)
                row[f"vllm_{name}_eager_us"] = eager_us(step)
            except Exception as err:  # report and keep going
                row[f"vllm_{name}_error"] = repr(err)[:300]
    return row


def markdown(rows: list[dict], vllm_names: list[str]) -> list[str]:
    columns = ["vocab", "batch", "k", "mode", "ours graph µs", "ours eager µs", "reference eager µs"]
    columns += [f"vLLM {n} graph µs" for n in vllm_names] + [f"vLLM {n} eager µs" for n in vllm_names]
    columns += [f"vs vLLM {n} (graph)" for n in vllm_names] + ["GB/s", "% of 4.8 TB/s", "mean num_sampled"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        cells = [r["vocab"], r["batch"], r["k"], r["mode"], f"{r['triton_us']:.1f}", f"{r['triton_eager_us']:.1f}"]
        cells.append(f"{r['reference_us']:.0f}")
        vllm = [r.get(f"vllm_{n}_us") for n in vllm_names]
        marks = ["" if r.get(f"vllm_{n}_captured", True) else "*" for n in vllm_names]
        cells += [f"{t:.1f}{m}" if t else "-" for t, m in zip(vllm, marks)]
        cells += [f"{r[f'vllm_{n}_eager_us']:.1f}" if r.get(f"vllm_{n}_eager_us") else "-" for n in vllm_names]
        cells += [f"{t / r['triton_us']:.2f}x" if t else "-" for t in vllm]
        cells += [f"{r['effective_gbps']:.0f}", f"{100 * r['fraction_of_peak']:.1f}%", f"{r['mean_num_sampled']:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--vllm-src", type=Path, help="unpacked vllm source tree to compare against")
    parser.add_argument("--quick", action="store_true", help="vocab 151936, batch {1, 64, 256}, k 3 only")
    parser.add_argument("--coupled", action="store_true", help="also coupled verification (seeded requests)")
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES), help="today's modes to time")
    parser.add_argument(
        "--alpha", type=float, nargs="*", default=[],
        help="also one-hot shapes with batch >= 64 whose drafts are accepted with these probabilities",
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")

    vllm_samplers = vllm_rejection_samplers.load(args.vllm_src) if args.vllm_src else {}
    vllm_status = {n: "ok" if callable(b) else b for n, b in vllm_samplers.items()}
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"vLLM samplers: {vllm_status or 'not requested'}\n")
    vllm_names = [n for n, b in vllm_samplers.items() if callable(b)]
    if args.quick:
        vocabs, batches, ks = (151936,), (1, 64, 256), (3,)
    else:
        vocabs, batches, ks = (32000, 151936), (1, 8, 64, 256), (1, 3, 5)

    rows = []
    print("\n".join(markdown([], vllm_names)))
    for vocab_size in vocabs:
        for batch in batches:
            for k in ks:
                modes = [*args.modes, *(COUPLED_MODES if args.coupled else ())]
                for mode in modes:
                    rows.append(measure(vocab_size, batch, k, mode, vllm_samplers))
                    print(markdown(rows[-1:], vllm_names)[-1], flush=True)
                    torch.cuda.empty_cache()
                for alpha in args.alpha if batch >= 64 else ():
                    rows.append(measure(vocab_size, batch, k, "one_hot", vllm_samplers, alpha))
                    print(markdown(rows[-1:], vllm_names)[-1], flush=True)

    summary = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        vllm=vllm_status,
        median_speedup_vs_reference=statistics.median(r["reference_us"] / r["triton_us"] for r in rows),
    )
    for name in vllm_names:
        ratios = [r[f"vllm_{name}_us"] / r["triton_us"] for r in rows if r.get(f"vllm_{name}_us")]
        summary[f"median_speedup_vs_vllm_{name}"] = statistics.median(ratios) if ratios else None
        summary[f"min_speedup_vs_vllm_{name}"] = min(ratios) if ratios else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(summary=summary, results=rows), indent=2))
    print(f"\n{json.dumps(summary)}\nwrote {args.out}")


if __name__ == "__main__":
    main()
