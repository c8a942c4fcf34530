"""Fuzzing the wire boundaries with thousands of generated cases: every input either parses into
something that satisfies the invariants or is refused with the documented error — never another
exception (which a server would turn into INTERNAL)."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specsplit.client.errors import FailedPrecondition, InvalidArgument
from specsplit.coordinator.validation import build_request
from specsplit.drafter.servicer import parse_items
from specsplit.proto import common_pb2, coordinator_pb2, drafter_pb2, verifier_pb2
from specsplit.transport.wire import tensor_from_proto, tensor_to_proto
from specsplit.verifier.input_batch import build_input_batch
from specsplit.verifier.wire import verify_batch

FAST = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ITEMSIZE = {1: 4, 2: 2, 3: 2, 4: 4, 5: 8}
VOCAB = 50

tensors = st.builds(
    lambda dtype, shape, data: common_pb2.Tensor(dtype=dtype, shape=shape, data=data),
    st.integers(-2, 8),
    st.lists(st.integers(-3, 9), max_size=4),
    st.binary(max_size=300),
)


@FAST
@given(tensors)
def test_tensor_codec_accepts_only_consistent_messages(msg):
    try:
        t = tensor_from_proto(msg)
    except ValueError:
        ok = (
            msg.dtype in ITEMSIZE
            and all(d >= 0 for d in msg.shape)
            and math.prod(msg.shape) * ITEMSIZE.get(msg.dtype, 0) == len(msg.data)
        )
        assert not ok, f"valid message refused: {msg}"
        return
    assert list(t.shape) == list(msg.shape)
    assert t.numel() * t.element_size() == len(msg.data)


@FAST
@given(
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]),
    st.lists(st.integers(0, 5), min_size=1, max_size=3),
    st.integers(0, 2**31),
)
def test_tensor_codec_round_trips(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    back = tensor_from_proto(tensor_to_proto(t))
    assert back.dtype == dtype and torch.equal(back, t)


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(0.0), st.just(1.0))


@FAST
@given(
    prompt=st.one_of(st.none(), st.text(max_size=20)),
    ids=st.lists(st.integers(-5, VOCAB + 5), max_size=12),
    max_tokens=st.integers(-3, 40),
    temperature=floats,
    top_p=st.one_of(st.none(), floats),
    top_k=st.integers(-3, 100),
    stop=st.lists(st.text(max_size=4), max_size=3),
    k=st.one_of(st.none(), st.integers(-2, 6)),
)
def test_generate_request_validation(prompt, ids, max_tokens, temperature, top_p, top_k, stop, k):
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k)
    if top_p is not None:
        sampling.top_p = top_p
    msg = coordinator_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stop)
    if prompt is not None:
        msg.prompt = prompt
    if k is not None:
        msg.num_speculative_tokens = k

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % VOCAB for c in text.strip()]

    try:
        r = build_request(msg, tokenizer=Tok(), vocab_size=VOCAB, max_model_len=10, num_speculative_tokens=3)
    except InvalidArgument as err:
        assert str(err)
        return
    assert 1 <= r.num_prompt_tokens < 10 and all(0 <= t < VOCAB for t in r.prompt_token_ids)
    assert r.sampling.max_tokens > 0 and 0 <= r.sampling.temperature <= 100 and 0 < r.sampling.top_p <= 1
    assert r.sampling.top_k >= 0 and (r.sampling.num_speculative_tokens or 0) in range(4)


scheduled = st.builds(
    lambda rid, nc, tokens, d, sample, nxt, spec: verifier_pb2.ScheduledRequest(
        request_id=rid,
        num_computed_tokens=nc,
        token_ids=tokens,
        num_draft_tokens=d,
        sample=sample,
        next_token_id=nxt,
        num_spec_tokens=spec,
        sampling=common_pb2.SamplingParams(top_p=1.0),
    ),
    st.sampled_from(["", "a", "b", "c"]),
    st.integers(-2, 12),
    st.lists(st.integers(-2, VOCAB + 2), max_size=6),
    st.integers(-1, 6),
    st.booleans(),
    st.integers(-1, VOCAB + 1),
    st.integers(-1, 4),
)


@FAST
@given(st.lists(scheduled, max_size=4), st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 8)))
def test_verify_request_validation(reqs, cached):
    msg = verifier_pb2.VerifyRequest(iteration=1, requests=reqs)
    try:
        batch = build_input_batch(
            verify_batch(msg), vocab_size=VOCAB, max_model_len=16, num_cached_tokens=lambda r: cached.get(r, 0)
        )
    except (InvalidArgument, FailedPrecondition) as err:
        assert str(err)
        return
    assert batch.input_ids.numel() == batch.query_start[-1] == sum(batch.num_new_tokens)
    assert (
        int(batch.cu_num_logits[-1])
        == batch.logits_indices.numel()
        == batch.draft_token_ids.numel() + len(batch.sampling_indices)
    )
    assert all(0 <= int(t) < VOCAB for t in batch.input_ids)
    assert all(nc <= cached.get(rid, 0) for rid, nc in zip(batch.req_ids, batch.num_computed_tokens))


# q of sampled drafts: any tensor messages, or well-encoded [rows, K] tensors with any ids and probabilities.
draft_probs = st.one_of(
    st.builds(common_pb2.DraftProbs, token_ids=tensors, probs=tensors),
    st.tuples(st.integers(0, 4), st.integers(1, 3)).flatmap(
        lambda shape: st.builds(
            lambda ids, probs: common_pb2.DraftProbs(
                token_ids=tensor_to_proto(torch.tensor(ids, dtype=torch.int32).view(shape)),
                probs=tensor_to_proto(torch.tensor(probs, dtype=torch.float32).view(shape)),
            ),
            st.lists(st.integers(-3, VOCAB + 2), min_size=math.prod(shape), max_size=math.prod(shape)),
            st.lists(floats, min_size=math.prod(shape), max_size=math.prod(shape)),
        )
    ),
)


@FAST
@given(st.lists(st.tuples(st.integers(0, 3), st.one_of(st.none(), draft_probs)), min_size=1, max_size=3))
def test_verify_request_draft_probs_validation(reqs):
    """Valid decode steps whose drafts carry any q: refused naming a request that sent q, or one q row per draft
    with ids in the vocabulary (or -1) and finite non-negative probabilities: the request's own first rows, one-hot
    at its drafts where it sent none."""
    msg = verifier_pb2.VerifyRequest(iteration=1)
    for i, (d, q) in enumerate(reqs):
        r = msg.requests.add(
            request_id=f"r{i}", token_ids=[7, *range(d)], num_draft_tokens=d, sample=True,
            sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0),
        )  # fmt: skip
        if q is not None:
            r.draft_probs.CopyFrom(q)
    try:
        batch = build_input_batch(verify_batch(msg), vocab_size=VOCAB, max_model_len=16, num_cached_tokens=lambda r: 0)
    except InvalidArgument as err:
        assert any(f"request 'r{i}': draft_probs" in str(err) for i, (d, q) in enumerate(reqs) if d and q is not None)
        return
    q = batch.draft_probs
    if q is None:
        assert not any(d and q is not None for d, q in reqs)
        return
    assert q.ids.shape == q.probs.shape and q.ids.shape[0] == batch.draft_token_ids.numel() == sum(d for d, _ in reqs)
    assert bool(((q.ids >= -1) & (q.ids < VOCAB)).all()) and bool((torch.isfinite(q.probs) & (q.probs >= 0)).all())
    row = 0
    for d, sent in reqs:
        ids, probs = q.ids[row : row + d], q.probs[row : row + d]
        if sent is None:
            assert ids[:, 0].tolist() == list(range(d)) and probs[:, 0].tolist() == [1.0] * d
            assert bool((ids[:, 1:] == -1).all()) and bool((probs[:, 1:] == 0).all())
        elif d:
            k = list(sent.token_ids.shape)[1]
            assert ids[:, :k].tolist() == tensor_from_proto(sent.token_ids)[:d].tolist()
            assert torch.equal(probs[:, :k], tensor_from_proto(sent.probs)[:d])
        row += d


items = st.builds(
    lambda rid, pos, nxt, rej, spec: drafter_pb2.ProposeItem(
        request_id=rid, start_position=pos, next_token_ids=nxt, num_rejected=rej, num_spec_tokens=spec
    ),
    st.sampled_from(["", "a", "b"]),
    st.integers(-3, 20),
    st.lists(st.integers(-2, VOCAB + 2), max_size=5),
    st.integers(-2, 8),
    st.integers(-2, 70),
)


@FAST
@given(st.lists(items, max_size=4))
def test_propose_request_validation(its):
    try:
        parsed = parse_items(drafter_pb2.ProposeRequest(requests=its), VOCAB, 4)
    except InvalidArgument as err:
        assert str(err)
        return
    assert all(0 <= it.num_rejected <= 64 for it in its)
    for p in parsed:
        assert p.start_position >= 0 and p.next_token_ids and 0 <= p.num_spec_tokens <= 64
        assert all(0 <= t < VOCAB for t in p.next_token_ids)
