"""The HTTP API's app without a cluster (ASGI calls in-process): a full queue is 429, a checkpoint without a chat
template answers chat requests 400 saying so, a request before the verifier answered is 503, and the
OpenAI body maps to the coordinator's request in one function."""

import asyncio
import json
import types

import pytest

from specsplit.coordinator.generation_config import OPENAI_DEFAULTS
from specsplit.coordinator.http.app import HttpApi
from specsplit.coordinator.http.mapping import to_generate_request
from specsplit.coordinator.http.protocol import ChatCompletionRequest, CompletionRequest
from specsplit.errors import ResourceExhausted
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
    sent = []
    payload = json.dumps(body).encode() if body is not None else b""

    async def receive():
        return {"type": "http.request", "body": payload, "more_body": False}

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
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    asyncio.run(api.app()(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


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
    msg = to_generate_request(body, prompt="x", default_max_tokens=16)
    assert (msg.prompt, msg.max_tokens, msg.n, msg.sampling.seed) == ("x", 16, 2, 3)
    assert list(msg.stop) == ["END"] and list(msg.stop_token_ids) == [9]
    assert not msg.sampling.HasField("temperature") and not msg.sampling.HasField("top_k")  # the server's defaults
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=5)
    assert to_generate_request(chat, prompt_token_ids=[1, 2], default_max_tokens=60).max_tokens == 5


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
