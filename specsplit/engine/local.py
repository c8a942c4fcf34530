"""The two handles of one process: the coordinator's loop (`specsplit/coordinator/engine.py`) over a verifier
handle that runs the verifier's step (`specsplit/verifier/step.py`) in place, and that step over a drafter handle
that runs the drafter's runner in place. The services put gRPC (or a socket) at both seams instead
(`coordinator/verify_stream.RpcVerifier`, `verifier/drafter_channel.DrafterChannel`); the iteration is the same code.

As in the services, a step's Propose is not waited for by the step that sends it but by the next one, before its
launch (async scheduling): here that wait is where the Propose runs. A device hand-off's Propose runs where it is
sent instead, queued on the device behind the step it drafts after (its tokens never wait for their host copy): one
process has no other worker to run it meanwhile, and launching it later would leave the device idle while the host
schedules. Its time then falls in the iteration that sends it, not the next one (the cost the adaptive choice
records: alike while the choice holds still).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specsplit.client.errors import SpecsplitError
from specsplit.coordinator.iteration import SchedulerOutput, VerifierTiming, VerifyOutcome, VerifyResult
from specsplit.drafter.device_propose import can_propose_on_device
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.drafter.servicer import SEED_MASK
from specsplit.rpc.bidi_stream import StreamError
from specsplit.transport.base import DeviceTokens
from specsplit.verifier.batch import CachedPrefixes, DraftProbs, Sampling, VerifyBatch, VerifyItem
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.propose_request import SentOutputs
from specsplit.verifier.step import StepResult, VerifierStep

IN_PROCESS = "in-process"  # the coordinator id of one process's iterations


@dataclass
class _Plan:
    items: list[ProposeItem]
    hidden_states: object  # torch.Tensor: the rows, in item order
    device_tokens: DeviceTokens | None = None  # a device hand-off's


@dataclass
class _Pending:
    plan: _Plan
    context: object
    on_answer: object
    proposal: Proposal | None = None


class LocalDrafter:
    """A drafter handle over `runner` in this process. `device_hand_off`: greedy decode steps that want drafts
    propose from the step's tokens on the device (`specsplit/drafter/device_propose.py`)."""

    def __init__(self, runner: DrafterRunner, *, device_hand_off: bool = True):
        self.runner = runner
        self.device_hand_off = device_hand_off
        self._pending: list[_Pending] = []  # sent, in order, not run yet
        self._cached_prefixes = CachedPrefixes()
        self._outputs_sent = SentOutputs()  # structured output: as `DrafterChannel`'s

    def device_plan(self, iteration: int, launched, sampling) -> _Plan | None:
        batch = launched.batch
        rows = batch.hand_off_rows() if self.device_hand_off else None
        if rows is None:
            return None
        outputs = launched.grammar_outputs or {}  # constrained: the output before the step (`_add_step_tokens`)
        items = [
            ProposeItem(
                rid,
                batch.num_computed_tokens[i],
                [],
                batch.num_spec_tokens[i],
                num_rows=rows[i],
                grammar=sampling[i].grammar if i in outputs else None,
            )
            for i, rid in enumerate(batch.req_ids)
        ]
        self._take_cached_prefixes(items)
        self._add_outputs(items, outputs)
        if not can_propose_on_device(self.runner, items):
            return None
        tokens = DeviceTokens(launched.sampled, launched.num_sampled)
        return _Plan(items, launched.hidden[: batch.query_start[-1]], tokens)

    def build_request(self, iteration: int, batch, step, sampling) -> _Plan:
        outputs = step.grammar_outputs or {}  # constrained: the output before the step, then the step's tokens
        items = [
            ProposeItem(
                rid,
                step.start_positions[i],
                step.next_token_ids[i],
                batch.num_spec_tokens[i],
                sampling[i].temperature,
                (sampling[i].seed or 0) & SEED_MASK if sampling[i].temperature else 0,
                coupled=sampling[i].coupled,
                grammar=sampling[i].grammar if i in outputs else None,
            )
            for i, rid in enumerate(batch.req_ids)
        ]
        self._take_cached_prefixes(items)
        self._add_outputs(items, outputs, step.sampled_token_ids)
        return _Plan(items, step.hidden_states)

    def _add_outputs(self, items: list[ProposeItem], outputs: dict[int, list[int]], step_tokens=None) -> None:
        """Constrained items' output past what their earlier Proposes carried (`SentOutputs`)."""
        for i, output in outputs.items():
            item, tokens = items[i], step_tokens[i] if step_tokens is not None else ()
            item.output_offset, item.output = self._outputs_sent.tail(item.request_id, output, tokens)

    def _take_cached_prefixes(self, items: list[ProposeItem]) -> None:
        """The drafter's keys of the cached blocks requests started on, on each one's first Propose from there."""
        for item in items:
            item.cached_block_hashes = self._cached_prefixes.take(item.request_id, item.start_position)

    def cache_blocks(self, blocks: list[tuple[str, int, bytes]]) -> None:
        """Registrations go after the Proposes sent before them, as on a drafter's stream."""
        while self._pending:
            self._run(self._pending.pop(0))
        self.runner.cache_blocks(blocks)

    def start_cached(self, prefixes: dict[str, tuple[list[bytes], int]]) -> None:
        self._cached_prefixes.add(prefixes)

    def send(self, plan: _Plan, context, on_answer, parent=None) -> _Pending:
        pending = _Pending(plan, context, on_answer)
        self._pending.append(pending)
        if plan.device_tokens is not None:
            self.wait(pending)
        return pending

    def wait(self, pending: _Pending) -> Proposal:
        while pending.proposal is None:
            self._run(self._pending.pop(0))
        return pending.proposal

    def _run(self, pending: _Pending, needed: bool = True) -> None:
        """Runs `pending`'s Propose (`needed` False: every request of it was freed; it is answered without
        drafts) and hands its answer on."""
        items = pending.plan.items
        t0, sent_ns = time.perf_counter_ns(), time.time_ns()
        proposal = Proposal(True, [[] for _ in items], sent_ns=sent_ns, draft_probs=[None] * len(items))
        if needed:
            hidden, tokens = pending.plan.hidden_states, pending.plan.device_tokens
            out = self.runner.propose(items, hidden) if tokens is None else self.runner.propose(items, hidden, tokens)
            proposal.drafts = out.drafts
            proposal.step0_ns, proposal.later_steps_ns = out.step0_ns, out.later_steps_ns
            proposal.hidden_state_bytes = hidden.numel() * hidden.element_size()
            if out.draft_probs:  # sampled drafts' q
                proposal.draft_probs = [None if q is None else DraftProbs(*q) for q in out.draft_probs]
            self._outputs_sent.drop(items[i].request_id for i in out.outputs_wanted)  # next time: whole
        proposal.received_ns = time.time_ns()
        proposal.propose_ns = time.perf_counter_ns() - t0
        pending.proposal = proposal
        pending.on_answer(pending)

    def free(self, request_ids) -> None:
        """Frees go after the Proposes sent before them, as on a drafter's stream; a Propose of freed requests only
        is answered without running."""
        freed = set(request_ids)
        self._cached_prefixes.drop(freed)
        self._outputs_sent.drop(freed)
        while self._pending:
            pending = self._pending.pop(0)
            self._run(pending, needed=not all(item.request_id in freed for item in pending.plan.items))
        self.runner.free(list(request_ids))


class LocalVerifier:
    """A verifier handle over `step` in this process: `send` runs the iteration's step, `receive` returns it."""

    def __init__(self, step: VerifierStep, eos_token_ids: frozenset[int]):
        self.step = step
        self.eos_token_ids = eos_token_ids
        self._outcome: VerifyOutcome | Exception | None = None

    async def send(self, output: SchedulerOutput) -> None:
        received_ns = time.time_ns()
        request = verify_batch(output, self.eos_token_ids)
        try:
            self._outcome = _outcome(self.step.run(request), received_ns, self.step.drafter is not None)
        except SpecsplitError as err:  # a refused batch: the loop handles it as the services' status
            self._outcome = StreamError(err.code, err.message)

    async def receive(self) -> VerifyOutcome:
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def close(self) -> None:
        pass


def _outcome(result: StepResult, received_ns: int, has_drafter: bool) -> VerifyOutcome:
    batch, step, unfilled, proposal = result.batch, result.step, result.unfilled, result.previous
    logprobs = step.logprobs or [None] * batch.num_reqs
    results = [
        VerifyResult(
            rid,
            step.sampled_token_ids[i],
            step.num_rejected[i] + unfilled[i],
            batch.num_draft_tokens[i],
            lps,
        )
        for i, (rid, lps) in enumerate(zip(batch.req_ids, logprobs))
    ]
    timing = VerifierTiming(
        prepare_ns=step.prepare_ns,
        forward_ns=step.forward_ns,
        sample_ns=step.sample_ns,
        received_ns=received_ns,
        replied_ns=time.time_ns(),
        drafts_wait_ns=result.wait_end_ns - received_ns,
    )
    if proposal is None:
        return VerifyOutcome(results, drafter_ok=has_drafter, timing=timing)
    timing.propose_ns, timing.propose_sent_ns, timing.propose_received_ns = (
        proposal.propose_ns,
        proposal.sent_ns,
        proposal.received_ns,
    )
    timing.drafter_received_ns, timing.drafter_replied_ns = proposal.sent_ns, proposal.received_ns
    timing.step0_ns, timing.later_steps_ns = proposal.step0_ns, proposal.later_steps_ns
    return VerifyOutcome(results, proposal.ok, proposal.error, proposal.hidden_state_bytes, timing)


def verify_batch(output: SchedulerOutput, eos_token_ids) -> VerifyBatch:
    """The scheduler's output as the verifier's step takes it: draft placeholders as held drafts to fill."""
    items = []
    for s in output.scheduled:
        p, held = s.request.sampling, s.num_draft_tokens
        hashes, keys, tokens = s.cached_prefix
        sampling = Sampling(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            coupled=p.coupled,
            grammar=p.grammar,
            repetition_penalty=None if p.repetition_penalty == 1.0 else p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            min_tokens=p.min_tokens,
            end_token_ids=p.end_token_ids(eos_token_ids),
            logprobs=p.logprobs,
        )
        items.append(
            VerifyItem(
                request_id=s.request.request_id,
                num_computed_tokens=s.num_computed_tokens,
                token_ids=s.token_ids[: len(s.token_ids) - held],
                num_held_drafts=held,
                sample=s.sample,
                next_token_id=s.next_token_id,
                sampling=sampling,
                num_spec_tokens=s.num_spec_tokens,
                num_prompt_tokens=len(s.request.prompt_token_ids),
                cached_block_hashes=hashes,
                drafter_block_hashes=keys,
                cached_token_ids=tokens,
            )
        )
    commands = output.cache_commands
    return VerifyBatch(
        output.iteration,
        items,
        list(output.finished_request_ids),
        IN_PROCESS,
        commands.reset,
        commands.registered,
        commands.evicted,
    )
