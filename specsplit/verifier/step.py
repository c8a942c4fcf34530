"""The verifier's side of one iteration, over a drafter handle: the last Propose's drafts waited for, the step
launched with them, this step's Propose sent (before the step finishes on a device hand-off, after it otherwise),
the step finished, and the Propose's drafts kept for the next iteration when it is answered.

The verifier's servicer runs it on its step thread with the gRPC / socket drafter handle
(`drafter_channel.DrafterChannel`); one process (`specsplit.engine`) runs it with a drafter handle over the drafter's
runner. Nothing else orders launch, propose, finish and keep.

A drafter handle has `device_plan(iteration, launched, sampling)` (a device hand-off's Propose, or None where the
step does not qualify), `build_request(iteration, batch, step, sampling)` (the Propose of a finished step),
`send(plan, context, on_answer, parent)` (returns a pending Propose whose `proposal` is set, and `on_answer` called
with it, once it is answered or failed), `wait(pending)` (blocks until then; returns the Proposal) and
`free`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specsplit.runtime.slow_steps import SlowStepWatch
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.runner import StepOutput
from specsplit.verifier.worker import EarlyStep, VerifierWorker


@dataclass
class StepResult:
    """One step: its batch, output and unfilled placeholders per request, the Proposal whose drafts it verified
    (None when it waited for none), and when the wait for those drafts began and ended (Unix ns)."""

    batch: InputBatch
    step: StepOutput
    unfilled: list[int]
    previous: Proposal | None
    wait_start_ns: int
    wait_end_ns: int
    early: EarlyStep | None  # the step planned while the drafts were on their way


@dataclass
class HeldStep:
    """What the step keeps while its Propose runs (the Propose's context): its batch, and the step once finished (a
    device hand-off sends the Propose before; an answer that comes first, or a failed send, waits here for it)."""

    batch: InputBatch
    step: StepOutput | None = None
    answered: object = None  # the pending Propose answered before the step finished

    def finished(self, step: StepOutput, keep) -> StepOutput:
        self.step = step
        if self.answered is not None:
            keep(self.answered)
        return step


def sampling_of(request) -> list:
    return [r.sampling for r in request.requests]


class VerifierStep:
    """`worker`'s steps, each with the Propose of the one before it in flight (async scheduling), over `drafter`
    (None: no drafter, target-only). `begin(request)`, when given, runs first in every step (the servicer's
    iteration-order check); `claim()` before every launch (the servicer's switch of the GPU to this process)."""

    def __init__(
        self,
        worker: VerifierWorker,
        drafter,
        *,
        slow_steps: SlowStepWatch | None = None,
        begin: Callable[[object], None] | None = None,
        claim: Callable[[], None] | None = None,
    ):
        self.worker = worker
        self.drafter = drafter
        self.slow_steps = slow_steps or SlowStepWatch("verifier", 0)
        self._begin_hook = begin
        self._claim = claim
        self.proposing = None  # the Propose still running: its drafts go to the worker's held drafts once answered

    def use_drafter(self, drafter) -> None:
        """`drafter` (None: none, target-only) from the next step on; the Propose still running on the last one is
        not waited for (its requests get no held drafts)."""
        self.drafter, self.proposing = drafter, None

    def free(self, request_ids) -> None:
        ids = list(request_ids)
        self.worker.free(ids)
        if self.drafter is not None:
            self.drafter.free(ids)

    def run(self, request, parent=None) -> StepResult:
        """One step of `request` (a VerifyBatch): the last Propose's drafts waited for (not by an iteration
        that only frees), the step, this step's Propose sent. `parent`: the trace context of the Propose's span."""
        earlier, self.proposing = self.proposing, None
        w0 = time.time_ns()
        early = None
        waited = earlier is not None and bool(request.requests)
        if waited:
            early = self._plan_early(request)  # while the drafts are on their way
            self.drafter.wait(earlier)
        w1 = time.time_ns()
        batch, launched, unfilled = self._launch(request, early)
        sampling = sampling_of(request)
        drafter, worker = self.drafter, self.worker
        plan = None
        if drafter is not None and launched is not None:
            plan = drafter.device_plan(request.iteration, launched, sampling)
        if plan is not None:  # a device hand-off: the Propose goes before the step is done
            held = HeldStep(batch)
            self.proposing = drafter.send(plan, held, self._keep_answered, parent)
            with self.slow_steps.watch("step"):
                step = held.finished(worker.finish(batch, launched, with_rows=False), self._keep_answered)
        else:
            # No drafter, or nobody wants drafts (adaptive speculation chose none): no Propose, so no hidden-state
            # rows either.
            no_propose = drafter is None or (
                bool(request.requests) and all(r.sample and not r.num_spec_tokens for r in request.requests)
            )
            with self.slow_steps.watch("step"):
                step = worker.finish(batch, launched, with_rows=not no_propose)
            if not no_propose:
                plan = drafter.build_request(request.iteration, batch, step, sampling)
                self.proposing = drafter.send(plan, HeldStep(batch, step), self._keep_answered, parent)
        previous = earlier.proposal if waited else None
        return StepResult(batch, step, unfilled, previous, w0, w1, early)

    def _begin(self, request) -> None:
        """Once per step, first: the hook (order check), the prefix cache's registrations, finished requests freed,
        then its evictions and the requests starting on cached blocks (the drafter told of both)."""
        if self._begin_hook is not None:
            self._begin_hook(request)
        blocks = self.worker.cache_blocks(request)
        if blocks and self.drafter is not None:
            self.drafter.cache_blocks(blocks)
        self.free(request.finished_request_ids)
        prefixes = self.worker.start_cached(request)
        if prefixes and self.drafter is not None:
            self.drafter.start_cached(prefixes)

    def _plan_early(self, request) -> EarlyStep:
        """While the drafts are still on their way: the step begun and planned ahead (`VerifierWorker.plan_early`).
        Never raises, so the drafts are always read first: an error of the step's beginning is raised by the step."""
        try:
            self._begin(request)
        except Exception as err:  # noqa: BLE001 (raised by the step, after the drafts are read)
            return EarlyStep(error=err, planned_ns=time.time_ns())
        return self.worker.plan_early(request)

    def _launch(self, request, early: EarlyStep | None):
        """The step of `request` queued on the device (`VerifierWorker.launch`); `early`: what `_plan_early` made
        of it, None when the step begins now."""
        # The drafter is done with the GPU (its drafts are in) but its context may still hold it: the switch
        # starts now and overlaps what is left to do on the host. Not earlier: it would preempt the drafter.
        if self._claim is not None:
            self._claim()
        if early is None:
            self._begin(request)
        elif early.error is not None:
            raise early.error
        with self.slow_steps.watch("step"):
            return self.worker.launch(request, early)

    def _keep_answered(self, pending) -> None:
        """A Propose is answered (or failed): its drafts are held for the next step (a device hand-off's once its
        step is finished)."""
        held: HeldStep = pending.context
        if held.step is None:
            held.answered = pending
            return
        proposal = pending.proposal
        self.worker.keep(held.batch, held.step, proposal.drafts, proposal.draft_probs)
