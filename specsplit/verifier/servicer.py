"""Verifier gRPC servicer: the adapter of the verifier's worker (`worker.py`) to the coordinator's stream and the
drafter channel: protobuf in → worker (held drafts, input batch, step) → drafter channel → protobuf out.

Async scheduling (the only mode): the response goes back as soon as the tokens are
sampled and the Propose runs on; its drafts are held (`held_drafts.py`) for the next Verify, which
waits for that Propose before its step. The coordinator's post_step, schedule and
both hops then overlap the drafter instead of following it.

One control plane: the step thread waits for the last Propose, steps and sends this step's, through
the drafter channel (`drafter_channel.py`: a co-located drafter's socket or pooled drafters);
the event loop decodes, prepares the channel, and encodes.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind

from specsplit.client.errors import FailedPrecondition, SpecsplitError
from specsplit.proto import common_pb2, verifier_pb2, verifier_pb2_grpc
from specsplit.rpc.bidi_stream import until_draining
from specsplit.rpc.telemetry import LATENCY_BUCKETS_S, extract_trace_context, incoming_context
from specsplit.runtime.device import DeviceClaim, StepThread
from specsplit.runtime.slow_steps import SlowStepWatch
from specsplit.verifier.batch import VerifyBatch
from specsplit.verifier.drafter_channel import DrafterChannel
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.runner import StepOutput
from specsplit.verifier.step import VerifierStep
from specsplit.verifier.wire import verify_batch, verify_response
from specsplit.verifier.worker import VerifierWorker

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specsplit.verifier")
meter = metrics.get_meter("specsplit.verifier")
verify_duration = meter.create_histogram(
    "specsplit.verifier.verify_duration", unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S
)
hidden_state_bytes = meter.create_counter("specsplit.verifier.hidden_state_bytes", unit="By")


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """Registered before the server starts; answers UNAVAILABLE until `ready()` (weights loaded)."""

    def __init__(self, drafter: DrafterChannel, device: str, slow_steps: SlowStepWatch | None = None):
        self.worker: VerifierWorker | None = None
        self.model_info: common_pb2.ModelInfo | None = None
        self.drafter = drafter
        self.slow_steps = slow_steps or SlowStepWatch("verifier", 0)  # `--slow-step-s`; 0: off
        self.device = device
        self._device_claim = DeviceClaim(device)  # the GPU switched to us while a step is planned
        # Model work runs on one thread: the GPU (or the CPU's cores) does one step at a time.
        self._steps = StepThread(device, "verifier-step")
        # One step at a time, together with handing its hidden states to the transport; the Propose
        # round trip runs outside it.
        self._lock = asyncio.Lock()
        self._coordinator_id: str | None = None  # whose requests the KV cache holds (the step thread's)
        # One coordinator per verifier: the one whose stream (or socket connection) is open holds the verifier;
        # another is refused until that stream closes (`_claim`). Event loop only: stream task -> coordinator id.
        self._lease: str | None = None
        self._streams: dict[asyncio.Task, str] = {}
        self.draining = asyncio.Event()
        self._last_iteration = 0
        self.step: VerifierStep | None = None  # the worker's steps over the drafter (`step.py`)

    def ready(self, worker: VerifierWorker, model_info: common_pb2.ModelInfo) -> None:
        self.step = VerifierStep(
            worker, self.drafter, slow_steps=self.slow_steps, begin=self._check_order, claim=self._device_claim.claim
        )
        self.worker = worker
        self.model_info = model_info

    async def _require_ready(self, context) -> None:
        if self.worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier is loading its weights")

    def _check_order(self, request: VerifyBatch) -> None:
        """Iterations of one coordinator arrive in order; a new coordinator starts afresh."""
        if request.coordinator_id != self._coordinator_id:
            if self._coordinator_id is not None:
                log.warning("new coordinator %r: dropping the KV cache of every request", request.coordinator_id)
                self.worker.free_all()
            self._coordinator_id = request.coordinator_id
            self._last_iteration = 0
        if request.iteration <= self._last_iteration:
            raise FailedPrecondition(
                f"iteration {request.iteration} arrived after iteration {self._last_iteration}; "
                "iterations of a coordinator must strictly increase"
            )
        self._last_iteration = request.iteration

    async def VerifyStream(self, request_iterator, context):
        await self._require_ready(context)
        async for request in until_draining(request_iterator, self.draining):
            try:
                yield await self._verify(request, self._parent(request, context), "stream")
            except SpecsplitError as err:
                await context.abort(err.code, err.message)

    async def handle_stream_request(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        """One message of a VerifyStream on the verifier's Unix socket (`LocalStreamServer`)."""
        if self.worker is None:
            raise SpecsplitError("verifier is loading its weights", grpc.StatusCode.UNAVAILABLE)
        return await self._verify(request, extract_trace_context(request.trace_context), "local")

    def drain(self) -> None:
        """SIGTERM: persistent streams end at their next idle moment instead of holding the grace period."""
        self.draining.set()

    @staticmethod
    def _parent(request: verifier_pb2.VerifyRequest, context):
        """The caller's trace context: per message on streams, else from the call's metadata."""
        if request.trace_context:
            return extract_trace_context(request.trace_context)
        return incoming_context(context.invocation_metadata())

    def _claim(self, coordinator_id: str) -> None:
        """Event loop, for each message: the verifier is this coordinator's unless another one holds it, i.e.
        still has a stream (a gRPC VerifyStream or a socket connection, each its own task) open to it. A second
        coordinator would otherwise make the verifier drop every KV cache at each switch between the two."""
        task = asyncio.current_task()
        holder = self._holder(besides=task)
        if holder not in (None, coordinator_id):
            raise FailedPrecondition(
                f"this verifier serves coordinator {holder!r}, whose stream is open; one coordinator per verifier: "
                "stop that one first, or give this one a verifier of its own"
            )
        self._lease = coordinator_id
        if task not in self._streams:
            task.add_done_callback(lambda done: self._streams.pop(done, None))
        self._streams[task] = coordinator_id

    def _holder(self, besides: asyncio.Task | None = None) -> str | None:
        """The coordinator holding this verifier: the last one to claim it, while a stream of it (other than
        `besides`) is open; None when none is."""
        held = any(cid == self._lease and not t.done() for t, cid in self._streams.items() if t is not besides)
        return self._lease if held else None

    async def _verify(self, request: verifier_pb2.VerifyRequest, parent, rpc: str) -> verifier_pb2.VerifyResponse:
        """One iteration that came by `rpc` (stream or local); raises SpecsplitError with the
        status the caller should get."""
        received_ns = time.time_ns()
        self._claim(request.coordinator_id)
        attrs = {
            "specsplit.iteration": request.iteration,
            "specsplit.batch_size": len(request.requests),
            "specsplit.verifier_rpc": rpc,
        }
        with tracer.start_as_current_span("Verify", context=parent, kind=SpanKind.SERVER, attributes=attrs) as span:
            span.set_attribute("specsplit.proposer", self.drafter.name)
            batch, step, unfilled, proposal, drafts_wait_ns = await self._verify_and_propose(
                verify_batch(request), received_ns
            )
            if proposal is not None:
                span.set_attribute("specsplit.drafter_ok", proposal.ok)
            verify_duration.record((time.time_ns() - step.stamps_ns[0]) / 1e9)
        response = verify_response(batch, step, proposal or Proposal(True, []), received_ns, unfilled)
        response.timing.drafts_wait_ns = drafts_wait_ns
        response.timing.replied_ns = time.time_ns()
        return response

    async def _verify_and_propose(self, request: VerifyBatch, received_ns: int):
        """The step thread waits for the last Propose, steps, and sends this step's (`VerifierStep.run`)."""
        parent = otel_context.get_current()  # the Verify span: the Propose's span goes under it
        async with self._lock:  # the step thread uses the drafter channel only inside calls made under it
            if self._coordinator_id not in (None, request.coordinator_id):  # taken over (`_check_order`):
                self.drafter.free_all()  # before the new one's requests are placed (its ids may be the old ones')
            await self.drafter.prepare([r.request_id for r in request.requests])
            result = await self._steps.run(self.step.run, request, parent)
            self._record()
        if result.previous is not None:
            w0, w1, early = result.wait_start_ns, result.wait_end_ns, result.early
            tracer.start_span("wait_for_drafts", start_time=w0).end(end_time=w1)
            attributes = {"specsplit.plan_used": early.used}
            tracer.start_span("plan_ahead", start_time=w0, attributes=attributes).end(end_time=early.planned_ns)
        self._step_spans(result.step)
        return result.batch, result.step, result.unfilled, result.previous, result.wait_end_ns - received_ns

    def _record(self) -> None:
        """Event loop: the Proposes answered meanwhile, in the hidden-state bytes metric."""
        for p in self.drafter.collect():
            hidden_state_bytes.add(p.nbytes)

    @staticmethod
    def _step_spans(step: StepOutput) -> None:
        t0, t1, t2, t3 = step.stamps_ns
        tracer.start_span("prepare_inputs", start_time=t0).end(end_time=t1)
        tracer.start_span("target_forward", start_time=t1).end(end_time=t2)
        tracer.start_span("rejection_sample", start_time=t2).end(end_time=t3)

    async def Free(self, request, context):
        await self._require_ready(context)
        async with self._lock:
            self.step.free(request.request_ids)
        return verifier_pb2.FreeResponse(num_free_blocks=self.worker.kv_cache.num_free_blocks)

    async def GetModelInfo(self, request, context):
        await self._require_ready(context)
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.model_info)
        info.coordinator_id = self._holder() or ""
        return info
