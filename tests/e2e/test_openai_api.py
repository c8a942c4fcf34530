"""The OpenAI-compatible HTTP API of the session cluster's coordinator, through the official `openai` client and raw
HTTP: completions and chat completions, whole and streamed, equal to the gRPC API's and transformers' greedy output;
n, seed and stop_token_ids on both APIs; errors as OpenAI error objects (bad options, prompt + max_tokens past the
model's length, bodies that are not JSON, unknown paths and methods, a body over the limit: 413 before it is read); a
client that disconnects aborts its request everywhere; /v1/models, /health, /metrics."""

import http.client
import json
import socket
import time
import urllib.parse

import openai
import pytest
from transformers import AutoTokenizer

from specsplit import Client
from specsplit.coordinator.http.app import MAX_BODY_BYTES

from .helpers import assert_kv_all_free, greedy_ignoring_eos, wait_idle

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Write a haiku about tests."}]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture
def oai(cluster):
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


def _post(cluster, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    url = urllib.parse.urlsplit(cluster.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    status, data = resp.status, json.loads(resp.read())
    conn.close()
    return status, data


def test_completions_greedy_equals_grpc_and_transformers_whole_and_streamed(cluster, oai, tok, hf_greedy):
    ids = tok.encode(PROMPT)  # BOS first: the tokenizer's default, on both APIs
    assert ids[0] == tok.bos_token_id
    with Client(cluster.address, timeout=60) as client:
        grpc_out = client.generate(PROMPT, max_tokens=12, ignore_eos=True)
    assert grpc_out.token_ids == greedy_ignoring_eos(hf_greedy, ids, 12)
    kw = dict(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=12, temperature=0)
    whole = oai.completions.create(**kw, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == grpc_out.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 12)
    assert whole.choices[0].model_extra["spec_decode_stats"]["num_draft_tokens"] > 0  # speculation ran
    chunks = list(oai.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_out.text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_chat_uses_the_checkpoint_template_and_equals_grpc_whole_and_streamed(cluster, oai, tok, hf_greedy):
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)  # the template writes BOS itself
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    expected = hf_greedy(ids, 10)
    with Client(cluster.address, timeout=60) as client:
        grpc_out = client.generate(prompt_token_ids=ids, max_tokens=10)
    assert grpc_out.token_ids == expected
    model = oai.models.list().data[0].id
    whole = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == grpc_out.text
    assert choice.finish_reason == grpc_out.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(grpc_out.token_ids))
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == grpc_out.text
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(grpc_out.token_ids)
    assert all(c.usage is None for c in body)  # include_usage: usage only on the last chunk, null before


def test_n_and_seed_give_the_same_samples_on_both_apis(cluster, oai):
    """n = 2 sampled completions with a seed: the HTTP API's choices are the gRPC API's, index for index (a
    request's noise depends only on its seed and positions), and the two differ (choice i samples with seed + i)."""
    with Client(cluster.address, timeout=60) as client:
        grpc_outs = client.generate_n(
            prompt_token_ids=[5, 6, 7], n=2, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True
        )
    assert grpc_outs[0].token_ids != grpc_outs[1].token_ids
    out = oai.completions.create(
        model=oai.models.list().data[0].id,
        prompt=[5, 6, 7],
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    by_index = {c.index: c.text for c in out.choices}
    assert [by_index[0], by_index[1]] == [grpc_outs[0].text, grpc_outs[1].text]
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == 3


def test_stop_token_ids_end_generation_on_both_apis(cluster, oai, tok, hf_greedy):
    """Stopping on a token id keeps the greedy tokens up to and including it (finish_reason stop), and its text
    is not output."""
    prompt = [5, 6, 7]
    greedy = greedy_ignoring_eos(hf_greedy, prompt, 12)
    stop_id = greedy[4]
    cut = greedy.index(stop_id)
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=prompt, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    assert out.token_ids == greedy[: cut + 1] and out.finish_reason == "stop"
    assert out.text == tok.decode(greedy[:cut], skip_special_tokens=True)
    http_out = oai.completions.create(
        model=oai.models.list().data[0].id,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    assert http_out.choices[0].text == out.text and http_out.choices[0].finish_reason == "stop"
    assert http_out.usage.completion_tokens == cut + 1


@pytest.mark.parametrize(
    "body, status, param, says",
    [
        ({"temperature": -1}, 400, None, "temperature must be in [0, 100.0], got -1.0"),  # validation.py's words
        ({"prompt": [10**6]}, 400, None, "outside the vocabulary"),
        ({"logit_bias": {"5": 1.0}}, 400, "logit_bias", "logit_bias is not supported yet"),
        ({"logprobs": 21}, 400, None, "logprobs must be in [0, 20], got 21"),
        ({"presence_penalty": 2.5}, 400, None, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"min_tokens": 3}, 400, None, "min_tokens must be in [0, max_tokens=2], got 3"),
        ({"max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
        ({"max_tokens": 2**40}, 400, "max_tokens", "out of range"),
        ({"n": 17}, 400, "n", "n must be in [1, 16], got 17"),
        ({"n": 0}, 400, "n", "n must be in [1, 16], got 0"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options", "stream_options needs stream: true"),
        ({"response_format": {"type": "xml"}}, 400, "response_format", "type must be text, json_object or json_schema"),
        ({"structured_outputs": {"regex": "a("}}, 400, None, "structured_output.regex is not a valid regex"),
        ({"model": "gpt-5"}, 404, None, "the model 'gpt-5' does not exist"),
    ],
)
def test_bad_requests_are_openai_errors(cluster, body, status, param, says):
    got, data = _post(cluster, "/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, **body})
    assert got == status, data
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert says in data["error"]["message"] and data["error"]["param"] == param
    assert data["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_its_errors(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature must be in"):
        oai.completions.create(model=oai.models.list().data[0].id, prompt="x", max_tokens=2, temperature=-3)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request_everywhere(cluster, stream):
    """480 tokens take seconds; the request leaves the coordinator within moments of the disconnect and every KV
    block on verifier and drafter is free again."""
    url = urllib.parse.urlsplit(cluster.http_url)
    body = {"model": "tiny-llama", "prompt": [4, 5], "max_tokens": 480, "ignore_eos": True, "stream": stream}
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    with Client(cluster.address, timeout=60) as client:
        deadline = time.monotonic() + 30
        while client.server_stats()[1].num_running == 0:  # generating
            assert time.monotonic() < deadline
            time.sleep(0.02)
        if stream:
            assert sock.recv(1024).startswith(b"HTTP/1.1 200")  # tokens are coming
        sock.close()
        t0 = time.monotonic()
        wait_idle(client, timeout_s=3.0)
        assert time.monotonic() - t0 < 3.0
    assert_kv_all_free(cluster)


def test_models_health_and_metrics(cluster, oai):
    models = oai.models.list().data
    assert [m.id for m in models] == ["tiny-llama"] and models[0].model_extra["max_model_len"] > 0
    url = urllib.parse.urlsplit(cluster.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert (resp.status, json.loads(resp.read())) == (200, {"status": "ok"})
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for series in (
        'vllm:num_requests_running{model_name="tiny-llama"}',
        'vllm:num_requests_waiting{model_name="tiny-llama"}',
        'vllm:prompt_tokens_total{model_name="tiny-llama"}',
        'vllm:generation_tokens_total{model_name="tiny-llama"}',
        'vllm:time_to_first_token_seconds_count{model_name="tiny-llama"}',
        'vllm:time_per_output_token_seconds_count{model_name="tiny-llama"}',
        'vllm:spec_decode_num_drafts_total{model_name="tiny-llama"}',
        'vllm:spec_decode_num_draft_tokens_total{model_name="tiny-llama"}',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny-llama"}',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-llama",position="0"}',
        "specsplit_draft_tokens_total",
    ):
        assert series in text, series
    drafts = float(text.split('vllm:spec_decode_num_draft_tokens_total{model_name="tiny-llama"} ')[1].split()[0])
    assert drafts > 0  # the earlier requests of the session were counted


def _max_model_len(oai) -> int:
    return oai.models.list().data[0].model_extra["max_model_len"]


def test_prompt_and_max_tokens_past_the_model_length_are_400_and_without_max_tokens_fit(oai):
    """A prompt 3 tokens short of the model's length: max_tokens 4 is refused (completions and chat, saying the
    prompt's length, max_tokens and the limit), 3 runs to the limit, and no max_tokens gets the 3 left."""
    model, limit = oai.models.list().data[0].id, _max_model_len(oai)
    prompt = [5] * (limit - 3)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    message = err.value.body["message"]
    assert f"prompt has {limit - 3} tokens and max_tokens is 4" in message
    assert f"maximum context length is {limit} tokens" in message
    for max_tokens in (3, None):
        kw = {} if max_tokens is None else {"max_tokens": max_tokens}
        out = oai.completions.create(model=model, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}, **kw)
        assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (3, "length")
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {limit} tokens"):
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=limit)
    with pytest.raises(openai.BadRequestError, match=f"max_tokens is {limit}"):
        oai.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=limit)


def _send(cluster, head: bytes, body: list[bytes] = ()) -> tuple[int, dict]:
    """`head` (request line and headers) and then `body`, as they are, on a connection of its own; the answer's
    (status, JSON body). The answer is read once all of `body` is sent: a body the server refuses part-way must end
    where the server stops reading (no bytes left unread that would reset the connection)."""
    url = urllib.parse.urlsplit(cluster.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head)
        for part in body:
            sock.sendall(part)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read())


def _head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", "content-type: application/json", *headers, "", ""]
    return "\r\n".join(lines).encode()


def _assert_openai_error(data: dict, says: str) -> None:
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    assert says in data["error"]["message"] and data["error"]["type"] == "invalid_request_error", data


@pytest.mark.parametrize(
    "method, path, body, status, says",
    [
        ("POST", "/v1/completions", b'{"model": "tiny-llama", "prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        ("POST", "/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"\xc3": 1}]}', 400, "not valid UTF-8"),
        ("POST", "/v1/nothing", b"{}", 404, "Invalid URL (POST /v1/nothing)"),
        ("GET", "/v2/models", b"", 404, "Invalid URL (GET /v2/models)"),
        ("GET", "/v1/chat/completions", b"", 405, "method GET is not allowed on /v1/chat/completions; allowed: POST"),
        ("POST", "/v1/models", b"{}", 405, "method POST is not allowed on /v1/models; allowed: GET"),
    ],
)
def test_bodies_paths_and_methods_the_api_cannot_take_are_openai_errors(cluster, method, path, body, status, says):
    got, data = _send(cluster, _head(method, path, f"content-length: {len(body)}"), [body])
    assert got == status
    _assert_openai_error(data, says)


def test_a_body_over_the_limit_is_413_before_it_is_read_and_the_server_keeps_serving(cluster, oai):
    """A content-length of 50 MB is answered with no byte of the body sent; a chunked body once its bytes pass the
    limit (the last chunk sent passes it by one byte: the server has read all that was sent)."""
    status, data = _send(cluster, _head("POST", "/v1/completions", f"content-length: {50 * 1024 * 1024}"))
    assert status == 413
    _assert_openai_error(data, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    head = b'{"model": "tiny-llama", "prompt": "x"'
    size = 1024 * 1024
    parts = [head] + [b" " * size] * ((MAX_BODY_BYTES - len(head)) // size)
    parts.append(b" " * (MAX_BODY_BYTES + 1 - sum(map(len, parts))))
    chunked = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts]
    status, data = _send(cluster, _head("POST", "/v1/completions", "transfer-encoding: chunked"), chunked)
    assert status == 413
    _assert_openai_error(data, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    under = [b"%x\r\n%s\r\n" % (len(p), p) for p in (*parts[:-2], b', "max_tokens": 2}')] + [b"0\r\n\r\n"]
    status, data = _send(cluster, _head("POST", "/v1/completions", "transfer-encoding: chunked"), under)
    assert status == 200 and data["usage"]["prompt_tokens"] > 0  # a chunked body under the limit: served
