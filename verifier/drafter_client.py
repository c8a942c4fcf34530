"""Sends an iteration's hidden states to the drafter replicas and brings back their drafts.

The batch is split by the replica that owns each request (`DrafterPool`): one Propose call per
replica, all concurrent, drafts merged back in batch order. Losing a replica never changes output:
its requests get no drafts this iteration and are placed on another replica from the next one on;
with no replica at all, requests decode plainly. Frees go to the replica that owned the request,
with its next call (or alone, in a Free call, when it has no request this iteration).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from models.wire import tensor_to_proto
from protos import common_pb2, drafter_pb2
from specsplit.security import TlsFiles
from specsplit.telemetry import outgoing_metadata
from verifier.drafter_pool import DrafterPool, Replica, ReplicaStats, parse_targets
from verifier.input_batch import InputBatch
from verifier.runner import StepOutput

log = logging.getLogger(__name__)


@dataclass
class Proposal:
    ok: bool
    drafts: list[list[int]]  # per request (empty without a drafter)
    error: str = ""
    hidden_state_bytes: int = 0
    propose_ns: int = 0
    draft_probs: list[common_pb2.DraftProbs | None] | None = None  # per request, for sampled drafts


@dataclass
class ProposeBatch:
    """One iteration's drafter input before it is split by replica."""

    iteration: int
    items: list[drafter_pb2.ProposeItem]  # per request, batch order
    row_offsets: list[int]  # [num_reqs + 1]: request i's hidden-state rows are [off[i], off[i+1])
    hidden_states: torch.Tensor  # [num_rows, hidden_size]

    @property
    def hidden_state_bytes(self) -> int:
        return self.hidden_states.numel() * self.hidden_states.element_size()

    def message(self, indices: list[int], finished: list[str]) -> drafter_pb2.ProposeRequest:
        """The Propose call for the requests at `indices` (batch order kept)."""
        if len(indices) == len(self.items):
            rows = self.hidden_states
        else:
            off = self.row_offsets
            rows = torch.cat([self.hidden_states[off[i] : off[i + 1]] for i in indices])
        return drafter_pb2.ProposeRequest(
            iteration=self.iteration,
            requests=[self.items[i] for i in indices],
            hidden_states=tensor_to_proto(rows),
            finished_request_ids=finished,
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
    ):
        self.address = address
        self.timeout_s = timeout_s
        self.pool = pool if pool is not None else DrafterPool(parse_targets(address), tls=tls)

    def free(self, request_ids: list[str]) -> None:
        self.pool.free(request_ids)

    def stats(self) -> dict[str, ReplicaStats]:
        return self.pool.stats()

    def build_request(
        self, iteration: int, batch: InputBatch, step: StepOutput, sampling: list[common_pb2.SamplingParams]
    ) -> ProposeBatch:
        items, offsets = [], [0]
        for i, rid in enumerate(batch.req_ids):
            item = drafter_pb2.ProposeItem(
                request_id=rid,
                start_position=step.start_positions[i],
                next_token_ids=step.next_token_ids[i],
                num_rejected=step.num_rejected[i],
                num_spec_tokens=batch.num_spec_tokens[i],
            )
            item.sampling.CopyFrom(sampling[i])
            items.append(item)
            offsets.append(offsets[-1] + len(step.next_token_ids[i]))
        return ProposeBatch(iteration, items, offsets, step.hidden_states)

    async def propose(self, plan: ProposeBatch, num_reqs: int) -> Proposal:
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
        replicas = self.pool.replicas  # read now: DNS re-resolution may change the set meanwhile
        calls = [self._propose_on(replicas[addr], plan, indices) for addr, indices in groups.items()]
        calls += [self._free_on(replicas[addr]) for addr in self.pool.healthy() if addr not in groups]
        results = await asyncio.gather(*calls)
        elapsed = time.perf_counter_ns() - t0
        drafts, probs, errors = no_drafts, [None] * num_reqs, []
        for (addr, indices), (got, error) in zip(groups.items(), results):
            if error:
                errors.append(f"{addr}: {error}")
                continue
            for i, d in zip(indices, got):
                drafts[i] = list(d.token_ids)
                probs[i] = d.draft_probs if d.HasField("draft_probs") else None
        if None in owners and num_reqs:
            errors.append("no healthy drafter replica")
        return Proposal(not errors, drafts, "; ".join(errors), nbytes, elapsed, probs)

    async def _propose_on(self, replica: Replica, plan: ProposeBatch, indices: list[int]) -> tuple[list, str]:
        address = replica.address
        finished = list(replica.pending_free)
        try:
            msg = plan.message(indices, finished)
            resp = await replica.stub.Propose(msg, timeout=self.timeout_s, metadata=outgoing_metadata())
        except grpc.RpcError as err:
            error = f"{err.code().name}: {err.details()}"
            self.pool.record_call(address, len(indices), error)
            return [], error
        del replica.pending_free[: len(finished)]  # frees queued meanwhile stay
        if len(resp.drafts) != len(indices):
            error = f"returned {len(resp.drafts)} drafts for {len(indices)} requests"
            self.pool.record_call(address, len(indices), error)
            return [], error
        self.pool.record_call(address, len(indices))
        return list(resp.drafts), ""

    async def _free_on(self, replica: Replica) -> None:
        address = replica.address
        finished = list(replica.pending_free)
        if not finished:
            return
        try:
            msg = drafter_pb2.DrafterFreeRequest(request_ids=finished)
            await replica.stub.Free(msg, timeout=self.timeout_s, metadata=outgoing_metadata())
        except grpc.RpcError as err:
            self.pool.record_call(address, 0, f"{err.code().name}: {err.details()}")
            return
        del replica.pending_free[: len(finished)]
        self.pool.record_call(address, 0)

    async def close(self) -> None:
        await self.pool.close()


def sampling_of(batch_msg) -> list[common_pb2.SamplingParams]:
    return [r.sampling for r in batch_msg.requests]
