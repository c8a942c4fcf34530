"""The verifier's Proposes made by its step thread (`--drafter-rpc local`, one drafter, async scheduling).

With async scheduling, the next step waits for the drafts of the last Propose. Made on the
event loop, that Propose costs hand-overs on the critical path: the step's result goes back to the
loop, the loop sends the Propose, the answer wakes the loop, which resolves futures and wakes the
next Verify, which hands its step to the step thread again. Here the step thread does it all: right
after its step it sends the Propose on a blocking connection to the co-located drafter's Unix socket, and
before the next step it reads the answer itself (answers come back in the order the
Proposes went out; `wait` reads up to the one asked for, handing each answer to its `on_answer`).
The event loop only asks the drafter for the socket's path, connects, and records each outcome in the
drafter pool (`collect`).

A failure is a failed Propose, as on the other paths: its requests get no drafts this iteration, every
Propose still unanswered fails with it, the connection and the hidden-state transport are reset, and
the next Propose reconnects. The same frames as `specsplit.local_stream`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
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
    """One Propose sent on the direct connection, until its answer (or failure) is in `proposal`."""

    context: object  # what `on_answer` needs (the servicer's batch and step)
    num_reqs: int
    nbytes: int
    num_finished: int  # frees it carried for the replica, dropped from its queue once answered
    span: trace.Span
    on_answer: Callable[[PendingPropose], None]
    sent_ns: int = 0
    t0: int = field(default_factory=time.perf_counter_ns)
    transfer: Transfer | None = None
    proposal: object = None  # specsplit.verifier.drafter_client.Proposal once answered


class DirectProposer:
    """A co-located drafter's Unix socket, driven by the verifier's step thread. `prepare()` and
    `collect()` run on the event loop, between step-thread calls; everything else on the step thread."""

    def __init__(self, client, address: str):
        self.client = client  # specsplit.verifier.drafter_client.DrafterClient
        self.address = address
        self._sock: socket.socket | None = None
        self._pending: collections.deque[PendingPropose] = collections.deque()
        self._done: list[PendingPropose] = []  # answered or failed since the loop last collected
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def replica(self):
        return self.client.pool.replicas[self.address]

    async def prepare(self) -> None:
        """Event loop, before a step-thread call that may send (the pool started): connects if not
        connected (asking the drafter for its socket's path). A failure here is left for `send` to report."""
        self._loop = asyncio.get_running_loop()
        if self._sock is not None:
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
        """Event loop: the Proposes answered or failed since the last call, in order."""
        done, self._done = self._done, []
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
        pending = PendingPropose(context, len(plan.items), plan.hidden_state_bytes, len(finished), span, on_answer)
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
