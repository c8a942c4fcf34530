"""OpenAI response objects and stream chunks, as plain dicts (what the official client parses)."""

from __future__ import annotations

import json
import time
import uuid

from specsplit.client.results import SpecStats, TokenLogprobs


class ResponseShape:
    """The objects of one endpoint (`completions` or `chat`) for one request id; `tokenizer` names the tokens of
    log-probabilities."""

    def __init__(self, endpoint: str, model: str, tokenizer=None):
        self.chat = endpoint == "chat"
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stats: SpecStats | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> dict:
        """A whole choice (non-streaming), with this server's speculative-decoding stats (`spec_decode_stats`)."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        out = {"index": index, **body, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
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
        logprobs: list[TokenLogprobs] | None = None,
    ) -> str:
        """One SSE event for one choice's delta; `role` (chat): the choice's first chunk; `with_usage`: the
        request asked for include_usage, so every chunk carries `usage: null` until the last one."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        if stats is not None:
            choice["spec_decode_stats"] = stats.to_dict()
        extra = {"usage": None} if with_usage else {}
        return event(self._object(self._chunk_kind, [choice], **extra))

    def usage_chunk(self, usage: dict) -> str:
        """stream_options.include_usage: the last chunk before [DONE], with no choices."""
        return event(self._object(self._chunk_kind, [], usage=usage))

    def logprobs(self, entries: list[TokenLogprobs] | None) -> dict | None:
        """OpenAI's `logprobs` of a choice or a chunk: chat's `content` list of {token, logprob, bytes,
        top_logprobs}; completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset, the offsets
        counted within these entries' text)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**self._token(e.token_id, e.logprob), "top_logprobs": [
                self._token(t, lp) for t, lp in e.top
            ]} for e in entries]}  # fmt: skip
        tokens = [self._name(e.token_id) for e in entries]
        offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._name(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _name(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _token(self, token_id: int, logprob: float) -> dict:
        name = self._name(token_id)
        return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(prompts: list, completion_tokens: int) -> dict:
    """`prompts`: the first request of each prompt; their prompt tokens, of which `cached_tokens` came from the prefix
    cache when they were admitted."""
    prompt_tokens = sum(r.num_prompt_tokens for r in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens or 0 for r in prompts)},
    }


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
