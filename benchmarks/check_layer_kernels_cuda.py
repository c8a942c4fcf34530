"""GPU check of the Triton layer kernels (`--layer-kernels`): each kernel against its torch op on random
inputs, then whole models with the kernels on against the same models with them off (the Triton
paged-attention path, eager and CUDA-graph replay).

    PYTHONPATH=. python benchmarks/check_layer_kernels_cuda.py          # H200; exit 1 on a mismatch
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.check_paged_attention_cuda import decode_steps  # noqa: E402
from kernels.rms_norm import rms_norm_reference, rms_norm_triton  # noqa: E402
from kernels.rotary import apply_rotary_qk_triton  # noqa: E402
from kernels.silu_mul import silu_mul_reference, silu_mul_triton  # noqa: E402
from models.cuda_graphs import CudaGraphRunner  # noqa: E402
from models.layer_ops import enable_layer_kernels  # noqa: E402
from models.loader import load_target  # noqa: E402
from models.rotary import apply_rotary  # noqa: E402
from models.tiny import write_tiny_checkpoint  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative to the reference's largest magnitude


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def op_cases(dev: torch.device) -> bool:
    gen = torch.Generator(device=dev).manual_seed(0)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, size in ((1, 320), (7, 1000), (64, 3584), (256, 4096)):
            x = torch.randn(tokens, size, device=dev, generator=gen).to(dtype)
            r = torch.randn(tokens, size, device=dev, generator=gen).to(dtype)
            w = torch.randn(size, device=dev, generator=gen).to(dtype)
            for res in (None, r):
                got, got_res = rms_norm_triton(x, w, 1e-6, res)
                ref, ref_res = rms_norm_reference(x, w, 1e-6, res)
                err = max(_rel(got, ref), _rel(got_res, ref_res) if res is not None else 0.0)
                ok &= report(f"rms_norm {dtype} [{tokens}, {size}] residual={res is not None}", err, TOL[dtype])
            gate_up = torch.randn(tokens, 2 * size, device=dev, generator=gen).to(dtype)
            ok &= report(
                f"silu_mul {dtype} [{tokens}, {2 * size}]",
                _rel(silu_mul_triton(gate_up), silu_mul_reference(gate_up)),
                TOL[dtype],
            )
        for tokens, heads, kv_heads, head_dim in ((1, 28, 4, 128), (33, 8, 2, 64), (256, 32, 8, 128)):
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=dev, generator=gen).to(dtype)
            q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views, as in the model
            k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
            angle = torch.rand(tokens, head_dim // 2, device=dev, generator=gen) * 6.28
            cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
            ref_q, ref_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
            got_q, got_k = apply_rotary_qk_triton(q, k, cos, sin)
            err = max(_rel(got_q, ref_q), _rel(got_k, ref_k))
            ok &= report(f"rotary {dtype} T={tokens} heads={heads}/{kv_heads} d={head_dim}", err, TOL[dtype])
    return ok


def report(name: str, err: float, tol: float) -> bool:
    if err > tol:
        print(f"MISMATCH {name}: relative error {err:.2e} > {tol:.0e}")
    return err <= tol


def model_case(name: str, model, tol: float) -> bool:
    logits = {}
    for on in (False, True):
        enable_layer_kernels(on)
        for path in ("kernel", "graphs"):
            cache = model.make_kv_cache(64, 16)
            runner = CudaGraphRunner(model, cache, max_model_len=256, max_num_tokens=8) if path == "graphs" else None
            logits[on, path] = decode_steps(model, cache, path, runner)
    enable_layer_kernels(False)
    ok = True
    for path in ("kernel", "graphs"):
        a, b = logits[True, path], logits[False, path]
        err = max((x - y).abs().max().item() for x, y in zip(a, b))
        same = all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b))
        print(f"{name} {path}: layer kernels vs torch ops: max |logits diff| {err:.2e}, argmax equal: {same}")
        ok &= err <= tol
    return ok


def main() -> None:
    dev = torch.device("cuda")
    ok = op_cases(dev)
    print(f"op cases: {'OK' if ok else 'MISMATCH'}")
    tmp = Path(tempfile.mkdtemp())
    for arch in ("qwen3", "qwen2"):
        ckpt = write_tiny_checkpoint(tmp / arch, architecture=arch, max_position_embeddings=256)
        ok &= model_case(f"tiny {arch} fp32", load_target(ckpt, device=dev), tol=1e-3)
    ok &= model_case("demo bf16", load_target(ROOT / "checkpoints" / "demo", dtype=torch.bfloat16, device=dev), 0.25)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
