"""The HTTP API's app without a cluster (ASGI calls in-process): a full queue is 429, a checkpoint without a chat
template answers chat requests 400 saying so, a request before the verifier answered is 503, and the
OpenAI body maps to the coordinator's request in one function; prompt + max_tokens past the model's length, n 0,
stream_options without stream and an option not supported yet are 400; response_format and structured_outputs
become the request's grammar, and a bad one is 400; bodies that are not JSON, unknown paths and methods answer OpenAI
error objects; a body over the limit is 413 without being read."""

import asyncio
import json
import types

import pytest

from specsplit.client.errors import ResourceExhausted
from specsplit.coordinator.generation_config import OPENAI_DEFAULTS
from specsplit.coordinator.http.app import MAX_BODY_BYTES, HttpApi
from specsplit.coordinator.http.mapping import to_generate_request
from specsplit.coordinator.http.protocol import ChatCompletionRequest, CompletionRequest
from specsplit.coordinator.structured_output import compile_grammar
from specsplit.proto import common_pb2
from tests.fixtures.tiny_tokenizer import make_llama_like, write_tiny_tokenizer

INFO = types.SimpleNamespace(vocab_size=320, max_model_len=64, num_speculative_tokens=3, model="tiny")


class FullQueue:
    """An engine whose scheduler's queue is full (Scheduler.add_request's refusal)."""

    def add_request(self, request, queue=None):
        raise ResourceExhausted("too many requests waiting (1024); retry later")

    def abort(self, request_id):
        return False


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    plain = tmp_path_factory.mktemp("plain")
    write_tiny_tokenizer(plain, 320, 64)
    chat = tmp_path_factory.mktemp("chat")
    write_tiny_tokenizer(chat, 320, 64)
    make_llama_like(chat)
    return AutoTokenizer.from_pretrained(plain), AutoTokenizer.from_pretrained(chat)


def call(api: HttpApi, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One request through the ASGI app; (status, JSON body)."""
    status, data, _ = call_raw(api, method, path, [json.dumps(body).encode() if body is not None else b""])
    return status, data


def call_raw(
    api: HttpApi, method: str, path: str, chunks, headers: list[tuple[bytes, bytes]] = ()
) -> tuple[int, dict, int]:
    """One request through the ASGI app whose body comes in `chunks` (an iterable: the last one ends it);
    (status, JSON body, how many chunks the app read)."""
    sent, read = [], [0]

    def messages():
        body = b""
        for i, chunk in enumerate(chunks):
            if i:
                yield {"type": "http.request", "body": body, "more_body": True}
            body = chunk
        yield {"type": "http.request", "body": body, "more_body": False}

    stream = messages()

    async def receive():
        message = next(stream, None)
        if message is None:  # the body was read; the client stays connected
            await asyncio.Event().wait()
        read[0] += 1
        return message

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    asyncio.run(api.app()(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    data = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    return status, data, read[0]


def ready_api(tokenizer, engine=None) -> HttpApi:
    api = HttpApi(tokenizer, frozenset(), OPENAI_DEFAULTS)
    api.ready(engine or FullQueue(), INFO, "tiny")
    return api


def test_a_full_queue_is_429_rate_limit(tokenizers):
    status, body = call(ready_api(tokenizers[0]), "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert "too many requests waiting" in body["error"]["message"]


def test_chat_without_a_template_is_400_saying_so(tokenizers):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    status, body = call(ready_api(tokenizers[0]), "POST", "/v1/chat/completions", chat)
    assert status == 400 and "has no chat template" in body["error"]["message"]
    status, body = call(ready_api(tokenizers[1]), "POST", "/v1/chat/completions", chat)
    assert status == 429  # with a template the request gets as far as the (full) queue


def test_before_the_verifier_answered_requests_are_503_and_health_too(tokenizers):
    api = HttpApi(tokenizers[0], frozenset(), OPENAI_DEFAULTS)
    assert call(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"})[0] == 503
    assert call(api, "GET", "/health") == (503, {"status": "starting"})


def test_the_body_maps_to_one_generate_request_leaving_unset_options_unset():
    body = CompletionRequest(model="m", prompt="x", n=2, seed=3, stop="END", stop_token_ids=[9], top_k=-1)
    msg = to_generate_request(body, prompt="x")
    assert (msg.prompt, msg.max_tokens, msg.n, msg.sampling.seed) == ("x", 0, 2, 3)  # max_tokens: the endpoint's
    assert list(msg.stop) == ["END"] and list(msg.stop_token_ids) == [9]
    assert not msg.sampling.HasField("temperature") and not msg.sampling.HasField("top_k")  # the server's defaults
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=5)
    assert to_generate_request(chat, prompt_token_ids=[1, 2]).max_tokens == 5


def test_on_sigterm_health_fails_at_once_and_new_requests_after_the_delay(tokenizers):
    api = ready_api(tokenizers[0])
    assert call(api, "GET", "/health") == (200, {"status": "ok"})
    api.draining = True  # SIGTERM: load balancers stop sending
    assert call(api, "GET", "/health") == (503, {"status": "draining"})
    assert call(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"})[0] == 429  # still admitted
    api.refusing = True  # --shutdown-delay later
    status, body = call(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert status == 503 and "shutting down" in body["error"]["message"]


class Recorder(FullQueue):
    """Records the requests the API adds, then refuses them (the test needs no tokens)."""

    def __init__(self):
        self.requests = []

    def add_request(self, request, queue=None):
        self.requests.append(request)
        super().add_request(request, queue)


def test_unset_sampling_options_take_generation_config_else_openai_defaults_and_text_gets_bos(tokenizers, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}')
    for defaults, expected in [
        (OPENAI_DEFAULTS.with_generation_config(tmp_path), (0.6, 1.0, 20, 1.1)),
        (OPENAI_DEFAULTS.with_generation_config(tmp_path / "absent"), (1.0, 1.0, 0, 1.0)),  # OpenAI's: temperature 1
    ]:
        engine = Recorder()
        api = HttpApi(tokenizers[1], frozenset(), defaults)
        api.ready(engine, INFO, "tiny")
        assert call(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.0})[0] == 429
        s = engine.requests[0].sampling
        assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == pytest.approx(expected)
        # a text prompt gets the tokenizer's special tokens: BOS first, as transformers' encode gives it
        assert engine.requests[0].prompt_token_ids == tokenizers[1].encode("hi") and tokenizers[1].encode("hi")[0] == 0


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt of a chat request: the template's text, whose BOS the template writes."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_openai_error(body: dict, says: str, param: str | None = None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert says in body["error"]["message"] and body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error"


def test_prompt_and_max_tokens_past_the_model_length_are_400_saying_both_and_the_limit(tokenizers):
    """INFO's max_model_len is 64: a prompt of 60 tokens leaves room for 4."""
    api = ready_api(tokenizers[1])
    for max_tokens in (5, 2**31 - 1):
        status, body = call(
            api, "POST", "/v1/completions", {"model": "tiny", "prompt": [7] * 60, "max_tokens": max_tokens}
        )
        assert status == 400
        assert_openai_error(body, f"prompt has 60 tokens and max_tokens is {max_tokens}")
        assert "maximum context length is 64 tokens" in body["error"]["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    n = len(chat_ids(tokenizers[1], chat["messages"]))
    for option in ("max_tokens", "max_completion_tokens"):
        status, body = call(api, "POST", "/v1/chat/completions", {**chat, option: 64 - n + 1})
        assert status == 400
        assert_openai_error(body, f"prompt has {n} tokens and max_tokens is {64 - n + 1}")
    # exactly the room left is admitted (as far as the full queue)
    assert call(api, "POST", "/v1/completions", {"model": "tiny", "prompt": [7] * 60, "max_tokens": 4})[0] == 429


def test_without_max_tokens_completions_get_16_and_chat_the_rest_of_the_model_length_never_more(tokenizers):
    engine = Recorder()
    api = ready_api(tokenizers[1], engine)
    for prompt in ([7] * 10, [7] * 60):
        assert call(api, "POST", "/v1/completions", {"model": "tiny", "prompt": prompt})[0] == 429
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert call(api, "POST", "/v1/chat/completions", chat)[0] == 429
    n = len(chat_ids(tokenizers[1], chat["messages"]))
    assert [r.sampling.max_tokens for r in engine.requests] == [16, 4, 64 - n]


@pytest.mark.parametrize(
    "path, body, param, says",
    [
        (path, *case)
        for path in ("/v1/completions", "/v1/chat/completions")
        for case in [
            ({"n": 0}, "n", "n must be in [1, 16], got 0"),
            ({"max_tokens": 0}, "max_tokens", "max_tokens must be > 0, got 0"),
        ]
    ]
    + [("/v1/completions", {"logit_bias": {"5": 1.0}}, "logit_bias", "is not supported yet")],
)
def test_options_the_request_cannot_mean_are_400_naming_them(tokenizers, path, body, param, says):
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, data = call(ready_api(tokenizers[1]), "POST", path, {"model": "tiny", **prompt, **body})
    assert status == 400
    assert_openai_error(data, says, param)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body, spec",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, common_pb2.StructuredOutput(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            common_pb2.StructuredOutput(json=json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, common_pb2.StructuredOutput(json=json.dumps(SCHEMA))),
        (
            {"structured_outputs": {"json": '{"type": "string"}'}},
            common_pb2.StructuredOutput(json='{"type": "string"}'),
        ),
        ({"structured_outputs": {"json_object": True}}, common_pb2.StructuredOutput(json_object=True)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, common_pb2.StructuredOutput(regex="[0-9]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"], "regex": None}},  # None: unset, as vLLM reads it
            common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["yes", "no"])),
        ),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, common_pb2.StructuredOutput(grammar='root ::= "x"')),
        (
            {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}},
            common_pb2.StructuredOutput(regex="a"),
        ),
    ],
    ids=[
        "response_format-text",
        "response_format-json_object",
        "response_format-json_schema",
        "structured_outputs-json",
        "structured_outputs-json-text",
        "structured_outputs-json_object",
        "structured_outputs-regex",
        "structured_outputs-choice",
        "structured_outputs-grammar",
        "text-and-structured_outputs",
    ],
)
def test_response_format_and_structured_outputs_become_the_requests_grammar(tokenizers, body, spec):
    msg = to_generate_request(CompletionRequest(model="m", prompt="x", **body), prompt="x")
    assert msg.sampling.HasField("structured_output") == (spec is not None)
    if spec is not None:
        assert msg.sampling.structured_output == spec
    for path, prompt in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        engine = Recorder()
        assert call(ready_api(tokenizers[1], engine), "POST", path, {"model": "tiny", **prompt, **body})[0] == 429
        assert engine.requests[0].sampling.grammar == (None if spec is None else compile_grammar(spec))


@pytest.mark.parametrize(
    "body, param, says",
    [
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "give response_format or structured_outputs, not both",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "type must be text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format", "needs json"),
        ({"structured_outputs": {}}, "structured_outputs", "must give exactly one of json, json_object, regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex, choice"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown key(s) pattern"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "structured_outputs.choice must be a list"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "json_object must be true"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs", "structured_outputs.regex must be a string"),
        # what does not compile: refused by the coordinator's validation, as over gRPC
        ({"structured_outputs": {"regex": "a("}}, None, "structured_output.regex is not a valid regex"),
        ({"structured_outputs": {"json": {"type": "objectx"}}}, None, "not a valid JSON schema"),
        ({"structured_outputs": {"choice": []}}, None, "structured_output.choice needs at least one string"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 3}}}},
            None,
            "not a valid JSON schema",
        ),
    ],
)
def test_a_bad_response_format_or_structured_outputs_is_400_naming_it(tokenizers, body, param, says):
    for path, prompt in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        status, data = call(ready_api(tokenizers[1]), "POST", path, {"model": "tiny", **prompt, **body})
        assert status == 400
        assert_openai_error(data, says, param)


@pytest.mark.parametrize("stream_options", [{"include_usage": True}, {}])
def test_stream_options_are_400_without_stream_true_and_taken_with_it(tokenizers, stream_options):
    api = ready_api(tokenizers[1])
    for path, prompt in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        body = {"model": "tiny", **prompt, "stream_options": stream_options}
        for stream in ({}, {"stream": False}):
            status, data = call(api, "POST", path, {**body, **stream})
            assert status == 400
            assert_openai_error(data, "stream_options needs stream: true", "stream_options")
        assert call(api, "POST", path, {**body, "stream": True})[0] == 429  # as far as the full queue


def test_a_body_over_the_limit_is_413_before_it_is_read(tokenizers):
    """Its content-length says so: none of it is read. Chunked (no content-length): reading stops at the chunk that
    passes the limit, of an endless body."""
    api = ready_api(tokenizers[1])
    chunk = b" " * (1024 * 1024)

    def endless():
        yield b'{"model": "tiny", "prompt": "'
        while True:
            yield chunk

    length = [(b"content-length", str(50 * 1024 * 1024).encode())]
    status, data, read = call_raw(api, "POST", "/v1/completions", endless(), length)
    assert (status, read) == (413, 0)
    assert_openai_error(data, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    status, data, read = call_raw(api, "POST", "/v1/completions", endless())
    assert (status, read) == (413, 1 + MAX_BODY_BYTES // len(chunk))  # the JSON head, then chunks to the limit
    assert_openai_error(data, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    under = [b'{"model": "tiny", "prompt": "hi"', chunk, b"}"]  # chunked, under the limit: read whole
    assert call_raw(api, "POST", "/v1/completions", under)[0] == 429
