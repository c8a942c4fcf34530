"""Client-facing gRPC servicer: Generate (server streaming), Abort, GetModelInfo, GetStats."""

from __future__ import annotations

import logging
import time

import grpc

from specsplit.coordinator import observability as obs
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.validation import build_request
from specsplit.errors import SpecsplitError
from specsplit.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specsplit.telemetry import incoming_context

log = logging.getLogger(__name__)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
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
        req = None
        try:
            req = build_request(
                request,
                tokenizer=self.tokenizer,
                vocab_size=info.vocab_size,
                max_model_len=info.max_model_len,
                num_speculative_tokens=info.num_speculative_tokens,
            )
            remaining = context.time_remaining()
            if remaining is not None:
                req.deadline = time.monotonic() + remaining
            req.span = obs.start_request_span(req, info.model, incoming_context(context.invocation_metadata()))
            queue = engine.add_request(req)
        except SpecsplitError as err:
            if req is not None:
                obs.end_request_span(req.span, req, "rejected", err)
            await context.abort(err.code, err.message)
        finished = False
        reason, error = "abort", None
        num_completion = 0
        try:
            while True:
                out = await queue.get()
                if out.error is not None:
                    finished = True
                    reason, error = "error", out.error
                    await context.abort(out.error.code, out.error.message)
                if out.finish_reason is not None:
                    finished = True
                    reason = out.finish_reason
                    yield coordinator_pb2.GenerateResponse(
                        request_id=req.request_id,
                        finish_reason=out.finish_reason,
                        usage=coordinator_pb2.Usage(
                            prompt_tokens=req.num_prompt_tokens, completion_tokens=num_completion
                        ),
                        spec_stats=req.stats.to_pb(),
                    )
                    return
                num_completion += len(out.token_ids)
                if out.token_ids or out.text:
                    yield coordinator_pb2.GenerateResponse(
                        request_id=req.request_id, token_ids=out.token_ids, text=out.text
                    )
        finally:
            if not finished:  # cancelled by the client, deadline, or server shutdown
                engine.abort(req.request_id)
            obs.end_request_span(req.span, req, reason, error)

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
            iterations=list(engine.iteration_timings) if request.include_iterations else [],
        )
