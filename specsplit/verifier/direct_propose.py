"""The verifier's Proposes, made by its step thread: one control plane for both placements.

With async scheduling, the next step waits for the drafts of the last Propose. The step thread does it
all: right after its step it sends the Propose, and before the next step it waits for the answer itself
(answers come back in the order the Proposes went out; `wait` takes them up to the one asked for,
handing each to its `on_answer` on the step thread). The event loop only prepares the connection before
a step-thread call and collects the outcomes after it (`prepare`, `collect`). Two proposers:

- `DirectProposer`, a co-located drafter: a blocking connection to the drafter's Unix socket; the step
  thread writes the Propose and reads the answer itself, crossing no event loop on either side.
- `PooledProposer`, pooled drafters (any number of replicas, gRPC ProposeStreams, hidden states by grpc
  bytes or nccl): the step thread hands the Propose to the event loop, where `DrafterClient.propose`
  spreads it over the replicas, and waits for its answer where the direct proposer reads it.

A failure is a failed Propose: its requests get no drafts this iteration. On the socket, every Propose
still unanswered fails with it, the connection and the hidden-state transport are reset, and the next
Propose reconnects (the same frames as `specsplit.local_stream`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from specsplit.bidi_stream import StreamError
from specsplit.local_stream import HEADER, KIND_ERROR, error_of_frame, message_frame, recv_exactly, served_socket
from specsplit.proto import drafter_pb2
from specsplit.telemetry import inject_trace_context
from specsplit.transport.base import Transfer, TransportError
from specsplit.verifier.proposal import Proposal, merge_replica_drafts

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specsplit.verifier")


@dataclass
class PendingPropose:
    """One Propose sent by the step thread, until its answer (or failure) is in `proposal`."""

    context: object  # what `on_answer` needs (the servicer's batch and step)
    num_reqs: int
    nbytes: int
    finished: list[str]  # frees it carried for the replica, dropped from its queue once answered
    span: trace.Span
    on_answer: Callable[[PendingPropose], None]
    sent_ns: int = 0
    t0: int = field(default_factory=time.perf_counter_ns)
    transfer: Transfer | None = None
    future: concurrent.futures.Future | None = None  # PooledProposer: the event loop's Propose
    proposal: object = None  # specsplit.verifier.drafter_client.Proposal once answered
    unsent: bool = False  # failed for want of a connection that `prepare` did not make: the drafter was counted out


class DirectProposer:
    """A co-located drafter's Unix socket, driven by the verifier's step thread. `prepare()` and
    `collect()` run on the event loop, between step-thread calls; everything else on the step thread."""

    name = "colocated"

    def __init__(self, client, address: str):
        self.client = client  # specsplit.verifier.drafter_client.DrafterClient
        self.address = address
        self._sock: socket.socket | None = None
        self._pending: collections.deque[PendingPropose] = collections.deque()
        self._done: list[PendingPropose] = []  # answered or failed since the loop last collected
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counted_out = False  # the pool counted the drafter out when `prepare` last ran

    @property
    def replica(self):
        return self.client.pool.replicas[self.address]

    async def prepare(self, request_ids: list[str]) -> None:
        """Event loop, before a step-thread call that may send: the step's requests placed on this drafter
        in the pool (so that their frees go to it), and a connection if there is none (asking the drafter
        for its socket's path). A failure here is left for `send` to report. No connection while the pool
        counts the drafter out (a failed call, until a health probe finds it SERVING): requests it drafted for
        then would have no owner in the pool, and their frees would never reach it."""
        self._loop = asyncio.get_running_loop()
        await self.client.pool.start()
        self.client.pool.assign(request_ids)
        self._counted_out = not self.replica.healthy
        if self._sock is not None or self._counted_out:
            return
        peer = f"drafter {self.address}"
        try:
            path = await served_socket(self.replica.stub, "propose_socket", peer, self.client.timeout_s)()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.client.timeout_s)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                raise
        except (OSError, grpc.RpcError) as err:
            log.warning("cannot reach %s's propose socket: %s", peer, err)
            return
        self._sock = sock

    def collect(self) -> list[PendingPropose]:
        """Event loop: the Proposes answered or failed since the last call, in order, counted in the
        drafter pool (frees they carried leave the replica's queue once answered)."""
        done, self._done = self._done, []
        replica = self.replica
        for p in done:
            ok = p.proposal.ok
            if p.unsent:  # not a call: a health probe may have found the drafter back meanwhile, which stands
                continue
            self.client.pool.record_call(self.address, p.num_reqs, None if ok else p.proposal.error)
            if ok:
                replica.freed(p.finished)
        return done

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def send(self, plan, context, on_answer: Callable[[PendingPropose], None], parent) -> PendingPropose:
        """Step thread: sends `plan` (a `ProposeBatch` of every request of the step) and returns at once;
        the answer is read by `wait`. `parent`: the trace context the Propose's span goes under."""
        replica = self.replica
        finished = list(replica.pending_free)
        msg = plan.message(list(range(len(plan.items))), finished)
        span = tracer.start_span(
            "send_hidden_states",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={"specsplit.hidden_state_bytes": plan.hidden_state_bytes},
        )
        pending = PendingPropose(context, len(plan.items), plan.hidden_state_bytes, finished, span, on_answer)
        transport = self.client.transport
        try:
            rows = plan.hidden_states
            if transport.needs_open(rows):
                self.wait_all()  # opening resets the transport: nothing of it may be in flight
                opening = transport.open(rows, self.client._open_call(replica))
                future = asyncio.run_coroutine_threadsafe(opening, self._loop)
                try:
                    future.result(self.client.timeout_s)
                except BaseException:
                    future.cancel()  # an open still running must not change the transport later
                    raise
            if plan.sampled is not None:  # a device hand-off: nothing waits for the verifier's step here
                pending.transfer = transport.send_on_device(rows, plan.sampled, plan.num_sampled, msg)
            else:
                pending.transfer = transport.send(rows, msg)
            with trace.use_span(span):
                inject_trace_context(msg.trace_context)
            if self._sock is None:
                pending.unsent = self._counted_out
                raise StreamError(grpc.StatusCode.UNAVAILABLE, f"no connection to drafter {self.address}'s socket")
            frame = message_frame(msg)
            pending.sent_ns = time.time_ns()
            self._sock.sendall(frame)
        except grpc.RpcError as err:
            self._fail_after_answers(pending, f"{err.code().name}: {err.details()}")
            return pending
        except OSError as err:  # the socket (TimeoutError included)
            self._fail_after_answers(pending, f"UNAVAILABLE: cannot reach drafter {self.address}: {err}")
            return pending
        except TransportError as err:
            self._fail_after_answers(pending, f"hidden-state transport {transport.name}: {err}")
            return pending
        except Exception as err:  # noqa: BLE001 (e.g. nccl's rendezvous timing out: a failed Propose, not a failed Verify)
            log.exception("direct Propose to drafter %s failed", self.address)
            self._fail_after_answers(pending, f"hidden-state transport {transport.name}: {type(err).__name__}: {err}")
            return pending
        self._pending.append(pending)
        return pending

    def wait(self, pending: PendingPropose):
        """Step thread: reads answers in order until `pending`'s is in; returns its Proposal."""
        while pending.proposal is None:
            self._read_one()
        return pending.proposal

    def wait_all(self) -> None:
        while self._pending:
            self._read_one()

    def _read_one(self) -> None:
        head = self._pending[0]
        try:
            response = self._read()
        except StreamError as err:
            self._fail(list(self._pending), f"{err.code().name}: {err.details()}")
            return
        self._pending.popleft()
        self.client.transport.finish(head.transfer, ok=True)
        no_drafts = [[] for _ in range(head.num_reqs)]
        elapsed = time.perf_counter_ns() - head.t0
        proposal = Proposal(True, no_drafts, "", head.nbytes, elapsed, [None] * head.num_reqs, head.sent_ns)
        proposal.received_ns = time.time_ns()
        if len(response.drafts) != head.num_reqs:
            proposal.ok = False
            proposal.error = f"{self.address}: returned {len(response.drafts)} drafts for {head.num_reqs} requests"
        else:
            proposal.drafter_received_ns, proposal.drafter_replied_ns = response.received_ns, response.replied_ns
            proposal.step0_ns, proposal.later_steps_ns = response.step0_ns, response.later_steps_ns
            merge_replica_drafts(proposal, list(range(head.num_reqs)), response)
        self._finish(head, proposal)

    def _read(self) -> drafter_pb2.ProposeResponse:
        """The next answer on the connection; StreamError with the status a unary call would have."""
        if self._sock is None:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"no connection to drafter {self.address}")
        try:
            length, kind = HEADER.unpack(self._recv(HEADER.size))
            body = self._recv(length)
        except TimeoutError:
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.client.timeout_s}s") from None
        except OSError as err:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"drafter {self.address} closed the stream: {err}") from None
        if kind == KIND_ERROR:
            raise error_of_frame(body)
        try:
            return drafter_pb2.ProposeResponse.FromString(body)
        except DecodeError as err:
            details = f"cannot parse drafter {self.address}'s answer: {err}"
            raise StreamError(grpc.StatusCode.INTERNAL, details) from None

    def _recv(self, n: int) -> bytes:
        data = recv_exactly(self._sock, n)
        if len(data) < n:
            raise ConnectionError("connection closed")
        return data

    def _fail_after_answers(self, pending: PendingPropose, error: str) -> None:
        """`pending` could not be sent: the answers to the Proposes before it are read first (a drafter that
        closed the connection may have answered them, an error among them), in order; then it fails."""
        self.wait_all()
        self._fail([pending], error)

    def _fail(self, pendings: list[PendingPropose], error: str) -> None:
        """These Proposes failed (with every other one in flight): the connection and the transport are reset."""
        pendings = pendings + [p for p in self._pending if p not in pendings]
        self._pending.clear()
        self.close()
        self.client.transport.reset()  # a slot may still be read, a send unpaired: open afresh
        for p in pendings:
            no_drafts = [[] for _ in range(p.num_reqs)]
            elapsed = time.perf_counter_ns() - p.t0
            self._finish(p, Proposal(False, no_drafts, f"{self.address}: {error}", p.nbytes, elapsed, None, p.sent_ns))

    def _finish(self, pending: PendingPropose, proposal) -> None:
        pending.proposal = proposal
        if not proposal.ok:
            pending.span.set_status(trace.Status(trace.StatusCode.ERROR, proposal.error))
        pending.span.end()
        try:
            pending.on_answer(pending)
        finally:
            self._done.append(pending)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class PooledProposer:
    """Pooled drafters, driven by the verifier's step thread through the event loop: `send` hands the
    Propose to `DrafterClient.propose` (which records its calls in the drafter pool) and returns once the
    rows are with the transport; `wait` blocks for the answer. `prepare()` and `collect()` run on the loop."""

    name = "pooled"

    def __init__(self, client):
        self.client = client  # specsplit.verifier.drafter_client.DrafterClient
        self._pending: collections.deque[PendingPropose] = collections.deque()
        self._done: list[PendingPropose] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def prepare(self, request_ids: list[str]) -> None:
        """Event loop, before a step-thread call that may send (`DrafterClient.propose` places the requests)."""
        self._loop = asyncio.get_running_loop()
        await self.client.pool.start()

    def collect(self) -> list[PendingPropose]:
        done, self._done = self._done, []
        return done

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def send(self, plan, context, on_answer: Callable[[PendingPropose], None], parent) -> PendingPropose:
        """Step thread: `plan` (a `ProposeBatch`) to the event loop; returns once every replica's transport
        holds its rows (the step's hidden states may then be overwritten). `parent`: the trace context."""
        span = tracer.start_span(
            "send_hidden_states",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={"specsplit.hidden_state_bytes": plan.hidden_state_bytes},
        )
        pending = PendingPropose(context, len(plan.items), plan.hidden_state_bytes, [], span, on_answer)
        if not self.client.pool.targets:  # no speculation: nothing to send
            pending.future = concurrent.futures.Future()
            no_drafts = [[] for _ in plan.items]
            pending.future.set_result(Proposal(False, no_drafts, "no drafter configured", plan.hidden_state_bytes))
            self._pending.append(pending)
            return pending
        staged = threading.Event()

        async def propose():
            with trace.use_span(span):  # the messages carry this span's trace context
                return await self.client.propose(plan, len(plan.items), staged.set)

        pending.sent_ns = time.time_ns()
        pending.future = asyncio.run_coroutine_threadsafe(propose(), self._loop)
        staged.wait(self.client.timeout_s)
        self._pending.append(pending)
        return pending

    def wait(self, pending: PendingPropose):
        """Step thread: the answers in order until `pending`'s is in; returns its Proposal."""
        while pending.proposal is None:
            self._take_one()
        return pending.proposal

    def wait_all(self) -> None:
        while self._pending:
            self._take_one()

    def _take_one(self) -> None:
        head = self._pending.popleft()
        try:
            proposal = head.future.result()
        except Exception as err:  # noqa: BLE001 (a bug in the drafter path fails the Propose, not the next Verify)
            log.exception("a pooled Propose failed")
            no_drafts = [[] for _ in range(head.num_reqs)]
            proposal = Proposal(False, no_drafts, f"Propose failed: {err!r}", head.nbytes, 0, None, head.sent_ns)
        head.proposal = proposal
        if not proposal.ok:
            head.span.set_status(trace.Status(trace.StatusCode.ERROR, proposal.error))
        head.span.end()
        try:
            head.on_answer(head)
        finally:
            self._done.append(head)

    def close(self) -> None:
        for p in self._pending:
            p.future.cancel()
