"""Structured output: a request's StructuredOutput → the llguidance grammar the verifier masks the target's logits
with (SamplingParams.grammar). Every grammar is compiled and validated here, so a bad schema, regex or grammar is
refused with the request (InvalidArgument naming the problem) and never reaches the verifier."""

from __future__ import annotations

import functools
import json

import llguidance

from specsplit.client.errors import InvalidArgument

CACHE_SIZE = 256  # compiled grammars kept (clients tend to send the same few schemas again and again)


def compile_grammar(spec) -> str | None:
    """The llguidance grammar (as `llguidance.LLMatcher` takes it) that `spec`, a common_pb2.StructuredOutput (not
    imported: protobuf stays at the edges), asks for; None when it sets no kind. InvalidArgument naming the problem
    for one that does not compile."""
    kind = spec.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not spec.json_object:
            raise InvalidArgument("structured_output.json_object must be true (unset it for unconstrained output)")
        return _compile("json", '{"type": "object"}')
    if kind == "choice":
        choices = tuple(spec.choice.choices)
        if not choices:
            raise InvalidArgument("structured_output.choice needs at least one string")
        return _compile(kind, choices)
    return _compile(kind, getattr(spec, kind))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compile(kind: str, value: str | tuple[str, ...]) -> str:
    """The grammar of one kind and its value (hashable, so compiled grammars are cached)."""
    if kind == "json":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as err:
            raise InvalidArgument(f"structured_output.json is not valid JSON: {err}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidArgument(
                f"structured_output.json must be a JSON schema (an object or a boolean), got {type(schema).__name__}"
            )
        # Compact JSON: no whitespace between tokens beyond what a string holds. With flexible whitespace a model can
        # pad a value with spaces or newlines until max_tokens, and the text never closes.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
        what = "a valid JSON schema"
    elif kind == "regex":
        grammar, what = llguidance.LLMatcher.grammar_from_regex(value), "a valid regex"
    elif kind == "choice":
        # Each choice a Lark string literal: JSON's escapes are Lark's, so any text stays literal.
        grammar, what = llguidance.grammar_from("choice", json.dumps(list(value))), "a valid choice list"
    else:  # grammar: GBNF is converted to Lark; Lark (a `start:` rule or `%llguidance`) is taken as it is
        try:
            grammar = llguidance.grammar_from("grammar", value)
        except ValueError as err:
            raise InvalidArgument(f"structured_output.grammar is not a valid GBNF or Lark grammar: {err}") from None
        what = "a valid GBNF or Lark grammar"
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)  # warnings: still valid
    if is_error:
        raise InvalidArgument(f"structured_output.{kind} is not {what}: {messages[0].strip()}")
    return grammar
