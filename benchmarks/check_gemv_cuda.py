"""On CUDA: the Qwen2-7B-shaped target (random bf16 weights) gives the same logits with the Triton GEMV
for its measured linears (the default) as with cuBLAS everywhere (`--no-gemv`), to bf16 rounding.

    PYTHONPATH=$PWD python3 benchmarks/check_gemv_cuda.py

For steps of 1, 4 and 32 new tokens after a 64-token prefill: max |logits difference| over the
logits' scale, and whether the argmax agrees per row. Exits 1 when a step's difference exceeds what
bf16 rounding of the linears explains (2 % of the logits' scale) or most argmaxes disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_step import random_qwen2_7b  # noqa: E402


def main() -> int:
    import torch

    from models.attention import use_kernel_for
    from models.layer_ops import enable_gemv

    device = torch.device("cuda")
    model = random_qwen2_7b(torch.bfloat16, device)
    cache = model.make_kv_cache(64, 16)
    context = 64
    failed = False
    with torch.inference_mode():
        for new_tokens in (1, 4, 32):
            rid = f"r{new_tokens}"
            attn = cache.prepare_step([rid], [context])
            prompt = torch.randint(0, model.config.vocab_size, (context,), device=device)
            model(prompt, torch.arange(context, device=device), cache, attn)
            ids = torch.randint(0, model.config.vocab_size, (new_tokens,), device=device)
            positions = torch.arange(context, context + new_tokens, device=device)
            logits = {}
            for mode in (False, None):  # cuBLAS, then the default (GEMV for the measured shapes)
                enable_gemv(mode)
                cache.truncate(rid, context)
                attn = cache.prepare_step([rid], [new_tokens], use_kernel=use_kernel_for(True, [new_tokens]))
                logits[mode] = model.compute_logits(model(ids, positions, cache, attn))
            cache.free(rid)
            diff = (logits[None] - logits[False]).abs().max().item()
            scale = logits[False].abs().max().item()
            agree = (logits[None].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
            ok = diff <= 0.02 * scale and agree >= 0.5
            failed |= not ok
            print(
                f"{new_tokens:2d} new tokens: max |logits diff| {diff:.3e} (scale {scale:.2f}), "
                f"argmax agrees on {agree:.0%} of rows: {'OK' if ok else 'FAIL'}",
                flush=True,
            )
    enable_gemv(None)
    print("OK" if not failed else "FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
