"""Structured output, the request side: each kind of StructuredOutput compiles to a grammar that llguidance runs on
the demo checkpoint's tokenizer (what it asks for is accepted token by token, anything else is not); a bad schema,
regex, choice list or grammar is InvalidArgument naming the problem, from the coordinator's validation; compiled
grammars are cached; a client cannot set the verifier's `grammar` itself; the n copies of a request and the
verifier's message carry the grammar."""

import pathlib

import grpc
import llguidance
import llguidance.hf
import pytest

from specsplit.client.errors import InvalidArgument
from specsplit.coordinator import structured_output, wire
from specsplit.coordinator.structured_output import compile_grammar
from specsplit.coordinator.validation import build_requests
from specsplit.proto import common_pb2, coordinator_pb2

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"

PERSON = (
    '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, '
    '"required": ["name", "age"], "additionalProperties": false}'
)
CHOICES = ["yes", "no", "a.b*", 'say "hi"\n', "(x|y)"]  # pattern characters and escapes are taken literally


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(DEMO)
    return hf, llguidance.hf.from_tokenizer(hf)


def matches(tokenizers, grammar: str, text: str) -> bool:
    """Whether a matcher of `grammar` takes `text`'s tokens one by one and then may stop."""
    hf, tokenizer = tokenizers
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in hf.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize(
    "spec, good, bad",
    [
        (
            common_pb2.StructuredOutput(json=PERSON),
            ['{"name":"Ann","age":31}', '{"name":"B","age":7}'],
            # Compact JSON only (no whitespace between tokens: compile_grammar's default), and the schema's shape.
            [
                '{"name": "Ann", "age": 31}',
                '{"name":"Ann","age":"31"}',
                '{"name":"Ann"}',
                '{"name":"Ann","age":31,"x":1}',
                "[1]",
            ],
        ),
        (common_pb2.StructuredOutput(json_object=True), ['{"a":[1,2]}', "{}"], ["[1]", '"a"', "{", '{"a": 1}']),
        (common_pb2.StructuredOutput(regex=r"\d{3}-[a-z]+"), ["123-abc", "000-x"], ["12-abc", "123-", "123-abc!"]),
        (common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=CHOICES)), CHOICES, ["ye", "yess", "a.bb"]),
        (
            common_pb2.StructuredOutput(grammar='root ::= "(" digits ")"\ndigits ::= [0-9]+'),  # GBNF
            ["(42)", "(0)"],
            ["()", "(4a)", "42"],
        ),
        (common_pb2.StructuredOutput(grammar='start: "(" /[0-9]+/ ")"'), ["(42)"], ["()", "42"]),  # Lark
    ],
    ids=["json", "json_object", "regex", "choice", "grammar-gbnf", "grammar-lark"],
)
def test_each_kind_compiles_to_a_grammar_that_takes_what_it_asks_for_and_nothing_else(tokenizers, spec, good, bad):
    grammar = compile_grammar(spec)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    for text in good:
        assert matches(tokenizers, grammar, text), text
    for text in bad:
        assert not matches(tokenizers, grammar, text), text


def test_unset_is_no_grammar():
    assert compile_grammar(common_pb2.StructuredOutput()) is None


BAD = [
    (common_pb2.StructuredOutput(json='{"type": "object"'), "structured_output.json is not valid JSON"),
    (common_pb2.StructuredOutput(json="[1, 2]"), "structured_output.json must be a JSON schema"),
    (common_pb2.StructuredOutput(json='{"type": "objectx"}'), "not a valid JSON schema: Invalid type: objectx"),
    (common_pb2.StructuredOutput(json='{"properties": 3}'), "not a valid JSON schema: properties must be an object"),
    (common_pb2.StructuredOutput(json_object=False), "structured_output.json_object must be true"),
    (common_pb2.StructuredOutput(regex="a(b"), "structured_output.regex is not a valid regex"),
    (common_pb2.StructuredOutput(choice=common_pb2.ChoiceList()), "structured_output.choice needs at least one"),
    (common_pb2.StructuredOutput(grammar="root ::= digits"), "structured_output.grammar is not a valid GBNF or Lark"),
    (common_pb2.StructuredOutput(grammar="start: digits"), 'unknown name: "digits"'),
    (common_pb2.StructuredOutput(grammar=""), "structured_output.grammar is not a valid GBNF or Lark"),
]


@pytest.mark.parametrize("spec, says", BAD, ids=[f"{s.WhichOneof('kind')}-{i}" for i, (s, _) in enumerate(BAD)])
def test_a_bad_spec_is_invalid_argument_naming_the_problem_in_the_request(spec, says):
    with pytest.raises(InvalidArgument, match="^structured_output") as err:
        compile_grammar(spec)
    assert says in err.value.message
    with pytest.raises(InvalidArgument) as err:  # refused with the request: never sent to the verifier
        build(sampling=common_pb2.SamplingParams(structured_output=spec))
    assert says in err.value.message and err.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_compiled_grammars_are_cached_per_spec():
    structured_output._compile.cache_clear()
    first = compile_grammar(common_pb2.StructuredOutput(json=PERSON))
    again = compile_grammar(common_pb2.StructuredOutput(json=PERSON))
    assert again is first and structured_output._compile.cache_info().hits == 1
    # The same text as two kinds: two grammars
    regex = compile_grammar(common_pb2.StructuredOutput(regex='start: "x"'))
    lark = compile_grammar(common_pb2.StructuredOutput(grammar='start: "x"'))
    assert regex != lark and structured_output._compile.cache_info().misses == 3


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


def build(n: int = 1, **kw):
    msg = coordinator_pb2.GenerateRequest(prompt="a b", max_tokens=4, n=n, **kw)
    return build_requests(msg, tokenizer=WordTokenizer(), vocab_size=100, max_model_len=16, num_speculative_tokens=3)


def test_a_client_cannot_set_the_verifiers_grammar():
    with pytest.raises(InvalidArgument, match="grammar is set by the coordinator; pass structured_output"):
        build(sampling=common_pb2.SamplingParams(grammar='start: "x"'))


def test_the_n_completions_and_the_verifiers_message_carry_the_grammar():
    spec = common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["yes", "no"]))
    requests = build(n=3, sampling=common_pb2.SamplingParams(structured_output=spec, temperature=0.7))
    assert len(requests) == 3
    for request in requests:
        assert request.sampling.grammar == compile_grammar(spec)
        assert wire._sampling(request.sampling, frozenset()).grammar == compile_grammar(spec)
    (plain,) = build()
    assert plain.sampling.grammar is None and wire._sampling(plain.sampling, frozenset()).grammar == ""
