"""One iteration in one process: schedule → verify (target forward + rejection sampling) → propose →
post_step.

This is the iteration the three services split across processes, over the same workers: the
coordinator's `Scheduler` (schedule, post_step) and wire form, the verifier's `VerifierWorker` (held
drafts, input batch, target forward and rejection sampling) and the drafter's `DrafterRunner` (the MTP
steps). The services are adapters over them (gRPC, sockets, spans); here they are called directly. As in
the services (async scheduling), the scheduler leaves draft placeholders in `spec_token_ids` and the
verifier's worker fills them with the drafts it holds from the previous iteration's propose. Tests,
benchmarks and `specsplit.LLM` run it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specsplit.coordinator.iteration import StepUpdate, VerifyResult
from specsplit.coordinator.scheduler import Scheduler
from specsplit.coordinator.wire import verify_request
from specsplit.drafter.device_propose import can_propose_on_device
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.drafter.servicer import SEED_MASK, propose_response
from specsplit.results import TokenLogprobs
from specsplit.transport.base import DeviceTokens
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.worker import VerifierWorker


@dataclass
class IterationTiming:
    """Where one iteration's time went, nanoseconds (wall clock)."""

    schedule_ns: int
    verify_ns: int  # the verifier's side: held drafts, input batch, step (on a device hand-off: its launch)
    prepare_ns: int
    forward_ns: int
    sample_ns: int  # 0 on a device hand-off: the drafter's step 0 waits for the verifier's device work
    propose_ns: int  # the drafter's side (on a device hand-off: with the verifier's finish)
    step0_ns: int
    later_steps_ns: int
    post_step_ns: int
    iteration_ns: int


class EngineCore:
    """The verifier's worker and the drafter's runner driven by a scheduler, one iteration per `step()`.

    `drafter`: None for target-only decoding (no drafts). `device_hand_off`: as the services do for
    greedy decode steps that want drafts, the drafter's MTP steps are queued behind the verifier's step
    on the device before its tokens reach the host (`specsplit/drafter/device_propose.py`)."""

    def __init__(self, verifier: VerifierWorker, drafter: DrafterRunner | None, *, device_hand_off: bool = True):
        self.verifier = verifier
        self.drafter = drafter  # replaceable, e.g. by a forced-acceptance wrapper in benchmarks
        self.device_hand_off = device_hand_off

    def step(self, scheduler: Scheduler) -> tuple[list[StepUpdate], IterationTiming]:
        t0 = time.time_ns()
        output = scheduler.schedule()
        t1 = time.time_ns()
        self.free(output.finished_request_ids)
        # The coordinator's message, as the services send it.
        request = verify_request(output, "in-process", scheduler.eos_token_ids)
        batch, launched, unfilled = self.verifier.launch(request)  # with the previous propose's drafts
        scheduler.choose_ahead(output)  # while the device runs the step (adaptive speculation's next choice)
        drafter = self.drafter
        if not output.proposes:
            drafter = None  # no request wants drafts (adaptive speculation chose none): no Propose
        items = self._device_items(batch) if drafter is not None and launched is not None else None
        if items is not None:  # the drafter's steps queued behind the verifier's, as the services do
            t_verified = time.time_ns()
            tokens = DeviceTokens(launched.sampled, launched.num_sampled)
            proposal = drafter.propose(items, launched.hidden[: batch.query_start[-1]], tokens)
            step = self.verifier.finish(batch, launched, with_rows=False)  # done: the drafter waited for it
            sample_ns = 0
        else:
            step = self.verifier.finish(batch, launched, with_rows=drafter is not None)  # rows: the Propose's
            t_verified, sample_ns = time.time_ns(), step.sample_ns
            proposal = None
            if drafter is not None and batch.num_reqs:
                items = [
                    ProposeItem(
                        rid,
                        step.start_positions[i],
                        step.next_token_ids[i],
                        batch.num_spec_tokens[i],
                        r.sampling.temperature,
                        r.sampling.seed & SEED_MASK,
                    )
                    for i, (rid, r) in enumerate(zip(batch.req_ids, request.requests))
                ]
                proposal = drafter.propose(items, step.hidden_states)
        if proposal is not None:
            probs = None
            if any(p is not None for p in proposal.draft_probs):  # sampled drafts: q in the wire form held drafts keep
                response = propose_response(items, proposal, 0)
                probs = [d.draft_probs if d.HasField("draft_probs") else None for d in response.drafts]
            self.verifier.keep(batch, step, proposal.drafts, probs)
        logprobs = step.logprobs or [None] * batch.num_reqs
        results = [
            VerifyResult(
                rid,
                step.sampled_token_ids[i],
                step.num_rejected[i] + unfilled[i],
                batch.num_draft_tokens[i],
                None if lps is None else TokenLogprobs.of_tokens(step.sampled_token_ids[i], lps) or [],
            )
            for i, (rid, lps) in enumerate(zip(batch.req_ids, logprobs))
        ]
        t2 = time.time_ns()
        updates = scheduler.update_from_output(output, results, drafter_ok=self.drafter is not None)
        t3 = time.time_ns()
        later_steps_ns = proposal.later_steps_ns if proposal is not None else 0
        num_later_steps = output.num_later_steps if proposal is not None else 0
        scheduler.record_iteration(output, (t3 - t0) / 1e9, proposal is not None, num_later_steps, later_steps_ns / 1e9)
        timing = IterationTiming(
            schedule_ns=t1 - t0,
            verify_ns=t_verified - t1,
            prepare_ns=step.prepare_ns,
            forward_ns=step.forward_ns,
            sample_ns=sample_ns,
            propose_ns=t2 - t_verified,
            step0_ns=proposal.step0_ns if proposal is not None else 0,
            later_steps_ns=proposal.later_steps_ns if proposal is not None else 0,
            post_step_ns=t3 - t2,
            iteration_ns=t3 - t0,
        )
        return updates, timing

    def _device_items(self, batch: InputBatch) -> list[ProposeItem] | None:
        """The drafter's items of a device hand-off where the services would make one (greedy decode
        steps that want drafts), else None."""
        rows = batch.hand_off_rows() if self.device_hand_off else None
        if rows is None:
            return None
        items = [
            ProposeItem(rid, batch.num_computed_tokens[i], [], batch.num_spec_tokens[i], num_rows=rows[i])
            for i, rid in enumerate(batch.req_ids)
        ]
        return items if can_propose_on_device(self.drafter, items) else None

    def free(self, request_ids: list[str]) -> None:
        self.verifier.free(request_ids)
        if self.drafter is not None:
            self.drafter.free(request_ids)
