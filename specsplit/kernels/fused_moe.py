"""The routed experts of an MoE layer in a few launches, with no host sync: capturable in CUDA graphs.

    routed(x)[t] = Σ_{slot} w[t, slot] · down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = topk_ids[t, slot]

The experts' weights are stacked: `w13` [E, 2 * inter, hidden] (each expert's gate rows, then its up rows)
and `w2` [E, hidden, inter], in the model dtype or block-scaled e4m3 with fp32 scales per block
(`w13_scale` [E, ceil(2 * inter / bn13), ceil(hidden / bk)], `w2_scale` [E, ceil(hidden / bn), ceil(inter / bk)]).

1. `align_pairs`: the (token, slot) pairs, `pair = token * top_k + slot`, grouped by expert on the device (one
   Triton program: counts, a cumsum over experts, each pair's place; `align_pairs_reference` is the same in torch
   ops: argsort, cumsum, searchsorted), each expert's run padded to a multiple of BLOCK_M with a sentinel pair;
   every buffer sized for the worst case `T * top_k + E * (BLOCK_M - 1)`, so the shapes depend on T alone. Pairs
   of experts on other tensor-parallel ranks are left out (their rows of the result stay zero).
2. `_grouped_gemm_kernel`, gate_up: each program takes one BLOCK_M block of sorted pairs (one expert), gathers
   their token rows and multiplies them by a [BLOCK_N] slice of that expert's `w13`; blocks past the padded pair
   count (read from device memory) return at once. Then `silu_mul_triton` (the dense MLP's activation launch).
3. The same kernel, down: the pairs' activations times `w2`, rounded to the model dtype, times the pair's routing
   weight, stored in fp32 per pair; the sum over top_k is a reshape-sum (fixed order, no atomics: the same bits
   run to run).

FP8: activations are quantized per token and per group of bk along K by `quantize_activations_triton` (the W8A8
recipe of `specsplit.kernels.fp8_gemm`), once per launch's input rows; the kernel loads e4m3 rows and their
scales, dots one group at a time and scales each group's fp32 sum by the row's and the block's scales, as
`fp8_gemm`'s kernel does. Under the Triton interpreter the dot runs in fp32 (exact for e4m3 products).

`routed_experts_reference` is the same computation as a loop over experts in torch (the CPU path): it needs the
per-expert counts on the host.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specsplit.kernels.fp8_gemm import quantize_activations_triton
from specsplit.kernels.fp8_reference import w8a8_block_linear_reference
from specsplit.kernels.gemv_configs import cdiv
from specsplit.kernels.silu_mul import silu_mul_reference, silu_mul_triton

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_N = 64
BLOCK_K = 128  # bf16 / fp32; FP8 walks K one scale group (bk) at a time
_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the model dtype, as the kernel's constexpr


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per program: 16 (the least tl.dot takes) while experts average at most 32 pairs (decode and verify
    steps: most blocks would be padding at 64), else 64."""
    return 16 if num_pairs <= 32 * num_experts else 64


def align_pairs_reference(
    topk_ids: torch.Tensor,  # [T, top_k] global expert indices
    first_expert: int,
    num_experts: int,  # this rank's: experts [first_expert, first_expert + num_experts)
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ sorted_pairs int32 [num_blocks * block_m] (this rank's pairs grouped by expert, each expert's run padded
    to a multiple of block_m with the sentinel T * top_k), block_expert int32 [num_blocks] (the local expert of
    each block), num_padded int32 [1] (blocks at and past num_padded / block_m are padding); num_blocks =
    ceil((T * top_k + num_experts * (block_m - 1)) / block_m). Device ops only, no host sync."""
    device = topk_ids.device
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    local = flat - first_expert
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # others' pairs: one last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts  # of each bucket in the sorted pairs, unpadded
    order = key.argsort(stable=True)  # pairs in expert order, each expert's in pair order
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - starts[sorted_key]  # a pair's place in its expert's run
    num_blocks = cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    size = num_blocks * block_m
    padded_starts = padded_ends - padded
    dest = torch.where(
        sorted_key < num_experts, padded_starts[sorted_key.clamp(max=num_experts - 1)] + rank, size
    )  # other ranks' pairs all go to the slot past the end, dropped
    sorted_pairs = torch.full((size + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs[:size], block_expert.to(torch.int32), padded_ends[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["num_pairs", "first_expert"])
def _align_kernel(
    ids_ptr,  # [T * top_k] int64 global expert indices, pair order
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32, filled with the sentinel num_pairs beforehand
    block_expert_ptr,  # [num_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    first_expert,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,  # a power of two >= NUM_EXPERTS
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`align_pairs_reference` in one program: per-expert counts, padded run starts (a cumsum over experts), then
    each pair's place (its run's start + the pairs of its expert before it), chunk by chunk in pair order."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        local = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32) - first_expert
        mine = (offs < num_pairs) & (local >= 0) & (local < NUM_EXPERTS)
        hot = (local[:, None] == experts[None, :]) & mine[:, None]  # [CHUNK, E_PAD]
        counts += tl.sum(hot.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    before = tl.zeros((E_PAD,), dtype=tl.int32)  # pairs of each expert placed so far
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        local = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32) - first_expert
        mine = (offs < num_pairs) & (local >= 0) & (local < NUM_EXPERTS)
        hot = ((local[:, None] == experts[None, :]) & mine[:, None]).to(tl.int32)  # [CHUNK, E_PAD]
        place = starts[None, :] + before[None, :] + tl.cumsum(hot, axis=0) - hot  # exclusive, within the chunk
        dest = tl.sum(place * hot, axis=1)  # [CHUNK]: each pair's own expert's column
        tl.store(sorted_pairs_ptr + dest, offs, mask=mine)
        before += tl.sum(hot, axis=0)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        # a block's expert: how many experts' padded runs end at or before its first row (clamped to the last)
        ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & (experts[None, :] < NUM_EXPERTS)
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), NUM_EXPERTS - 1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


def align_pairs(
    topk_ids: torch.Tensor,  # [T, top_k] global expert indices
    first_expert: int,
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_pairs_reference`'s result in two launches (a fill and `_align_kernel`); no host sync. One program walks
    the pairs twice in chunks of [chunk, E_PAD] (8K elements, 64 pairs at most): a few µs at decode sizes, longer
    than the torch ops' ~35 launches only past about a thousand pairs (reasoned, not measured)."""
    num_pairs = topk_ids.numel()
    e_pad = triton.next_power_of_2(num_experts)
    num_blocks = cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    device = topk_ids.device
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids.contiguous(),
        sorted_pairs,
        block_expert,
        num_padded,
        num_pairs,
        first_expert,
        num_blocks,
        NUM_EXPERTS=num_experts,
        E_PAD=e_pad,
        BLOCK_M=block_m,
        CHUNK=min(64, max(16, 8192 // e_pad)),
        num_warps=8,
    )
    return sorted_pairs, block_expert, num_padded


@triton.jit(do_not_specialize=["num_pairs", "stride_asm"])
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x (row = pair // top_k) or the pairs' activations (row = pair); e4m3 if FP8
    a_scale_ptr,  # [rows, ceil(K / BLOCK_K)] fp32 (read only if FP8)
    w_ptr,  # [E, N, K], unit stride along K
    w_scale_ptr,  # [E, ceil(N / SCALE_BN), ceil(K / BLOCK_K)] fp32 (read only if FP8)
    out_ptr,  # [T * top_k, N]: per pair
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32
    block_expert_ptr,  # [num_blocks] int32
    num_padded_ptr,  # [1] int32
    weights_ptr,  # [T * top_k] fp32 routing weights (read only if MUL_WEIGHT)
    num_pairs,
    N,
    K,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    ROW_DIV: tl.constexpr,  # top_k for the gate_up launch (rows of x), 1 for down (rows per pair)
    MUL_WEIGHT: tl.constexpr,
    ROUNDING: tl.constexpr,  # the model dtype the GEMM's result is rounded to before the weight: _ROUNDING
    FP8: tl.constexpr,
    SCALE_BN: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: no TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    rows = (pairs // ROW_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None] * stride_am  # [BLOCK_M, 1]
    w_cols = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        kk = g * BLOCK_K + offs_k
        k_mask = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if FP8:
            if EMULATE_CAST:  # the interpreter's dot: in fp32 (exact for e4m3 products)
                part = tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:  # one group per dot, added in fp32, as fp8_gemm's kernel does
                part = tl.dot(a, w)
            a_scale = tl.load(a_scale_ptr + rows * stride_asm + g, mask=m_mask, other=0.0)  # [BLOCK_M]
            w_scale = tl.load(w_scale_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn + g, mask=n_mask)
            acc += part * a_scale[:, None] * w_scale[None, :]
        elif IEEE or EMULATE_CAST:  # the interpreter's bf16 dot is wrong (numpy has no bf16): in fp32 there
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if MUL_WEIGHT:  # the expert's output in the model dtype, then weighted in fp32 (as the reference does)
        if ROUNDING == 1:
            acc = acc.to(tl.bfloat16).to(tl.float32)
        elif ROUNDING == 2:
            acc = acc.to(tl.float16).to(tl.float32)
        acc = acc * tl.load(weights_ptr + pairs, mask=m_mask, other=0.0)[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    a, a_scale, w, w_scale, scale_block_n, block_k, out, aligned, weights, num_pairs, row_div, block_m, rounding
) -> None:
    fp8 = a_scale is not None
    sorted_pairs, block_expert, num_padded = aligned
    n, k = w.shape[1], w.shape[2]
    _grouped_gemm_kernel[(block_expert.shape[0], cdiv(n, BLOCK_N))](
        a,
        a if a_scale is None else a_scale,
        w,
        w if w_scale is None else w_scale,
        out,
        sorted_pairs,
        block_expert,
        num_padded,
        out if weights is None else weights,
        num_pairs,
        n,
        k,
        a.stride(0),
        0 if a_scale is None else a_scale.stride(0),
        w.stride(0),
        w.stride(1),
        0 if w_scale is None else w_scale.stride(0),
        0 if w_scale is None else w_scale.stride(1),
        out.stride(0),
        ROW_DIV=row_div,
        MUL_WEIGHT=weights is not None,
        ROUNDING=rounding,
        FP8=fp8,
        SCALE_BN=scale_block_n,
        EMULATE_CAST=_INTERPRETED,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )


def fused_routed_experts(
    x: torch.Tensor,  # [T, hidden] model dtype
    topk_ids: torch.Tensor,  # [T, top_k] global expert indices
    topk_weights: torch.Tensor,  # [T, top_k] fp32
    w13: torch.Tensor,  # [E, 2 * inter, hidden]
    w2: torch.Tensor,  # [E, hidden, inter]
    first_expert: int,
    fp8_scales: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None,  # w13_scale, w2_scale, bn13, bn2, bk
) -> torch.Tensor:  # [T, hidden] in x's dtype: the routed experts' sum (zero rows for other ranks' experts)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = block_m_for(num_pairs, num_experts)
    aligned = align_pairs(topk_ids, first_expert, num_experts, block_m)
    rounding = _ROUNDING[x.dtype]
    fp8 = fp8_scales is not None
    x = x.contiguous()
    # zeros: the rows of other ranks' pairs are never written, and their activation is not computed on garbage
    gate_up = torch.zeros(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    if fp8:
        w13_scale, w2_scale, bn13, bn2, bk = fp8_scales
        x_q, x_scale = quantize_activations_triton(x, bk)
        _launch(x_q, x_scale, w13, w13_scale, bn13, bk, gate_up, aligned, None, num_pairs, top_k, block_m, rounding)
    else:
        _launch(x, None, w13, None, 1, BLOCK_K, gate_up, aligned, None, num_pairs, top_k, block_m, rounding)
    act = silu_mul_triton(gate_up)  # [T * top_k, inter]; rows of other ranks' pairs are never read
    weighted = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.flatten().float().contiguous()
    if fp8:
        a_q, a_scale = quantize_activations_triton(act, bk)
        _launch(a_q, a_scale, w2, w2_scale, bn2, bk, weighted, aligned, weights, num_pairs, 1, block_m, rounding)
    else:
        _launch(act, None, w2, None, 1, BLOCK_K, weighted, aligned, weights, num_pairs, 1, block_m, rounding)
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def routed_experts_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int,
    fp8_scales: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None,
) -> torch.Tensor:
    """`fused_routed_experts` as a loop over this rank's experts in torch: one gather, per expert its gate_up
    linear, silu(gate) * up and its down linear (the W8A8 reference for FP8 weights), one scatter back, the
    weighted sum over top_k in fp32. One host sync for the per-expert counts."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = w13.shape[0], w2.shape[1]

    def linear(part: torch.Tensor, which: int, e: int) -> torch.Tensor:
        w = (w13, w2)[which][e]
        if fp8_scales is None:
            return F.linear(part, w)
        return w8a8_block_linear_reference(part, w, fp8_scales[which][e], None, fp8_scales[2 + which], fp8_scales[4])

    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)  # pair indices in expert order
    counts = torch.bincount(flat_ids, minlength=first_expert + num_experts).tolist()
    first, last = first_expert, first_expert + num_experts
    start = sum(counts[:first])
    mine = order[start : start + sum(counts[first:last])]
    weighted = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    if mine.shape[0]:
        inputs = x[mine // top_k].split(counts[first:last])
        outputs = torch.cat(
            [linear(silu_mul_reference(linear(part, 0, e)), 1, e) for e, part in enumerate(inputs) if part.shape[0]]
        )
        weighted[mine] = outputs * topk_weights.flatten()[mine, None].float()
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
