"""The OpenAI request bodies the HTTP API takes. Fields it does not know are ignored, as OpenAI's API ignores
them; the options it knows but cannot honour yet are refused by `mapping.to_generate_request`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    """Options completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # The target's log-probabilities: completions `logprobs: N`; chat `logprobs: true` and `top_logprobs: N`.
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    min_tokens: int | None = None  # vLLM's extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    # Structured output: OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}},
    # or vLLM's extension {"json" | "json_object" | "regex" | "choice" | "grammar": ...} (one of them).
    response_format: dict | None = None
    structured_outputs: dict | None = None
    # Not supported: refused when set to anything but the default.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None


class CompletionRequest(_Body):
    """POST /v1/completions: a prompt as text, token ids, or a list of either (one completion set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, …: handed to the chat template as given

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Body):
    """POST /v1/chat/completions: messages rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    add_generation_prompt: bool = True  # vLLM's extension
    chat_template_kwargs: dict | None = None  # vLLM's extension
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


Endpoint = Literal["completions", "chat"]
