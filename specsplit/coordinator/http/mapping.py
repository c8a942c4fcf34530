"""An OpenAI request body → the coordinator's GenerateRequest: the one place the HTTP API's options become the
coordinator's, validated afterwards by `validation.build_requests` as the gRPC API's are (same refusals, same
words). An option the coordinator gains is added here."""

from __future__ import annotations

import json

from specsplit.client.errors import InvalidArgument
from specsplit.client.sdk import structured_output_pb
from specsplit.coordinator.http.errors import BadOption
from specsplit.coordinator.http.protocol import ChatCompletionRequest, CompletionRequest
from specsplit.coordinator.validation import MAX_N
from specsplit.proto import common_pb2, coordinator_pb2

# OpenAI options this server does not honour: (name, the value that means "off").
NOT_SUPPORTED_YET = (
    ("logit_bias", None),
    ("best_of", None),
    ("echo", False),
    ("suffix", None),
    ("tools", None),
)


def to_generate_request(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
) -> coordinator_pb2.GenerateRequest:
    """The GenerateRequest for one prompt of `body` (text or ids); InvalidArgument naming the option for one this
    server does not support yet, a value the request cannot carry, or a value whose meaning the GenerateRequest's
    field would lose (BadOption: 0 is its "unset"). Unset options stay unset: the server's defaults fill them
    (generation_config.json, else OpenAI's; max_tokens: the endpoint's default, given to `build_requests`)."""
    for name, off in NOT_SUPPORTED_YET:
        value = getattr(body, name, off)
        if value is not None and value != off:
            raise BadOption(f"{name} is not supported yet by this server (got {value!r})", param=name)
    if body.stream_options is not None and not body.stream:
        raise BadOption("stream_options needs stream: true", param="stream_options")
    if not 1 <= body.n <= MAX_N:
        raise BadOption(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    msg = coordinator_pb2.GenerateRequest()
    max_tokens, max_tokens_name = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, max_tokens_name = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise BadOption(f"{max_tokens_name} must be > 0, got {max_tokens}", param=max_tokens_name)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    options = [
        ("prompt", msg, "prompt", prompt),
        ("prompt", msg.prompt_token_ids, None, prompt_token_ids),
        (max_tokens_name, msg, "max_tokens", max_tokens),
        ("temperature", msg.sampling, "temperature", body.temperature),
        ("top_p", msg.sampling, "top_p", body.top_p),
        ("top_k", msg.sampling, "top_k", None if body.top_k in (None, -1) else body.top_k),  # vLLM: -1 is off
        ("seed", msg.sampling, "seed", body.seed),
        ("stop", msg.stop, None, stop),
        ("stop_token_ids", msg.stop_token_ids, None, body.stop_token_ids),
        ("ignore_eos", msg, "ignore_eos", body.ignore_eos),
        ("n", msg, "n", body.n),
        ("repetition_penalty", msg.sampling, "repetition_penalty", body.repetition_penalty),
        ("presence_penalty", msg.sampling, "presence_penalty", body.presence_penalty),
        ("frequency_penalty", msg.sampling, "frequency_penalty", body.frequency_penalty),
        ("min_tokens", msg.sampling, "min_tokens", body.min_tokens),
        ("logprobs", msg.sampling, "logprobs", _logprobs(body)),
    ]
    for name, target, field, value in options:
        if value is None:
            continue
        try:
            if field is None:
                target.extend(value)
            else:
                setattr(target, field, value)
        except (TypeError, ValueError) as err:
            raise BadOption(f"{name}={value!r} is out of range: {err}", param=name) from None
    structured_output = _structured_output(body)
    if structured_output is not None:
        msg.sampling.structured_output.CopyFrom(structured_output)
    return msg


def _structured_output(body: CompletionRequest | ChatCompletionRequest) -> common_pb2.StructuredOutput | None:
    """What the output must match: OpenAI's `response_format` or vLLM's `structured_outputs` (not both); None for
    neither (or `{"type": "text"}`). Whether the schema, regex or grammar compiles, validation says."""
    response_format = _response_format(body.response_format)
    if body.structured_outputs is None:
        return response_format
    if response_format is not None:
        raise BadOption("give response_format or structured_outputs, not both", param="structured_outputs")
    try:
        return structured_output_pb(body.structured_outputs, "structured_outputs")
    except InvalidArgument as err:
        raise BadOption(err.message, param="structured_outputs") from None


def _response_format(value: dict | None) -> common_pb2.StructuredOutput | None:
    """OpenAI's response_format: text (nothing), json_object, or json_schema with its `json_schema.schema` (`name`,
    `description` and `strict` are taken as given: the output always matches the schema)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise BadOption(
                f"response_format json_schema needs json_schema.schema, a JSON schema; got {spec!r}",
                param="response_format",
            )
        return common_pb2.StructuredOutput(json=json.dumps(schema))
    raise BadOption(
        f"response_format type must be text, json_object or json_schema, got {value!r}", param="response_format"
    )


def _logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many top alternatives per token, or None: completions take `logprobs: N`; chat takes `logprobs: true`
    with `top_logprobs: N` (0 if unset), as OpenAI defines them."""
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs not in (None, False, True):
            raise BadOption(f"logprobs must be true or false on chat completions, got {body.logprobs!r}", "logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise BadOption("top_logprobs needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None:
        raise BadOption("top_logprobs is a chat completions option; completions take logprobs: N", "top_logprobs")
    if isinstance(body.logprobs, bool):
        raise BadOption(f"logprobs must be an integer on completions, got {body.logprobs!r}", param="logprobs")
    return body.logprobs
