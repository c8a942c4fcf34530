"""The drafter's later steps (1..k-1) of a greedy propose as one CUDA graph: each step's inputs, its MTP forward, the
draft's pick (argmax, then a draft vocabulary's id) and the next step's inputs, all on the device.

Step by step (`DrafterRunner._propose`'s loop) the host launches every later step itself: a graph replay, the copies
into its static buffers, the device hand-off's shift, the argmax and the id map, about a dozen launches per step. At
batch 1 the step's kernels take about 0.3 ms (a 16,384-id draft vocabulary) and the host's launches between them left
the GPU idle for about as long (benchmarks/results/draft_vocab.md). Here the host copies the inputs once and replays one
graph for all S later steps, whose inputs one kernel works out from step 0's plan
(`specsplit/kernels/draft_step_inputs.py`):

- a row (a request that drafts) takes later step s while s <= its `steps` (its more_steps, as capped by the MTP cache);
  past them its step writes no KV (slot -1) and reads none (context 0), and its drafts are dropped on the host;
- its context is step 0's cache entries plus s, its position its last token's plus s, both moved by the device
  hand-off's `shift` (num_sampled - rows, ≤ 0: `device_propose.py`); its KV slot comes from step 0's block tables;
- its input token is the draft the step before picked, its previous hidden state that step's output.

The same steps, the same kernels and buckets as the step-by-step graphs: the drafts equal theirs (tests compare them,
on the CPU through `capture=False`, which runs the same static-buffer code eagerly). One graph per (bucket of rows, S),
in the step graphs' memory pool: S = 1 and 2 (k 2 and 3, the coordinator's default) for every bucket with the runner,
any other S for a bucket the first time a propose needs it (about 10 ms, once per process).
"""

from __future__ import annotations

import logging
import time

import torch

from specsplit.drafter.sampling import to_ids
from specsplit.kernels.draft_step_inputs import step_inputs
from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache
from specsplit.models.mtp import MTPModule
from specsplit.runtime.cuda_graphs import CudaGraphRunner

log = logging.getLogger(__name__)
CAPTURED_WITH_THE_RUNNER = 2  # the most later steps whose graphs are captured at start (k 3, the default)


class LaterStepsGraphs:
    def __init__(
        self,
        mtp: MTPModule,
        kv_cache: PagedKVCache,
        step_graphs: CudaGraphRunner,  # step 0's: its buckets, block-table width and memory pool are shared
        column_ids,  # () -> [N] int64 draft vocabulary ids on the device, or None (every id)
    ) -> None:
        self.mtp = mtp
        self.kv_cache = kv_cache
        self.step_graphs = step_graphs
        self.column_ids = column_ids
        self.capture = step_graphs.pool is not None
        self.buckets = step_graphs.buckets
        self.max_blocks = step_graphs.max_blocks
        size, device = self.buckets[-1], kv_cache.device
        self.tokens = torch.zeros(size, dtype=torch.int64, device=device)  # step 1's input: step 0's drafts
        self.hidden = torch.zeros(size, mtp.config.hidden_size, dtype=mtp.embed_tokens.weight.dtype, device=device)
        self.last_positions = torch.zeros(size, dtype=torch.int64, device=device)  # of each row's last token
        self.shift = torch.zeros(size, dtype=torch.int64, device=device)
        self.req_rows = torch.zeros(size, dtype=torch.int32, device=device)  # each row's row of the block tables
        self.context = torch.zeros(size, dtype=torch.int32, device=device)  # step 0's cache entries
        self.steps = torch.zeros(size, dtype=torch.int32, device=device)  # later steps of each row; padding 0
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, S) → drafts
        if self.capture:
            t0 = time.perf_counter()
            for num_steps in range(1, CAPTURED_WITH_THE_RUNNER + 1):
                for bucket in reversed(self.buckets):
                    self._graphs[bucket, num_steps] = self._capture(bucket, num_steps)
            log.info("drafter: %d later-steps graphs captured in %.1f s", len(self._graphs), time.perf_counter() - t0)

    def can_run(self, num_rows: int, num_reqs: int, table_width: int) -> bool:
        top = self.buckets[-1]
        return num_rows <= top and num_reqs <= top and table_width <= self.max_blocks

    def run(
        self,
        tokens: torch.Tensor,  # [n] int64 step 0's drafts
        hidden: torch.Tensor,  # [n, H] step 0's outputs of those rows
        last_positions: torch.Tensor,  # [n] int64 position of each row's last token (its x_{p+1})
        req_rows: torch.Tensor,  # [n] int32 each row's request: its row of `block_tables`
        context: torch.Tensor,  # [n] int32 each row's request's cache entries after step 0
        steps: torch.Tensor,  # [n] int32 later steps of each row (≥ 0)
        block_tables: torch.Tensor,  # [num_reqs, width] int32 step 0's
        shift: torch.Tensor | None,  # [n] int64 ≤ 0 (a device hand-off), or None
        num_steps: int,  # S: the most later steps of any row
    ) -> torch.Tensor:  # [S, n] int64 the drafts of steps 1..S, row by row (past a row's `steps`: dropped)
        n = tokens.shape[0]
        bucket = next(b for b in self.buckets if b >= n)
        num_reqs, width = block_tables.shape
        torch._foreach_copy_([self.tokens[:n], self.last_positions[:n]], [tokens, last_positions], non_blocking=True)
        torch._foreach_copy_(
            [self.req_rows[:n], self.context[:n], self.steps[:n]], [req_rows, context, steps], non_blocking=True
        )
        self.hidden[:n].copy_(hidden, non_blocking=True)
        if shift is None:
            self.shift[:n].zero_()
        else:
            self.shift[:n].copy_(shift, non_blocking=True)
        if n < bucket:
            self.steps[n:bucket].zero_()
        self.block_tables[:num_reqs, :width].copy_(block_tables, non_blocking=True)
        key = (bucket, num_steps)
        if not self.capture:
            return self._forward(bucket, num_steps)[:, :n]
        if key not in self._graphs:
            t0 = time.perf_counter()
            self._graphs[key] = self._capture(bucket, num_steps)
            log.info(
                "drafter: later-steps graph of %d rows, %d steps in %.0f ms",
                bucket,
                num_steps,
                1e3 * (time.perf_counter() - t0),
            )
        graph, drafts = self._graphs[key]
        graph.replay()
        return drafts[:, :n]

    def _forward(self, bucket: int, num_steps: int) -> torch.Tensor:  # [S, bucket] int64
        size = self.kv_cache.block_size
        tokens, hidden, req_rows = self.tokens[:bucket], self.hidden[:bucket], self.req_rows[:bucket]
        context, slots, positions = step_inputs(  # [S, bucket] each, one launch
            self.context[:bucket],
            self.shift[:bucket],
            self.last_positions[:bucket],
            self.steps[:bucket],
            req_rows,
            self.block_tables,
            size,
            num_steps,
        )
        drafts = torch.empty(num_steps, bucket, dtype=torch.int64, device=tokens.device)
        for s in range(num_steps):
            attn = AttentionMetadata(
                query_start_loc=req_rows[:0],  # not read by the kernel path
                seq_lens=req_rows[:0],
                block_tables=self.block_tables,
                slot_mapping=slots[s],
                token_req_index=req_rows,
                token_context_lens=context[s],
                block_size=size,
                use_kernel=True,
            )
            hidden = self.mtp(tokens, hidden, positions[s], self.kv_cache, attn)
            tokens = to_ids(self.mtp.compute_logits(hidden).argmax(dim=-1), self.column_ids())
            drafts[s] = tokens
        return drafts

    @torch.inference_mode()
    def _capture(self, bucket: int, num_steps: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Captured with every row's `steps` at 0 for the warm-up and the capture: they write and read no KV."""
        saved = self.steps[:bucket].clone()
        self.steps[:bucket].zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(bucket, num_steps)  # not captured: first launches of this bucket's shapes
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.step_graphs.pool):
            drafts = self._forward(bucket, num_steps)
        self.steps[:bucket].copy_(saved)
        return graph, drafts
