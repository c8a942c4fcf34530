"""Client-facing gRPC servicer: Generate (server streaming), Abort, GetModelInfo, GetStats."""

from __future__ import annotations

import logging
import time

import grpc

from specsplit.client.errors import SpecsplitError
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.generation import Choices
from specsplit.coordinator.generation_config import GRPC_DEFAULTS, SamplingDefaults
from specsplit.coordinator.validation import build_requests
from specsplit.coordinator.wire import iteration_timing_pb
from specsplit.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specsplit.rpc.telemetry import incoming_context

log = logging.getLogger(__name__)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, tokenizer, defaults: SamplingDefaults = GRPC_DEFAULTS):
        self.tokenizer = tokenizer
        self.defaults = defaults  # what unset sampling options become (generation_config.json's values)
        self.engine: Engine | None = None  # set once the verifier answered
        self.model_info: common_pb2.ModelInfo | None = None

    def ready(self, engine: Engine, model_info: common_pb2.ModelInfo) -> None:
        self.engine = engine
        self.model_info = model_info

    async def _require_engine(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "coordinator is starting: no verifier yet")
        return self.engine

    async def Generate(self, request, context):
        engine = await self._require_engine(context)
        info = self.model_info
        try:
            requests = build_requests(
                request,
                tokenizer=self.tokenizer,
                vocab_size=info.vocab_size,
                max_model_len=info.max_model_len,
                num_speculative_tokens=info.num_speculative_tokens,
                defaults=self.defaults,
            )
        except SpecsplitError as err:
            await context.abort(err.code, err.message)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        parent = incoming_context(context.invocation_metadata())
        num_completion = [0] * len(requests)
        try:
            async with Choices(engine, requests, info.model, parent, deadline) as choices:
                async for index, req, out in choices.outputs():
                    if out.finish_reason is not None:
                        yield coordinator_pb2.GenerateResponse(
                            request_id=req.request_id,
                            finish_reason=out.finish_reason,
                            usage=coordinator_pb2.Usage(
                                prompt_tokens=req.num_prompt_tokens,
                                completion_tokens=num_completion[index],
                                cached_tokens=req.num_cached_tokens or 0,
                            ),
                            spec_stats=req.stats.to_pb(),
                            index=index,
                        )
                    elif out.token_ids or out.text:
                        num_completion[index] += len(out.token_ids)
                        yield coordinator_pb2.GenerateResponse(
                            request_id=req.request_id,
                            token_ids=out.token_ids,
                            text=out.text,
                            index=index,
                            logprobs=[lp.to_pb() for lp in out.logprobs or ()],
                        )
        except SpecsplitError as err:
            await context.abort(err.code, err.message)

    async def Abort(self, request, context):
        engine = await self._require_engine(context)
        return coordinator_pb2.AbortResponse(found=engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        await self._require_engine(context)
        return self.model_info

    async def GetStats(self, request, context):
        engine = await self._require_engine(context)
        return coordinator_pb2.ServerStats(
            spec_stats=engine.totals.to_pb(),
            num_finished_requests=engine.num_finished,
            num_waiting=engine.scheduler.num_waiting,
            num_running=len(engine.scheduler.running),
            iterations=[iteration_timing_pb(t) for t in engine.iteration_timings] if request.include_iterations else [],
        )
