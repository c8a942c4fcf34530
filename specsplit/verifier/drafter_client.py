"""Sends an iteration's hidden states to the drafter replicas and brings back their drafts.

The batch is split by the replica that owns each request (`DrafterPool`): one Propose per
replica, all concurrent, drafts merged back in batch order. Each replica gets one persistent
`ProposeStream` (one message each way per iteration); a broken stream fails the Propose and is
reopened. A co-located drafter (`rpc="local"`) is instead driven on its Unix socket by the verifier's
step thread (`direct_propose.DirectProposer`); this client then only opens its transport and frees.
Losing a replica never changes output: its requests get no drafts this iteration and are placed on
another replica from the next one on; with no replica at all, requests decode plainly. Frees go to
the replica that owned the request, with its next call (or alone, in a Free call, when it has no
request this iteration).

The hidden states travel by the configured transport (`specsplit.transport`): gRPC bytes to any
number of replicas, or cuda_ipc / nccl to exactly one drafter, opened at start-up and opened
again after any failed call.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from specsplit.bidi_stream import BidiStream
from specsplit.errors import UsageError
from specsplit.local_stream import DRAFTER_RPCS, LocalStream
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.security import TlsFiles
from specsplit.telemetry import inject_trace_context, outgoing_metadata
from specsplit.transport.base import HiddenStatesSender, Transfer, TransportError
from specsplit.transport.grpc_bytes import GrpcSender
from specsplit.verifier.direct_propose import DirectProposer, PooledProposer
from specsplit.verifier.drafter_pool import DNS_PREFIX, DrafterPool, Replica, ReplicaStats, parse_targets
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.proposal import Proposal, merge_replica_drafts
from specsplit.verifier.runner import StepOutput

log = logging.getLogger(__name__)


@dataclass
class ProposeBatch:
    """One iteration's drafter input before it is split by replica."""

    iteration: int
    items: Sequence[drafter_pb2.ProposeItem]  # per request, batch order
    row_offsets: list[int]  # [num_reqs + 1]: request i's hidden-state rows are [off[i], off[i+1])
    hidden_states: torch.Tensor  # [num_rows, hidden_size]
    # A device hand-off (`device_plan`): the step's sampled tokens still on the device, items with num_rows.
    sampled: torch.Tensor | None = None  # [num_reqs, width]
    num_sampled: torch.Tensor | None = None  # [num_reqs]
    # The Propose of every request, built with the items (`items` are its requests): the first `message` of
    # them all is this one, no copy of each item made.
    request: drafter_pb2.ProposeRequest | None = None

    @property
    def hidden_state_bytes(self) -> int:
        return self.hidden_states.numel() * self.hidden_states.element_size()

    def rows(self, indices: list[int]) -> torch.Tensor:
        """[rows of the requests at `indices`, hidden_size], batch order kept."""
        if len(indices) == len(self.items):
            return self.hidden_states
        off = self.row_offsets
        return torch.cat([self.hidden_states[off[i] : off[i + 1]] for i in indices])

    def message(self, indices: list[int], finished: list[str]) -> drafter_pb2.ProposeRequest:
        """The Propose call for the requests at `indices`, without its hidden states (the transport adds them)."""
        if self.request is not None and len(indices) == len(self.items):
            msg, self.request = self.request, None  # the caller fills it in: given once
            msg.finished_request_ids.extend(finished)
            return msg
        return drafter_pb2.ProposeRequest(
            iteration=self.iteration, requests=[self.items[i] for i in indices], finished_request_ids=finished
        )


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


class TransportConfigError(UsageError):
    """Verifier and drafter do not fit together (hidden-state transport, control path, model): fix how
    they are started."""


def model_mismatch(ours: common_pb2.ModelInfo, theirs: common_pb2.ModelInfo, address: str) -> str | None:
    """Why the drafter at `address`, which answered `theirs`, cannot draft for the verifier serving
    `ours`, or None: its MTP layers belong to a model of another architecture, vocabulary or hidden size."""
    differ = [
        f"{name} {getattr(theirs, name)} vs {getattr(ours, name)}"
        for name in ("architecture", "vocab_size", "hidden_size")
        if getattr(theirs, name) != getattr(ours, name)
    ]
    if not differ:
        return None
    return (
        f"drafter {address} serves another model than this verifier ({theirs.model!r}, {', '.join(differ)}); "
        "start both from the same checkpoint (--model)"
    )


class DrafterClient:
    """`address`: None (no speculation) or the `--drafter` targets, e.g. `a:50053,dns:///drafter:50053`."""

    def __init__(
        self,
        address: str | None,
        timeout_s: float = 30.0,
        *,
        tls: TlsFiles | None = None,
        pool: DrafterPool | None = None,
        rpc: str = "stream",
        transport: HiddenStatesSender | None = None,
    ):
        if rpc not in DRAFTER_RPCS:
            raise ValueError(f"drafter rpc must be one of {', '.join(DRAFTER_RPCS)}, got {rpc!r}")
        self.address = address
        self.timeout_s = timeout_s
        self.pool = pool if pool is not None else DrafterPool(parse_targets(address), tls=tls)
        self.rpc = rpc
        # address -> (stub it was opened on, stream)
        self._streams: dict[str, tuple[object, BidiStream]] = {}
        # Per replica: one Propose at a time, from handing over its rows to the reply, so Proposes reach a
        # drafter in the order their rows were sent (nccl pairs them by order).
        self._replica_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.transport = transport if transport is not None else GrpcSender()
        targets = self.pool.targets
        one_replica = len(targets) == 1 and not targets[0].startswith(DNS_PREFIX)
        # The verifier's step thread makes the Proposes (`direct_propose.py`): itself on a co-located drafter's
        # socket (`rpc="local"`, one drafter), else through the event loop's `propose`. Not nccl on the socket:
        # its sends pair with the drafter's receives through a process group that a restarted drafter must
        # re-join, which `propose` handles.
        if rpc == "local" and self.transport.name == "nccl":
            raise TransportConfigError("a co-located drafter takes hidden states by cuda_ipc (grpc on CPU), not nccl")
        self.proposer: DirectProposer | PooledProposer
        if rpc == "local" and one_replica:
            self.proposer = DirectProposer(self, targets[0])
        else:
            self.proposer = PooledProposer(self)
        if targets and (self.transport.name != "grpc" or rpc == "local") and not one_replica:
            kind = "a co-located drafter" if rpc == "local" else f"hidden states by {self.transport.name}"
            raise TransportConfigError(
                f"{kind} needs exactly one --drafter HOST:PORT, got {address!r} (several drafter replicas: "
                "--placement pooled with --hidden-transport grpc)"
            )

    def free(self, request_ids: list[str]) -> None:
        self.pool.free(request_ids)

    def free_all(self) -> None:
        """Every request placed on a drafter and not freed yet (a new coordinator took the verifier over: the old
        one's last finished ids may never come)."""
        self.pool.free(list(self.pool.owner))

    def stats(self) -> dict[str, ReplicaStats]:
        return self.pool.stats()

    def build_request(
        self, iteration: int, batch: InputBatch, step: StepOutput, sampling: list[common_pb2.SamplingParams]
    ) -> ProposeBatch:
        msg = drafter_pb2.ProposeRequest(iteration=iteration)
        add = msg.requests.add
        starts, next_ids, rejected, spec = (
            step.start_positions,
            step.next_token_ids,
            step.num_rejected,
            batch.num_spec_tokens,
        )
        for i, rid in enumerate(batch.req_ids):
            item = add()  # fields set one by one: a ProposeItem(...) copied in costs several times more
            item.request_id = rid
            item.start_position = starts[i]
            item.next_token_ids.extend(next_ids[i])
            item.num_rejected = rejected[i]
            item.num_spec_tokens = spec[i]
            _draft_sampling(item, sampling[i])
        offsets = [0, *itertools.accumulate(map(len, next_ids))]
        return ProposeBatch(iteration, msg.requests, offsets, step.hidden_states, request=msg)

    def device_plan(self, iteration: int, launched, sampling: list[common_pb2.SamplingParams]) -> ProposeBatch | None:
        """The Propose of a launched step (`VerifierRunner.launch`) as a device hand-off, sent before the
        step finishes; None where the step does not qualify. It does when the transport takes hand-offs
        (cuda_ipc, open, to a drafter on the same GPU) and every request is a greedy decode step that
        wants drafts: its rows are then its last token and all the drafts it verifies."""
        batch, transport = launched.batch, self.transport
        rows = batch.hand_off_rows() if transport.device_hand_off else None
        if rows is None:
            return None
        hidden = launched.hidden[: batch.query_start[-1]]
        if transport.needs_open(hidden):
            return None
        msg = drafter_pb2.ProposeRequest(iteration=iteration)
        add = msg.requests.add
        starts, spec = batch.num_computed_tokens, batch.num_spec_tokens
        for i, rid in enumerate(batch.req_ids):
            item = add()  # fields set one by one (see build_request)
            item.request_id = rid
            item.start_position = starts[i]
            item.num_spec_tokens = spec[i]
            item.num_rows = rows[i]
            _draft_sampling(item, sampling[i])
        offsets = [0, *itertools.accumulate(rows)]
        return ProposeBatch(iteration, msg.requests, offsets, hidden, launched.sampled, launched.num_sampled, msg)

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
            if error:
                errors.append(f"{addr}: {error}")
                continue
            if not proposal.drafter_received_ns:
                proposal.drafter_received_ns, proposal.drafter_replied_ns = resp.received_ns, resp.replied_ns
                proposal.step0_ns, proposal.later_steps_ns = resp.step0_ns, resp.later_steps_ns
            merge_replica_drafts(proposal, indices, resp)
        if None in owners and num_reqs:
            errors.append("no healthy drafter replica")
        proposal.ok, proposal.error = not errors, "; ".join(errors)
        return proposal

    async def _propose_on(
        self, replica: Replica, plan: ProposeBatch, indices: list[int], staged: _Countdown
    ) -> tuple[drafter_pb2.ProposeResponse | None, str]:
        address = replica.address
        transfer: Transfer | None = None
        try:
            async with self._replica_locks[address]:
                finished = list(replica.pending_free)
                try:
                    rows = plan.rows(indices)  # [num_rows, hidden_size]
                    msg = plan.message(indices, finished)
                    if self.transport.needs_open(rows):
                        await self.transport.open(rows, self._open_call(replica))
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
            self.pool.record_call(address, len(indices), error)
            return None, error
        if len(resp.drafts) != len(indices):
            error = f"returned {len(resp.drafts)} drafts for {len(indices)} requests"
            self.pool.record_call(address, len(indices), error)
            return None, error
        self.pool.record_call(address, len(indices))
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

    def _open_call(self, replica: Replica):
        def call(request: drafter_pb2.OpenHiddenTransportRequest):
            return replica.stub.OpenHiddenTransport(request, timeout=self.timeout_s, metadata=outgoing_metadata())

        return call

    async def open_transport(
        self, example: torch.Tensor, wait_s: float, model: common_pb2.ModelInfo | None = None
    ) -> None:
        """Start-up: opens a cuda_ipc / nccl transport with the drafter once it has loaded (waiting up to
        `wait_s`; past that, the first Propose opens it). example: [1, hidden_size], dtype and device of
        the hidden states. Raises TransportConfigError when the drafter runs another transport, serves
        no Unix socket on this host for `rpc="local"` (co-located), or serves another model than `model`
        (the verifier's; None: not checked). With gRPC's ProposeStream and hidden states inside it
        nothing needs the drafter yet: its first replica is checked if it answers at once, not waited for."""
        waits = self.transport.name != "grpc" or self.rpc == "local"
        if not waits and model is None:
            return
        await self.pool.start()
        if not self.pool.replicas:  # a DNS name that resolved to nothing yet
            return
        replica = next(iter(self.pool.replicas.values()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (wait_s if waits else 0.0)
        while True:
            try:
                info = await replica.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5.0)
                break
            except grpc.RpcError as err:
                if loop.time() > deadline:
                    level = logging.WARNING if waits else logging.INFO
                    later = "opening the transport later" if waits else "its model is not checked"
                    log.log(level, "drafter %s not ready (%s); %s", replica.address, err.code(), later)
                    return
                await asyncio.sleep(0.5)
        refusal = model_mismatch(model, info, replica.address) if model is not None else None
        if refusal:
            raise TransportConfigError(refusal)
        if model is not None and info.num_blocks * info.block_size < model.num_blocks * model.block_size:
            log.warning(
                "drafter %s holds %d tokens of MTP KV cache, fewer than this verifier's %d: requests past that go "
                "without drafts; give the drafter a larger --gpu-memory-utilization or --num-blocks",
                replica.address,
                info.num_blocks * info.block_size,
                model.num_blocks * model.block_size,
            )
        if self.rpc == "local" and not os.path.exists(info.propose_socket):
            raise TransportConfigError(
                f"a co-located drafter shares its verifier's host: drafter {replica.address} serves ProposeStream on "
                f"{info.propose_socket or 'no socket'!r}, not on this host (start it with --placement colocated "
                "beside this verifier, or start both with --placement pooled)"
            )
        if self.transport.name == "grpc":
            return
        theirs = info.hidden_transport or "grpc"
        if theirs != self.transport.name:
            raise TransportConfigError(
                f"drafter {replica.address} takes hidden states by {theirs} but this verifier sends them by "
                f"{self.transport.name}; start both with the same --placement (and, pooled, --hidden-transport)"
            )
        try:
            await self.transport.open(example, self._open_call(replica))
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                raise TransportConfigError(f"drafter {replica.address} refused the transport: {err.details()}") from err
            log.warning("could not open the hidden-state transport yet (%s); the first Propose retries", err.code())
        except TransportError as err:
            raise TransportConfigError(str(err)) from err

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

    async def close(self) -> None:
        self.proposer.close()
        for _, stream in self._streams.values():
            stream.close()
        self.transport.close()
        await self.pool.close()


def _fixed(path: str) -> Callable[[], Awaitable[str]]:
    """`LocalStream`'s `connect` for a path decided once per channel (`DrafterClient._stream`)."""

    async def connect() -> str:
        return path

    return connect


def _draft_sampling(item: drafter_pb2.ProposeItem, sp: common_pb2.SamplingParams) -> None:
    """What the drafter reads of a request's sampling: a sampled request's temperature and seed (a greedy one's
    temperature is 0, unset); not the rest (penalties, end tokens), which only the verifier applies."""
    if sp.temperature:
        item.sampling.temperature = sp.temperature
        if sp.HasField("seed"):
            item.sampling.seed = sp.seed


def sampling_of(batch_msg) -> list[common_pb2.SamplingParams]:
    return [r.sampling for r in batch_msg.requests]
