"""Pure-torch reference of the paged attention kernel (`specsplit/kernels/paged_attention.py`).

Terms, shared with the kernel:
- a step is a flat batch of `T` query tokens; token t belongs to request `token_req_index[t]`;
- `token_context_lens[t]` is how many cache entries token t sees: cache indices 0 .. len - 1 of its
  request, which includes its own K/V (written before attention) and every earlier token; 0 marks a
  padding token, whose output is zero;
- cache index i of request r lives at slot `block_tables[r, i // block_size] * block_size +
  i % block_size` of the paged cache `[num_blocks, block_size, kv_heads, head_dim]`;
- GQA: query head h reads kv head `h // (num_heads // kv_heads)`.
"""

from __future__ import annotations

import torch


def paged_attention_reference(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int
    token_req_index: torch.Tensor,  # [T] int
    token_context_lens: torch.Tensor,  # [T] int, 0 = padding token
    scale: float | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for t in range(num_tokens):
        n = int(token_context_lens[t])
        if n == 0:
            continue
        cache_index = torch.arange(n)
        blocks = block_tables[int(token_req_index[t])].long().cpu()[cache_index // block_size]
        keys = k_cache[blocks, cache_index % block_size].float()  # [n, kv_heads, head_dim]
        values = v_cache[blocks, cache_index % block_size].float()
        keys = keys.repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t].float(), keys) * scale
        out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values).to(q.dtype)
    return out


def mla_attention_reference(
    q_latent: torch.Tensor,  # [T, num_heads, R]: W_UK-absorbed q_nope
    q_pe: torch.Tensor,  # [T, num_heads, P], rotated
    latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]: [c_kv; k_pe]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int
    token_req_index: torch.Tensor,  # [T] int
    token_context_lens: torch.Tensor,  # [T] int, 0 = padding token
    scale: float,
) -> torch.Tensor:  # [T, num_heads, R], q_latent's dtype
    """Reference of `specsplit/kernels/mla_attention.py`: MLA's absorbed attention is paged attention with one KV head
    whose keys are the cached latents [c_kv; k_pe] and whose values are c_kv (here the latents with k_pe zeroed, the
    output cut to R)."""
    rank = q_latent.shape[2]
    values = torch.cat([latent_cache[..., :rank], torch.zeros_like(latent_cache[..., rank:])], dim=-1)
    q = torch.cat([q_latent, q_pe], dim=-1)
    out = paged_attention_reference(
        q, latent_cache[:, :, None], values[:, :, None], block_tables, token_req_index, token_context_lens, scale
    )
    return out[..., :rank]
