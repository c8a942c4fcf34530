"""OpenAI response objects and stream chunks, as plain dicts (what the official client parses)."""

from __future__ import annotations

import json
import time
import uuid

from specsplit.results import SpecStats


class ResponseShape:
    """The objects of one endpoint (`completions` or `chat`) for one request id."""

    def __init__(self, endpoint: str, model: str):
        self.chat = endpoint == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def choice(self, index: int, text: str, finish_reason: str | None, stats: SpecStats | None = None) -> dict:
        """A whole choice (non-streaming), with this server's speculative-decoding stats (`spec_decode_stats`)."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        out = {"index": index, **body, "logprobs": None, "finish_reason": finish_reason}
        if stats is not None:
            out["spec_decode_stats"] = stats.to_dict()
        return out

    def response(self, choices: list[dict], usage: dict) -> dict:
        return self._object("chat.completion" if self.chat else "text_completion", choices, usage=usage)

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        stats: SpecStats | None = None,
        with_usage: bool = False,
    ) -> str:
        """One SSE event for one choice's delta; `role` (chat): the choice's first chunk; `with_usage`: the
        request asked for include_usage, so every chunk carries `usage: null` until the last one."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if stats is not None:
            choice["spec_decode_stats"] = stats.to_dict()
        extra = {"usage": None} if with_usage else {}
        return event(self._object(self._chunk_kind, [choice], **extra))

    def usage_chunk(self, usage: dict) -> str:
        """stream_options.include_usage: the last chunk before [DONE], with no choices."""
        return event(self._object(self._chunk_kind, [], usage=usage))

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
