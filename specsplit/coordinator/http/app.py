"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (whole or SSE-streamed), /v1/models, /health,
/metrics. Requests run on the coordinator's Engine through `generation.Choices`, as the gRPC API's do."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from specsplit.client.errors import InvalidArgument, SpecsplitError, Unavailable
from specsplit.coordinator.generation import Choices
from specsplit.coordinator.generation_config import SamplingDefaults
from specsplit.coordinator.http.chat import chat_prompt_token_ids
from specsplit.coordinator.http.errors import error_body, error_response, from_specsplit_error, status_of
from specsplit.coordinator.http.mapping import to_generate_request
from specsplit.coordinator.http.protocol import ChatCompletionRequest, CompletionRequest
from specsplit.coordinator.http.responses import DONE, ResponseShape, event, usage
from specsplit.coordinator.validation import build_requests
from specsplit.rpc.security import bearer_token_valid
from specsplit.rpc.telemetry import incoming_context

log = logging.getLogger(__name__)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) for /v1/completions
# The largest request body read: a prompt of validation.MAX_PROMPT_CHARS (4 Mi characters, 4 MiB of ASCII) and the
# JSON around it fit, with room for escapes and multi-byte characters; a larger body is 413 before it is read.
MAX_BODY_BYTES = 8 * 1024 * 1024


class HttpApi:
    """The HTTP API's state: `ready()` once the verifier answered; from SIGTERM `draining` (/health 503, as gRPC's
    health is NOT_SERVING), then after --shutdown-delay `refusing` (new requests 503; those in flight finish)."""

    def __init__(self, tokenizer, tokens: frozenset[str], defaults: SamplingDefaults):
        self.tokenizer = tokenizer
        self.model_name = ""  # set by ready()
        self.tokens = tokens
        self.defaults = defaults
        self.engine = None
        self.model_info = None
        self.draining = False
        self.refusing = False
        self.started = int(time.time())

    def ready(self, engine, model_info, model_name: str) -> None:
        self.engine = engine
        self.model_info = model_info
        self.model_name = model_name

    def app(self) -> FastAPI:
        app = FastAPI(title="specsplit", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(SpecsplitError, lambda _r, err: from_specsplit_error(err))
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(HTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)
        app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
        auth = [Depends(self._authenticate)]
        app.get("/health")(self.health)
        app.get("/metrics")(metrics)
        app.get("/v1/models", dependencies=auth)(self.models)
        app.post("/v1/completions", dependencies=auth)(self.completions)
        app.post("/v1/chat/completions", dependencies=auth)(self.chat_completions)
        return app

    def _authenticate(self, request: Request) -> None:
        """Bearer tokens as on gRPC (`--auth-token-file`)."""
        if not self.tokens:
            return
        if not bearer_token_valid(request.headers.get("authorization"), self.tokens):
            raise SpecsplitError("missing or invalid bearer token", grpc.StatusCode.UNAUTHENTICATED)

    async def health(self) -> Response:
        if self.engine is None or self.draining:
            return JSONResponse({"status": "starting" if self.engine is None else "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self) -> dict:
        self._serving()
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "specsplit",
            "max_model_len": self.model_info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def _serving(self, model: str | None = None):
        if self.engine is None:
            raise Unavailable("the coordinator is starting: no verifier yet")
        if self.refusing:
            raise Unavailable("the coordinator is shutting down")
        if model is not None and model != self.model_name:
            raise SpecsplitError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}", grpc.StatusCode.NOT_FOUND
            )
        return self.engine, self.model_info

    def _build(self, msg, default_max_tokens: int) -> list:
        """The request's completions; without max_tokens, `default_max_tokens` at most what the prompt leaves."""
        info = self.model_info
        return build_requests(
            msg,
            tokenizer=self.tokenizer,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            num_speculative_tokens=info.num_speculative_tokens,
            defaults=self.defaults,
            default_max_tokens=default_max_tokens,
        )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._serving(body.model)
        requests, prompts = [], []
        for prompt in _prompts(body.prompt):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            msg = to_generate_request(body, prompt=text, prompt_token_ids=ids)
            built = self._build(msg, COMPLETIONS_DEFAULT_MAX_TOKENS)
            requests += built
            prompts.append(built[0])
        return await self._run(
            request, body, ResponseShape("completions", self.model_name, self.tokenizer), requests, prompts
        )

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        _, info = self._serving(body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = chat_prompt_token_ids(
            self.tokenizer,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
        msg = to_generate_request(body, prompt_token_ids=ids)
        requests = self._build(msg, info.max_model_len)  # unset: up to the model's length, as vLLM's chat
        return await self._run(
            request, body, ResponseShape("chat", self.model_name, self.tokenizer), requests, requests[:1]
        )

    async def _run(self, request: Request, body, shape: ResponseShape, requests: list, prompts: list) -> Response:
        """`prompts`: the first request of each prompt (its n completions share its usage's prompt tokens)."""
        choices = Choices(self.engine, requests, self.model_name, incoming_context(request.headers.items()))
        choices.start()  # a full queue: 429 here, before any byte is sent
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ChoicesStream(_events(choices, shape, prompts, include_usage), choices)
        try:
            return await _unless_disconnected(request, _collect(choices, shape, prompts))
        finally:
            choices.close()


async def metrics() -> Response:
    """The coordinator's metrics in Prometheus' text format (the same as on `--metrics-port`)."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def _collect(choices: Choices, shape: ResponseShape, prompts: list) -> Response:
    n = len(choices.requests)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list | None] = [None] * n
    reasons: list[str | None] = [None] * n
    completion_tokens = 0
    async for i, _, out in choices.outputs():
        texts[i].append(out.text)
        if out.logprobs is not None:
            logprobs[i] = (logprobs[i] or []) + out.logprobs
        completion_tokens += len(out.token_ids)
        reasons[i] = out.finish_reason or reasons[i]
    for i, req in enumerate(choices.requests):
        if req.sampling.logprobs is not None and logprobs[i] is None:
            logprobs[i] = []  # asked for, no token came
    body = [shape.choice(i, "".join(texts[i]), reasons[i], choices.requests[i].stats, logprobs[i]) for i in range(n)]
    return JSONResponse(shape.response(body, usage(prompts, completion_tokens)))


async def _events(choices: Choices, shape: ResponseShape, prompts: list, include_usage: bool):
    """The SSE stream: one chunk per choice's delta, its finish_reason (with its spec_decode_stats) last, the
    usage chunk if asked for, then [DONE]. An error after the stream began is an `error` event before [DONE]."""
    started: set[int] = set()
    completion_tokens = 0
    try:
        async for i, req, out in choices.outputs():
            completion_tokens += len(out.token_ids)
            role = shape.chat and i not in started
            started.add(i)
            if out.text or role or out.logprobs:
                yield shape.chunk(i, out.text, role=role, with_usage=include_usage, logprobs=out.logprobs)
            if out.finish_reason is not None:
                yield shape.chunk(i, "", out.finish_reason, stats=req.stats, with_usage=include_usage)
        if include_usage:
            yield shape.usage_chunk(usage(prompts, completion_tokens))
    except SpecsplitError as err:
        yield event(error_body(err.message, status_of(err)[1], None, err.code.name.lower()))
    yield DONE


class _ChoicesStream(StreamingResponse):
    """An SSE response that aborts its choices however it ends: finished, the client gone (Starlette cancels the
    body's iteration on `http.disconnect`), or never started."""

    def __init__(self, content, choices: Choices):
        super().__init__(content, media_type="text/event-stream")
        self._choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.close()


async def _unless_disconnected(request: Request, work):
    """Awaits `work`, cancelling it when the client disconnects first (the caller's `Choices.close()` then aborts
    the request); 499 when nobody is listening any more."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


def _prompts(prompt) -> list[str | list[int]]:
    """A completions `prompt`: text, ids, or a list of either → one entry per prompt."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise InvalidArgument("prompt is empty")
    return list(prompt)


async def _internal_error(_request, err: Exception) -> JSONResponse:
    """A bug: still an OpenAI error object (500), and the traceback in the log."""
    log.exception("HTTP API: %s", err)
    return error_response(500, f"internal error: {type(err).__name__}", "server_error")


async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
    """Starlette's own refusals as OpenAI error objects: an unknown path (404, in OpenAI's words), a method the path
    does not take (405), a body over MAX_BODY_BYTES (413), a body that is not UTF-8 (400)."""
    if err.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif err.status_code == 405:
        allowed = (err.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}"
    elif isinstance(err.__cause__, UnicodeDecodeError):
        message = f"the body is not valid UTF-8: {err.__cause__}"
    else:
        message = str(err.detail)
    return error_response(err.status_code, message, "invalid_request_error", headers=err.headers)


def _too_large_message(limit: int) -> str:
    return f"the request body is larger than {limit} bytes, this server's limit"


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is 413 (an OpenAI error object), before any of it is read
    when its content-length says so, else (chunked) once the bytes received pass the limit: at most `limit` bytes
    of a body are ever held."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            response = error_response(413, _too_large_message(self.limit), "invalid_request_error")
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # raised inside the body's read: `_http_error` answers it
                    raise HTTPException(413, _too_large_message(self.limit))
            return message

        await self.app(scope, limited_receive, send)


async def _validation_error(_request, err: RequestValidationError) -> JSONResponse:
    """A body that does not parse as the endpoint's request: 400 naming the field."""
    first = err.errors()[0] if err.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(
            400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", "invalid_request_error"
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid request body")
    return error_response(400, message, "invalid_request_error", param)
