"""Sends an iteration's hidden states to the drafter and brings back its drafts.

Losing the drafter never changes output: any failure here means "no drafts this iteration",
and the requests decode plainly until the drafter answers again. Frees that could not be
delivered are kept and sent with the next successful call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from models.wire import tensor_to_proto
from protos import common_pb2, drafter_pb2, drafter_pb2_grpc
from specsplit.grpc_server import insecure_channel
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


class DrafterClient:
    def __init__(self, address: str | None, timeout_s: float = 30.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = insecure_channel(address) if address else None
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel) if self._channel else None
        self._pending_free: list[str] = []
        self._was_ok = True

    def free(self, request_ids: list[str]) -> None:
        self._pending_free.extend(request_ids)

    def build_request(
        self, iteration: int, batch: InputBatch, step: StepOutput, sampling: list[common_pb2.SamplingParams]
    ) -> drafter_pb2.ProposeRequest:
        msg = drafter_pb2.ProposeRequest(
            iteration=iteration,
            hidden_states=tensor_to_proto(step.hidden_states),
            finished_request_ids=self._pending_free,
        )
        for i, rid in enumerate(batch.req_ids):
            item = msg.requests.add(
                request_id=rid,
                start_position=step.start_positions[i],
                next_token_ids=step.next_token_ids[i],
                num_rejected=step.num_rejected[i],
                num_spec_tokens=batch.num_spec_tokens[i],
            )
            item.sampling.CopyFrom(sampling[i])
        return msg

    async def propose(self, msg: drafter_pb2.ProposeRequest, num_reqs: int) -> Proposal:
        nbytes = len(msg.hidden_states.data)
        if self._stub is None:
            return Proposal(False, [[] for _ in range(num_reqs)], "no drafter configured", nbytes)
        t0 = time.perf_counter_ns()
        try:
            resp = await self._stub.Propose(msg, timeout=self.timeout_s)
        except grpc.RpcError as err:
            if self._was_ok:
                log.warning(
                    "drafter %s failed (%s: %s); continuing without drafts",
                    self.address,
                    err.code().name,
                    err.details(),
                )
            self._was_ok = False
            return Proposal(False, [[] for _ in range(num_reqs)], f"{err.code().name}: {err.details()}", nbytes)
        if not self._was_ok:
            log.info("drafter %s is back", self.address)
        self._was_ok = True
        del self._pending_free[: len(msg.finished_request_ids)]
        drafts = [list(d.token_ids) for d in resp.drafts]
        if len(drafts) != num_reqs:
            return Proposal(False, [[] for _ in range(num_reqs)], "drafter returned a wrong count", nbytes)
        return Proposal(True, drafts, "", nbytes, time.perf_counter_ns() - t0)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def sampling_of(batch_msg) -> list[common_pb2.SamplingParams]:
    return [r.sampling for r in batch_msg.requests]
