"""Drafter gRPC servicer: ProposeRequest → hidden states (by the configured transport) → propose() →
drafts, one message of a persistent ProposeStream per iteration.

A Propose is handled whole (parse, receive the rows, the MTP steps, the answer) on one thread: the
step thread for gRPC calls, or the own thread of a connection to the co-located drafter's socket
(`ThreadedLocalStreamServer`), which then writes the answer itself, with no event loop between the
request's bytes and the model. One lock keeps the model to one thread at a time.

Prefix caching: a Propose's `cached_blocks` are registered in the MTP cache first (`DrafterRunner.cache_blocks`), then
its finished requests are freed; an item's `cached_block_hashes` start a request the drafter has no history for on
its cached MTP KV. The drafter's queries and hits (in tokens) are served as vLLM's `vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits` with `worker="drafter"` on `--metrics-port` (prometheus_client's default registry)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import torch
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily

from specsplit.client.errors import InvalidArgument, SpecsplitError, Unavailable
from specsplit.drafter.runner import DrafterRunner, ProposeItem, ProposeOutput
from specsplit.proto import common_pb2, drafter_pb2, drafter_pb2_grpc
from specsplit.rpc.bidi_stream import until_draining
from specsplit.rpc.telemetry import LATENCY_BUCKETS_S, extract_trace_context
from specsplit.runtime.device import DeviceClaim, StepThread, use_device
from specsplit.runtime.slow_steps import SlowStepWatch
from specsplit.transport.base import HiddenStatesReceiver
from specsplit.transport.wire import dtype_from_proto, fill_tensor_protos, tensor_nbytes

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specsplit.drafter")
meter = metrics.get_meter("specsplit.drafter")
device_hand_offs = meter.create_counter(
    "specsplit.drafter.device_hand_offs", description="Proposes sent before the verifier's step finished"
)
propose_latency = meter.create_histogram(
    "specsplit.drafter.propose_latency",
    unit="s",
    description="Propose handling time, queueing included",
    explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
)


MAX_DRAFTS = 64  # bound on num_spec_tokens and num_rejected
SEED_MASK = 2**63 - 1
MAX_KEY_BYTES = 64  # bound on a cached block's key


class _PrefixCacheCounters:
    """vllm:prefix_cache_queries and vllm:prefix_cache_hits of this process's drafter (`worker="drafter"`), read
    from its runner at each scrape. Collected, not `Counter`s: a process that also holds the coordinator's series of
    these names (the in-process engine) registers no second family unless it serves a drafter."""

    def __init__(self):
        self.servicer: DrafterServicer | None = None

    def collect(self):
        servicer = self.servicer
        if servicer is None or servicer.runner is None:
            return
        runner, model = servicer.runner, servicer.model_info.model
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", runner.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", runner.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name", "worker"])
            counter.add_metric([model, "drafter"], value)
            yield counter


prefix_cache_counters = _PrefixCacheCounters()
REGISTRY.register(prefix_cache_counters)


def on_device(msg: drafter_pb2.ProposeRequest) -> bool:
    """Whether `msg` is a device hand-off: its sampled tokens are on the device (`device_propose.py`)."""
    return msg.WhichOneof("hidden") == "hidden_states_handle" and msg.hidden_states_handle.tokens_on_device


def parse_items(msg: drafter_pb2.ProposeRequest, vocab_size: int, block_size: int) -> list[ProposeItem]:
    """The request's items, validated; raises InvalidArgument naming the first bad field. `block_size`: the MTP
    cache's, which an item's cached_block_hashes cover (their tokens are its start_position).

    Every field is read once and checked in one expression (token ids by their min and max); the
    message saying what is wrong is worked out only for a bad item."""
    if on_device(msg):
        return _parse_device_items(msg, block_size)
    items, seen = [], set()
    for r in msg.requests:
        rid, start, tokens, spec = r.request_id, r.start_position, list(r.next_token_ids), r.num_spec_tokens
        sampling, keys = r.sampling, r.cached_block_hashes
        temperature = sampling.temperature
        if not (
            rid
            and rid not in seen
            and start >= 0
            and tokens
            and min(tokens) >= 0
            and max(tokens) < vocab_size
            and 0 <= r.num_rejected <= MAX_DRAFTS
            and 0 <= spec <= MAX_DRAFTS
            and 0 <= temperature <= 1e4
            and r.output_offset >= 0
            and (not keys or _keys_fit(keys, start, block_size))
            and r.num_rows == 0
        ):
            raise _invalid_item(r, seen, vocab_size, block_size)
        seen.add(rid)
        items.append(
            ProposeItem(
                rid, start, tokens, spec, temperature, sampling.seed & SEED_MASK, coupled=sampling.coupled,
                grammar=sampling.grammar or None, output=list(r.output_token_ids), output_offset=r.output_offset,
                cached_block_hashes=list(keys),
            )
        )  # fmt: skip
    return items


def _parse_device_items(msg: drafter_pb2.ProposeRequest, block_size: int) -> list[ProposeItem]:
    """A device hand-off's items: num_rows rows each (1..MAX_DRAFTS + 1, at most the handle's
    token_width), no next_token_ids and no num_rejected (the device has them). Checked in one expression per
    item, as `parse_items` does; the message saying what is wrong is worked out only for a bad item."""
    items, seen, width = [], set(), msg.hidden_states_handle.token_width
    max_rows = min(width, MAX_DRAFTS + 1)
    for r in msg.requests:
        rid, start, rows, spec, sampling = r.request_id, r.start_position, r.num_rows, r.num_spec_tokens, r.sampling
        keys = r.cached_block_hashes
        temperature = sampling.temperature
        if not (
            rid
            and rid not in seen
            and start >= 0
            and not r.next_token_ids
            and not r.num_rejected
            and 1 <= rows <= max_rows
            and 0 <= spec <= MAX_DRAFTS
            and 0 <= temperature <= 1e4
            and r.output_offset >= 0
            and (not keys or _keys_fit(keys, start, block_size))
        ):
            raise _invalid_device_item(r, seen, width, block_size)
        seen.add(rid)
        items.append(
            ProposeItem(
                rid, start, [], spec, temperature, sampling.seed & SEED_MASK, rows, coupled=sampling.coupled,
                grammar=sampling.grammar or None, output=list(r.output_token_ids), output_offset=r.output_offset,
                cached_block_hashes=list(keys),
            )
        )  # fmt: skip
    return items


def _keys_fit(keys, start: int, block_size: int) -> bool:
    """Whether an item's cached_block_hashes cover its start_position, each key 1..MAX_KEY_BYTES bytes."""
    return len(keys) * block_size == start and all(0 < len(k) <= MAX_KEY_BYTES for k in keys)


def _invalid_keys(r: drafter_pb2.ProposeItem, block_size: int) -> InvalidArgument:
    keys = r.cached_block_hashes
    return InvalidArgument(
        f"request {r.request_id!r}: cached_block_hashes: {len(keys)} keys of {block_size}-token blocks for "
        f"start_position {r.start_position}, or a key not of 1..{MAX_KEY_BYTES} bytes (they cover start_position)"
    )


def _invalid_device_item(r: drafter_pb2.ProposeItem, seen: set[str], width: int, block_size: int) -> InvalidArgument:
    """What is wrong with an item `_parse_device_items` refused, the first failing check in its order."""
    rid = r.request_id
    if not rid or rid in seen:
        return InvalidArgument(f"empty or repeated request_id {rid!r}")
    if r.start_position < 0 or r.next_token_ids or r.num_rejected:
        return InvalidArgument(
            f"request {rid!r}: a device hand-off's item has a start_position >= 0, no next_token_ids "
            "and no num_rejected"
        )
    if not 1 <= r.num_rows <= min(width, MAX_DRAFTS + 1) or not 0 <= r.num_spec_tokens <= MAX_DRAFTS:
        return InvalidArgument(
            f"request {rid!r}: num_rows {r.num_rows} not in [1, token_width {width}] or num_spec_tokens "
            f"{r.num_spec_tokens} not in [0, {MAX_DRAFTS}]"
        )
    if not 0 <= r.sampling.temperature <= 1e4:
        return InvalidArgument(f"request {rid!r}: temperature {r.sampling.temperature} not in [0, 1e4]")
    if r.output_offset < 0:
        return InvalidArgument(f"request {rid!r}: negative output_offset {r.output_offset}")
    return _invalid_keys(r, block_size)


def _invalid_item(r: drafter_pb2.ProposeItem, seen: set[str], vocab_size: int, block_size: int) -> InvalidArgument:
    """What is wrong with an item `parse_items` refused, the first failing check in its order."""
    rid = r.request_id
    if not rid or rid in seen:
        return InvalidArgument(f"empty or repeated request_id {rid!r}")
    if r.start_position < 0:
        return InvalidArgument(f"request {rid!r}: negative start_position {r.start_position}")
    if not r.next_token_ids:
        return InvalidArgument(f"request {rid!r}: no next_token_ids (no hidden-state rows)")
    if any(not 0 <= t < vocab_size for t in r.next_token_ids):
        return InvalidArgument(f"request {rid!r}: token id outside the vocabulary [0, {vocab_size})")
    if not 0 <= r.num_rejected <= MAX_DRAFTS:
        return InvalidArgument(f"request {rid!r}: num_rejected {r.num_rejected} not in [0, {MAX_DRAFTS}]")
    if not 0 <= r.num_spec_tokens <= MAX_DRAFTS:
        return InvalidArgument(f"request {rid!r}: num_spec_tokens {r.num_spec_tokens} not in [0, {MAX_DRAFTS}]")
    if not 0 <= r.sampling.temperature <= 1e4:
        return InvalidArgument(f"request {rid!r}: temperature {r.sampling.temperature} not in [0, 1e4]")
    if r.output_offset < 0:
        return InvalidArgument(f"request {rid!r}: negative output_offset {r.output_offset}")
    if r.cached_block_hashes and not _keys_fit(r.cached_block_hashes, r.start_position, block_size):
        return _invalid_keys(r, block_size)
    return InvalidArgument(f"request {rid!r}: num_rows {r.num_rows} without a device hand-off (tokens_on_device)")


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Registered before the server starts; answers UNAVAILABLE until `ready()` (weights loaded)."""

    def __init__(self, device: str = "cpu", slow_steps: SlowStepWatch | None = None):
        self.runner: DrafterRunner | None = None
        self.receiver: HiddenStatesReceiver | None = None
        self.model_info: common_pb2.ModelInfo | None = None
        self.device = device
        self._device_claim = DeviceClaim(device)  # the GPU switched to us while a Propose is planned
        self.slow_steps = slow_steps or SlowStepWatch("drafter", 0)  # `--slow-step-s`; 0: off
        self._steps = StepThread(device, "drafter-step")
        self._model_lock = threading.Lock()  # runner and receiver: one thread at a time
        self._queued_lock = threading.Lock()
        self._queued = 0  # Propose calls waiting or running: the autoscaler's queue depth
        self._hand_offs = 0  # device hand-offs served
        # Each request's state was placed last through which connection (a gRPC ProposeStream's task, a socket
        # connection's thread); a closed connection's requests are freed (`connection_closed`): a verifier that
        # went away, or was restarted, never frees them itself. Guarded by _model_lock.
        self._placed: dict[str, object] = {}
        self.draining = asyncio.Event()

        def queue_depth(_options):
            yield metrics.Observation(self._queued)

        meter.create_observable_gauge(
            "specsplit.drafter.queue_depth", [queue_depth], description="Propose calls waiting or running"
        )

    def ready(self, runner: DrafterRunner, model_info: common_pb2.ModelInfo, receiver: HiddenStatesReceiver) -> None:
        self.receiver = receiver
        self.runner = runner
        self.model_info = model_info
        self._vocab_size = model_info.vocab_size
        self._block_size = model_info.block_size  # the MTP cache's
        if isinstance(runner, DrafterRunner):  # a runner that counts (stand-ins in tests need not)
            prefix_cache_counters.servicer = self
        param = next(runner.mtp.parameters())
        self._hidden_layout = param.device, param.dtype  # where and how propose() takes the hidden states

    async def _require_ready(self, context) -> None:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter is loading its weights")

    def init_thread(self) -> None:
        """First call on the thread of a socket connection (co-located): the model's device becomes current."""
        use_device(self.device)

    def connection_closed(self, connection: object | None = None) -> None:
        """A connection Proposes came by closed (default: the calling socket connection's thread): the requests
        last placed through it are freed. The verifier may come back on a new connection; a request it still
        runs then starts its MTP state afresh here (`DrafterRunner`): drafts worse for a step, output the same."""
        connection = connection or threading.current_thread()
        with self._model_lock:
            request_ids = [rid for rid, placed_by in self._placed.items() if placed_by is connection]
            self._free(request_ids)
        if request_ids:
            log.info("a verifier's connection closed: freed the %d requests it had placed", len(request_ids))

    def _free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._placed.pop(rid, None)
        self.runner.free(request_ids)

    def _count(self, delta: int) -> None:
        with self._queued_lock:
            self._queued += delta

    def _propose(
        self, request: drafter_pb2.ProposeRequest, connection: object
    ) -> tuple[list[ProposeItem], ProposeOutput]:
        if request.cached_blocks:  # before the frees: a request that finished registers its last blocks
            self.runner.cache_blocks([(b.request_id, b.block_index, b.block_hash) for b in request.cached_blocks])
        if request.finished_request_ids:
            self._free(list(request.finished_request_ids))
        # Rows first: an nccl receive pairs with a send already made, whatever the items hold.
        hidden = self.receiver.receive(request)  # [num_rows, hidden_size] on the drafter's device
        try:
            items = parse_items(request, self._vocab_size, self._block_size)
            for item in items:
                self._placed[item.request_id] = connection
            device_tokens = None
            if on_device(request):
                device_tokens = self.receiver.device_tokens(request)
                if not self._hand_offs:
                    log.info("device hand-offs: the first one arrived (the verifier's step still running)")
                self._hand_offs += 1
                device_hand_offs.add(1)
            rows = sum(item.num_rows or len(item.next_token_ids) for item in items)
            if hidden.shape[0] != rows:
                raise InvalidArgument(f"hidden_states: {hidden.shape[0]} rows for {rows} next_token_ids / num_rows")
            device, dtype = self._hidden_layout
            if hidden.dtype != dtype or hidden.device != device:
                hidden = hidden.to(device=device, dtype=dtype)
            if device_tokens is None:
                return items, self.runner.propose(items, hidden)
            return items, self.runner.propose(items, hidden, device_tokens)
        finally:
            self.receiver.release()  # before any reply: the sender reuses the rows' memory once it has one

    async def ProposeStream(self, request_iterator, context):
        await self._require_ready(context)
        connection = asyncio.current_task()
        try:
            async for request in until_draining(request_iterator, self.draining):
                try:
                    yield await self._handle(request, extract_trace_context(request.trace_context), connection)
                except SpecsplitError as err:
                    await context.abort(err.code, err.message)
        finally:
            await self._steps.run(self.connection_closed, connection)

    def handle_local_request(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        """One message of a ProposeStream on the co-located drafter's socket, on its connection's thread."""
        if self.runner is None:
            raise SpecsplitError("drafter is loading its weights", grpc.StatusCode.UNAVAILABLE)
        self._count(1)
        try:
            parent = extract_trace_context(request.trace_context)
            return self._serve_propose(request, parent, "local", time.time_ns(), threading.current_thread())
        finally:
            self._count(-1)

    def drain(self) -> None:
        """SIGTERM: persistent streams end at their next idle moment instead of holding the grace period."""
        self.draining.set()

    async def _handle(
        self, request: drafter_pb2.ProposeRequest, parent, connection: asyncio.Task
    ) -> drafter_pb2.ProposeResponse:
        """One Propose that came by gRPC's stream, handled on the step thread."""
        t_arrival = time.time_ns()
        self._count(1)
        try:
            return await self._steps.run(self._serve_propose, request, parent, "stream", t_arrival, connection)
        finally:
            self._count(-1)

    def _serve_propose(
        self, request: drafter_pb2.ProposeRequest, parent, rpc: str, t_arrival: int, connection: object
    ) -> drafter_pb2.ProposeResponse:
        """One Propose that came by `rpc` (stream or local) on `connection` at `t_arrival`, on a model thread;
        raises SpecsplitError with the status the caller should get."""
        if not on_device(request):  # a device hand-off queues nothing before its wait for the verifier
            self._device_claim.claim()
        span = tracer.start_span("Propose", parent, SpanKind.SERVER)
        recording = span.is_recording()  # nothing to count or time for a span that goes nowhere
        if recording:
            span.set_attributes(
                {
                    "specsplit.iteration": request.iteration,
                    "specsplit.drafter_rpc": rpc,
                    "specsplit.batch_size": len(request.requests),
                    "specsplit.hidden_state_bytes": tensor_nbytes(request.hidden_states) or _handle_bytes(request),
                }
            )
        with trace.use_span(span, end_on_exit=True):
            with self._model_lock, self.slow_steps.watch("propose"):
                items, out = self._propose(request, connection)
            if recording:
                t0, t1, t2 = out.stamps_ns
                tracer.start_span("mtp_step_0", start_time=t0).end(end_time=t1)
                if t2 > t1:
                    tracer.start_span("mtp_steps_1_to_k", start_time=t1).end(end_time=t2)
        propose_latency.record((time.time_ns() - t_arrival) / 1e9)
        response = propose_response(items, out, t_arrival)
        response.replied_ns = time.time_ns()
        return response

    async def Free(self, request, context):
        await self._require_ready(context)
        await self._steps.run(self.locked, self._free, list(request.request_ids))
        return drafter_pb2.DrafterFreeResponse(num_free_blocks=self.runner.kv_cache.num_free_blocks)

    async def OpenHiddenTransport(self, request, context):
        await self._require_ready(context)
        left = context.time_remaining()
        deadline = None if left is None else time.monotonic() + left
        try:  # never while a Propose is receiving
            await self._steps.run(self.locked, self._open_transport, request, deadline)
        except SpecsplitError as err:
            await context.abort(err.code, err.message)
        return drafter_pb2.OpenHiddenTransportResponse(
            device=str(self.receiver.device), device_hand_off=self.receiver.device_hand_off
        )

    def _open_transport(self, request: drafter_pb2.OpenHiddenTransportRequest, deadline: float | None) -> None:
        """Step thread: opens the receiver within what is left of the caller's deadline. An open that waited its
        turn past it is refused without joining: the verifier has given up on that generation, and waiting out a
        rendezvous nobody holds would put every later open one timeout behind the verifier's."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    f"OpenHiddenTransport: generation {request.generation} waited its turn past the caller's deadline"
                )
            if request.timeout_s <= 0 or request.timeout_s > left:
                bounded = drafter_pb2.OpenHiddenTransportRequest()
                bounded.CopyFrom(request)
                bounded.timeout_s = left
                request = bounded
        self.receiver.open(request)

    def locked(self, fn, *args):
        """`fn(*args)` with the model to itself (no Propose or Free running)."""
        with self._model_lock:
            return fn(*args)

    async def GetModelInfo(self, request, context):
        await self._require_ready(context)
        return self.model_info


def _handle_bytes(request: drafter_pb2.ProposeRequest) -> int:
    h = request.hidden_states_handle
    dtype = dtype_from_proto(h.dtype)
    return h.num_rows * h.hidden_size * dtype.itemsize if dtype is not None else 0


def propose_response(items: list[ProposeItem], out: ProposeOutput, received_ns: int) -> drafter_pb2.ProposeResponse:
    """Drafts per request in request order (+ sparse q of sampled drafts) and the step times."""
    response = drafter_pb2.ProposeResponse(
        step0_ns=out.step0_ns, later_steps_ns=out.later_steps_ns, received_ns=received_ns
    )
    add = response.drafts.add
    q_msgs, q = [], []  # sampled drafts' q: filled all at once
    for item, drafts, probs in zip(items, out.drafts, out.draft_probs or [None] * len(out.drafts)):
        d = add()  # fields set one by one: add(request_id=..., token_ids=...) costs more
        d.request_id = item.request_id
        d.token_ids.extend(drafts)
        if probs is not None:
            q_msgs.append(d.draft_probs)
            q.append(probs)
    for i in out.outputs_wanted:
        response.drafts[i].output_wanted = True
    if q:
        fill_tensor_protos([m.token_ids for m in q_msgs], [ids for ids, _ in q], torch.int32)
        fill_tensor_protos([m.probs for m in q_msgs], [probs for _, probs in q], torch.float32)
    return response
