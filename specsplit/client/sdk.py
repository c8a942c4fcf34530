"""Client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for the coordinator's API.

    from specsplit import Client
    with Client("127.0.0.1:50051") as client:
        out = client.generate("def fib(n):", max_tokens=64)
        print(out.text, out.stats.acceptance_rate)

Errors raise `SpecsplitError` whose `.code` is the gRPC status (INVALID_ARGUMENT, UNAVAILABLE, …).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc

from specsplit.client.errors import InvalidArgument, from_rpc_error
from specsplit.client.results import Collector, GenerationDelta, GenerationResult, SpecStats, delta_from_pb
from specsplit.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specsplit.rpc.server import CHANNEL_OPTIONS
from specsplit.rpc.telemetry import outgoing_metadata


def _request(
    prompt,
    prompt_token_ids,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    stop,
    ignore_eos,
    num_speculative_tokens,
    request_id,
    stop_token_ids,
    n,
    structured_output,
    options: dict,
) -> coordinator_pb2.GenerateRequest:
    """The request message; a value its field cannot hold (a negative seed, max_tokens past int32, a string for a
    number) raises InvalidArgument naming the option, as the coordinator names what it refuses."""
    msg = coordinator_pb2.GenerateRequest()
    options = [
        ("request_id", msg, "request_id", request_id or ""),
        ("prompt_token_ids", msg.prompt_token_ids, None, list(prompt_token_ids or [])),
        ("max_tokens", msg, "max_tokens", max_tokens),
        ("temperature", msg.sampling, "temperature", temperature),
        ("top_p", msg.sampling, "top_p", top_p),
        ("top_k", msg.sampling, "top_k", top_k),
        ("seed", msg.sampling, "seed", seed),
        ("stop", msg.stop, None, [stop] if isinstance(stop, str) else list(stop or [])),
        ("ignore_eos", msg, "ignore_eos", ignore_eos),
        ("prompt", msg, "prompt", prompt),
        ("num_speculative_tokens", msg, "num_speculative_tokens", num_speculative_tokens),
        ("stop_token_ids", msg.stop_token_ids, None, stop_token_ids),
        ("n", msg, "n", n),
        *((name, msg.sampling, name, options.get(name)) for name in LOGITS_OPTIONS),
    ]
    for name, target, field, value in options:
        if value is None:
            continue  # unset: the server's default
        try:
            if field is None:
                target.extend(value)  # a repeated field
            else:
                setattr(target, field, value)
        except (TypeError, ValueError) as err:
            raise InvalidArgument(f"{name}={value!r} cannot be sent: {err}") from None
    if structured_output is not None:
        msg.sampling.structured_output.CopyFrom(structured_output_pb(structured_output))
    return msg


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_output_pb(value, option: str = "structured_output") -> common_pb2.StructuredOutput:
    """vLLM's `structured_outputs` shape as a StructuredOutput: a dict giving exactly one of `json` (a JSON schema: a
    dict, or its JSON text), `json_object` (True), `regex`, `choice` (a list of strings) and `grammar` (GBNF or
    Lark); a key whose value is None is unset. Another shape raises InvalidArgument naming `option`; whether the
    schema, regex or grammar compiles is the coordinator's to say."""
    kinds = ", ".join(STRUCTURED_OUTPUT_KINDS)
    if not isinstance(value, dict):
        raise InvalidArgument(f"{option} must be a dict with exactly one of {kinds}, got {value!r}")
    unknown = sorted(str(k) for k in set(value) - set(STRUCTURED_OUTPUT_KINDS))
    if unknown:
        raise InvalidArgument(f"{option} has unknown key(s) {', '.join(unknown)}; it takes exactly one of {kinds}")
    given = {k: v for k, v in value.items() if v is not None}
    if len(given) != 1:
        names = ", ".join(given) or "none"
        raise InvalidArgument(f"{option} must give exactly one of {kinds}; got {names}")
    ((kind, v),) = given.items()
    pb = common_pb2.StructuredOutput()
    if kind == "json":
        if isinstance(v, dict | bool):
            try:
                v = json.dumps(v)
            except (TypeError, ValueError) as err:
                raise InvalidArgument(f"{option}.json cannot be written as JSON: {err}") from None
        if not isinstance(v, str):
            raise InvalidArgument(f"{option}.json must be a JSON schema (a dict or its JSON text), got {v!r}")
        pb.json = v
    elif kind == "json_object":
        if v is not True:
            raise InvalidArgument(f"{option}.json_object must be true, got {v!r}")
        pb.json_object = True
    elif kind == "choice":
        if not isinstance(v, list | tuple) or not all(isinstance(c, str) for c in v):
            raise InvalidArgument(f"{option}.choice must be a list of strings, got {v!r}")
        pb.choice.choices.extend(v)
    else:
        if not isinstance(v, str):
            raise InvalidArgument(f"{option}.{kind} must be a string, got {v!r}")
        setattr(pb, kind, v)
    return pb


LOGITS_OPTIONS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logprobs")


def _logits_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(LOGITS_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
    return options


def _channel(api, address: str, tls_ca: str | bytes | None, token: str | None):
    """A channel from `api` (grpc or grpc.aio): TLS when `tls_ca` is given, plus a bearer token."""
    if tls_ca is None:
        if token is not None:
            raise ValueError("a bearer token needs TLS (tls_ca): tokens are never sent in plaintext")
        return api.insecure_channel(address, options=CHANNEL_OPTIONS)
    ca = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return api.secure_channel(address, creds, options=CHANNEL_OPTIONS)


class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of every call.

    `tls_ca` (a CA file path or PEM bytes) connects over TLS; `token` sends `authorization: Bearer`.
    """

    def __init__(
        self, address: str, *, timeout: float | None = None, tls_ca: str | bytes | None = None, token: str | None = None
    ):
        self._channel = _channel(grpc, address, tls_ca, token)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self.timeout = timeout

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        max_tokens: int = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        ignore_eos: bool = False,
        num_speculative_tokens: int | None = None,
        request_id: str = "",
        timeout: float | None = None,
        stop_token_ids: list[int] | None = None,
        n: int | None = None,
        structured_output: dict | None = None,
        **options,
    ) -> Iterator[GenerationDelta]:
        """Streams the request's deltas. `structured_output`: what the output must match, in vLLM's
        `structured_outputs` shape (`structured_output_pb`), e.g. `{"json": schema}`, `{"regex": "[0-9]+"}`,
        `{"choice": ["yes", "no"]}`. `options`: repetition_penalty, presence_penalty, frequency_penalty,
        min_tokens, logprobs (the target's log-probability of each token and of the top N; on each delta)."""
        msg = _request(
            prompt,
            prompt_token_ids,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop,
            ignore_eos,
            num_speculative_tokens,
            request_id,
            stop_token_ids,
            n,
            structured_output,
            _logits_options(options),
        )
        call = self._stub.Generate(msg, timeout=timeout or self.timeout, metadata=outgoing_metadata())
        try:
            for pb in call:
                yield delta_from_pb(pb)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op when finished; aborts the request when the caller stops early

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        return self.generate_n(prompt, n=1, **kwargs)[0]

    def generate_n(self, prompt: str | None = None, *, n: int, **kwargs) -> list[GenerationResult]:
        """n independent completions of one prompt, in `index` order."""
        collectors = [Collector() for _ in range(n)]
        for d in self.stream(prompt, n=n, **kwargs):
            collectors[d.index].add(d)
        return [c.result() for c in collectors]

    def abort(self, request_id: str) -> bool:
        try:
            return self._stub.Abort(coordinator_pb2.AbortRequest(request_id=request_id), timeout=self.timeout).found
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def model_info(self) -> common_pb2.ModelInfo:
        try:
            return self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def server_stats(self) -> tuple[SpecStats, coordinator_pb2.ServerStats]:
        try:
            pb = self._stub.GetStats(coordinator_pb2.GetStatsRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return SpecStats.from_pb(pb.spec_stats), pb

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client mirroring `Client` (same TLS and token options)."""

    def __init__(
        self, address: str, *, timeout: float | None = None, tls_ca: str | bytes | None = None, token: str | None = None
    ):
        self._channel = _channel(grpc.aio, address, tls_ca, token)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self.timeout = timeout

    async def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        max_tokens: int = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        ignore_eos: bool = False,
        num_speculative_tokens: int | None = None,
        request_id: str = "",
        timeout: float | None = None,
        stop_token_ids: list[int] | None = None,
        n: int | None = None,
        structured_output: dict | None = None,
        **options,
    ) -> AsyncIterator[GenerationDelta]:
        """As `Client.stream`."""
        msg = _request(
            prompt,
            prompt_token_ids,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop,
            ignore_eos,
            num_speculative_tokens,
            request_id,
            stop_token_ids,
            n,
            structured_output,
            _logits_options(options),
        )
        call = self._stub.Generate(msg, timeout=timeout or self.timeout, metadata=outgoing_metadata())
        try:
            async for pb in call:
                yield delta_from_pb(pb)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        return (await self.generate_n(prompt, n=1, **kwargs))[0]

    async def generate_n(self, prompt: str | None = None, *, n: int, **kwargs) -> list[GenerationResult]:
        """n independent completions of one prompt, in `index` order."""
        collectors = [Collector() for _ in range(n)]
        async for d in self.stream(prompt, n=n, **kwargs):
            collectors[d.index].add(d)
        return [c.result() for c in collectors]

    async def abort(self, request_id: str) -> bool:
        try:
            resp = await self._stub.Abort(coordinator_pb2.AbortRequest(request_id=request_id), timeout=self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return resp.found

    async def model_info(self) -> common_pb2.ModelInfo:
        try:
            return await self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
