"""The coordinator's loop, the one iteration every engine runs: schedule → the verifier's step (→ propose, inside
it) → post_step, over a verifier handle: the services' `RpcVerifier` (`verify_stream.py`: the persistent
VerifyStream) or one process's `specsplit.engine.local.LocalVerifier`. Nothing else calls `schedule()` or
`update_from_output()`.

One iteration is in flight at a time.

Outputs are pushed to per-request asyncio queues that the Generate handlers stream from. Post_step
updates the request state at once (the next schedule needs it) but streams the outputs (detokenize,
stop strings, queue puts) only after the next iteration's request is on its way, while the verifier
works: client-facing work off the critical path.

The verifier is the only peer: if a Verify fails, the iteration's effect is unknown, so every running
request is re-prefilled from the tokens held here — nothing the client already received is lost or
repeated.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from specsplit.client.errors import SpecsplitError, Unavailable
from specsplit.client.results import SpecStats, TokenLogprobs
from specsplit.coordinator import observability as obs
from specsplit.coordinator.acceptance import AcceptanceMonitor
from specsplit.coordinator.detokenizer import IncrementalDetokenizer
from specsplit.coordinator.iteration import IterationTiming, SchedulerOutput, StepUpdate
from specsplit.coordinator.request import Request
from specsplit.coordinator.scheduler import Scheduler

log = logging.getLogger(__name__)
MAX_INTERNAL_RETRIES = 3  # consecutive failed iterations after which INTERNAL fails the batch


@dataclass
class RequestOutput:
    """One streamed delta of a request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: SpecsplitError | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids, when the request asked


class _Stream:
    def __init__(
        self, request: Request, detokenizer: IncrementalDetokenizer | None, queue: asyncio.Queue[RequestOutput]
    ):
        self.request = request
        self.detokenizer = detokenizer
        self.queue = queue


class Engine:
    """`scheduler`'s requests run over `verifier` (a handle: `async send(output)`, `async receive()` ->
    VerifyOutcome, `close()`; a failed iteration raises grpc.RpcError with its status). `tokenizer` None: outputs
    carry token ids only, no text."""

    def __init__(self, scheduler: Scheduler, verifier, tokenizer, *, verifier_unavailable_s: float = 30.0):
        self.scheduler = scheduler
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.verifier_unavailable_s = verifier_unavailable_s
        self.totals = SpecStats()
        self.num_finished = 0
        self.num_iterations = 0
        self._streams: dict[str, _Stream] = {}
        self._pending: list[StepUpdate] = []  # outputs of the last iteration, streamed once the next is sent
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failing_since: float | None = None
        self._num_failures = 0
        # The last iteration's span: the next one links to it (the drafts' hop).
        self._previous_iteration: trace.SpanContext | None = None
        self.acceptance = AcceptanceMonitor()
        # Whether the last iteration sent a Propose, and its drafter steps after step 0 (the next one waits for it).
        self._previous_propose = (False, 0)
        # Where the time of recent iterations went (GetStats with include_iterations; benchmarks).
        self.iteration_timings: collections.deque[IterationTiming] = collections.deque(maxlen=4096)
        obs.observe_queue(scheduler)

    # ---- public API used by the servicer ---------------------------------------------------------
    def add_request(
        self, request: Request, queue: asyncio.Queue[RequestOutput] | None = None
    ) -> asyncio.Queue[RequestOutput]:
        """Queues `request`; its outputs go to `queue` (one several requests can share: each output names its
        request) or to a new one; returns that queue."""
        self.scheduler.add_request(request)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling.stop)
        stream = _Stream(request, detokenizer, asyncio.Queue() if queue is None else queue)
        self._streams[request.request_id] = stream
        self._wake()
        return stream.queue

    def abort(self, request_id: str) -> bool:
        """Aborts a request; it leaves the batch before the next iteration."""
        found = self.scheduler.finish_request(request_id, "abort")
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._finish_stream(stream, "abort")
        self._wake()
        return found

    def _wake(self) -> None:
        self._wakeup.set()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.verifier.close()

    # ---- loop --------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work():
                self.flush_outputs()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not await self.step():
                await asyncio.sleep(0.001)  # everything waits for KV blocks; let aborts land

    async def step(self) -> bool:
        """One iteration: schedule → the verifier's step → post_step; the previous iteration's outputs are streamed
        once this one is sent, this one's are held until the next is (or `flush_outputs`). False when nothing could
        be scheduled. The loop (`start`) runs it; a benchmark may run it a counted number of times instead."""
        t_schedule = time.time_ns()
        output = self.scheduler.schedule()
        t_scheduled = time.time_ns()
        if not output.scheduled and not output.finished_request_ids and not output.cache_commands:
            self.flush_outputs()
            return False
        span = obs.start_iteration_span(output, self._previous_iteration, t_schedule)
        obs.record_draft_choice(output)
        self._previous_iteration = span.get_span_context()
        outputs, self._pending = self._pending, []
        try:
            with trace.use_span(span, end_on_exit=True):
                obs.tracer.start_span("schedule", start_time=t_schedule).end(end_time=t_scheduled)
                self._pending = await self._iteration(output, span, t_schedule, outputs)
        except grpc.RpcError as err:
            await self._on_verify_error(output, err)
        finally:
            obs.iteration_duration.record((time.time_ns() - t_schedule) / 1e9)
        return True

    def flush_outputs(self) -> None:
        """Streams the outputs of the last iteration still held."""
        self._pending = self._stream_outputs(self._pending)

    async def _iteration(
        self, output: SchedulerOutput, span: trace.Span, t_schedule: int, outputs: list[StepUpdate]
    ) -> list[StepUpdate]:
        """Runs one iteration; streams `outputs` (the previous one's) once its request is sent; returns
        this iteration's outputs, still to be streamed."""
        with obs.tracer.start_as_current_span("verify", kind=SpanKind.CLIENT):
            t_sent = time.time_ns()
            try:
                await self.verifier.send(output)
            finally:  # also when the send failed: these tokens are the client's either way
                self._stream_outputs(outputs)
            self.scheduler.choose_ahead(output)  # while the verifier and drafter run it
            response = await self.verifier.receive()
            t_received = time.time_ns()
        self._failing_since = None
        self._num_failures = 0
        self.num_iterations += 1
        with obs.tracer.start_as_current_span("post_step"):
            results = response.results
            try:
                updates = self.scheduler.update_from_output(output, results, response.drafter_ok)
                if response.drafter_error:
                    self.scheduler.drafter_failed()
            except SpecsplitError as err:
                log.error("bad verifier response: %s; re-prefilling", err)
                self.scheduler.reset_all()
                return []
            self.acceptance.record(*obs.record_verify(span, output, results, response))
        # The iteration waited for the previous iteration's Propose, whose drafts it verified (async scheduling): its
        # cost is that wait, of which the drafter reports the later steps' part.
        seconds = (time.time_ns() - t_schedule) / 1e9
        proposed, later_steps = self._previous_propose
        timing = response.timing
        later_s, propose_s = timing.later_steps_ns / 1e9, (timing.drafts_wait_ns - timing.later_steps_ns) / 1e9
        self.scheduler.record_iteration(output, seconds, proposed, later_steps, later_s, propose_s)
        self._previous_propose = (output.proposes, output.num_later_steps)
        self.iteration_timings.append(
            IterationTiming(
                iteration=output.iteration,
                batch_size=len(output.scheduled),
                num_draft_tokens=sum(s.num_draft_tokens for s in output.scheduled),
                schedule_start_ns=t_schedule,
                verify_sent_ns=t_sent,
                verify_received_ns=t_received,
                post_step_end_ns=time.time_ns(),
                verifier=response.timing,
            )
        )
        return updates

    def _stream_outputs(self, updates: list[StepUpdate]) -> list[StepUpdate]:
        """Streams post_step's outputs to the Generate handlers; returns the empty pending list."""
        if updates:
            with obs.tracer.start_as_current_span("stream_outputs"):
                emitted = 0
                for update in updates:
                    emitted += self._emit(update.request, update.new_token_ids, update.finished, update.new_logprobs)
                obs.record_generated_tokens(emitted)  # once per iteration, not per request
        return []

    def _emit(
        self, request: Request, new_token_ids: list[int], finished: bool, logprobs: list[TokenLogprobs] | None = None
    ) -> int:
        """Puts a request's new tokens (and text) on its stream's queue; returns how many tokens went out."""
        stream = self._streams.get(request.request_id)
        if stream is None:
            return 0
        if request.first_token_time is None and new_token_ids:
            request.first_token_time = time.monotonic()
            obs.record_first_token(request)
        text_ids = new_token_ids
        if finished and new_token_ids and new_token_ids[-1] in request.sampling.stop_token_ids:
            text_ids = new_token_ids[:-1]  # a stop token's text is not output (vLLM's behaviour too)
        text, detokenizer = "", stream.detokenizer
        if detokenizer is not None:
            text = detokenizer.add_tokens(text_ids)
            if detokenizer.stopped and not finished:
                self.scheduler.finish_request(request.request_id, "stop")
                finished = True
            if finished:
                text += detokenizer.flush()
        stream.queue.put_nowait(RequestOutput(request.request_id, new_token_ids, text, logprobs=logprobs))
        if finished:
            self._streams.pop(request.request_id, None)
            self._finish_stream(stream, request.finish_reason or "stop")
        return len(new_token_ids)

    def _finish_stream(self, stream: _Stream, reason: str) -> None:
        self.totals.merge(stream.request.stats)
        self.num_finished += 1
        stream.queue.put_nowait(RequestOutput(stream.request.request_id, [], "", finish_reason=reason))

    async def _on_verify_error(self, output: SchedulerOutput, err: grpc.RpcError) -> None:
        code = err.code()
        log.warning("Verify failed (%s: %s); re-prefilling running requests", code.name, err.details())
        # INVALID_ARGUMENT: the verifier refused the batch, and would again. INTERNAL: a verifier going away (a
        # stream cut by its shutdown) says so too; retried as UNAVAILABLE is, it counts as a refusal only when it
        # comes back MAX_INTERNAL_RETRIES times in a row. A refused batch fails only the request the verifier
        # refuses alone: the scheduler runs the others apart until it is found.
        refused = code == grpc.StatusCode.INVALID_ARGUMENT
        if refused or (code == grpc.StatusCode.INTERNAL and self._num_failures >= MAX_INTERNAL_RETRIES):
            request_ids = [item.request.request_id for item in output.scheduled]
            for request_id in self.scheduler.isolate(request_ids):
                self._fail(request_id, SpecsplitError(f"verifier: {err.details()}", code))
            if len(request_ids) > 1:
                log.warning(
                    "scheduling the %d requests of the refused batch apart, to fail only the one refused",
                    len(request_ids),
                )
        if refused:  # the verifier answered: it is there, nothing to wait for
            self.scheduler.reset_all()
            return
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        self.scheduler.reset_all()  # the iteration's effect is unknown: recompute from held tokens
        self._num_failures += 1
        backoff = min(1.0, 0.05 * 2 ** min(self._num_failures, 5))
        for request_id, stream in list(self._streams.items()):
            deadline = stream.request.deadline
            # Give up on a request when its deadline falls before the verifier could answer again, or when the
            # verifier has been unreachable for verifier_unavailable_s while the request waited: an outage that
            # began before it arrived (the engine idle meanwhile) counts from its arrival.
            down_for = now - max(self._failing_since, stream.request.arrival_time)
            if down_for > self.verifier_unavailable_s or (deadline is not None and deadline - now < backoff + 0.25):
                self._fail(
                    request_id,
                    Unavailable(
                        f"verifier unreachable for {down_for:.1f}s ({code.name}: {err.details()}); "
                        "the request was aborted before its deadline"
                    ),
                )
        await asyncio.sleep(backoff)

    def _fail(self, request_id: str, error: SpecsplitError) -> None:
        self.scheduler.finish_request(request_id, "error")
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(RequestOutput(request_id, [], "", finish_reason="error", error=error))


def _log_crash(task: asyncio.Task) -> None:
    """The engine loop ends only when stopped; anything else is a bug, logged with its traceback."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("the engine loop crashed; no request will make progress", exc_info=task.exception())
