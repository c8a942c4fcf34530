"""Bytes of a model's weights from its config.json: what each model server holds (the verifier the target,
a drafter its MTP layer with an embedding and LM head of its own) and what one step reads, its *active* weights,
for the HBM roofline of `benchmarks/e2e.py` and the memory plan of `benchmarks/lib/shapes.py`.

Per linear: 1 byte per element plus an fp32 scale per [128, 128] block where the checkpoint is FP8 (every
linear of the decoder layers but DeepSeek-V3's kv_b_proj, which the loader dequantizes), else the dtype's
size; LM heads, MTP eh_proj and embeddings stay in the dtype; the MoE router is fp32. Biases and norms are
left out (under 0.1 % of any layer here).

A step over T tokens reads every layer's attention, dense MLP or shared experts and router, the LM head, and
the routed experts its tokens chose. Random weights route as they route, not uniformly, and which experts a
step touched is not recorded: the count is the expected number of distinct experts when each token picks its
top_k of E uniformly, E (1 - (1 - top_k / E)^T) (exact in expectation for independent tokens; an upper bound
on what skewed routing touches).
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.runtime.kv_cache_size import GIB, HEADROOM

HBM_BYTES_PER_S = 4.8e12  # the H200's HBM3e
HBM_BYTES_PER_S_BY_GPU = {"H100": 3.35e12, "H200": HBM_BYTES_PER_S}  # SXM parts: HBM3, HBM3e


def hbm_bytes_per_s(device_name: str) -> float:
    """The memory bandwidth of the GPU named `device_name` (torch.cuda.get_device_name); the H200's for any other
    device (a CPU run's fraction is only a reference point)."""
    return next((bw for gpu, bw in HBM_BYTES_PER_S_BY_GPU.items() if gpu in device_name), HBM_BYTES_PER_S)


FP8_BLOCK = 128
ROUTER_BYTES = 4  # fp32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerBytes:
    fixed: int  # read by every step: attention, dense MLP or shared experts, router
    expert: int  # one routed expert (0: a dense layer)
    num_experts: int
    top_k: int

    def held(self) -> int:
        return self.fixed + self.expert * self.num_experts

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts of a step over `tokens` tokens under uniform routing."""
        if not self.num_experts or tokens <= 0:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)

    def active(self, tokens: int) -> float:
        return self.fixed + self.expert * self.experts_touched(tokens)


@dataclass(frozen=True)
class ModelBytes:
    embed: int
    head: int  # the target's LM head; the MTP layer's shared head is as large
    layers: list[LayerBytes]  # the target's decoder layers
    mtp: LayerBytes  # the MTP layer's decoder block
    eh_proj: int
    kv_per_token: int  # the target's KV cache, all layers
    mtp_kv_per_token: int
    vocab_size: int
    max_position_embeddings: int

    @property
    def verifier_weights(self) -> int:
        return self.embed + self.head + sum(layer.held() for layer in self.layers)

    @property
    def drafter_weights(self) -> int:
        return self.embed + self.head + self.eh_proj + self.mtp.held()

    def verify_step(self, tokens: int) -> float:
        """Active weight bytes of a target step over `tokens` tokens (LM head included)."""
        return self.head + sum(layer.active(tokens) for layer in self.layers) if tokens > 0 else 0.0

    def draft_step(self, tokens: int) -> float:
        """Active weight bytes of one MTP step over `tokens` tokens (eh_proj, the block, the shared head)."""
        return self.eh_proj + self.mtp.active(tokens) + self.head if tokens > 0 else 0.0

    def iteration(self, batch: int, k: int, accepted_per_request: float) -> float:
        """Active weight bytes of one decode iteration of `batch` requests at k drafts: the verify step over
        batch (k + 1) tokens, the drafter's step 0 over each request's accepted drafts and bonus token, and its
        k - 1 later steps over one token each (target-only, k = 0: the verify step over batch tokens)."""
        total = self.verify_step(batch * (k + 1))
        if k > 0:
            total += self.draft_step(round(batch * (1 + accepted_per_request))) + (k - 1) * self.draft_step(batch)
        return total


def _linear(n: int, k: int, fp8: bool, dtype_bytes: int) -> int:
    if fp8:
        return n * k + ROUTER_BYTES * cdiv(n, FP8_BLOCK) * cdiv(k, FP8_BLOCK)
    return dtype_bytes * n * k


def model_bytes(config: dict, dtype_bytes: int = 2) -> ModelBytes:
    """From a config.json dict (Qwen2 / Llama, GLM-4.5 MoE, DeepSeek-V3 layouts)."""
    fp8 = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    h, vocab = config["hidden_size"], config["vocab_size"]

    def linear(n: int, k: int, quantized: bool = True) -> int:
        return _linear(n, k, fp8 and quantized, dtype_bytes)

    heads = config["num_attention_heads"]
    if "kv_lora_rank" in config:  # MLA
        q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        q = linear(q_rank, h) + linear(heads * (nope + rope), q_rank) if q_rank else linear(heads * (nope + rope), h)
        attention = q + linear(kv_rank + rope, h) + linear(heads * (nope + v), kv_rank, quantized=False)
        attention += linear(h, heads * v)
        kv_per_layer = dtype_bytes * (kv_rank + rope)
    else:
        d = config.get("head_dim") or h // heads
        kv_heads = config.get("num_key_value_heads", heads)
        attention = linear((heads + 2 * kv_heads) * d, h) + linear(h, heads * d)
        kv_per_layer = dtype_bytes * 2 * kv_heads * d
    experts = config.get("n_routed_experts") or 0

    def mlp(inter: int) -> int:  # gate, up and down
        return 2 * linear(inter, h) + linear(h, inter) if inter else 0

    def layer(index: int) -> LayerBytes:
        if not experts or index < config.get("first_k_dense_replace", 0):
            return LayerBytes(attention + mlp(config["intermediate_size"]), 0, 0, 0)
        inter = config["moe_intermediate_size"]
        shared = mlp(inter * (config.get("n_shared_experts") or 0))
        router = ROUTER_BYTES * experts * h
        return LayerBytes(attention + shared + router, mlp(inter), experts, config["num_experts_per_tok"])

    num_layers = config["num_hidden_layers"]
    return ModelBytes(
        embed=dtype_bytes * vocab * h,
        head=dtype_bytes * vocab * h,
        layers=[layer(i) for i in range(num_layers)],
        mtp=layer(num_layers),
        eh_proj=dtype_bytes * 2 * h * h,
        kv_per_token=kv_per_layer * num_layers,
        mtp_kv_per_token=kv_per_layer,
        vocab_size=vocab,
        max_position_embeddings=config["max_position_embeddings"],
    )


# Of a model server's share, what is taken besides weights and KV cache (the step's workspace, CUDA graphs, the
# allocator's rounding) is measured only at its start-up; the plan sets aside the fp32 logits of the largest step
# and this much more. Measured on the H200 (2026-12-02, the DeepSeek-V3 cut at a 512-token step, fused MoE): the
# verifier's peak without its cache 3.7 GiB above its weights, the drafter's 2.8 GiB, each with 0.25 GiB of logits.
# (1 GiB, the value before, left the drafter's share short: it refused to start.)
WORKSPACE_BYTES = int(3.5 * GIB)


@dataclass(frozen=True)
class SharePlan:
    """`--gpu-memory-utilization` of a verifier and its co-located drafter on one device, from bytes."""

    total: int  # the device's memory
    verifier: float
    drafter: float
    verifier_need: int  # weights + workspace + its KV cache (the larger of one max_model_len request and the batch)
    drafter_need: int

    def room(self, share: float) -> float:
        return share * self.total * (1 - HEADROOM)

    @property
    def fits(self) -> bool:
        return self.verifier > 0 and self.verifier_need <= self.room(self.verifier)

    def describe(self) -> str:
        return (
            f"[memory plan of {self.total / GIB:.1f} GiB: verifier --gpu-memory-utilization {self.verifier:g} "
            f"({self.room(self.verifier) / GIB:.1f} GiB) needs {self.verifier_need / GIB:.1f} GiB; drafter "
            f"{self.drafter:g} ({self.room(self.drafter) / GIB:.1f} GiB) needs {self.drafter_need / GIB:.1f} GiB]"
        )

    def refusal(self) -> str:
        return (
            f"the verifier needs {self.verifier_need / GIB:.1f} GiB (weights, workspace, KV) but its share "
            f"{self.verifier:g} of {self.total / GIB:.1f} GiB holds {self.room(self.verifier) / GIB:.1f} GiB beside "
            f"a drafter of {self.drafter_need / GIB:.1f} GiB: cut the shape's layers (benchmarks/lib/shapes.py)"
        )


def plan_shares(
    sizes: ModelBytes,
    total: int,  # the device's memory, bytes
    up_share: float,  # what the two may use together (`specsplit up`'s default 0.9)
    drafter_share: float,  # a co-located drafter's default share (`up`: 0.1)
    kv_tokens: int,  # tokens the verifier's KV cache must hold: its --max-model-len, or the batch's tokens if more
    max_step_tokens: int,  # rows of the largest step (--max-num-batched-tokens)
    dtype_bytes: int = 2,
) -> SharePlan:
    """`up`'s split (the drafter `drafter_share`, the verifier the rest of `up_share`), the drafter's raised to
    the next hundredth (half a hundredth to spare) where its weights need more; each server's need: weights,
    the largest step's fp32 logits plus `WORKSPACE_BYTES`, and a KV cache: the verifier's of `kv_tokens`, the
    drafter's of one request of the model's context length (what it refuses to start without)."""
    logits = 4 * max_step_tokens * sizes.vocab_size
    drafter_need = sizes.drafter_weights + logits + WORKSPACE_BYTES
    drafter_need += sizes.mtp_kv_per_token * sizes.max_position_embeddings
    verifier_need = sizes.verifier_weights + logits + WORKSPACE_BYTES + sizes.kv_per_token * kv_tokens
    needed = drafter_need / (total * (1 - HEADROOM)) + 0.005  # at least half a hundredth to spare
    drafter = max(drafter_share, cdiv(round(needed * 1e4), 100) / 100)
    return SharePlan(total, round(up_share - drafter, 6), drafter, verifier_need, drafter_need)
