"""The verifier → drafter channel: the verifier's one way to its drafters, with two implementations.

- `SocketChannel` (`socket_channel.py`), a co-located drafter (`--placement colocated`): a blocking connection to
  the drafter's Unix socket; the verifier's step thread writes each Propose and reads its answer itself, crossing no
  event loop on either side.
- `PoolChannel` (`pool_channel.py`), pooled drafters: any number of replicas (`drafter_pool.py`), one persistent
  ProposeStream each (on the replica's Unix socket where that is on this host, else gRPC's), the batch split by the
  replica that owns each request and the drafts merged back in batch order.

`channels.make_channel` picks one from the verifier's flags. Every method runs on the event loop or on the verifier's
step thread, as marked; the step thread uses the channel only inside a call the loop makes after `prepare` and before
`collect`:

    event loop   prepare(request_ids)       before a step-thread call that may send: the connection made, the
                                            requests placed on their drafter (so that their frees go to it)
                 collect() -> [Pending]     after it: the Proposes answered or failed meanwhile, in order, counted in
                                            the drafter pool
                 free_all()                 a new coordinator took the verifier over: every request placed is freed
                 open_transport(...)        start-up: the hidden-state transport opened, the drafter checked
                 stats(), close()
    step thread  device_plan(iteration, launched, sampling) -> ProposeBatch | None
                                            a launched step's Propose as a device hand-off, None where it does not
                                            qualify
                 build_request(iteration, batch, step, sampling) -> ProposeBatch
                                            a finished step's Propose (`propose_request.build_propose` builds both)
                 send(plan, context, on_answer, parent) -> Pending
                                            the Propose sent; returns once the step's hidden states may be
                                            overwritten
                 wait(pending) -> Proposal  the answers taken in the order the Proposes went out, each handed to its
                                            `on_answer` on the step thread, until `pending`'s is in
    either       free(ids)                  frees, carried by the next call to the drafter that owned each request

A failure is a failed Propose: its requests get no drafts this iteration (output never changes), the drafter is
counted out of the pool until its health probe finds it back, and the next Propose reconnects and opens the
hidden-state transport afresh. Each Propose is a `send_hidden_states` span under `parent`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from specsplit.client.errors import InvalidArgument, UsageError
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.rpc.telemetry import outgoing_metadata
from specsplit.transport.base import HiddenStatesSender, Transfer, TransportError
from specsplit.verifier.batch import CachedPrefixes, Sampling
from specsplit.verifier.drafter_pool import DrafterPool, Replica, ReplicaStats
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.propose_request import ProposeBatch, SentOutputs, build_propose
from specsplit.verifier.runner import StepOutput
from specsplit.verifier.wire import merge_replica_drafts

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specsplit.verifier")


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


@dataclass
class PendingPropose:
    """One Propose sent by the step thread, until its answer (or failure) is in `proposal`."""

    context: object  # what `on_answer` needs (the step's batch and output)
    num_reqs: int
    nbytes: int
    span: trace.Span
    on_answer: Callable[[PendingPropose], None]
    finished: list[str] = field(default_factory=list)  # frees it carried, dropped from the queue once answered
    sent_ns: int = 0
    t0: int = field(default_factory=time.perf_counter_ns)
    transfer: Transfer | None = None  # SocketChannel: its rows with the transport
    future: object = None  # PoolChannel: the event loop's Propose (a concurrent.futures.Future)
    proposal: Proposal | None = None
    constrained: list[str] = field(default_factory=list)  # its requests whose output the drafter follows
    unsent: bool = False  # failed for want of a connection that `prepare` did not make: the drafter was counted out


def take_drafts(proposal: Proposal, indices: list[int], response: drafter_pb2.ProposeResponse) -> str:
    """A drafter's answer for the batch's requests at `indices` merged into `proposal` (the first answer's stamps
    too); what is wrong with a malformed answer, which merges nothing, else ""."""
    if len(response.drafts) != len(indices):
        return f"returned {len(response.drafts)} drafts for {len(indices)} requests"
    try:
        merge_replica_drafts(proposal, indices, response)
    except InvalidArgument as err:
        for i in indices:
            proposal.drafts[i], proposal.draft_probs[i] = [], None
        return err.message
    if not proposal.drafter_received_ns:
        proposal.drafter_received_ns, proposal.drafter_replied_ns = response.received_ns, response.replied_ns
        proposal.step0_ns, proposal.later_steps_ns = response.step0_ns, response.later_steps_ns
    return ""


class DrafterChannel:
    """What both implementations share: the pool, the transport, the Propose's build and span, the answers' hand-over
    and the collected outcomes. An implementation provides `transmit` and `take_answer` (step thread) and extends
    `prepare`, `collect` and `close` where it needs to."""

    name: str  # the Verify span's `specsplit.proposer`
    colocated = False  # the drafter shares this verifier's host and serves it on its Unix socket

    def __init__(self, pool: DrafterPool, transport: HiddenStatesSender, timeout_s: float):
        self.pool = pool
        self.transport = transport
        self.timeout_s = timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop `prepare` last ran on
        self._done: list[PendingPropose] = []  # answered or failed since the loop last collected
        self._cached_prefixes = CachedPrefixes()
        self._outputs_sent = SentOutputs()  # structured output: what each request's Proposes carried

    # Event loop.

    async def prepare(self, request_ids: list[str]) -> None:
        self.loop = asyncio.get_running_loop()
        await self.pool.start()

    def collect(self) -> list[PendingPropose]:
        done, self._done = self._done, []
        return done

    def free(self, request_ids: list[str]) -> None:
        self._cached_prefixes.drop(request_ids)
        self._outputs_sent.drop(request_ids)
        self.pool.free(request_ids)

    def free_all(self) -> None:
        """Every request placed on a drafter and not freed yet (a new coordinator took the verifier over: the old
        one's last finished ids may never come)."""
        self._cached_prefixes.clear()
        self._outputs_sent.clear()
        self.pool.free(list(self.pool.owner))

    def cache_blocks(self, blocks: list[tuple[str, int, bytes]]) -> None:
        """Prefix caching: blocks of requests placed on a drafter for it to register (request id, block index, its
        key), sent with its next Propose, before its frees."""
        self.pool.cache_blocks(blocks)

    def start_cached(self, prefixes: dict[str, tuple[list[bytes], int]]) -> None:
        """Prefix caching: requests the verifier started on cached blocks, for their drafter to start on its own
        (the drafter's keys and where they end), sent with each one's next Propose."""
        self._cached_prefixes.add(prefixes)

    def stats(self) -> dict[str, ReplicaStats]:
        return self.pool.stats()

    async def close(self) -> None:
        self.transport.close()
        await self.pool.close()

    # Step thread.

    def build_request(
        self, iteration: int, batch: InputBatch, step: StepOutput, sampling: list[Sampling]
    ) -> ProposeBatch:
        return build_propose(
            iteration,
            batch.req_ids,
            step.start_positions,
            batch.num_spec_tokens,
            sampling,
            step.hidden_states,
            next_token_ids=step.next_token_ids,
            num_rejected=step.num_rejected,
            grammar_outputs=step.grammar_outputs,
            sampled_token_ids=step.sampled_token_ids,
            outputs_sent=self._outputs_sent,
            cached_prefixes=self._cached_prefixes,
        )

    def device_plan(self, iteration: int, launched, sampling: list[Sampling]) -> ProposeBatch | None:
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
        return build_propose(
            iteration,
            batch.req_ids,
            batch.num_computed_tokens,
            batch.num_spec_tokens,
            sampling,
            hidden,
            num_rows=rows,
            sampled=launched.sampled,
            num_sampled=launched.num_sampled,
            grammar_outputs=launched.grammar_outputs,
            outputs_sent=self._outputs_sent,
            cached_prefixes=self._cached_prefixes,
        )

    def send(self, plan: ProposeBatch, context, on_answer: Callable[[PendingPropose], None], parent) -> PendingPropose:
        """Sends `plan` (every request of the step); its answer is taken by `wait`. `parent`: the trace context the
        Propose's span goes under."""
        span = tracer.start_span(
            "send_hidden_states",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={"specsplit.hidden_state_bytes": plan.hidden_state_bytes},
        )
        pending = PendingPropose(context, len(plan.items), plan.hidden_state_bytes, span, on_answer)
        pending.constrained = plan.constrained
        self.transmit(plan, pending)
        return pending

    def wait(self, pending: PendingPropose) -> Proposal:
        """Takes the answers in order until `pending`'s is in; returns its Proposal."""
        while pending.proposal is None:
            self.take_answer()
        return pending.proposal

    def transmit(self, plan: ProposeBatch, pending: PendingPropose) -> None:
        """The implementation's send of `plan`: in flight, or answered at once (`answered`) where it failed."""
        raise NotImplementedError

    def take_answer(self) -> None:
        """The implementation's wait for the oldest Propose in flight, handed to `answered`."""
        raise NotImplementedError

    def answered(self, pending: PendingPropose, proposal: Proposal) -> None:
        """`pending`'s outcome: its span ended, handed to its `on_answer`, and kept for the loop's `collect`."""
        pending.proposal = proposal
        # A failed Propose's requests, or those their drafter lacked: their next Propose carries their whole output.
        self._outputs_sent.drop(pending.constrained if not proposal.ok else proposal.outputs_wanted)
        if not proposal.ok:
            pending.span.set_status(trace.Status(trace.StatusCode.ERROR, proposal.error))
        pending.span.end()
        try:
            pending.on_answer(pending)
        finally:
            self._done.append(pending)

    # Either.

    def open_call(self, replica: Replica):
        """The OpenHiddenTransport call a transport's `open` makes to `replica`."""

        def call(request: drafter_pb2.OpenHiddenTransportRequest):
            # A transport that waits for the drafter to join (nccl) gives up after its own timeout_s: so does the call.
            timeout = request.timeout_s if request.timeout_s > 0 else self.timeout_s
            return replica.stub.OpenHiddenTransport(request, timeout=timeout, metadata=outgoing_metadata())

        return call

    async def open_transport(
        self, example: torch.Tensor, wait_s: float, model: common_pb2.ModelInfo | None = None
    ) -> None:
        """Start-up: opens a cuda_ipc / nccl transport with the drafter once it has loaded (waiting up to
        `wait_s`; past that, the first Propose opens it). example: [1, hidden_size], dtype and device of
        the hidden states. Raises TransportConfigError when the drafter runs another transport, serves
        no Unix socket on this host for a co-located drafter, or serves another model than `model`
        (the verifier's; None: not checked). With gRPC's ProposeStream and hidden states inside it
        nothing needs the drafter yet: its first replica is checked if it answers at once, not waited for."""
        waits = self.transport.name != "grpc" or self.colocated
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
        if self.colocated and not os.path.exists(info.propose_socket):
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
            await self.transport.open(example, self.open_call(replica))
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                raise TransportConfigError(f"drafter {replica.address} refused the transport: {err.details()}") from err
            log.warning("could not open the hidden-state transport yet (%s); the first Propose retries", err.code())
        except TransportError as err:
            raise TransportConfigError(str(err)) from err
