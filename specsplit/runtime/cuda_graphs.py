"""CUDA graphs for decode / verify steps of the target, and for the MTP module's draft steps:
capture per token-count bucket, then replay.

A step of T query tokens runs in the smallest bucket b >= T (1, 2, 4, ... `max_num_tokens`). Its
inputs are copied into static buffers (input ids, positions, and the attention metadata of the
Triton path); the padding tokens T .. b - 1 get slot -1 (their K/V are not written) and context
length 0 (their attention output is zero), so they touch neither the cache nor the real rows. The
graph computes the hidden states and the logits of all b rows; the caller picks its logits rows.

`capture=False` runs exactly the same static-buffer path eagerly, without graphs: that is how the
bucket choice, padding and buffer filling are tested on CPU. Steps the graphs cannot take (more
tokens than the largest bucket, longer block tables, or the SDPA path: prefill) go eager.
Outputs of `run` are views of static buffers, valid until the next `run`.

The MTP module (`specsplit.models.mtp.MTPModule`) takes one more input, the previous hidden state of every
token; it gets a static buffer too.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache
from specsplit.models.mtp import MTPModule
from specsplit.models.target import TargetModel


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool):
    """`torch.cuda.graph(graph, pool=pool)` with Python's cyclic garbage collector held off: a collection during the
    capture can free what a dead object held (another graph, a CUDA event, a pinned buffer), a CUDA call the capture
    forbids, and the capture fails ("operation failed due to a previous error during capture"). Seen on an H100 when a
    test's dropped runner was collected while the next one captured."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


def token_buckets(max_num_tokens: int) -> list[int]:
    """1, 2, 4, ... up to and including `max_num_tokens`."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    buckets = [1]
    while buckets[-1] < max_num_tokens:
        buckets.append(min(2 * buckets[-1], max_num_tokens))
    return buckets


class CudaGraphRunner:
    def __init__(
        self,
        model: TargetModel | MTPModule,
        kv_cache: PagedKVCache,
        *,
        max_model_len: int,
        max_num_tokens: int = 256,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = token_buckets(max_num_tokens)
        device = kv_cache.device
        size = self.buckets[-1]  # also the most requests a step can have
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.token_req_index = torch.zeros(size, dtype=torch.int32, device=device)
        self.token_context_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device)
        self.previous_hidden = (  # [size, hidden] for the MTP module, else None
            torch.zeros(size, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=device)
            if isinstance(model, MTPModule)
            else None
        )
        # bucket → (graph or None, hidden [b, H], logits [b, V])
        self._outputs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor, torch.Tensor]] = {}
        self.pool = None  # the graphs' memory pool, once captured (`specsplit.drafter.later_steps` captures into it)
        if capture:
            self._capture()

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def can_run(self, attn: AttentionMetadata) -> bool:
        return (
            attn.use_kernel
            and self.bucket_for(attn.num_tokens) is not None
            and attn.block_tables.shape[1] <= self.max_blocks
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        previous_hidden: torch.Tensor | None = None,  # [T, H], the MTP module's second input
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden [T, H], logits [T, V] float32 of every row
        if (previous_hidden is None) != (self.previous_hidden is None):
            raise ValueError("previous_hidden is the MTP module's input, and only its")
        if not self.can_run(attn):
            raise ValueError(f"a step of {attn.num_tokens} tokens does not fit the CUDA graph buckets")
        num_tokens = attn.num_tokens
        bucket = self.bucket_for(num_tokens)
        self._fill(input_ids, positions, attn, bucket)
        if previous_hidden is not None:
            self.previous_hidden[:num_tokens].copy_(previous_hidden, non_blocking=True)
        if bucket in self._outputs:
            graph, hidden, logits = self._outputs[bucket]
            graph.replay()
        else:
            hidden, logits = self._forward(bucket)
        # logits: None on a tensor-parallel follower (gathered to the first rank only)
        return hidden[:num_tokens], None if logits is None else logits[:num_tokens]

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, bucket: int) -> None:
        """The step's inputs into the static buffers: one multi-tensor copy per dtype (a launch each, not
        one per buffer), then the block tables; the padding rows only when the bucket has any."""
        n, (num_reqs, width) = attn.num_tokens, attn.block_tables.shape
        torch._foreach_copy_(
            [self.input_ids[:n], self.positions[:n], self.slot_mapping[:n]],
            [input_ids, positions, attn.slot_mapping],
            non_blocking=True,
        )
        torch._foreach_copy_(
            [self.token_req_index[:n], self.token_context_lens[:n]],
            [attn.token_req_index, attn.token_context_lens],
            non_blocking=True,
        )
        if n < bucket:
            self.slot_mapping[n:bucket].fill_(-1)
            self.token_context_lens[n:bucket].fill_(0)
        # Entries right of `width` and rows below `num_reqs` are stale but never read (context lengths).
        self.block_tables[:num_reqs, :width].copy_(attn.block_tables, non_blocking=True)

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """Static metadata of a bucket: views of the buffers, the kernel path (host lists unused)."""
        return AttentionMetadata(
            query_start_loc=self.token_req_index[:0],  # not read by the kernel path
            seq_lens=self.token_context_lens[:0],  # not read by the kernel path
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:bucket],
            token_req_index=self.token_req_index[:bucket],
            token_context_lens=self.token_context_lens[:bucket],
            block_size=self.kv_cache.block_size,
            use_kernel=True,
        )

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions, attn = self.input_ids[:bucket], self.positions[:bucket], self._metadata(bucket)
        if self.previous_hidden is None:
            hidden = self.model(ids, positions, self.kv_cache, attn)
        else:
            hidden = self.model(ids, self.previous_hidden[:bucket], positions, self.kv_cache, attn)
        return hidden, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        if self.kv_cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and cache on a CUDA device")
        self.slot_mapping.fill_(-1)  # warm-up and capture runs write nothing and read nothing
        self.token_context_lens.fill_(0)
        pool = self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        for bucket in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool memory
            with torch.cuda.stream(side):
                self._forward(bucket)  # compiles the Triton kernels, moves RoPE tables; not captured
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool):
                hidden, logits = self._forward(bucket)
            self._outputs[bucket] = (graph, hidden, logits)
        torch.cuda.synchronize()


def resolve_step_path(
    model: TargetModel | MTPModule,
    kv_cache: PagedKVCache,
    attention_kernel: bool | None,
    cuda_graphs: bool | None,
    max_model_len: int,
    max_num_tokens: int,
) -> tuple[bool, CudaGraphRunner | None]:
    """The runners' options → (use the Triton paged attention, the graph runner or None).

    None means "by device": the kernel on CUDA for models that support it, graphs on CUDA with the
    kernel for models that support them. Asking for graphs without the kernel is an error, and so is
    asking for them for a model that cannot be captured (`supports_cuda_graphs`)."""
    on_cuda = kv_cache.device.type == "cuda"
    kernel = model.supports_attention_kernel and (on_cuda if attention_kernel is None else attention_kernel)
    if cuda_graphs is None:
        cuda_graphs = on_cuda and kernel and model.supports_cuda_graphs
    elif cuda_graphs and not kernel:
        raise ValueError("CUDA graphs need the attention kernel (and a model that supports it)")
    elif cuda_graphs and not model.supports_cuda_graphs:
        raise ValueError(f"{type(model).__name__} cannot run in CUDA graphs (its forward syncs with the host)")
    graphs = (
        CudaGraphRunner(model, kv_cache, max_model_len=max_model_len, max_num_tokens=max_num_tokens)
        if cuda_graphs
        else None
    )
    return kernel, graphs
