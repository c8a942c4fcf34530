"""The drafter's later steps (1..k-1) of a propose as CUDA graphs: each step's inputs, its MTP forward, the draft's
pick (the argmax, or for sampled requests the race over q, `sampling.py`; then a draft vocabulary's id) and the next
step's inputs, all on the device; for an unconstrained propose one graph of every step.

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

A constrained propose (structured output) masks each step's logits with its rows' grammars before the pick, and the
masks of step s follow the drafts of step s - 1: the host fills them (`DrafterRunner._masked_later_steps`). Its
steps run as parts, each a graph: step s's forward, replayed before the host waits for the drafts before it, so that
the device runs it while the host fills its masks; then its pick, the masks copied in first (`masks`, one row per
row). Step by step instead, the host's launches, the hand-off's shift and the KV plan of every step came on top of the
masks, and the later steps of a constrained batch of 32 took 4.8-5.2 ms against 1.4 ms unconstrained on an H100
(docs/performance.md, "Structured output").

The same steps, the same kernels and buckets as the step-by-step graphs: the drafts (and q) equal theirs (tests compare
them, on the CPU through `capture=False`, which runs the same static-buffer code eagerly). Graphs per (bucket of
rows, S, greedy or sampled, masked), in the step graphs' memory pool: unmasked, S = 1 and 2 (k 2 and 3, the
coordinator's default) for every bucket with the runner, any other S for a bucket the first time a propose needs it
(11–88 ms on an H100 with the 7B shape, once per process); masked, each the first time a propose needs it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from specsplit.drafter.sampling import pick_drafts, to_ids
from specsplit.kernels.draft_step_inputs import step_inputs
from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache
from specsplit.models.mtp import MTPModule
from specsplit.runtime.cuda_graphs import CudaGraphRunner, capturing
from specsplit.runtime.grammar import apply_packed

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
        self.masks: torch.Tensor | None = None  # masked steps: [size, 1 + W] int32 (`_masks_of`)
        # (bucket, S, sampled, masked) → its graphs (`_capture`) and their state, whose "outputs" are the drafts
        # [S, bucket] and sampled q's ids and probs [S, bucket, K]
        self._graphs: dict[tuple[int, int, bool, bool], tuple[list[torch.cuda.CUDAGraph], dict]] = {}
        if self.capture:
            t0 = time.perf_counter()
            for num_steps in range(1, CAPTURED_WITH_THE_RUNNER + 1):
                for sampled in (False, True):
                    for bucket in reversed(step_graphs.buckets):
                        key = (bucket, num_steps, sampled, False)
                        self._graphs[key] = self._capture(*key)
            log.info("drafter: %d later-steps graphs captured in %.1f s", len(self._graphs), time.perf_counter() - t0)

    def can_run(self, num_rows: int, num_reqs: int, table_width: int) -> bool:
        top = self.step_graphs.buckets[-1]
        return num_rows <= top and num_reqs <= top and table_width <= self.step_graphs.max_blocks

    def start(
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
        words: int = 0,  # masked (a constrained propose): the int32 words of a grammar mask
    ) -> LaterStepsRun:
        """The inputs copied in; the steps then run by the returned run: `all` at once, or masked a part at a time
        (each step's forward, its masks filled on the host meanwhile, then its pick). Its `outputs` are the drafts of
        steps 1..S row by row ([S, n] int64; past a row's `steps` dropped by the caller), and with `sampling` q's ids
        and probabilities ([S, n, K] each)."""
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
        if words:
            self._masks_of(words)
        key = (bucket, num_steps, sampling is not None, bool(words))
        if not self.capture:
            return LaterStepsRun(self, n, *self._parts(*key))
        if key not in self._graphs:
            t0 = time.perf_counter()
            self._graphs[key] = self._capture(*key)
            log.info("drafter: later-steps graph %s in %.0f ms", key, 1e3 * (time.perf_counter() - t0))
        graphs, state = self._graphs[key]
        return LaterStepsRun(self, n, [graph.replay for graph in graphs], state)

    def _masks_of(self, words: int) -> None:
        """The masked steps' masks on the device, [rows, 1 + words] int32 (`apply_packed`'s layout: row r's mask is
        row r's), made at the first constrained propose."""
        if self.masks is None:
            size = self.step_graphs.buckets[-1]
            self.masks = torch.full((size, 1 + words), -1, dtype=torch.int32, device=self.tokens.device)
            self.masks[:, 0] = torch.arange(size, dtype=torch.int32, device=self.tokens.device)
        elif self.masks.shape[1] != 1 + words:
            raise ValueError(f"masks of {words} words; the drafter's tokenizer has {self.masks.shape[1] - 1}")

    def _parts(self, bucket: int, num_steps: int, sampled: bool, masked: bool) -> tuple[list[Callable], dict]:
        """The steps' work over `bucket` rows in the order it runs: step 1's inputs and forward, then step by step
        its pick (its masks applied first where `masked`: `self.masks`) and the next step's forward. Returns the
        parts and the state they pass on: its "drafts" [n] per step, and once the last pick ran its "outputs"."""
        size = self.kv_cache.block_size
        req_rows = self.req_rows[:bucket]
        state: dict = {"drafts": [], "q_ids": [], "q_probs": []}

        def forward(s: int) -> None:
            attn = AttentionMetadata(
                query_start_loc=req_rows[:0],  # not read by the kernel path
                seq_lens=req_rows[:0],
                block_tables=self.block_tables,
                slot_mapping=state["slots"][s],
                token_req_index=req_rows,
                token_context_lens=state["context"][s],
                block_size=size,
                use_kernel=True,
            )
            state["hidden"] = self.mtp(state["tokens"], state["hidden"], state["positions"][s], self.kv_cache, attn)
            state["logits"] = self.mtp.compute_logits(state["hidden"])

        def first() -> None:
            state["context"], state["slots"], state["positions"] = step_inputs(  # [S, bucket] each, one launch
                self.context[:bucket],
                self.shift[:bucket],
                self.last_positions[:bucket],
                self.steps[:bucket],
                req_rows,
                self.block_tables,
                size,
                num_steps,
            )
            state["tokens"], state["hidden"] = self.tokens[:bucket], self.hidden[:bucket]
            forward(0)

        def pick(s: int) -> None:
            logits = state.pop("logits")
            if masked:
                apply_packed(logits, self.masks[:bucket], self.column_ids)
            if sampled:  # a draft's noise counter: the position of the token before it (the step's input)
                step = pick_drafts(
                    logits,
                    self.temperature[:bucket],
                    self.seeds[:bucket],
                    state["positions"][s],
                    self.draft_top_k,
                    any_sampled=True,
                    column_ids=self.column_ids,
                    vocab_size=self.mtp.config.vocab_size,
                )
                state["tokens"] = step.tokens
                state["q_ids"].append(step.q_ids)
                state["q_probs"].append(step.q_probs)
            else:
                state["tokens"] = to_ids(logits.argmax(dim=-1), self.column_ids)
            state["drafts"].append(state["tokens"])
            if s + 1 == num_steps:
                kept = ("drafts", "q_ids", "q_probs") if sampled else ("drafts",)
                state["outputs"] = tuple(torch.stack(state[name]) for name in kept)

        parts = [first, functools.partial(pick, 0)]
        for s in range(1, num_steps):
            parts += [functools.partial(forward, s), functools.partial(pick, s)]
        return parts, state

    @torch.inference_mode()
    def _capture(self, bucket: int, num_steps: int, sampled: bool, masked: bool) -> tuple[list, dict]:
        """Captured with every row's `steps` at 0 for the warm-up and the capture: they write and read no KV. One
        graph of every part, or masked one per part (the host fills each step's masks between them)."""
        saved = self.steps[:bucket].clone()
        self.steps[:bucket].zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for part in self._parts(bucket, num_steps, sampled, masked)[0]:
                part()  # not captured: first launches of this bucket's shapes
        torch.cuda.current_stream().wait_stream(side)
        parts, state = self._parts(bucket, num_steps, sampled, masked)
        groups = [[part] for part in parts] if masked else [parts]
        graphs = []
        for group in groups:
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.step_graphs.pool):
                for part in group:
                    part()
            graphs.append(graph)
        self.steps[:bucket].copy_(saved)
        return graphs, state


class LaterStepsRun:
    """One propose's later steps (`LaterStepsGraphs.start`): `all` of them, or masked one part at a time: step s's
    `forward`, then, its masks filled on the host, its `pick`. `parts`: step 1's inputs and forward, its pick, then
    per later step its forward and pick; graph replays, or on the CPU the parts themselves."""

    def __init__(self, graphs: LaterStepsGraphs, n: int, parts: list[Callable], state: dict):
        self.graphs, self.n, self.parts, self.state = graphs, n, parts, state

    def all(self) -> None:
        for part in self.parts:
            part()

    def forward(self, s: int) -> None:
        """Step s's forward queued (s from 0: the first later step)."""
        self.parts[2 * s]()

    def pick(self, s: int, words: torch.Tensor) -> None:
        """Step s's drafts picked under `words` ([n, W] int32, pinned on a GPU: row r's mask, all ones for a row
        left unmasked), copied without a wait: the host writes `words` again only once a later copy is done."""
        self.graphs.masks[: self.n, 1:].copy_(words, non_blocking=True)
        self.parts[2 * s + 1]()

    def drafts(self, s: int) -> torch.Tensor:
        """[n] int64 step s's drafts (on the device; valid once its pick is queued)."""
        return self.state["drafts"][s][: self.n]

    def outputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t[:, : self.n] for t in self.state["outputs"])
