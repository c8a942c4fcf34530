"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged latent cache.

Per token, one down-projection gives the latent c_kv (`kv_lora_rank`, RMS-normed) and the shared RoPE
key k_pe (`qk_rope_head_dim`); only [c_kv; rot(k_pe)] is cached. Per head h, `kv_b_proj` holds
W_UK[h] ([qk_nope_head_dim, kv_lora_rank]) and W_UV[h] ([v_head_dim, kv_lora_rank]), so

    score(q, s) = q_nope[h]·(W_UK[h] c_kv[s]) + q_pe[h]·k_pe[s] = (W_UK[h]ᵀ q_nope[h])·c_kv[s] + q_pe[h]·k_pe[s]
    out[h]      = Σ_s p[h, s] W_UV[h] c_kv[s] = W_UV[h] (Σ_s p[h, s] c_kv[s])

Two ways to compute the same attention:
- expanded: up-project every context latent into per-head keys and values, then ordinary attention.
  Its cost grows with the context once, whatever the number of queries: right for prefill chunks.
- absorbed: fold W_UK into the query and W_UV after the weighted sum, so every head attends directly
  over the cached latents (one shared "KV head" of width kv_lora_rank + qk_rope_head_dim): right for
  decode and verification, where a few queries meet a long context.
Per query, context token and head, absorbed does 2·kv_lora_rank − qk_nope − v_head more
multiply-adds (it scores and sums in latent width); expanded pays kv_lora_rank·(qk_nope + v_head)
per context token and head to up-project, whatever the number of queries. Requests with at most
`absorb_max_query_len` new tokens (that break-even by default: 170 for DeepSeek-V3, 32 for the
tiny test config) take the absorbed path.

Tensor-parallel: the heads split across the ranks (q_proj / q_b_proj and kv_b_proj column-parallel by
head, o_proj row-parallel, its partial output all-reduced); the down-projections, their norms and the
latent cache are replicated (every rank caches the whole latent: it is per token, not per head).

Two paths, as `specsplit.models.attention.paged_attention` has: with `attn.use_kernel` (the runners choose it,
`use_kernel_for`: decode, verify and prefill chunks under its pairs bound) the latents are written by a Triton
launch that skips padding slots and the absorbed attention runs in one Triton kernel over the step's device metadata
(`specsplit/kernels/mla_attention.py`): no host work per request, no host sync, so the step can replay a CUDA
graph. Otherwise a per-request loop over the gathered context picks the absorbed or the expanded form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.kernels.kv_write import write_rows_triton
from specsplit.kernels.mla_attention import mla_attention_triton
from specsplit.models.deepseek_v3.config import DeepseekV3Config
from specsplit.models.deepseek_v3.latent_cache import LatentKVCache
from specsplit.models.deepseek_v3.rotary import apply_rotary, softmax_scale
from specsplit.models.kv_cache import AttentionMetadata
from specsplit.models.layers import RMSNorm
from specsplit.models.parallel import all_reduce, tp_rank, tp_size
from specsplit.models.parallel_layers import column_parallel_linear, row_parallel_linear

# DeepSeek's reference code and transformers build q_a_layernorm and kv_a_layernorm with RMSNorm's
# default eps, not config.rms_norm_eps (equal in every published DeepSeek config).
LATENT_NORM_EPS = 1e-6


def absorbed_break_even(config: DeepseekV3Config) -> int:
    """Largest query count per request for which the absorbed path needs fewer multiply-adds."""
    rank, nope, v = config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim
    extra_per_query = 2 * rank - nope - v  # per context token and head
    return rank * (nope + v) // extra_per_query if extra_per_query > 0 else 1 << 30


class MLAttention(nn.Module):
    # kv_b_proj's weight is split and absorbed into the attention (`mla_paged_attention`), never called:
    # an FP8 checkpoint's is dequantized at load (`specsplit.models.fp8_linear`).
    dequantized_linears = ("kv_b_proj",)

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        if config.num_attention_heads % tp_size():
            raise ValueError(
                f"{config.num_attention_heads} attention heads do not divide into {tp_size()} tensor-parallel ranks"
            )
        self.num_heads = heads = config.num_attention_heads // tp_size()  # this rank's
        first = tp_rank() * heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.qk_head_dim = config.qk_head_dim
        self.interleave = config.rope_interleave
        self.scale = softmax_scale(config)
        self.absorb_max_query_len = absorbed_break_even(config)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_lora = config.q_lora_rank is not None
        all_heads, qk, kv = config.num_attention_heads, self.qk_head_dim, self.nope_dim + self.v_head_dim
        if not self.q_lora:
            self.q_proj = column_parallel_linear(hidden, all_heads * qk, False, start=first * qk, size=heads * qk)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = column_parallel_linear(
                config.q_lora_rank, all_heads * qk, False, start=first * qk, size=heads * qk
            )
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = column_parallel_linear(
            config.kv_lora_rank, all_heads * kv, False, start=first * kv, size=heads * kv
        )
        v = self.v_head_dim
        self.o_proj = row_parallel_linear(all_heads * v, hidden, bias, start=first * v, size=heads * v)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, qk_rope_head_dim // 2]
        kv_cache: LatentKVCache,
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, self.qk_head_dim).split([self.nope_dim, self.rope_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        cos, sin = rope
        q_pe = apply_rotary(q_pe, cos, sin, self.interleave)
        k_pe = apply_rotary(k_pe[:, None, :], cos, sin, self.interleave)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)  # [T, kv_lora_rank + rope]
        out = mla_paged_attention(
            q_nope,
            q_pe,
            latent,
            kv_cache.latent[cache_layer],
            attn,
            self.kv_b_proj.weight,
            self.scale,
            self.absorb_max_query_len,
        )
        return all_reduce(self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim)))


def mla_paged_attention(
    q_nope: torch.Tensor,  # [T, heads, qk_nope_head_dim]
    q_pe: torch.Tensor,  # [T, heads, qk_rope_head_dim], rotated
    latent: torch.Tensor,  # [T, kv_lora_rank + qk_rope_head_dim], the new tokens' cache entries
    latent_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one layer
    attn: AttentionMetadata,
    kv_b_weight: torch.Tensor,  # [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    scale: float,
    absorb_max_query_len: int,
) -> torch.Tensor:  # [T, heads, v_head_dim]
    """Writes `latent` at the step's slots, then attends each request's queries over its cache."""
    if q_nope.shape[0] != attn.num_tokens:
        raise ValueError(f"{q_nope.shape[0]} query tokens but the attention metadata describes {attn.num_tokens}")
    if attn.use_kernel:
        write_rows_triton(latent, latent_cache, attn.slot_mapping)
        return attend_absorbed_kernel(q_nope, q_pe, latent_cache, attn, kv_b_weight, scale)
    flat_cache = latent_cache.view(-1, latent_cache.shape[-1])
    flat_cache.index_copy_(0, attn.slot_mapping, latent.to(flat_cache.dtype))
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    v_head_dim = kv_b_weight.shape[0] // heads - nope
    out = q_nope.new_empty(q_nope.shape[0], heads, v_head_dim)
    qsl, ctx = attn.query_start_loc_host, attn.context_start_loc_host
    for r, seq_len in enumerate(attn.seq_lens_host):
        q_start, q_end = qsl[r], qsl[r + 1]
        n = q_end - q_start
        context = flat_cache.index_select(0, attn.context_slots[ctx[r] : ctx[r + 1]]).to(q_nope.dtype)
        mask = None
        if n > 1:  # query j of n sees cache indices 0 .. seq_len - n + j
            cache_index = torch.arange(seq_len, device=q_nope.device)
            mask = cache_index[None, :] <= torch.arange(seq_len - n, seq_len, device=q_nope.device)[:, None]
        attend = attend_absorbed if n <= absorb_max_query_len else attend_expanded
        out[q_start:q_end] = attend(q_nope[q_start:q_end], q_pe[q_start:q_end], context, kv_b_weight, scale, mask)
    return out


def attend_absorbed_kernel(
    q_nope: torch.Tensor,  # [T, heads, qk_nope]
    q_pe: torch.Tensor,  # [T, heads, rope], rotated
    latent_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope], the step's latents written
    attn: AttentionMetadata,
    kv_b_weight: torch.Tensor,  # [heads * (qk_nope + v_head), kv_lora_rank]
    scale: float,
) -> torch.Tensor:  # [T, heads, v_head]
    """`attend_absorbed` for the whole step at once, the attention in the Triton kernel."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = kv_b_weight.shape[1]
    w = kv_b_weight.view(heads, -1, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [heads, qk_nope, rank], [heads, v_head, rank]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, rank]
    o_latent = mla_attention_triton(
        q_latent,
        q_pe,
        latent_cache,
        attn.block_tables,
        attn.token_req_index,
        attn.token_context_lens,
        scale,
    )
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, heads, v_head]


def attend_expanded(
    q_nope: torch.Tensor,  # [n, heads, qk_nope]
    q_pe: torch.Tensor,  # [n, heads, rope]
    context: torch.Tensor,  # [S, kv_lora_rank + rope]
    kv_b_weight: torch.Tensor,  # [heads * (qk_nope + v_head), kv_lora_rank]
    scale: float,
    mask: torch.Tensor | None,  # [n, S] bool, True = visible
) -> torch.Tensor:  # [n, heads, v_head]
    """Up-projects the context into per-head keys and values (the naive MLA)."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = kv_b_weight.shape[1]
    c_kv, k_pe = context[:, :rank], context[:, rank:]
    kv = F.linear(c_kv, kv_b_weight).view(c_kv.shape[0], heads, -1).transpose(0, 1)  # [heads, S, nope + v]
    k_nope, values = kv[..., :nope], kv[..., nope:]
    keys = torch.cat([k_nope, k_pe[None].expand(heads, -1, -1)], dim=-1)  # [heads, S, qk_head]
    queries = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [heads, n, qk_head]
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def attend_absorbed(
    q_nope: torch.Tensor,  # [n, heads, qk_nope]
    q_pe: torch.Tensor,  # [n, heads, rope]
    context: torch.Tensor,  # [S, kv_lora_rank + rope]
    kv_b_weight: torch.Tensor,  # [heads * (qk_nope + v_head), kv_lora_rank]
    scale: float,
    mask: torch.Tensor | None,  # [n, S] bool, True = visible
) -> torch.Tensor:  # [n, heads, v_head]
    """Attends in the latent space: every head's query against the cached latents directly."""
    n, heads, nope = q_nope.shape
    rank = kv_b_weight.shape[1]
    w = kv_b_weight.view(heads, -1, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [heads, qk_nope, rank], [heads, v_head, rank]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [heads, n, rank]
    queries = torch.cat([q_latent, q_pe.transpose(0, 1)], dim=-1).reshape(1, heads * n, -1)
    keys, values = context[None], context[None, :, :rank]  # one KV head shared by all query heads
    if mask is not None:
        mask = mask.repeat(heads, 1)  # [heads * n, S], rows in (head, query) order like `queries`
    o_latent = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    o = torch.bmm(o_latent.view(heads, n, rank), w_uv.transpose(1, 2))  # [heads, n, v_head]
    return o.transpose(0, 1)
