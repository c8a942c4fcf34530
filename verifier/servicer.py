"""Verifier gRPC servicer: protobuf in → InputBatch → runner → drafter → protobuf out."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

import grpc

from models.kv_cache import PagedKVCache
from protos import common_pb2, verifier_pb2, verifier_pb2_grpc
from specsplit.errors import SpecsplitError
from verifier.drafter_client import DrafterClient, sampling_of
from verifier.input_batch import build_input_batch
from verifier.runner import VerifierRunner

log = logging.getLogger(__name__)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """Registered before the server starts; answers UNAVAILABLE until `ready()` (weights loaded)."""

    def __init__(self, drafter: DrafterClient, device: str):
        self.runner: VerifierRunner | None = None
        self.model_info: common_pb2.ModelInfo | None = None
        self.drafter = drafter
        self.device = device
        # Model work runs on one thread: the GPU (or the CPU's cores) does one step at a time.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verifier-step")
        self._lock = asyncio.Lock()

    def ready(self, runner: VerifierRunner, model_info: common_pb2.ModelInfo) -> None:
        self.runner = runner
        self.model_info = model_info

    async def _require_ready(self, context) -> None:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier is loading its weights")

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.runner.kv_cache

    def _prepare_and_step(self, request: verifier_pb2.VerifyRequest):
        self.runner.free(list(request.finished_request_ids))
        batch = build_input_batch(
            request,
            vocab_size=self.model_info.vocab_size,
            max_model_len=self.model_info.max_model_len,
            num_cached_tokens=self.kv_cache.num_tokens,
            device=self.device,
        )
        return batch, self.runner.step(batch)

    async def Verify(self, request, context):
        await self._require_ready(context)
        loop = asyncio.get_running_loop()
        async with self._lock:
            self.drafter.free(list(request.finished_request_ids))
            try:
                batch, step = await loop.run_in_executor(self._executor, self._prepare_and_step, request)
            except SpecsplitError as err:
                await context.abort(err.code, err.message)
            propose_msg = self.drafter.build_request(request.iteration, batch, step, sampling_of(request))
            proposal = await self.drafter.propose(propose_msg, batch.num_reqs)
        response = verifier_pb2.VerifyResponse(
            drafter_ok=proposal.ok,
            drafter_error=proposal.error,
            hidden_state_bytes=proposal.hidden_state_bytes,
            timing=verifier_pb2.VerifyTiming(
                prepare_ns=step.prepare_ns,
                forward_ns=step.forward_ns,
                sample_ns=step.sample_ns,
                propose_ns=proposal.propose_ns,
            ),
        )
        for i, rid in enumerate(batch.req_ids):
            response.results.add(
                request_id=rid,
                sampled_token_ids=step.sampled_token_ids[i],
                num_rejected=step.num_rejected[i],
                draft_token_ids=proposal.drafts[i] if batch.sample[i] else [],
            )
        return response

    async def Free(self, request, context):
        await self._require_ready(context)
        async with self._lock:
            self.runner.free(list(request.request_ids))
            self.drafter.free(list(request.request_ids))
        return verifier_pb2.FreeResponse(num_free_blocks=self.kv_cache.num_free_blocks)

    async def GetModelInfo(self, request, context):
        await self._require_ready(context)
        return self.model_info
