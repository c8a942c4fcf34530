"""The verifier's worker: its side of one iteration on its device, from the coordinator's message to the
sampled tokens, knowing nothing of gRPC.

The previous Propose's held drafts go into their placeholders (`held_drafts.py`), the input batch is planned
(ahead of the drafts when it can: `plan_early`) and uploaded, the target forward and rejection sampling are
queued (`launch`) and waited for (`finish`), and the drafts of this step's Propose are kept for the next
iteration (`keep`). The verifier's step (`step.py`: `VerifierStep.run`, which orders launch, propose, finish and
keep) drives it, on the servicer's step thread and in one process (`specsplit/engine/local.py`) alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specsplit.client.errors import FailedPrecondition, InvalidArgument
from specsplit.models.kv_cache import PagedKVCache
from specsplit.models.step_upload import StepUpload
from specsplit.runtime.grammar import Grammars
from specsplit.verifier.batch import DraftProbs, VerifyBatch
from specsplit.verifier.held_drafts import HeldDrafts
from specsplit.verifier.input_batch import (
    InputBatch,
    PlannedBatch,
    plan_input_batch,
    upload_input_batch,
    with_held_drafts,
)
from specsplit.verifier.logits_processors import LogitsOptions, LogitsPlan, TokenHistory, plan_logits
from specsplit.verifier.runner import LaunchedStep, Prepared, StepOutput, VerifierRunner


@dataclass
class EarlyStep:
    """A step planned before its held drafts are in (`VerifierWorker.plan_early`): its batch with placeholder
    drafts and its KV slots; or the error the step's beginning raised (the caller's, raised by the step); or
    nothing (the step plans then)."""

    planned: PlannedBatch | None = None
    prepared: Prepared | None = None
    error: Exception | None = None
    planned_ns: int = 0  # when the planning ended (the `plan_ahead` span)
    used: bool = False  # the step ran on this plan (False: it planned again, with the drafts that came)
    options: list[LogitsOptions | None] | None = None  # per request, its logits options (`_logits_plan`)


class VerifierWorker:
    """`runner` on `device` for a model of `vocab_size` and `max_model_len`, with the drafts held between
    iterations and one upload buffer reused step after step; `tokenizer_dir`: the checkpoint whose tokenizer
    structured output's grammars run over (None: structured output is refused)."""

    def __init__(self, runner: VerifierRunner, *, vocab_size: int, max_model_len: int, device: str, tokenizer_dir=None):
        self.runner = runner
        self.vocab_size, self.max_model_len, self.device = vocab_size, max_model_len, device
        self.held = HeldDrafts()
        self._upload = StepUpload(device)  # input batches' host→device copies, one pinned buffer
        # The tokens each request with penalties or a grammar ran, drafts included (`logits_processors.py`).
        self._histories: dict[str, TokenHistory] = {}
        self.grammars = Grammars(tokenizer_dir)

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.runner.kv_cache

    def free(self, request_ids) -> None:
        """Finished or aborted requests: their KV blocks and held drafts."""
        ids = list(request_ids)
        self.runner.free(ids)
        self.held.free(ids)
        self.grammars.free(ids)
        for rid in ids:
            self._histories.pop(rid, None)

    def free_all(self) -> None:
        """A new coordinator: every request's KV blocks and held drafts, and the prefix cache's blocks."""
        self.runner.free_all()
        self.kv_cache.forget_cached()
        self.held.clear()
        self._histories.clear()
        self.grammars.clear()

    def cache_blocks(self, request: VerifyBatch) -> list[tuple[str, int, bytes]]:
        """Prefix caching, before the step's frees: a reset forgets every cached block, then the registered blocks
        enter the cache (one without a block hash is for the drafter alone: it lost the block, which the verifier keeps
        cached). Returns the drafter's registrations (request id, block index, drafter key)."""
        cache = self.kv_cache
        if request.reset_prefix_cache:
            cache.forget_cached()
        for rid, index, block_hash, _ in request.registered_blocks:
            if block_hash and not cache.cache_block(rid, index, block_hash):
                raise FailedPrecondition(
                    f"request {rid!r}: cannot cache its block {index}: this verifier holds {cache.num_tokens(rid)} of "
                    "its tokens (restarted?); re-prefill"
                )
        return [(rid, index, key) for rid, index, _, key in request.registered_blocks if key]

    def start_cached(self, request: VerifyBatch) -> dict[str, tuple[list[bytes], int]]:
        """Prefix caching, after the step's frees: evicted blocks leave the cache, and each request admitted on cached
        blocks starts on them, their tokens its history. Returns, per such request, the drafter's keys of its blocks
        and where they end."""
        cache = self.kv_cache
        if request.evicted_block_hashes:
            cache.evict(request.evicted_block_hashes)
        prefixes = {}
        for r in request.requests:
            hashes = r.cached_block_hashes
            if not hashes:
                continue
            rid, n, nc = r.request_id, len(hashes), r.num_computed_tokens
            if n * cache.block_size != nc or len(r.cached_token_ids) != nc or len(r.drafter_block_hashes) not in (0, n):
                raise InvalidArgument(
                    f"request {rid!r}: {n} cached_block_hashes of {cache.block_size}-token blocks, "
                    f"{len(r.drafter_block_hashes)} drafter_block_hashes and {len(r.cached_token_ids)} "
                    f"cached_token_ids do not make num_computed_tokens {nc}"
                )
            if cache.has(rid):  # the coordinator starts it afresh on its cached blocks
                self.runner.free([rid])
            if not cache.attach(rid, hashes):
                raise FailedPrecondition(
                    f"request {rid!r}: {n - cache.cached_prefix(hashes)} of its {n} cached blocks are not in this "
                    "verifier's prefix cache (restarted?); re-prefill"
                )
            self.runner.held_by(rid)
            self._histories[rid] = TokenHistory(r.cached_token_ids)
            if r.drafter_block_hashes:
                prefixes[rid] = (r.drafter_block_hashes, nc)
        return prefixes

    def plan_early(self, request: VerifyBatch) -> EarlyStep:
        """While the drafts are still on their way: the step's batch planned with placeholder drafts and its KV
        slots allocated, all on the host (a co-located drafter is using the GPU), so that only the drafts, the
        uploads and the launch are left once they are in. Never raises: anything that fails here is left to the
        step, which plans with the real drafts (and meets it again if it was no placeholder's)."""
        try:
            planned = plan_input_batch(
                request,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                num_cached_tokens=self.kv_cache.num_tokens,
                placeholders=HeldDrafts.placeholders(request),
            )
            prepared = self.runner.prepare(planned.req_ids, planned.num_computed_tokens, planned.num_new_tokens)
            options = [LogitsOptions.of(r.sampling) for r in request.requests]
        except Exception:  # noqa: BLE001 (e.g. no KV room for every placeholder: the step plans with the real drafts)
            return EarlyStep(planned_ns=time.time_ns())
        return EarlyStep(planned, prepared, planned_ns=time.time_ns(), options=options)

    def launch(
        self, request: VerifyBatch, early: EarlyStep | None = None
    ) -> tuple[InputBatch, LaunchedStep | None, list[int]]:
        """The step of `request` with its held drafts filled in (on `early`'s plan when the drafts that came fit
        it), queued on the device: the batch, the launched step (None for a batch without requests, an iteration
        that only frees) and, per request, how many of its placeholders stayed unfilled. Raises SpecsplitError
        naming the first bad field of the message."""
        filled: list[list[int]] = []
        unfilled = self.held.fill(request, filled)
        planned = early.planned if early is not None else None
        if planned is not None:
            planned = with_held_drafts(planned, filled, self.vocab_size)  # None: fewer drafts came than planned
            early.used = planned is not None
        if planned is None:
            planned = plan_input_batch(
                request,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                num_cached_tokens=self.kv_cache.num_tokens,
            )
        logits_plan, grammar_outputs = self._logits_plan(request, planned, early.options if early is not None else None)
        batch = upload_input_batch(planned, vocab_size=self.vocab_size, device=self.device, upload=self._upload)
        if not batch.num_reqs:
            return batch, None, unfilled
        prepared = early.prepared if early is not None else None
        launched = self.runner.launch(batch, prepared, logits_plan)
        launched.grammar_outputs = grammar_outputs or None
        return batch, launched, unfilled

    def _logits_plan(
        self, request: VerifyBatch, planned: PlannedBatch, options: list | None = None
    ) -> tuple[LogitsPlan | None, dict[int, list[int]]]:
        """The step's penalties, min_tokens, grammar masks and logprobs (None: no request uses any), with the history
        of each request with penalties or a grammar: its tokens up to its last one (the chunks of its prompt, then
        what each step ran and the next one's num_computed_tokens kept); and batch index -> each constrained request's
        output before the step. `options`: each request's `LogitsOptions`, when the early plan made them."""
        if options is None:
            options = [LogitsOptions.of(r.sampling) for r in request.requests]  # batch order is the message's
        if not any(options):
            return None, {}
        histories = {}
        for i, (r, o) in enumerate(zip(request.requests, options)):
            if o is None or not o.needs_history:
                continue
            nc, tokens = planned.num_computed_tokens[i], planned.token_ids[i]
            history = self._histories.get(r.request_id)
            if history is None:
                history = self._histories[r.request_id] = TokenHistory()
            if len(history) < nc:
                raise FailedPrecondition(
                    f"request {r.request_id!r}: num_computed_tokens {nc} but this verifier knows {len(history)} of its "
                    "tokens for its penalties (restarted?); re-prefill it"
                )
            # Kept with the drafts: the next step's num_computed_tokens says which of them were accepted.
            history.set(nc, tokens)
            histories[i] = history.view(len(history) - planned.num_draft_tokens[i])
        plan = plan_logits(
            planned.sampling_indices,
            planned.num_drafts,
            planned.token_ids,
            planned.num_computed_tokens,
            options,
            [r.num_prompt_tokens for r in request.requests],
            histories,
        )
        constrained = [r for r in plan.requests if r.options.grammar is not None] if plan is not None else []
        outputs = {r.index: r.history[r.num_prompt_tokens :] for r in constrained}  # views, no copies
        if constrained:

            def fill_masks():
                jobs = [
                    (request.requests[r.index].request_id, r.options.grammar, outputs[r.index], r.drafts)
                    for r in constrained
                ]
                # The output before num_computed_tokens is what earlier steps gave the matchers: only the rest is read.
                kept = [max(0, planned.num_computed_tokens[r.index] - r.num_prompt_tokens) for r in constrained]
                for r, masks in zip(constrained, self.grammars.batch_masks(jobs, kept)):
                    r.allowed = masks

            plan.fill_masks = fill_masks
        return plan, outputs

    def finish(self, batch: InputBatch, launched: LaunchedStep | None, with_rows: bool = True) -> StepOutput:
        """Waits for a launched step's sampled tokens (`with_rows=False`: without the drafter's hidden-state rows,
        which a device hand-off took on the device already)."""
        if launched is None:
            return self.runner.step(batch)  # no request: an empty output, nothing on the device
        step = self.runner.finish(launched, with_rows=with_rows)
        # What the drafter's grammar masks follow (`specsplit/drafter/runner.py`), the step's tokens after it.
        step.grammar_outputs = launched.grammar_outputs
        return step

    def keep(
        self,
        batch: InputBatch,
        step: StepOutput,
        drafts: list[list[int]],
        probs: list[DraftProbs | None] | None,
    ) -> None:
        """The Propose of `batch`'s step is answered: its drafts held for each request's next iteration (not for
        a request freed while the Propose ran)."""
        self.held.keep(batch, step, drafts, probs, self.kv_cache.num_tokens)
