"""Incremental detokenization with stop strings.

Decoding a sliding window of tokens (rather than the whole output every step) keeps the cost per
step constant; a window whose text ends in U+FFFD is an incomplete UTF-8 sequence and is held back
until the next token completes it (or, at the end of the output, given as a whole decode gives it).
When stop strings are set, the last `max(len(stop)) - 1` characters are held back too, so a client
never sees the beginning of a stop string that is then cut.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the window so word boundaries come out right


def fast_decode(tokenizer):
    """The Rust tokenizer's own decode, where it returns exactly what `tokenizer.decode(ids,
    skip_special_tokens=True)` does (a fast tokenizer that does not clean up tokenization spaces);
    else the tokenizer's decode. transformers' decode spends most of its time per call checking and converting
    the ids, and the engine decodes twice per generated token, so at large batches that check is a noticeable share
    of the coordinator's host time per iteration (docs/performance.md, "Host time around the GPU work (CPU)")."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self._decode = fast_decode(tokenizer)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False

    def add_tokens(self, token_ids: list[int]) -> str:
        """Adds generated tokens; returns the text delta that can be streamed now."""
        if self.stopped:
            return ""
        for token in token_ids:
            self._ids.append(token)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                continue
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._apply_stop():
                break
        return self._take(final=self.stopped)

    def _apply_stop(self) -> bool:
        for stop in self._stop:
            start = max(0, self._emitted - len(stop))
            idx = self.text.find(stop, start)
            if idx != -1:
                self.text = self.text[:idx]
                self.stopped = True
                return True
        return False

    def flush(self) -> str:
        """Returns whatever was held back (call when the request finishes), including the tokens of an output
        that ends inside a UTF-8 sequence: decoded as a whole decode gives them (U+FFFD for the incomplete tail)."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix):
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset = len(self._ids)
                self._apply_stop()
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
