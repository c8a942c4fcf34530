"""Small-M linear layers on one GPU: cuBLAS (`F.linear`) vs the Triton GEMV (`specsplit/kernels/gemv.py`) over a
small grid of launch configurations, for the linears of the Qwen2-7B decode step.

    PYTHONPATH=$PWD python3 benchmarks/gemv.py --out runs/gemv.json      # H200, about 2-3 minutes
    PYTHONPATH=$PWD python3 benchmarks/gemv.py --device cpu --tiny       # smoke check: interpreter, no timing

Shapes (out x in, bf16): qkv 4608 x 3584 with bias, o_proj 3584 x 3584, gate_up 37888 x 3584, down
3584 x 18944, lm_head 152064 x 3584; M (tokens per step) in {1, 2, 4, 8, 16, 32}. A time is the mean
of `triton.testing.do_bench_cudagraph` over calls that cycle through copies of the weight (>= 512 MB in
all), so that no call finds its weight in the 50 MB L2, as in the model where every layer has its own.
Bandwidth: bytes of W, x, bias and y per call over the time. Each configuration's output is checked
against F.linear in fp32 (max |diff| over max |y|, printed) and for being bitwise the same on a second
call; one that fails is reported, not timed, and makes the exit status 1.

Printed: a row per (shape, M), the `CONFIGS` entries to paste into `specsplit/kernels/gemv_configs.py` (None
where cuBLAS is faster), and a whole-step proxy: 28 layers x (qkv + o_proj + gate_up + down) + lm_head
at M = 1 and 4, for torch, the best Triton configuration, and the faster of the two per linear.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # name: (N, K, bias)
    "qkv": (4608, 3584, True),
    "o_proj": (3584, 3584, False),
    "gate_up": (37888, 3584, False),
    "down": (3584, 18944, False),
    "lm_head": (152064, 3584, False),
}
TINY_SHAPES = {"qkv": (48, 64, True), "odd": (100, 77, False)}
LAYERS, LAYER_LINEARS = 28, ("qkv", "o_proj", "gate_up", "down")
FLUSH_BYTES = 512 * 2**20
TOLERANCE = 1e-2  # max |diff| / max |y|; the bf16 rounding of y alone is up to 2**-9

# The sweep. FMA tiles (block_n, block_k, num_warps) per M bucket <= 4; tensor-core tiles (block_n,
# block_k, num_warps, num_stages) per padded M (16 or 32), only the first two at M <= 2. Each tile runs
# unsplit where N alone gives every SM a program, and with K split for about 2 and 8 programs per SM
# where it does not.
FMA_TILES = {
    1: [(16, 256, 4), (16, 512, 8), (32, 256, 8), (8, 512, 4)],
    2: [(16, 256, 8), (32, 256, 8)],
    4: [(16, 256, 8), (8, 256, 4)],
}
DOT_TILES = {
    16: [(64, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 4), (128, 128, 8, 3)],
    32: [(64, 128, 4, 4), (32, 256, 4, 3), (128, 64, 8, 4)],
}
TINY_FMA_TILES, TINY_DOT_TILES = [(16, 32, 4)], [(16, 32, 4, 2)]
TINY_NUM_SMS = 4  # so that the tiny shapes split K too


def candidates(n: int, k: int, m: int, num_sms: int, tiny: bool) -> list:
    from specsplit.kernels.gemv_configs import MAX_FMA_M, GemvConfig, cdiv, m_bucket, split_for_programs

    tiles = []
    if m <= MAX_FMA_M:
        tiles += [(False, bn, bk, w, 1) for bn, bk, w in (TINY_FMA_TILES if tiny else FMA_TILES[m_bucket(m)])]
    dot_tiles = TINY_DOT_TILES if tiny else DOT_TILES[16 if m <= 16 else 32]
    tiles += [(True, *t) for t in (dot_tiles[:2] if m <= 2 else dot_tiles)]
    configs = []
    for dot, bn, bk, warps, stages in tiles:
        n_blocks = cdiv(n, bn)
        splits = {1} if n_blocks >= num_sms else set()
        splits |= {split_for_programs(n, k, bn, bk, w * num_sms) for w in (2, 8) if n_blocks < w * num_sms}
        configs += [GemvConfig(dot, bn, bk, s, warps, stages) for s in sorted(splits)]
    return configs


def variant(config, m: int, has_bias: bool) -> tuple:
    """What Triton compiles one GEMV variant for (the split-K sum aside)."""
    from specsplit.kernels.gemv_configs import block_m

    c, split = config, config.split_k > 1
    return (c.dot, block_m(m, c.dot), c.block_n, c.block_k, c.num_warps, c.num_stages, split, has_bias and not split)


def describe(c) -> str:
    return f"{'dot' if c.dot else 'fma'} {c.block_n}x{c.block_k} split {c.split_k} w{c.num_warps} s{c.num_stages}"


def bench_shape(name: str, n: int, k: int, has_bias: bool, args, num_sms: int, bench, variants: set) -> list:
    """A row per M of one shape: torch's time and error, and every candidate configuration's."""
    import torch
    import torch.nn.functional as F

    from specsplit.kernels.gemv import gemv

    dev, dtype = torch.device(args.device), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    copies = 1 if bench is None else -(-FLUSH_BYTES // (n * k * 2))
    weights = [(torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
    biases = [torch.randn(n, device=dev, generator=gen).to(dtype) if has_bias else None for _ in range(copies)]
    pairs = list(zip(weights, biases))
    w, b = pairs[0]
    rows = []
    for m in args.m:
        x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        scale = ref.abs().max().item()

        def rel_err(y: torch.Tensor, ref=ref, scale=scale) -> float:
            return (y.float() - ref).abs().max().item() / scale

        def time_us(linear, x=x) -> float | None:
            """Mean µs of one call, over calls that cycle through the weight's copies."""
            if bench is None:
                return None
            return bench(lambda: [linear(x, w_, b_) for w_, b_ in pairs]) * 1e3 / copies

        row = dict(shape=name, n=n, k=k, m=m, bias=has_bias, bytes=(n * k + m * k + m * n + has_bias * n) * 2)
        row.update(torch_us=time_us(F.linear), torch_err=rel_err(F.linear(x, w, b)), configs=[])
        for c in candidates(n, k, m, num_sms, args.tiny):
            variants.add(variant(c, m, has_bias))
            measured = dict(config=dataclasses.asdict(c), ok=False, err=None, deterministic=None, us=None)
            row["configs"].append(measured)
            try:  # a configuration that does not compile or launch here is reported, not fatal
                y = gemv(x, w, b, c)
                measured.update(err=rel_err(y), deterministic=torch.equal(y, gemv(x, w, b, c)))
                measured["ok"] = measured["err"] <= TOLERANCE and measured["deterministic"]
                if measured["ok"]:
                    measured["us"] = time_us(lambda x_, w_, b_, c=c: gemv(x_, w_, b_, c))
            except Exception as e:
                measured["ok"], measured["error"] = False, f"{type(e).__name__}: {str(e)[:300]}"
            if not measured["ok"]:
                print(f"  FAILED {name} M={m} {describe(c)}: {measured}", flush=True)
        timed = [r for r in row["configs"] if r["us"] is not None]
        row["best"] = min(timed, key=lambda r: r["us"]) if timed else None
        rows.append(row)
        errs = max((r["err"] for r in row["configs"] if r["err"] is not None), default=0.0)
        line = f"  {name:7s} M={m:2d}: {len(row['configs'])} configs, max rel err {errs:.1e}"
        line += f" (torch {row['torch_err']:.1e})"
        if row["best"]:
            best = row["best"]
            line += f"; torch {row['torch_us']:.1f} µs, triton {best['us']:.1f} µs ({describe(config_of(best))})"
        print(line, flush=True)
    return rows


def config_of(measured: dict):
    from specsplit.kernels.gemv_configs import GemvConfig

    return GemvConfig(**measured["config"])


def tb_per_s(num_bytes: int, us: float) -> float:
    return num_bytes / us / 1e6


def print_report(rows: list) -> list:
    """The markdown table, the CONFIGS entries and the whole-step proxy; returns the proxy rows."""
    from specsplit.kernels.gemv_configs import m_bucket

    print("\n| shape | M | torch µs | torch TB/s | triton µs | triton TB/s | best config | rel err | speedup |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        best = r["best"]
        if best is None:
            continue
        print(
            f"| {r['shape']} | {r['m']} | {r['torch_us']:.1f} | {tb_per_s(r['bytes'], r['torch_us']):.2f} "
            f"| {best['us']:.1f} | {tb_per_s(r['bytes'], best['us']):.2f} | {describe(config_of(best))} "
            f"| {best['err']:.1e} | {r['torch_us'] / best['us']:.2f} |"
        )
    print("\nCONFIGS: dict[tuple[int, int, int], GemvConfig | None] = {  # benchmarks/gemv.py")
    for r in rows:
        best = r["best"]
        if best is None:
            continue
        key = f"({r['n']}, {r['k']}, {m_bucket(r['m'])})"
        note = f"# {r['shape']}"  # the timings are in the table above
        entry = repr(config_of(best)) if best["us"] < r["torch_us"] else "None"
        print(f"    {note}\n    {key}: {entry},")
    print("}")
    by_key = {(r["shape"], r["m"]): r for r in rows if r["best"]}
    proxy = []
    for m in (1, 4):
        parts = [(by_key.get((s, m)), LAYERS if s in LAYER_LINEARS else 1) for s in (*LAYER_LINEARS, "lm_head")]
        if any(r is None for r, _ in parts):
            continue
        total = {
            key: sum(times * pick(r) for r, times in parts)
            for key, pick in (
                ("torch_us", lambda r: r["torch_us"]),
                ("triton_us", lambda r: r["best"]["us"]),
                ("faster_us", lambda r: min(r["torch_us"], r["best"]["us"])),
            )
        }
        proxy.append(dict(m=m, **total))
    if proxy:
        print(f"\nWhole-step proxy: {LAYERS} x (qkv + o_proj + gate_up + down) + lm_head")
        print("| M | torch µs | triton µs | faster of the two µs | speedup |")
        print("|---:|---:|---:|---:|---:|")
        for p in proxy:
            speedup = p["torch_us"] / p["faster_us"]
            print(f"| {p['m']} | {p['torch_us']:.0f} | {p['triton_us']:.0f} | {p['faster_us']:.0f} | {speedup:.3f} |")
    return proxy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, correctness only (with --device cpu)")
    p.add_argument("--m", default="1,2,4,8,16,32", help="rows of x (tokens per step), comma-separated")
    p.add_argument("--shapes", default=None, help="comma-separated subset of " + ", ".join(SHAPES))
    p.add_argument("--rep", type=int, default=10, help="ms of CUDA-graph replay per timing")
    p.add_argument("--out", type=Path, default=None, help="write every row (all configurations) as JSON")
    args = p.parse_args(argv)
    args.m = [int(m) for m in args.m.split(",")]
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels on CPU tensors
    import torch
    import triton.testing

    from specsplit.kernels.gemv import num_sms

    cuda = args.device.startswith("cuda")
    bench = (lambda fn: triton.testing.do_bench_cudagraph(fn, rep=args.rep)) if cuda and not args.tiny else None
    sms = TINY_NUM_SMS if args.tiny else num_sms(torch.device(args.device))
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu (Triton interpreter)"
    print(f"{device_name}, {sms} SMs; M in {args.m}", flush=True)
    start, rows, variants = time.perf_counter(), [], set()
    for name, (n, k, has_bias) in shapes.items():
        print(f"{name}: {n} x {k}{' + bias' if has_bias else ''}", flush=True)
        rows += bench_shape(name, n, k, has_bias, args, sms, bench, variants)
        if cuda:
            torch.cuda.empty_cache()
        print(f"  {time.perf_counter() - start:.0f} s so far, {len(variants)} GEMV variants compiled", flush=True)
    proxy = print_report(rows) if bench is not None else []
    failed = sum(not c["ok"] for r in rows for c in r["configs"])
    print(f"\n{failed} configurations failed their check; {time.perf_counter() - start:.0f} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = dict(device=device_name, num_sms=sms, rows=rows, proxy=proxy, failed=failed)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
