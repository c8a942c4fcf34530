"""Block-scaled FP8 linears vs bf16 on one GPU, at decode and verify sizes (M = 1..256 tokens), for the linears of
GLM-4.5-Air and DeepSeek-V3: the Triton W8A8 kernel (`specsplit/kernels/fp8_gemm.py`, over a small grid of launch
configurations) against bf16 cuBLAS (`F.linear`) and bf16 through our Triton GEMV (M <= 32).

    PYTHONPATH=$PWD python3 benchmarks/fp8_gemm.py                      # all 14 linears (not timed yet); $OUT
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemm.py --shapes subset --rep 5 --time-limit-s 210   # SUBSET: ~4 min
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemm.py --shapes glm45air.qkv,dsv3.kv_a_proj   # a part of it
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemm.py --quick              # the default configuration only
    PYTHONPATH=$PWD python3 benchmarks/fp8_gemm.py --device cpu --tiny  # smoke check: interpreter, no timing

A time is the mean of `triton.testing.do_bench_cudagraph` over calls that cycle through copies of the weight
(>= 512 MB in all) so that no call finds its weight in L2, as in a model where every layer has its own. Bytes per
call: the weight (1 byte per element in FP8 plus its fp32 block scales; 2 in bf16), x and y in bf16; "% roofline"
is those bytes over the time against 4.8 TB/s (the H200's HBM3e). Every FP8 configuration's output is checked
against the torch reference (`w8a8_block_linear_reference`: max |diff| <= 1e-2 of max |y|, bf16 output) and for
being the same on a second call; one that fails is reported, not timed, and makes the exit status 1.

Printed: a row per (shape, M) with the bf16 times, the best FP8 time, its speed-up over the faster bf16 path and
over cuBLAS, % of roofline; the `CONFIGS` entries to paste into `specsplit/kernels/fp8_gemm_configs.py`; and how
many rows where the weight read dominates (bf16 weight >= 4x the bytes of x and y) reach the 1.6x target. With
`$OUT` (or --out DIR) set, fp8_gemm.md and fp8_gemm.json are written there, after every shape. The kernel variants
of the sweep are compiled first, in parallel processes (into Triton's on-disk cache); --time-limit-s stops it from
beginning another M after that many seconds, the rest reported as left out.
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

# name: (N, K) of the linears as specsplit runs them (q/k/v and gate/up fused; DeepSeek-V3's kv_b_proj is
# dequantized at load and so not here).
SHAPES = {
    "glm45air.qkv": (14336, 4096),  # 96 heads + 2 x 8 KV heads, of 128
    "glm45air.o_proj": (4096, 12288),
    "glm45air.expert.gate_up": (2816, 4096),  # moe_intermediate 1408 (and the shared expert)
    "glm45air.expert.down": (4096, 1408),
    "glm45air.dense.gate_up": (21888, 4096),  # the first (dense) layer's MLP, intermediate 10944
    "glm45air.dense.down": (4096, 10944),
    "dsv3.q_a_proj": (1536, 7168),
    "dsv3.q_b_proj": (24576, 1536),  # 128 heads x 192
    "dsv3.kv_a_proj": (576, 7168),  # latent 512 + rope 64
    "dsv3.o_proj": (7168, 16384),
    "dsv3.expert.gate_up": (4096, 7168),  # moe_intermediate 2048 (and the shared expert)
    "dsv3.expert.down": (7168, 2048),
    "dsv3.dense.gate_up": (36864, 7168),  # the first three layers' MLP, intermediate 18432
    "dsv3.dense.down": (7168, 18432),
}
# One sweep call's worth (~4 minutes on an H200, a fresh Triton cache): the linears that carry GLM-4.5-Air's and
# DeepSeek-V3's decode steps.
SUBSET = (
    "glm45air.qkv",
    "glm45air.o_proj",
    "glm45air.expert.gate_up",
    "glm45air.expert.down",
    "dsv3.o_proj",
    "dsv3.dense.gate_up",
)
TINY_SHAPES = {"odd": (200, 300), "split": (96, 512)}
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BLOCK = (128, 128)
FLUSH_BYTES = 512 * 2**20
HBM_BYTES_PER_S = 4.8e12
TOLERANCE = 1e-2
TARGET = 1.6
# The sweep: launch configurations per M bucket, each tile (block_n, num_warps, num_stages) with x's rows as the
# MMA's rows ("xw") or W's ("wx", `swap_ab`), unsplit and with K split for about 2, 4 or 8 programs per SM where N
# alone gives fewer; x quantized in the kernel and in a launch before it (`prequantize`: its e4m3 tile is then a
# plain operand load the loop's pipelining covers, for one more launch); from M = 128 only before it. Few tiles per
# bucket: every (tile, block_m, split or not, prequantized or not) is a Triton compile of its own (compiled in
# parallel first: `precompile`) and ~40-100 ms of timing per shape and M.
SWEEP = {  # largest M of the bucket family: (block_ms, xw tiles, wx tiles, prequantize choices, split targets)
    16: ((16,), [(64, 4, 3), (128, 4, 3)], [(64, 4, 4), (128, 4, 4), (128, 8, 4), (256, 8, 3)], (False, True), (4, 8)),
    64: ((None,), [(64, 4, 3), (128, 4, 3)], [(64, 4, 4), (128, 4, 4), (128, 8, 4)], (False, True), (2, 4)),
    256: ((64, 128), [(64, 4, 3), (128, 4, 3), (128, 8, 3)], [(128, 4, 4)], (True,), (2, 4)),
}  # fmt: skip
TINY_SWEEP = {256: ((None,), [(32, 4, 2)], [(32, 4, 2)], (False, True), (4,))}
TINY_NUM_SMS = 4


def candidates(n: int, k: int, m: int, num_sms: int, tiny: bool, quick: bool) -> list:
    from specsplit.kernels.fp8_gemm_configs import Fp8GemmConfig, default_config, effective_split, m_bucket
    from specsplit.kernels.gemv_configs import cdiv

    default = default_config(n, k, m, num_sms)
    if quick:
        return [default]
    sweep = TINY_SWEEP if tiny else SWEEP
    block_ms, xw, wx, prequantize, targets = sweep[min(top for top in sweep if top >= min(m_bucket(m), max(sweep)))]
    configs = {default}
    for block_m in block_ms:
        block_m = block_m or min(64, max(16, m_bucket(m)))  # None: M's bucket, 16..64
        for swap_ab, tiles in ((False, xw), (True, wx)):
            for block_n, warps, stages in tiles:
                programs = cdiv(n, block_n) * cdiv(m, block_m)
                splits = {1} | {
                    effective_split(k, BLOCK[1], cdiv(p * num_sms, programs))[0]
                    for p in targets
                    if programs < p * num_sms
                }
                for pre in prequantize:
                    configs |= {Fp8GemmConfig(block_m, block_n, s, warps, stages, pre, swap_ab) for s in splits}
    return sorted(configs, key=dataclasses.astuple)


def _spec(value: int) -> str:
    """How Triton specializes an integer argument: 1, a multiple of 16, or neither."""
    return "1" if value == 1 else "16" if value % 16 == 0 else "-"


def compile_jobs(shapes: dict, ms: list[int], num_sms: int, quick: bool) -> list[tuple[int, object]]:
    """(K, configuration) pairs that together compile every kernel variant the sweep launches: one per
    configuration (K split or not) and specialization of K (the kernel's other varying integers are not
    specialized)."""
    from specsplit.kernels.fp8_gemm_configs import effective_split

    jobs = {}
    for n, k in shapes.values():
        for m in ms:
            for c in candidates(n, k, m, num_sms, False, quick):
                split = effective_split(k, BLOCK[1], c.split_k)[0]
                jobs.setdefault((dataclasses.replace(c, split_k=min(split, 2)), _spec(k)), (k, c))
    return list(jobs.values())


def compile_kernels(jobs: list[tuple[int, object]], device: str = "cuda") -> int:
    """Each job's kernels launched once on a [1, K] x [128, K] problem: compiled, or loaded from Triton's on-disk
    cache (which the sweep then reads). Returns how many failed (the sweep's own launch reports them)."""
    import torch

    from specsplit.kernels.fp8_gemm import w8a8_block_linear
    from specsplit.kernels.fp8_reference import FP8_DTYPE

    failed = 0
    for k, config in jobs:
        try:
            x = torch.randn(1, k, device=device).to(torch.bfloat16)
            w = torch.zeros(128, k, device=device).to(FP8_DTYPE)
            scale = torch.ones(1, -(-k // BLOCK[1]), device=device)
            w8a8_block_linear(x, w, scale, None, *BLOCK, config)
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001
            failed += 1
    return failed


def precompile(jobs: list, workers: int, device: str, timeout_s: float = 240.0) -> None:
    """Compiles the sweep's kernel variants in `workers` processes at once (on a fresh machine compiling them one
    after another would take most of the sweep's time). If that fails, a worker dies or it takes more than
    `timeout_s`, the workers are stopped and the sweep compiles what is left as it goes."""
    import concurrent.futures
    import multiprocessing

    start = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    pool = concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(compile_kernels, chunk, device) for chunk in chunks]
        failed = sum(f.result(timeout=max(1.0, start + timeout_s - time.perf_counter())) for f in futures)
    except Exception as e:  # noqa: BLE001 (a convenience: the sweep is the same without it, only slower)
        print(f"parallel compilation stopped ({type(e).__name__}: {e}); compiling as the sweep goes", flush=True)
        for process in list(getattr(pool, "_processes", {}).values()):  # a hung compile must not outlive the sweep
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        return
    pool.shutdown()
    print(f"compiled {len(jobs)} kernel variants in {len(chunks)} processes: {time.perf_counter() - start:.0f} s"
          + (f", {failed} failed" if failed else ""), flush=True)  # fmt: skip


def describe(c) -> str:
    pre = " prequantized" if c.prequantize else ""
    return f"{c.block_m}x{c.block_n} split {c.split_k} w{c.num_warps} s{c.num_stages}{pre}"


def bench_shape(name: str, n: int, k: int, args, num_sms: int, bench, deadline: float = float("inf")) -> list:
    """A row per M of one shape: bf16 cuBLAS and GEMV times, every FP8 candidate's error and time; the M values
    not begun by `deadline` (time.perf_counter()) are left out."""
    import torch
    import torch.nn.functional as F

    from specsplit.kernels.fp8_gemm import w8a8_block_linear
    from specsplit.kernels.fp8_gemm_configs import default_config
    from specsplit.kernels.fp8_reference import quantize_weight_blockwise, w8a8_block_linear_reference
    from specsplit.kernels.gemv import gemv
    from specsplit.kernels.gemv_configs import MAX_M
    from specsplit.kernels.gemv_configs import config_for as gemv_config_for

    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    w16 = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
    w8, scale = quantize_weight_blockwise(w16, *BLOCK)
    copies8 = 1 if bench is None else -(-FLUSH_BYTES // (n * k))
    copies16 = 1 if bench is None else -(-FLUSH_BYTES // (2 * n * k))
    fp8_weights = [(w8.clone(), scale.clone()) for _ in range(copies8)]
    bf16_weights = [w16.clone() for _ in range(copies16)]
    scale_bytes = scale.numel() * 4
    rows = []
    for m in args.m:
        if time.perf_counter() > deadline:
            print(f"  {name} M={m}: left out (--time-limit-s)", flush=True)
            continue
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = w8a8_block_linear_reference(x.float(), w8, scale, None, *BLOCK)
        ref_scale = ref.abs().max().item()
        io_bytes = (m * k + m * n) * 2
        row = dict(shape=name, n=n, k=k, m=m, bytes_fp8=n * k + scale_bytes + io_bytes, bytes_bf16=2 * n * k + io_bytes)
        if bench is not None:
            row["cublas_us"] = bench(lambda x=x: [F.linear(x, w) for w in bf16_weights]) * 1e3 / copies16
            gemv_config = gemv_config_for(n, k, m, num_sms) if m <= MAX_M else None
            row["gemv_us"] = (
                bench(lambda x=x, c=gemv_config: [gemv(x, w, None, c) for w in bf16_weights]) * 1e3 / copies16
                if gemv_config is not None
                else None
            )
        row["configs"] = []
        row["default"] = dataclasses.asdict(default_config(n, k, m, num_sms))
        for c in candidates(n, k, m, num_sms, args.tiny, args.quick):
            measured = dict(config=dataclasses.asdict(c), ok=False, err=None, us=None)
            row["configs"].append(measured)
            try:  # a configuration that does not compile or launch here is reported, not fatal
                y = w8a8_block_linear(x, w8, scale, None, *BLOCK, c)
                measured["err"] = (y.float() - ref).abs().max().item() / ref_scale
                same = torch.equal(y, w8a8_block_linear(x, w8, scale, None, *BLOCK, c))
                measured["ok"] = measured["err"] <= TOLERANCE and same
                if measured["ok"] and bench is not None:

                    def calls(c=c, x=x) -> list:
                        return [w8a8_block_linear(x, w_, s_, None, *BLOCK, c) for w_, s_ in fp8_weights]

                    measured["us"] = bench(calls) * 1e3 / copies8
            except Exception as e:
                measured["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if not measured["ok"]:  # printed once per kind of failure (the JSON has every one)
                kind = (c.swap_ab, c.prequantize, str(measured.get("error", "check"))[:80])
                if kind not in _FAILURES_PRINTED:
                    _FAILURES_PRINTED.add(kind)
                    print(f"  FAILED {name} M={m} {describe(c)}: {measured} (further ones like it not printed)")
        timed = [r for r in row["configs"] if r["us"] is not None]
        row["best"] = min(timed, key=lambda r: r["us"]) if timed else None
        rows.append(row)
        line = f"  {name} M={m}: {len(row['configs'])} configs"
        if row["best"]:
            b, bf16 = row["best"], _bf16_us(row)
            line += f"; bf16 {bf16:.1f} µs, fp8 {b['us']:.1f} µs ({describe(_config(b))}), {bf16 / b['us']:.2f}x"
        print(line, flush=True)
    return rows


_FAILURES_PRINTED: set = set()


def _us(row: dict, which) -> str:
    """The fastest time among the row's configurations `which` selects (a config dict → bool), "-" if none."""
    times = [c["us"] for c in row["configs"] if c["us"] is not None and which(c["config"])]
    return f"{min(times):.1f}" if times else "-"


def _bf16_us(row: dict) -> float:
    return min(t for t in (row["cublas_us"], row["gemv_us"]) if t is not None)


def _config(measured: dict):
    from specsplit.kernels.fp8_gemm_configs import Fp8GemmConfig

    return Fp8GemmConfig(**measured["config"])


def weight_bound(row: dict) -> bool:
    """The bf16 weight is at least 4x the bytes of x and y: its read dominates."""
    return 2 * row["n"] * row["k"] >= 4 * (row["bytes_bf16"] - 2 * row["n"] * row["k"])


def report(rows: list, device: str) -> str:
    from specsplit.kernels.fp8_gemm_configs import m_bucket

    lines = [
        f"# FP8 (block-scaled W8A8, Triton) vs bf16 linears — {device}",
        "",
        "`PYTHONPATH=$PWD python3 benchmarks/fp8_gemm.py`; µs per call, weights not in L2; roofline 4.8 TB/s.",
        "",
        "| linear | N x K | M | cuBLAS bf16 µs | GEMV bf16 µs | FP8 µs | FP8 vs best bf16 | FP8 vs cuBLAS "
        "| FP8 % roofline | bf16 % roofline | FP8 config | default µs | best x-rows µs | best W-rows µs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        b = r["best"]
        if b is None:
            continue
        bf16 = _bf16_us(r)
        gemv = f"{r['gemv_us']:.1f}" if r["gemv_us"] is not None else "-"
        lines.append(
            f"| {r['shape']} | {r['n']} x {r['k']} | {r['m']} | {r['cublas_us']:.1f} | {gemv} | {b['us']:.1f} "
            f"| {bf16 / b['us']:.2f}x | {r['cublas_us'] / b['us']:.2f}x "
            f"| {100 * r['bytes_fp8'] / b['us'] / 1e-6 / HBM_BYTES_PER_S:.0f} % "
            f"| {100 * r['bytes_bf16'] / bf16 / 1e-6 / HBM_BYTES_PER_S:.0f} % | {describe(_config(b))} "
            f"| {_us(r, lambda c, r=r: c == r['default'])} | {_us(r, lambda c: not c['swap_ab'])} "
            f"| {_us(r, lambda c: c['swap_ab'])} |"
        )
    bound = [r for r in rows if r["best"] and weight_bound(r)]
    hit = [r for r in bound if _bf16_us(r) / r["best"]["us"] >= TARGET]
    lines += ["", f"Weight-bound rows (bf16 weight >= 4x the activation bytes) at >= {TARGET}x the best bf16: "]
    lines[-1] += f"{len(hit)} of {len(bound)}."
    lines += ["", "```python", "CONFIGS: dict[tuple[int, int, int], Fp8GemmConfig] = {  # benchmarks/fp8_gemm.py"]
    for r in rows:
        if r["best"] is not None:
            lines.append(f"    # {r['shape']}")  # the timings are in the table above
            lines.append(f"    ({r['n']}, {r['k']}, {m_bucket(r['m'])}): {_config(r['best'])!r},")
    lines += ["}", "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, correctness only (with --device cpu)")
    p.add_argument("--quick", action="store_true", help="time the default configuration only")
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="rows of x (tokens per step), comma-separated")
    p.add_argument(
        "--shapes", default=None, help="comma-separated names of " + ", ".join(SHAPES) + "; or 'subset': SUBSET"
    )
    p.add_argument("--rep", type=int, default=10, help="ms of CUDA-graph replay per timing")
    p.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="directory for fp8_gemm.md/json ($OUT)")
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="begin no shape or M after this many seconds (the rest is left out; results so far are written)",
    )
    args = p.parse_args(argv)
    args.m = [int(m) for m in args.m.split(",")]
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels on CPU tensors
    import torch
    import triton.testing

    from specsplit.kernels.gemv import num_sms

    cuda = args.device.startswith("cuda")
    if cuda and torch.cuda.get_device_capability(args.device) < (8, 9):
        print("FP8 tensor cores need compute capability >= 8.9 (Ada, Hopper)", file=sys.stderr)
        return 2
    bench = (lambda fn: triton.testing.do_bench_cudagraph(fn, rep=args.rep)) if cuda and not args.tiny else None
    sms = TINY_NUM_SMS if args.tiny else num_sms(torch.device(args.device))
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        names = SUBSET if args.shapes == "subset" else args.shapes.split(",")
        unknown = [s for s in names if s not in shapes]
        if unknown:
            print(f"unknown shapes {', '.join(unknown)}; choose from {', '.join(shapes)}", file=sys.stderr)
            return 2
        shapes = {s: shapes[s] for s in names}
    device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu (Triton interpreter)"
    print(f"{device_name}, {sms} SMs; M in {args.m}", flush=True)
    start, rows = time.perf_counter(), []
    deadline = start + args.time_limit_s if args.time_limit_s is not None else float("inf")

    def write(rows: list) -> str:
        text = report(rows, device_name) if bench is not None else ""
        if args.out:  # after every shape: a run cut short keeps what it measured
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "fp8_gemm.json").write_text(json.dumps(dict(device=device_name, num_sms=sms, rows=rows), indent=2))
            if text:
                (out / "fp8_gemm.md").write_text(text)
        return text

    if bench is not None and not args.quick:
        workers = max(1, min(12, (os.cpu_count() or 2) - 2))
        limit = 240.0 if args.time_limit_s is None else args.time_limit_s / 2  # leave the sweep its half
        precompile(compile_jobs(shapes, args.m, sms, args.quick), workers, args.device, limit)
    for name, (n, k) in shapes.items():
        print(f"{name}: {n} x {k}", flush=True)
        rows += bench_shape(name, n, k, args, sms, bench, deadline)
        if cuda:
            torch.cuda.empty_cache()
        write(rows)
        print(f"  {time.perf_counter() - start:.0f} s so far", flush=True)
    failed = sum(not c["ok"] for r in rows for c in r["configs"])
    print("\n" + write(rows), flush=True)
    print(f"{failed} configurations failed their check; {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
