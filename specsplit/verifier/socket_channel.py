"""`SocketChannel`: the verifier → drafter channel (`drafter_channel.py`) to a co-located drafter, on its Unix socket.

With async scheduling, the next step waits for the drafts of the last Propose. The step thread does it all: right
after its step it writes the Propose on a blocking connection, and before the next step it reads the answer itself
(answers come back in the order the Proposes went out), crossing no event loop; the drafter's connection thread
answers it the same way (`specsplit.rpc.threaded_stream`). The event loop only connects before a step-thread call
(`prepare`) and counts the outcomes in the drafter pool after it (`collect`).

A failure fails every Propose still unanswered with it; the connection and the hidden-state transport are reset, and
the next Propose reconnects (the frames of `specsplit.rpc.frames`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time

import grpc
from opentelemetry import trace

from specsplit.proto import drafter_pb2
from specsplit.rpc.bidi_stream import StreamError
from specsplit.rpc.frames import answer_of, message_frame, read_frame
from specsplit.rpc.local_stream import served_socket
from specsplit.rpc.telemetry import inject_trace_context
from specsplit.transport.base import HiddenStatesSender, TransportError
from specsplit.verifier.drafter_channel import DrafterChannel, PendingPropose, take_drafts
from specsplit.verifier.drafter_pool import DrafterPool
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.propose_request import ProposeBatch

log = logging.getLogger(__name__)


class SocketChannel(DrafterChannel):
    """The one drafter of `pool` (its only target), on its Unix socket, driven by the verifier's step thread."""

    name = "colocated"
    colocated = True

    def __init__(self, pool: DrafterPool, transport: HiddenStatesSender, timeout_s: float):
        super().__init__(pool, transport, timeout_s)
        self.address = pool.targets[0]
        self.peer = f"drafter {self.address}"
        self._sock: socket.socket | None = None
        self._pending: collections.deque[PendingPropose] = collections.deque()  # sent, not answered, in order
        self._counted_out = False  # the pool counted the drafter out when `prepare` last ran

    @property
    def replica(self):
        return self.pool.replicas[self.address]

    async def prepare(self, request_ids: list[str]) -> None:
        """The step's requests placed on this drafter in the pool (so that their frees go to it), and a connection
        if there is none (asking the drafter for its socket's path). A failure here is left for `send` to report.
        No connection while the pool counts the drafter out (a failed call, until a health probe finds it SERVING):
        requests it drafted for then would have no owner in the pool, and their frees would never reach it."""
        await super().prepare(request_ids)
        self.pool.assign(request_ids)
        self._counted_out = not self.replica.healthy
        if self._sock is not None or self._counted_out:
            return
        try:
            path = await served_socket(self.replica.stub, "propose_socket", self.peer, self.timeout_s)()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                raise
        except (OSError, grpc.RpcError) as err:
            log.warning("cannot reach %s's propose socket: %s", self.peer, err)
            return
        self._sock = sock

    def collect(self) -> list[PendingPropose]:
        """The Proposes answered or failed since the last call, in order, counted in the drafter pool (frees they
        carried leave the replica's queue once answered)."""
        done = super().collect()
        replica = self.replica
        for p in done:
            ok = p.proposal.ok
            if p.unsent:  # not a call: a health probe may have found the drafter back meanwhile, which stands
                continue
            self.pool.record_call(self.address, p.num_reqs, None if ok else p.proposal.error)
            if ok:
                replica.freed(p.finished)
        return done

    async def close(self) -> None:
        self._disconnect()
        await super().close()

    def transmit(self, plan: ProposeBatch, pending: PendingPropose) -> None:
        """Writes the Propose, with the frees queued for the drafter, and returns at once (a device hand-off's rows
        and tokens go as the step queued them: nothing waits for the step here)."""
        replica = self.replica
        pending.finished = list(replica.pending_free)
        msg = plan.message(list(range(len(plan.items))), pending.finished, replica.take_cached())
        transport = self.transport
        try:
            rows = plan.hidden_states
            if transport.needs_open(rows):
                self._take_all()  # opening resets the transport: nothing of it may be in flight
                future = asyncio.run_coroutine_threadsafe(transport.open(rows, self.open_call(replica)), self.loop)
                try:
                    future.result(self.timeout_s)
                except BaseException:
                    future.cancel()  # an open still running must not change the transport later
                    raise
            if plan.sampled is not None:
                pending.transfer = transport.send_on_device(rows, plan.sampled, plan.num_sampled, msg)
            else:
                pending.transfer = transport.send(rows, msg)
            with trace.use_span(pending.span):
                inject_trace_context(msg.trace_context)
            if self._sock is None:
                pending.unsent = self._counted_out
                raise StreamError(grpc.StatusCode.UNAVAILABLE, f"no connection to {self.peer}'s socket")
            frame = message_frame(msg)
            pending.sent_ns = time.time_ns()
            self._sock.sendall(frame)
        except grpc.RpcError as err:
            self._fail_after_answers(pending, f"{err.code().name}: {err.details()}")
            return
        except OSError as err:  # the socket (TimeoutError included)
            self._fail_after_answers(pending, f"UNAVAILABLE: cannot reach {self.peer}: {err}")
            return
        except TransportError as err:
            self._fail_after_answers(pending, f"hidden-state transport {transport.name}: {err}")
            return
        except Exception as err:  # noqa: BLE001 (e.g. nccl's rendezvous timing out: a failed Propose, not a failed Verify)
            log.exception("Propose to %s failed", self.peer)
            self._fail_after_answers(pending, f"hidden-state transport {transport.name}: {type(err).__name__}: {err}")
            return
        self._pending.append(pending)

    def take_answer(self) -> None:
        """Reads the oldest Propose's answer (or fails every one in flight)."""
        head = self._pending[0]
        try:
            response = self._read()
        except StreamError as err:
            self._fail(list(self._pending), f"{err.code().name}: {err.details()}")
            return
        self._pending.popleft()
        self.transport.finish(head.transfer, ok=True)
        no_drafts = [[] for _ in range(head.num_reqs)]
        elapsed = time.perf_counter_ns() - head.t0
        proposal = Proposal(True, no_drafts, "", head.nbytes, elapsed, [None] * head.num_reqs, head.sent_ns)
        proposal.received_ns = time.time_ns()
        error = take_drafts(proposal, list(range(head.num_reqs)), response)
        if error:
            proposal.ok, proposal.error = False, f"{self.address}: {error}"
        self.answered(head, proposal)

    def _take_all(self) -> None:
        while self._pending:
            self.take_answer()

    def _read(self) -> drafter_pb2.ProposeResponse:
        """The next answer on the connection; StreamError with the status a unary call would have."""
        if self._sock is None:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"no connection to {self.peer}")
        try:
            kind, body = read_frame(self._sock)
        except TimeoutError:
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout_s}s") from None
        except OSError as err:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"{self.peer} closed the stream: {err}") from None
        return answer_of(kind, body, drafter_pb2.ProposeResponse.FromString, self.peer)

    def _fail_after_answers(self, pending: PendingPropose, error: str) -> None:
        """`pending` could not be sent: the answers to the Proposes before it are read first (a drafter that
        closed the connection may have answered them, an error among them), in order; then it fails."""
        self._take_all()
        self._fail([pending], error)

    def _fail(self, pendings: list[PendingPropose], error: str) -> None:
        """These Proposes failed (with every other one in flight): the connection and the transport are reset."""
        pendings = pendings + [p for p in self._pending if p not in pendings]
        self._pending.clear()
        self._disconnect()
        self.transport.reset()  # a slot may still be read, a send unpaired: open afresh
        for p in pendings:
            no_drafts = [[] for _ in range(p.num_reqs)]
            elapsed = time.perf_counter_ns() - p.t0
            self.answered(p, Proposal(False, no_drafts, f"{self.address}: {error}", p.nbytes, elapsed, None, p.sent_ns))

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
