"""Client input → validated Request. Every rejection says what was wrong and what is allowed."""

from __future__ import annotations

import dataclasses
import math
import random
import uuid

from specsplit.client.errors import InvalidArgument
from specsplit.coordinator.generation_config import GRPC_DEFAULTS, SamplingDefaults
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.structured_output import compile_grammar
from specsplit.proto import coordinator_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_TEMPERATURE = 100.0
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's, vLLM's)


def build_request(
    msg: coordinator_pb2.GenerateRequest,
    *,
    tokenizer,
    vocab_size: int,
    max_model_len: int,
    num_speculative_tokens: int,
    defaults: SamplingDefaults = GRPC_DEFAULTS,
    default_max_tokens: int | None = None,
) -> Request:
    """The request `msg` asks for (one completion: `build_requests` makes its n). A text prompt is tokenized the
    way the tokenizer does by default, special tokens included (BOS where the checkpoint has one), as
    transformers and vLLM do. Prompt and max_tokens together must fit `max_model_len` (the verifier's). A request
    without max_tokens (0) gets `default_max_tokens`, at most what the prompt leaves of max_model_len (the HTTP
    API's: OpenAI's and vLLM's defaults); None: max_tokens must be given (the gRPC API's)."""
    has_text = msg.HasField("prompt")
    has_ids = len(msg.prompt_token_ids) > 0
    if has_text == has_ids:
        raise InvalidArgument("give exactly one of prompt and prompt_token_ids")
    if has_text:
        if not msg.prompt:
            raise InvalidArgument("prompt is empty")
        if len(msg.prompt) > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"prompt has {len(msg.prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        prompt_ids = list(tokenizer.encode(msg.prompt))
        if not prompt_ids:
            raise InvalidArgument("prompt encodes to no tokens")
    else:
        prompt_ids = list(msg.prompt_token_ids)
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(
                f"prompt_token_ids contains {len(bad)} id(s) outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}"
            )
    if len(prompt_ids) >= max_model_len:
        raise InvalidArgument(
            f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len} and at least one "
            "token must be generated"
        )
    max_tokens = msg.max_tokens
    if max_tokens == 0 and default_max_tokens is not None:
        max_tokens = min(default_max_tokens, max_model_len - len(prompt_ids))
    if max_tokens > max_model_len - len(prompt_ids):
        raise InvalidArgument(
            f"prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: {len(prompt_ids) + max_tokens} "
            f"tokens, but this model's maximum context length is {max_model_len} tokens (max_model_len); give "
            f"max_tokens <= {max_model_len - len(prompt_ids)} or a shorter prompt"
        )
    return Request(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        sampling=_sampling(msg, max_tokens, num_speculative_tokens, vocab_size, defaults),
    )


def build_requests(msg: coordinator_pb2.GenerateRequest, **kwargs) -> list[Request]:
    """The request's `n` independent completions (`build_request`'s arguments): ids `<id>-<i>` when n > 1; with a
    seed, completion i samples with seed + i, else each draws its own."""
    n = msg.n or 1
    if not 1 <= n <= MAX_N:
        raise InvalidArgument(f"n must be in [1, {MAX_N}], got {n}")
    first = build_request(msg, **kwargs)
    if n == 1:
        return [first]
    seeded = msg.sampling.HasField("seed")
    requests = []
    for i in range(n):
        seed = (first.sampling.seed + i) & (2**63 - 1) if seeded else random.getrandbits(63)
        requests.append(
            Request(
                request_id=f"{first.request_id}-{i}",
                prompt_token_ids=list(first.prompt_token_ids),
                sampling=dataclasses.replace(first.sampling, seed=seed),
            )
        )
    return requests


def _sampling(
    msg: coordinator_pb2.GenerateRequest,
    max_tokens: int,
    num_speculative_tokens: int,
    vocab_size: int,
    defaults: SamplingDefaults,
) -> SamplingParams:
    if max_tokens <= 0:
        raise InvalidArgument(f"max_tokens must be > 0, got {max_tokens}")
    s = msg.sampling
    temperature = s.temperature if s.HasField("temperature") else defaults.temperature
    if not math.isfinite(temperature) or temperature < 0 or temperature > MAX_TEMPERATURE:
        raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE}], got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else defaults.top_p
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
    top_k = s.top_k if s.HasField("top_k") else defaults.top_k
    if top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {top_k}")
    stop = tuple(msg.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not x or len(x) > MAX_STOP_LEN for x in stop):
        raise InvalidArgument(f"stop strings must be 1 to {MAX_STOP_LEN} characters long")
    stop_token_ids = tuple(msg.stop_token_ids)
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_token_ids)}")
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"stop_token_ids must be in the vocabulary [0, {vocab_size}), got {bad[0]}")
    k = None
    if msg.HasField("num_speculative_tokens"):
        k = msg.num_speculative_tokens
        if not 0 <= k <= num_speculative_tokens:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [0, {num_speculative_tokens}] (the server's k), got {k}"
            )
    seed = (s.seed if s.HasField("seed") else random.getrandbits(64)) & (2**63 - 1)
    repetition_penalty = s.repetition_penalty if s.HasField("repetition_penalty") else defaults.repetition_penalty
    if not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise InvalidArgument(f"repetition_penalty must be > 0 (1 = off), got {repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not math.isfinite(value) or abs(value) > MAX_PENALTY:
            raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if not 0 <= s.min_tokens <= max_tokens:
        raise InvalidArgument(f"min_tokens must be in [0, max_tokens={max_tokens}], got {s.min_tokens}")
    if s.end_token_ids:
        raise InvalidArgument("end_token_ids is set by the coordinator; use stop_token_ids")
    if s.coupled:
        raise InvalidArgument("coupled is set by the coordinator; pass a seed for reproducible sampling")
    if s.grammar:
        raise InvalidArgument("grammar is set by the coordinator; pass structured_output")
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=int(seed),
        seeded=s.HasField("seed"),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=msg.ignore_eos,
        num_speculative_tokens=k,
        repetition_penalty=float(repetition_penalty),
        presence_penalty=float(s.presence_penalty),
        frequency_penalty=float(s.frequency_penalty),
        min_tokens=int(s.min_tokens),
        logprobs=logprobs,
        grammar=compile_grammar(s.structured_output) if s.HasField("structured_output") else None,
    )
