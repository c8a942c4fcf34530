"""The verifier's model runner: roll back, target forward, rejection sampling, hidden states out.

One `step()` is one iteration for a batch. After it, each request's KV cache holds
`num_computed_tokens + len(token_ids)` tokens; the rejected tail is rolled back at the start of
the request's next step (the coordinator sends the new `num_computed_tokens`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specsplit.client.errors import ResourceExhausted
from specsplit.client.results import TokenLogprobs
from specsplit.kernels.rejection import rejection_sample
from specsplit.models.attention import use_kernel_for, use_precompiled_sdpa
from specsplit.models.kv_cache import AttentionMetadata, KVCacheFull, PagedKVCache, StepPlan
from specsplit.models.parallel import broadcast_from_first, tp_size
from specsplit.models.target import TargetModel
from specsplit.runtime.cuda_graphs import resolve_step_path
from specsplit.runtime.warm_up import warm_up_eager
from specsplit.verifier.forward_step import ForwardStep
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.logits_processors import LaunchedLogprobs, LogitsPlan, apply, logprobs_to_host, take_logprobs

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A step's KV side planned by `VerifierRunner.prepare` (slots allocated, host arrays; uploaded by
    the step), for the batch of these requests and counts."""

    req_ids: list[str]
    num_computed: list[int]
    num_new: list[int]
    plan: StepPlan
    use_kernel: bool

    def matches(self, batch: InputBatch) -> bool:
        return (
            self.req_ids == batch.req_ids
            and self.num_computed == batch.num_computed_tokens
            and self.num_new == batch.num_new_tokens
        )


@dataclass
class StepOutput:
    sampled_token_ids: list[list[int]]  # per request; empty for a non-final prefill chunk
    num_rejected: list[int]  # per request
    # What the drafter needs, per request: the first hidden-state row's position and the token
    # that follows each row; rows of all requests concatenated in `hidden_states`.
    start_positions: list[int]
    next_token_ids: list[list[int]]
    hidden_states: torch.Tensor  # [num_rows, hidden_size]
    # Wall-clock stamps (time.time_ns): start, inputs prepared, forward done, sampling done.
    stamps_ns: tuple[int, int, int, int] = (0, 0, 0, 0)
    # Per request, the target's log-probabilities of its sampled tokens (None: not asked; None for all: nobody).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Structured output: batch index -> the request's output before this step (its sampled tokens follow), for the
    # drafter's grammar masks.
    grammar_outputs: dict[int, list[int]] | None = None

    @property
    def prepare_ns(self) -> int:
        return self.stamps_ns[1] - self.stamps_ns[0]

    @property
    def forward_ns(self) -> int:
        return self.stamps_ns[2] - self.stamps_ns[1]

    @property
    def sample_ns(self) -> int:
        return self.stamps_ns[3] - self.stamps_ns[2]


class VerifierRunner:
    """`attention_kernel`: decode / verify steps run the Triton paged attention (default: on CUDA,
    for models that support it). `cuda_graphs`: those steps replay CUDA graphs (default: on CUDA with
    the kernel); `max_model_len` sizes the graphs' block tables. Prefill steps always run eagerly."""

    def __init__(
        self,
        model: TargetModel,
        kv_cache: PagedKVCache,
        sampler_backend: str = "auto",
        *,
        attention_kernel: bool | None = None,
        cuda_graphs: bool | None = None,
        max_model_len: int | None = None,
        max_graph_tokens: int = 512,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler_backend = sampler_backend
        self._request_ids: set[str] = set()  # requests holding KV blocks
        self.attention_kernel, self.graphs = resolve_step_path(
            model,
            kv_cache,
            attention_kernel,
            cuda_graphs,
            max_model_len or model.config.max_position_embeddings,
            max_graph_tokens,
        )
        use_precompiled_sdpa()  # eager steps: no per-shape cuDNN plan builds mid-run
        if kv_cache.device.type == "cuda":
            self._warm_up(sampler_backend)

    def _warm_up(self, sampler_backend: str) -> None:
        """Start-up, on CUDA: the sampler's kernel variants compiled and large eager steps run once, so no
        request waits for either (`specsplit.kernels.triton_rejection.warm_up`, `specsplit.runtime.warm_up`)."""
        model, cache = self.model, self.kv_cache
        if sampler_backend in ("auto", "triton"):
            from specsplit.kernels.triton_rejection import warm_up

            t0 = time.perf_counter()
            calls = warm_up(model.config.vocab_size, cache.device)
            log.info("rejection sampler: %d kernel variants warmed up in %.1f s", calls, time.perf_counter() - t0)
        steps, seconds = warm_up_eager(
            cache, lambda ids, pos, attn: model.compute_logits(model(ids, pos, cache, attn)[-1:])
        )
        log.info("verifier: %d eager warm-up steps in %.1f s", steps, seconds)

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.kv_cache.free(rid)
            self._request_ids.discard(rid)

    def free_all(self) -> None:
        self.free(list(self._request_ids))

    def held_by(self, request_id: str) -> None:
        """The request holds KV blocks now (started on cached ones), before any step of it."""
        self._request_ids.add(request_id)

    def prepare(self, req_ids: list[str], num_computed: list[int], num_new: list[int]) -> Prepared:
        """A step's KV cache side, on the host only: each request rolled back to `num_computed` tokens,
        then slots for its `num_new` tokens and the attention metadata's arrays. A step may be prepared
        while the previous Propose still runs on the GPU (`step(batch, prepared)`, which uploads the
        arrays); if the batch then differs, `step` prepares it again (the rollback undoes this one)."""
        cache = self.kv_cache
        for rid, nc in zip(req_ids, num_computed):
            if cache.has(rid):
                cache.truncate(rid, nc)
        self._request_ids.update(req_ids)
        try:
            seq_lens = [nc + n for nc, n in zip(num_computed, num_new)]
            graph_tokens = self.graphs.buckets[-1] if self.graphs is not None else 0
            use_kernel = use_kernel_for(self.attention_kernel, num_new, seq_lens, graph_tokens)
            plan = cache.plan_step(req_ids, num_new)
        except KVCacheFull as err:
            raise ResourceExhausted(f"verifier KV cache is full: {err}") from err
        plan.int32_arrays  # noqa: B018 (made now and kept: an early prepare flattens the block tables off the path)
        return Prepared(list(req_ids), list(num_computed), list(num_new), plan, use_kernel)

    @torch.inference_mode()
    def step(self, batch: InputBatch, prepared: Prepared | None = None) -> StepOutput:
        """One iteration; `prepared`: this batch's `prepare()` made ahead of time (off the critical
        path: the step's stamps then show no prepare time), or None to prepare now."""
        if batch.num_reqs == 0:  # an iteration that only frees finished requests
            t0 = time.time_ns()
            dtype = next(self.model.parameters()).dtype  # what the transport opened for: no reopening
            hidden = torch.empty(0, self.model.config.hidden_size, dtype=dtype, device=self.kv_cache.device)
            return StepOutput([], [], [], [], hidden, stamps_ns=(t0, t0, t0, t0))
        return self.finish(self.launch(batch, prepared))

    def launch(
        self, batch: InputBatch, prepared: Prepared | None = None, logits_plan: LogitsPlan | None = None
    ) -> LaunchedStep:
        """The step of a batch with requests, queued on the device: forward and rejection sampling,
        without waiting for them (`finish` does). A device hand-off sends the Propose in between.
        `logits_plan`: the requests' penalties, min_tokens and logprobs (`logits_processors.py`)."""
        t0 = time.time_ns()
        if prepared is None or not prepared.matches(batch):
            prepared = self.prepare(batch.req_ids, batch.num_computed_tokens, batch.num_new_tokens)
        if tp_size() > 1:  # the followers run the same forward (`follower.py`)
            broadcast_from_first(ForwardStep.of(batch, prepared.plan, prepared.use_kernel))
        attn = self.kv_cache.upload_step(prepared.plan, use_kernel=prepared.use_kernel)
        t1 = time.time_ns()
        hidden, logits = self.forward(batch.input_ids, batch.positions, attn, batch.logits_indices)
        t2 = time.time_ns()
        logprobs = None
        if logits_plan is not None:
            logprobs = take_logprobs(logits, logits_plan)  # the raw target's, before the processing
            apply(logits, logits_plan)
        out = rejection_sample(
            logits,
            batch.draft_token_ids,
            batch.cu_num_draft,
            batch.temperature,
            batch.top_k if batch.any_filter else None,
            batch.top_p if batch.any_filter else None,
            batch.seeds,
            batch.first_logits_positions,
            draft_probs=batch.draft_probs,
            backend=self.sampler_backend,
            max_num_draft=batch.max_num_draft,
            all_greedy=batch.all_greedy,
            coupled=batch.coupled,
        )
        chosen = None
        if logprobs is not None:
            chosen = logprobs.chosen(out.sampled, _sampling_slots(batch))
        return LaunchedStep(batch, hidden, out.sampled, out.num_sampled, (t0, t1, t2), logprobs, chosen)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [num_logits] int64: the rows the sampler reads
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # hidden [T, H], logits [num_logits, V] (None off rank 0)
        """The target forward of a step: a CUDA graph's replay where one fits, else eager."""
        if self.graphs is not None and self.graphs.can_run(attn):
            hidden, all_logits = self.graphs.run(input_ids, positions, attn)  # [T, H], [T, V]
            return hidden, None if all_logits is None else all_logits[logits_indices]
        hidden = self.model(input_ids, positions, self.kv_cache, attn)  # [T, H]
        return hidden, self.model.compute_logits(hidden[logits_indices])

    @staticmethod
    def finish(launched: LaunchedStep, with_rows: bool = True) -> StepOutput:
        """Waits for a launched step's sampled tokens: its output on the host. `with_rows=False`: without
        the drafter's hidden-state rows (a device hand-off sent them already). Picking them queues device
        work, which would wait for the drafter's turn on the GPU."""
        sampled, num_sampled = _to_host(launched.sampled, launched.num_sampled)
        t3 = time.time_ns()
        stamps = (*launched.stamps_ns, t3)
        step = step_output(launched.batch, sampled, num_sampled, launched.hidden, stamps, with_rows)
        if launched.logprobs is not None:
            batch = launched.batch
            slots = _sampling_slots(batch)
            step.logprobs = logprobs_to_host(
                launched.logprobs, launched.chosen, num_sampled, slots, batch.num_reqs, step.sampled_token_ids
            )
        return step


@dataclass
class LaunchedStep:
    """A step queued on the device (`VerifierRunner.launch`), before its host copy."""

    batch: InputBatch
    hidden: torch.Tensor  # [num_tokens, H] target hidden states of the step
    sampled: torch.Tensor  # [num_sampling, max_num_draft + 1] on the device, padding past num_sampled
    num_sampled: torch.Tensor  # [num_sampling] on the device
    stamps_ns: tuple[int, int, int]  # start, prepared, forward queued
    logprobs: LaunchedLogprobs | None = None  # of the requests that asked for log-probabilities
    chosen: torch.Tensor | None = None  # [rows of those requests] log-probability of the token each row emitted
    # Structured output: batch index -> a constrained request's output before this step (a device hand-off sends it
    # with the grammar; the drafter adds the step's tokens from the device).
    grammar_outputs: dict[int, list[int]] | None = None


def _sampling_slots(batch: InputBatch) -> dict[int, int]:
    """Batch index -> the request's row in the sampler's output (sampling requests only)."""
    return {i: j for j, i in enumerate(batch.sampling_indices)}


def step_output(
    batch: InputBatch,
    sampled: list[list[int]],  # [num_sampling][max_num_draft + 1] host copy of the sampler's output
    num_sampled: list[int],  # [num_sampling]
    hidden: torch.Tensor,  # [num_tokens, H] target hidden states of the step
    stamps_ns: tuple[int, int, int, int],
    with_rows: bool = True,
) -> StepOutput:
    """Per request: the sampled tokens, num_rejected, and the hidden-state rows (with the token
    following each) that the drafter needs (none, `hidden[:0]`, without `with_rows`)."""
    sampled_ids: list[list[int]] = [[] for _ in batch.req_ids]
    num_rejected = [0] * batch.num_reqs
    for j, i in enumerate(batch.sampling_indices):
        sampled_ids[i] = sampled[j][: num_sampled[j]]
        num_rejected[i] = batch.num_draft_tokens_per_req[j] + 1 - num_sampled[j]
    rows, start_positions, next_ids = [], [], []
    for i in range(batch.num_reqs):
        n, tokens, qs = batch.num_new_tokens[i], batch.token_ids[i], batch.query_start[i]
        if batch.sample[i]:
            # Prompt rows (if any), then the rows of the last token and accepted drafts.
            follow = tokens[1 : n - batch.num_draft_tokens[i]] + sampled_ids[i]
        else:
            follow = tokens[1:] + [batch.next_token_ids[i]]
        rows.extend(range(qs, qs + len(follow)))
        start_positions.append(batch.num_computed_tokens[i])
        next_ids.append(follow)
    if not with_rows:
        hidden_rows = hidden[:0]  # a view: no device work
    elif rows and rows[-1] - rows[0] == len(rows) - 1:  # one run of rows (always at batch 1): a copy, no index upload
        hidden_rows = hidden[rows[0] : rows[-1] + 1].clone()  # [rows, H]
    else:
        hidden_rows = hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=hidden.device))
    return StepOutput(
        sampled_ids,
        num_rejected,
        start_positions,
        next_ids,
        hidden_rows,
        stamps_ns=stamps_ns,
    )


def _to_host(sampled: torch.Tensor, num_sampled: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """The sampler's outputs as lists, with one wait for the device: both copies are queued first."""
    if sampled.is_cuda:
        stream = torch.cuda.current_stream(sampled.device)
        sampled, num_sampled = sampled.to("cpu", non_blocking=True), num_sampled.to("cpu", non_blocking=True)
        stream.synchronize()
    return sampled.tolist(), num_sampled.tolist()
