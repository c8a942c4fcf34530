"""The drafter's later steps (1..k-1) of an unconstrained propose as one CUDA graph: each step's inputs, its MTP
forward, the draft's pick (the argmax, or for sampled requests the race over q, `sampling.py`; then a draft vocabulary's
id) and the next step's inputs, all on the device.

Step by step (`DrafterRunner._propose`'s loop) the host launches every later step itself: a graph replay, the copies
into its static buffers, the device hand-off's shift, the pick and the id map, about a dozen launches per step. At
batch 1 the step's kernels take about 0.3 ms (a 16,384-id draft vocabulary) and the host's launches between them left
the GPU idle for about as long (benchmarks/results/draft_vocab.md). Here the host copies the inputs once and replays one
graph for all S later steps, whose inputs one kernel works out from step 0's plan
(`specsplit/kernels/draft_step_inputs.py`):

- a row (a request that drafts) takes later step s while s <= its `steps` (its more_steps, as capped by the MTP cache);
  past them its step writes no KV (slot -1) and reads none (context 0), and its drafts are dropped on the host;
- its context is step 0's cache entries plus s, its position its last token's plus s, both moved by the device
  hand-off's `shift` (num_sampled - rows, ≤ 0: `device_propose.py`); its KV slot comes from step 0's block tables;
- its input token is the draft the step before picked, its previous hidden state that step's output;
- a sampled row's noise counter is its position (the verifier's row that scores the draft), its temperature and seed
  step 0's.

The same steps, the same kernels and buckets as the step-by-step graphs: the drafts (and q) equal theirs (tests compare
them, on the CPU through `capture=False`, which runs the same static-buffer code eagerly). One graph per (bucket of
rows, S, greedy or sampled), in the step graphs' memory pool: S = 1 and 2 (k 2 and 3, the coordinator's default) for
every bucket with the runner, any other S for a bucket the first time a propose needs it (11–88 ms on an H100 with
the 7B shape, once per process).
"""

from __future__ import annotations

import logging
import time

import torch

from specsplit.drafter.sampling import pick_drafts, to_ids
from specsplit.kernels.draft_step_inputs import step_inputs
from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache
from specsplit.models.mtp import MTPModule
from specsplit.runtime.cuda_graphs import CudaGraphRunner, capturing

log = logging.getLogger(__name__)
CAPTURED_WITH_THE_RUNNER = 2  # the most later steps whose graphs (greedy and sampled) are captured at start (k 3)


class LaterStepsGraphs:
    def __init__(
        self,
        mtp: MTPModule,
        kv_cache: PagedKVCache,
        step_graphs: CudaGraphRunner,  # step 0's: its buckets, block-table width and memory pool are shared
        column_ids: torch.Tensor | None,  # [N] int64 a draft vocabulary's ids (rewritten in place at a swap), or None
        draft_top_k: int,  # sampled drafts: q's support (`sampling.py`)
    ) -> None:
        self.mtp = mtp
        self.kv_cache = kv_cache
        self.step_graphs = step_graphs
        self.column_ids = column_ids
        self.draft_top_k = draft_top_k
        self.capture = step_graphs.pool is not None
        size, device = step_graphs.buckets[-1], kv_cache.device
        self.tokens = torch.zeros(size, dtype=torch.int64, device=device)  # step 1's input: step 0's drafts
        self.hidden = torch.zeros(size, mtp.config.hidden_size, dtype=mtp.embed_tokens.weight.dtype, device=device)
        self.last_positions = torch.zeros(size, dtype=torch.int64, device=device)  # of each row's last token
        self.shift = torch.zeros(size, dtype=torch.int64, device=device)
        self.req_rows = torch.zeros(size, dtype=torch.int32, device=device)  # each row's row of the block tables
        self.context = torch.zeros(size, dtype=torch.int32, device=device)  # step 0's cache entries
        self.steps = torch.zeros(size, dtype=torch.int32, device=device)  # later steps of each row; padding 0
        self.block_tables = torch.zeros(size, step_graphs.max_blocks, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(size, dtype=torch.float32, device=device)  # sampled graphs: 0 = greedy row
        self.seeds = torch.zeros(size, dtype=torch.int64, device=device)  # sampled graphs: each row's noise seed
        # (bucket, S, sampled) → the graph and its outputs: drafts [S, bucket], sampled q's ids and probs [S, bucket, K]
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        if self.capture:
            t0 = time.perf_counter()
            for num_steps in range(1, CAPTURED_WITH_THE_RUNNER + 1):
                for sampled in (False, True):
                    for bucket in reversed(step_graphs.buckets):
                        key = (bucket, num_steps, sampled)
                        self._graphs[key] = self._capture(*key)
            log.info("drafter: %d later-steps graphs captured in %.1f s", len(self._graphs), time.perf_counter() - t0)

    def can_run(self, num_rows: int, num_reqs: int, table_width: int) -> bool:
        top = self.step_graphs.buckets[-1]
        return num_rows <= top and num_reqs <= top and table_width <= self.step_graphs.max_blocks

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
        sampling: tuple[torch.Tensor, torch.Tensor] | None,  # [n] float32 temperatures, [n] int64 seeds; None: greedy
        num_steps: int,  # S: the most later steps of any row
    ) -> tuple[torch.Tensor, ...]:
        """The drafts of steps 1..S row by row ([S, n] int64; past a row's `steps` dropped by the caller), and with
        `sampling` q's ids and probabilities ([S, n, K] each)."""
        n = tokens.shape[0]
        bucket = self.step_graphs.bucket_for(n)
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
        if sampling is not None:  # padding rows: greedy
            torch._foreach_copy_([self.temperature[:n], self.seeds[:n]], list(sampling), non_blocking=True)
            if n < bucket:
                self.temperature[n:bucket].zero_()
        key = (bucket, num_steps, sampling is not None)
        if not self.capture:
            return tuple(t[:, :n] for t in self._forward(*key))
        if key not in self._graphs:
            t0 = time.perf_counter()
            self._graphs[key] = self._capture(*key)
            log.info("drafter: later-steps graph %s in %.0f ms", key, 1e3 * (time.perf_counter() - t0))
        graph, outputs = self._graphs[key]
        graph.replay()
        return tuple(t[:, :n] for t in outputs)

    def _forward(self, bucket: int, num_steps: int, sampled: bool) -> tuple[torch.Tensor, ...]:
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
        drafts, q_ids, q_probs = [], [], []
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
            logits = self.mtp.compute_logits(hidden)
            if sampled:  # a draft's noise counter: the position of the token before it (the step's input)
                step = pick_drafts(
                    logits,
                    self.temperature[:bucket],
                    self.seeds[:bucket],
                    positions[s],
                    self.draft_top_k,
                    any_sampled=True,
                    column_ids=self.column_ids,
                    vocab_size=self.mtp.config.vocab_size,
                )
                tokens = step.tokens
                q_ids.append(step.q_ids)
                q_probs.append(step.q_probs)
            else:
                tokens = to_ids(logits.argmax(dim=-1), self.column_ids)
            drafts.append(tokens)
        return tuple(torch.stack(t) for t in ((drafts, q_ids, q_probs) if sampled else (drafts,)))

    @torch.inference_mode()
    def _capture(self, bucket: int, num_steps: int, sampled: bool) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """Captured with every row's `steps` at 0 for the warm-up and the capture: they write and read no KV."""
        saved = self.steps[:bucket].clone()
        self.steps[:bucket].zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(bucket, num_steps, sampled)  # not captured: first launches of this bucket's shapes
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.step_graphs.pool):
            outputs = self._forward(bucket, num_steps, sampled)
        self.steps[:bucket].copy_(saved)
        return graph, outputs
