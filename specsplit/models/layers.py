"""Building blocks of a Llama-style decoder: RMSNorm, SwiGLU MLP, self-attention, decoder layer.

Submodule names equal Hugging Face's (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...)
so checkpoint tensors load by name. The same `DecoderLayer` serves the target and the MTP block.
After loading, `fuse_projections` concatenates q/k/v into one `qkv_proj` and gate/up into one
`gate_up_proj` (one GEMM each instead of three and two); norms, rotary and the activation run as
one Triton launch each on CUDA, and the linears can run a Triton GEMV (`specsplit.models.layer_ops`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.models.attention import paged_attention
from specsplit.models.config import ModelConfig
from specsplit.models.fp8_linear import Fp8Linear
from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache
from specsplit.models.layer_ops import apply_rotary_qk, apply_rotary_qk_and_write_kv, linear, rms_norm, silu_mul
from specsplit.models.meta_init import on_meta
from specsplit.models.parallel import all_reduce, tp_rank, tp_size
from specsplit.models.parallel_layers import column_parallel_linear, row_parallel_linear
from specsplit.models.rotary import RotaryEmbedding

__all__ = [
    "FUSED_PROJECTIONS",
    "MLP",
    "DecoderLayer",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "check_token_inputs",
    "fuse_projections",
]

# fused projection → the checkpoint projections it concatenates, in row order
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def check_token_inputs(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and positions must both be [num_tokens], got {tuple(input_ids.shape)} "
            f"and {tuple(positions.shape)}"
        )


class RMSNorm(nn.Module):
    """Computed in float32 and cast back before the weight, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size] → [..., size]
        return rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [..., size] → norm(x + residual), x + residual (one launch on CUDA)
        return rms_norm(x, self.weight, self.eps, residual)


def _concat_linears(*linears: nn.Linear | Fp8Linear) -> nn.Linear | Fp8Linear:
    """One Linear whose output rows are the given layers' rows, in order (a new tensor; the caller
    drops the originals, so the weights stay single); FP8 layers keep each row's scale."""
    first = linears[0]
    if isinstance(first, Fp8Linear):
        return Fp8Linear.concat(*linears)
    with on_meta():
        fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None)
    fused.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=first.weight.requires_grad)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=first.bias.requires_grad)
    return fused


def fuse_projections(model: nn.Module) -> nn.Module:
    """Calls `fuse_projections` on every module of `model` that has one, a module's children before the module:
    every `SelfAttention` and `MLP` (q/k/v → `qkv_proj`, gate/up → `gate_up_proj`: one GEMM each instead of three
    and two), then each `MoE` stacks its fused experts (`specsplit.models.moe.StackedExperts`); modules without
    one (e.g. MLA) are left alone. The loader calls it on every model it returns; parameters are then named by
    `FUSED_PROJECTIONS` instead of the checkpoint's q/k/v and gate/up names, and `experts.gate_up_proj` /
    `experts.down_proj` (transformers' names and layout) instead of `experts.{e}.*`."""
    _fuse_children_first(model)
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # hand back the originals' blocks, which the fused tensors did not reuse
    return model


def _fuse_children_first(module: nn.Module) -> None:
    """Nothing here holds a module past its parent's fusion (no list of the model's modules): a MoE's per-expert
    weights are freed as it stacks them, so the peak stays one layer's experts twice, not the whole model's."""
    for child in list(module.children()):
        _fuse_children_first(child)
    if hasattr(module, "fuse_projections"):
        module.fuse_projections()


class MLP(nn.Module):
    """SwiGLU, down(silu(gate(x)) * up(x)): the dense MLP, the MoE's shared experts and each routed expert (until
    its MoE stacks them). Tensor-parallel (`sharded`, the default): gate and up column-parallel, down row-parallel,
    whose partial sums it all-reduces itself (`reduce`) or leaves to its MoE (the shared experts: one all-reduce
    with the routed experts'); a routed expert is whole on its rank (`sharded=False`)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, *, sharded: bool = True, reduce: bool = True
    ) -> None:
        super().__init__()
        column, row = (column_parallel_linear, row_parallel_linear) if sharded else (nn.Linear, nn.Linear)
        self.gate_proj = column(hidden_size, intermediate_size, bias)
        self.up_proj = column(hidden_size, intermediate_size, bias)
        self.down_proj = row(intermediate_size, hidden_size, bias)
        self.reduce = reduce
        self.gate_up_proj: nn.Linear | Fp8Linear | None = None  # set by fuse_projections, replacing gate and up

    def fuse_projections(self) -> None:
        if self.gate_up_proj is None:
            self.gate_up_proj = _concat_linears(*(getattr(self, n) for n in FUSED_PROJECTIONS["gate_up_proj"]))
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] → [T, hidden]
        if self.gate_up_proj is None:
            out = linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)
        else:
            out = linear(silu_mul(linear(x, self.gate_up_proj)), self.down_proj)
        return all_reduce(out) if self.reduce else out


def local_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """Tensor-parallel: (query heads, KV heads, index of the first KV head) of this rank. Query heads split
    equally; KV heads too while there are at least as many as ranks, else each is replicated on the
    `size // num_kv_heads` ranks whose query heads use it."""
    size, rank = tp_size(), tp_rank()
    if num_heads % size:
        raise ValueError(f"{num_heads} attention heads do not divide into {size} tensor-parallel ranks")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"{num_kv_heads} KV heads do not divide into {size} tensor-parallel ranks")
        return num_heads // size, num_kv_heads // size, rank * (num_kv_heads // size)
    if size % num_kv_heads:
        raise ValueError(f"{size} tensor-parallel ranks are not a multiple of {num_kv_heads} KV heads")
    return num_heads // size, 1, rank // (size // num_kv_heads)


class SelfAttention(nn.Module):
    """GQA self-attention with optional qkv bias (Qwen2) and per-head q/k RMSNorm (Qwen3). Tensor-parallel:
    each rank its query heads and their KV heads (`local_heads`), q/k/v column-parallel, o_proj row-parallel."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = self.head_dim = config.head_dim
        heads = local_heads(config.num_attention_heads, config.num_key_value_heads)
        self.num_heads, self.num_kv_heads, first_kv = heads
        hidden, qkv_bias = config.hidden_size, config.attention_bias
        q_full, kv_full = config.num_attention_heads * d, config.num_key_value_heads * d
        q_rows, kv_rows = (tp_rank() * self.num_heads * d, self.num_heads * d), (first_kv * d, self.num_kv_heads * d)
        self.q_proj = column_parallel_linear(hidden, q_full, qkv_bias, start=q_rows[0], size=q_rows[1])
        self.k_proj = column_parallel_linear(hidden, kv_full, qkv_bias, start=kv_rows[0], size=kv_rows[1])
        self.v_proj = column_parallel_linear(hidden, kv_full, qkv_bias, start=kv_rows[0], size=kv_rows[1])
        self.o_proj = row_parallel_linear(q_full, hidden, config.o_proj_bias, start=q_rows[0], size=q_rows[1])
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections, replacing q, k and v

    def fuse_projections(self) -> None:
        if self.qkv_proj is None:
            self.qkv_proj = _concat_linears(*(getattr(self, n) for n in FUSED_PROJECTIONS["qkv_proj"]))
            del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [T, hidden] → q [T, heads * head_dim], k, v [T, kv_heads * head_dim] (views of one GEMM output)
        if self.qkv_proj is None:
            return linear(x, self.q_proj), linear(x, self.k_proj), linear(x, self.v_proj)
        kv_size = self.num_kv_heads * self.head_dim
        return linear(x, self.qkv_proj).split([self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, rotary_dim]
        kv_cache: PagedKVCache,
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self._project(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache.k[cache_layer], kv_cache.v[cache_layer]
        if attn.use_kernel:  # the kernel path: the rotary launch writes k and v into the cache too
            q, k, written = apply_rotary_qk_and_write_kv(q, k, v, *rope, k_cache, v_cache, attn.slot_mapping)
        else:
            (q, k), written = apply_rotary_qk(q, k, *rope), False
        out = paged_attention(q, k, v, k_cache, v_cache, attn, kv_written=written)
        return all_reduce(linear(out.reshape(num_tokens, self.num_heads * self.head_dim), self.o_proj))


class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), for layers with `input_layernorm`, `self_attn`,
    `post_attention_layernorm` (RMSNorms) and `mlp`; the attention may be any (GQA here, MLA in
    models/deepseek_v3). The target runs `forward_deferred`, whose last residual add the next layer's
    norm fuses (one launch fewer per layer); `forward` is that plus the add (the MTP block's output)."""

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # the layer's rotary tables
        kv_cache,  # the model's cache (paged, or latent for MLA)
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: the full residual stream
        mlp_out, residual = self.forward_deferred(x, None, rope, kv_cache, cache_layer, attn)
        return residual + mlp_out

    def forward_deferred(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's input, or (with residual) the last layer's MLP output
        residual: torch.Tensor | None,  # [T, hidden]: the stream x still has to be added to
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache,
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # MLP output, and the stream it still has to be added to
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn_out = self.self_attn(h, rope, kv_cache, cache_layer, attn)
        h, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(h), residual


class DecoderLayer(PreNormBlock):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Returns the full residual stream."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
