"""Paged causal attention over a ragged batch.

`paged_attention` gets one layer's cache views and the step's `AttentionMetadata`, writes the new
K/V at `slot_mapping`, and returns the attention output; query j of a request's n new tokens sees
cache indices 0 .. seq_len - n + j. Two paths:
- `attn.use_kernel`: the Triton kernel (`specsplit/kernels/paged_attention.py`) over the metadata's device
  tensors; no host work per request, no host sync, capturable in a CUDA graph. Runners choose it
  (`use_kernel_for`) for decode / verify steps, and for steps of up to a CUDA graph's tokens whose (query,
  key) pairs stay below `KERNEL_MAX_PREFILL_PAIRS`: one program per query token re-reads its context, right
  for a few new tokens per request, wasteful for very long contexts; but the eager path's host work (large per
  step whatever the prompt: `benchmarks/step.py --phase prefill`; docs/performance.md, "Decode step and
  kernels") costs more than that re-reading for chunks of prompts of a few thousand tokens, and the kernel path
  can replay a CUDA graph.
- otherwise (prefill steps, CPU, DeepSeek-V3's MLA has its own): `scaled_dot_product_attention` over
  the gathered K/V, in one call over the step padded to its longest request (`attn.padded_batch`)
  when the padding costs at most twice the real work, else in a per-request loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specsplit.kernels.kv_write import write_kv_triton
from specsplit.kernels.paged_attention import choose_num_splits, paged_attention_triton
from specsplit.models.kv_cache import AttentionMetadata
from specsplit.models.padded_batch import PaddedBatch


def use_precompiled_sdpa() -> None:
    """Keeps `scaled_dot_product_attention` off PyTorch's cuDNN backend in this process (process-wide, as
    torch's backend switches are; both runners call it). With a mask SDPA may pick cuDNN, which builds an
    execution plan (kernels compiled by NVRTC) for every new (query, key) shape, so a new shape's first call
    costs many times what the attention does. Prefill chunks come in every length, so each new length would
    stall every request in flight (docs/performance.md, "Decode step and kernels")."""
    torch.backends.cuda.enable_cudnn_sdp(False)


# Steps whose requests all have at most this many new tokens run the kernel (decode: 1, verify: 1 + k).
KERNEL_MAX_QUERY_LEN = 16
# Longer steps (prefill chunks) run it while the step has at most this many (query token, visible key)
# pairs: a 512-token prompt from its start is 131,328; its chunk from 1,536 to 2,048 is 917,760, and a batch-32
# step of such a chunk beside 31 verify rows of 4 tokens about 1.0M. Past the bound a step runs eagerly, and an
# eager step of several requests that padding would blow up (`specsplit/models/padded_batch.py`) is a loop of
# about ten launches per request and layer. Measured against 1 << 18 on an H100: docs/performance.md, "Prefix
# caching" (DeepSeek-V3's MLA kernel at this bound is not measured).
KERNEL_MAX_PREFILL_PAIRS = 1 << 21


def use_kernel_for(enabled: bool, num_new_tokens: list[int], seq_lens: list[int], max_prefill_tokens: int) -> bool:
    """Whether a step of requests with these new tokens and (after the step) sequence lengths runs the
    Triton kernel, given that the runner may use it (`enabled`). Longer steps only up to
    `max_prefill_tokens` in all (the runner's largest CUDA graph; 0 without graphs): run eagerly, the
    kernel would gain nothing over SDPA, and each new step length could compile a kernel variant."""
    if not enabled:
        return False
    if max(num_new_tokens) <= KERNEL_MAX_QUERY_LEN:
        return True
    if sum(num_new_tokens) > max_prefill_tokens:
        return False
    # Query j of n new tokens in a sequence of s sees s - n + j + 1 keys.
    pairs = sum(n * (s - n) + n * (n + 1) // 2 for n, s in zip(num_new_tokens, seq_lens))
    return pairs <= KERNEL_MAX_PREFILL_PAIRS


def write_kv(
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    attn: AttentionMetadata,
    kv_written: bool = False,  # the caller wrote k and v into the caches already (fused with its rotary)
) -> torch.Tensor:  # [T, num_heads, head_dim]
    if q.shape[0] != attn.num_tokens:
        raise ValueError(f"{q.shape[0]} query tokens but the attention metadata describes {attn.num_tokens}")
    if attn.use_kernel:
        if not kv_written:
            write_kv_triton(k, v, k_cache, v_cache, attn.slot_mapping)
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], q.device)
        return paged_attention_triton(
            q, k_cache, v_cache, attn.block_tables, attn.token_req_index, attn.token_context_lens, num_splits=num_splits
        )
    write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    batch = attn.padded_batch
    if batch is not None:
        return _sdpa_padded(q, flat_k, flat_v, batch, kv_heads, group)
    out = torch.empty_like(q)
    qsl, ctx = attn.query_start_loc_host, attn.context_start_loc_host
    for r, seq_len in enumerate(attn.seq_lens_host):
        q_start, q_end = qsl[r], qsl[r + 1]
        n = q_end - q_start
        slots = attn.context_slots[ctx[r] : ctx[r + 1]]
        keys = flat_k.index_select(0, slots).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
        values = flat_v.index_select(0, slots).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
        # GQA without copying K/V: fold each kv head's query group into the query length.
        queries = q[q_start:q_end].view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        queries = queries.reshape(kv_heads, group * n, head_dim)
        mask = None
        if n > 1:
            cache_index = torch.arange(seq_len, device=q.device)
            last_visible = torch.arange(seq_len - n, seq_len, device=q.device)
            mask = (cache_index[None, :] <= last_visible[:, None]).repeat(group, 1)  # [group * n, seq_len]
        o = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
        out[q_start:q_end] = o.view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    return out


def _sdpa_padded(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    flat_k: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    flat_v: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    batch: PaddedBatch,
    kv_heads: int,
    group: int,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """The whole step in one SDPA call over the padded batch: a constant number of launches per
    layer, where the per-request loop launches about ten per request."""
    num_reqs, n, head_dim = batch.slots.shape[0], batch.max_new, q.shape[2]
    keys = flat_k[batch.slots].permute(0, 2, 1, 3).to(q.dtype)  # [R, kv_heads, L, head_dim]
    values = flat_v[batch.slots].permute(0, 2, 1, 3).to(q.dtype)  # [R, kv_heads, L, head_dim]
    queries = q[batch.query_index].view(num_reqs, n, kv_heads, group, head_dim)
    queries = queries.permute(0, 2, 3, 1, 4).reshape(num_reqs, kv_heads, group * n, head_dim)  # rows (g, j)
    mask = batch.mask.repeat(1, group, 1)[:, None]  # [R, 1, group * N, L]
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)  # [R, kv_heads, group * N, D]
    o = o.view(num_reqs, kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)  # [R, N, kv_heads, group, D]
    return o.reshape(num_reqs * n, kv_heads * group, head_dim)[batch.out_index]
