"""`PoolChannel`: the verifier → drafter channel (`drafter_channel.py`) to pooled drafter replicas.

The batch is split by the replica that owns each request (`DrafterPool`): one Propose per replica, all concurrent,
drafts merged back in batch order. Each replica gets one persistent ProposeStream (one message each way per
iteration), on its Unix socket where that is on this host, else gRPC's; a broken stream fails the Propose and is
reopened. Losing a replica never changes output: its requests get no drafts this iteration and are placed on another
replica from the next one on; with no replica at all, requests decode plainly. Frees go to the replica that owned the
request, with its next call (or alone, in a Free call, when it has no request this iteration).

The step thread hands each Propose to the event loop (`propose`) and waits there for its answer. The hidden states
travel by the configured transport (`specsplit.transport`): gRPC bytes to any number of replicas, or nccl to exactly
one drafter, opened at start-up and opened again after any failed call.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable

import grpc
from opentelemetry import trace

from specsplit.proto import common_pb2, drafter_pb2
from specsplit.rpc.bidi_stream import BidiStream
from specsplit.rpc.local_stream import LocalStream
from specsplit.rpc.telemetry import inject_trace_context, outgoing_metadata
from specsplit.transport.base import HiddenStatesSender, Transfer, TransportError
from specsplit.verifier.drafter_channel import DrafterChannel, PendingPropose, take_drafts
from specsplit.verifier.drafter_pool import DrafterPool, Replica
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.propose_request import ProposeBatch

log = logging.getLogger(__name__)


class _Countdown:
    """Calls `callback` once, when `one()` has been called as often as `expect(n)` said, or at `done()`."""

    def __init__(self, callback: Callable[[], None] | None):
        self._callback = callback
        self._left = 0

    def expect(self, n: int) -> None:
        self._left = n
        if n == 0:
            self.done()

    def one(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self.done()

    def done(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class PoolChannel(DrafterChannel):
    """The replicas of `pool` (none: every Propose fails at once, no drafts), each on its ProposeStream."""

    name = "pooled"

    def __init__(self, pool: DrafterPool, transport: HiddenStatesSender, timeout_s: float):
        super().__init__(pool, transport, timeout_s)
        self._pending: collections.deque[PendingPropose] = collections.deque()  # sent, not answered, in order
        # address -> (stub it was opened on, stream)
        self._streams: dict[str, tuple[object, BidiStream | LocalStream]] = {}
        # Per replica: one Propose at a time, from handing over its rows to the reply, so Proposes reach a
        # drafter in the order their rows were sent (nccl pairs them by order).
        self._replica_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    async def close(self) -> None:
        for p in self._pending:
            p.future.cancel()
        for _, stream in self._streams.values():
            stream.close()
        await super().close()

    # Step thread.

    def transmit(self, plan: ProposeBatch, pending: PendingPropose) -> None:
        """Hands `plan` to the event loop's `propose` and returns once every replica's transport holds its rows."""
        if not self.pool.targets:  # no speculation: nothing to send
            pending.future = concurrent.futures.Future()
            no_drafts = [[] for _ in plan.items]
            pending.future.set_result(Proposal(False, no_drafts, "no drafter configured", plan.hidden_state_bytes))
            self._pending.append(pending)
            return
        staged = threading.Event()

        async def propose():
            with trace.use_span(pending.span):  # the messages carry this span's trace context
                return await self.propose(plan, len(plan.items), staged.set)

        pending.sent_ns = time.time_ns()
        pending.future = asyncio.run_coroutine_threadsafe(propose(), self.loop)
        staged.wait(self.timeout_s)
        self._pending.append(pending)

    def take_answer(self) -> None:
        """Waits for the oldest Propose's outcome."""
        head = self._pending.popleft()
        try:
            proposal = head.future.result()
        except Exception as err:  # noqa: BLE001 (a bug in the drafter path fails the Propose, not the next Verify)
            log.exception("a pooled Propose failed")
            no_drafts = [[] for _ in range(head.num_reqs)]
            proposal = Proposal(False, no_drafts, f"Propose failed: {err!r}", head.nbytes, 0, None, head.sent_ns)
        self.answered(head, proposal)

    # Event loop.

    async def propose(self, plan: ProposeBatch, num_reqs: int, on_staged: Callable[[], None] | None = None) -> Proposal:
        """Drafts for the plan's requests. `on_staged()` is called once every replica's transport holds
        its rows (the step's hidden states may then be overwritten), or once nothing will be sent."""
        staged = _Countdown(on_staged)
        try:
            return await self._propose(plan, num_reqs, staged)
        finally:
            staged.done()

    async def _propose(self, plan: ProposeBatch, num_reqs: int, staged: _Countdown) -> Proposal:
        nbytes = plan.hidden_state_bytes
        no_drafts = [[] for _ in range(num_reqs)]
        if not self.pool.targets:
            return Proposal(False, no_drafts, "no drafter configured", nbytes)
        await self.pool.start()
        owners = self.pool.assign([item.request_id for item in plan.items])
        groups: dict[str, list[int]] = {}
        for i, owner in enumerate(owners):
            if owner is not None:
                groups.setdefault(owner, []).append(i)
        t0 = time.perf_counter_ns()
        sent_ns = time.time_ns()
        replicas = self.pool.replicas  # read now: DNS re-resolution may change the set meanwhile
        staged.expect(len(groups))
        calls = [self._propose_on(replicas[addr], plan, indices, staged) for addr, indices in groups.items()]
        calls += [self._free_on(replicas[addr]) for addr in self.pool.healthy() if addr not in groups]
        results = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)  # one replica: no task
        elapsed = time.perf_counter_ns() - t0
        proposal = Proposal(True, no_drafts, "", nbytes, elapsed, [None] * num_reqs, sent_ns, time.time_ns())
        errors = []
        for (addr, indices), (resp, error) in zip(groups.items(), results):
            if not error:
                error = take_drafts(proposal, indices, resp)
            self.pool.record_call(addr, len(indices), error or None)
            if error:
                errors.append(f"{addr}: {error}")
        if None in owners and num_reqs:
            errors.append("no healthy drafter replica")
        proposal.ok, proposal.error = not errors, "; ".join(errors)
        return proposal

    async def _propose_on(
        self, replica: Replica, plan: ProposeBatch, indices: list[int], staged: _Countdown
    ) -> tuple[drafter_pb2.ProposeResponse | None, str]:
        """The replica's answer for the requests at `indices`, or what failed (counted in the pool by the caller)."""
        transfer: Transfer | None = None
        try:
            async with self._replica_locks[replica.address]:
                finished = list(replica.pending_free)
                try:
                    rows = plan.rows(indices)  # [num_rows, hidden_size]
                    msg = plan.message(indices, finished, replica.take_cached())
                    if self.transport.needs_open(rows):
                        await self.transport.open(rows, self.open_call(replica))
                    transfer = self.transport.send(rows, msg)
                finally:
                    staged.one()
                inject_trace_context(msg.trace_context)
                resp = await (await self._stream(replica)).call(msg)
                self.transport.finish(transfer, ok=True)
                replica.freed(finished)
        except (grpc.RpcError, TransportError) as err:
            if isinstance(err, grpc.RpcError):
                error = f"{err.code().name}: {err.details()}"
                if transfer is not None:
                    self.transport.finish(transfer, ok=False)
                else:
                    self.transport.reset()
            else:
                error = f"hidden-state transport {self.transport.name}: {err}"
                self.transport.reset()
            return None, error
        except Exception as err:  # noqa: BLE001 (e.g. a rendezvous that failed: the replica fails, not every Propose)
            log.exception("Propose to %s failed", replica.address)
            self.transport.reset()
            return None, f"hidden-state transport {self.transport.name}: {type(err).__name__}: {err}"
        return resp, ""

    async def _stream(self, replica: Replica) -> BidiStream | LocalStream:
        """The replica's ProposeStream, reopened on its current channel (a failed replica gets a fresh
        channel from its health probe; a stream that failed has closed itself): on the replica's Unix socket
        where that is on this host (`_same_host_socket`), else gRPC's. Chosen afresh with each channel, so a
        replica that restarted elsewhere, or whose socket went away, is reached the way it can be now."""
        stub, stream = self._streams.get(replica.address, (None, None))
        if stub is not replica.stub:
            if stream is not None:
                stream.close()
            peer = f"drafter {replica.address}"
            path = await self._same_host_socket(replica)
            if path is None:
                stream = BidiStream(replica.stub.ProposeStream, self.timeout_s, peer)
            else:
                stream = LocalStream(_fixed(path), drafter_pb2.ProposeResponse.FromString, self.timeout_s, peer)
            self._streams[replica.address] = (replica.stub, stream)
        return stream

    async def _same_host_socket(self, replica: Replica) -> str | None:
        """The Unix socket the replica serves ProposeStream on (`ModelInfo.propose_socket`) if this process can
        connect to it, else None. A pooled drafter names its socket for its own process alone, so a path that
        exists here is that drafter on this host; one in another pod, or another host's, does not exist here. The
        socket carries the same messages without gRPC's per-message work, so its round trip costs the host less
        (benchmarks/results/cpu_2core.md; docs/performance.md, "End to end: both placements, one process,
        target-only")."""
        try:
            info = await replica.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError:
            return None  # (the gRPC stream fails the same way: the replica is counted out and probed)
        path = info.propose_socket
        if not path or not os.path.exists(path):
            log.info("drafter %s: ProposeStream on gRPC (its socket %r is not on this host)", replica.address, path)
            return None
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)  # (a full backlog refuses rather than blocks the loop)
        try:
            probe.connect(path)  # (the drafter's thread for this connection ends at once: nothing placed by it)
        except OSError as err:
            log.info(
                "drafter %s: its socket %s is on this host but refused a connection (%s); gRPC",
                replica.address,
                path,
                err,
            )
            return None
        finally:
            probe.close()
        log.info("drafter %s: ProposeStream on its Unix socket %s (on this host)", replica.address, path)
        return path

    async def _free_on(self, replica: Replica) -> None:
        """A replica that drafts nothing this iteration gets its frees by a Free call, after any Propose to it
        still running (the replica's lock): a Free overtaking it would be undone by it."""
        address = replica.address
        if not replica.pending_free:
            return
        async with self._replica_locks[address]:
            finished = list(replica.pending_free)
            try:
                msg = drafter_pb2.DrafterFreeRequest(request_ids=finished)
                await replica.stub.Free(msg, timeout=self.timeout_s, metadata=outgoing_metadata())
            except grpc.RpcError as err:
                self.pool.record_call(address, 0, f"{err.code().name}: {err.details()}")
                return
            replica.freed(finished)
        self.pool.record_call(address, 0)


def _fixed(path: str) -> Callable[[], Awaitable[str]]:
    """`LocalStream`'s `connect` for a path decided once per channel (`PoolChannel._stream`)."""

    async def connect() -> str:
        return path

    return connect
