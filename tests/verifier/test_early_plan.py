"""A batch planned before its held drafts are in (async scheduling: `VerifierWorker.plan_early`, driven
by `VerifierStep._plan_early`): placeholders where the drafts go, then `with_held_drafts` puts the
real ones in. It must equal the batch planned from the filled request, refuse what planning refuses,
and give up (None) when fewer drafts came than planned."""

from types import SimpleNamespace

import pytest
import torch

from specsplit.client.errors import FailedPrecondition, InvalidArgument
from specsplit.proto import common_pb2
from specsplit.verifier.batch import Sampling, VerifyBatch, VerifyItem
from specsplit.verifier.held_drafts import HeldDraft, HeldDrafts
from specsplit.verifier.input_batch import build_input_batch, plan_input_batch, upload_input_batch, with_held_drafts
from specsplit.verifier.runner import Prepared
from specsplit.verifier.servicer import VerifierServicer
from specsplit.verifier.worker import VerifierWorker

VOCAB = 50
LAUNCHED = SimpleNamespace(name="launched")  # what the stub runner launches (the worker adds its grammar outputs)


def _request(held: dict[str, int]) -> VerifyBatch:
    msg = VerifyBatch(iteration=2, requests=[])
    msg.requests.append(  # a prefill chunk: no held drafts
        VerifyItem(request_id="chunk", num_computed_tokens=0, token_ids=[3, 4, 5], sample=False, next_token_id=6)
    )
    for i, (rid, n) in enumerate(held.items()):
        msg.requests.append(
            VerifyItem(
                request_id=rid, num_computed_tokens=10 + i, token_ids=[7 + i], sample=True, num_held_drafts=n,
                num_spec_tokens=n, sampling=Sampling(top_p=0.9, temperature=0.5, seed=i),
            )
        )  # fmt: skip
    return msg


def _fill(msg: VerifyBatch, drafts: dict[str, list[int]]) -> list[list[int]]:
    """What `HeldDrafts.fill` does for drafts that continue where each request stands; per request, the drafts
    put in."""
    for r in msg.requests:
        if r.request_id in drafts:
            r.token_ids = r.token_ids + drafts[r.request_id]
            r.num_draft_tokens = len(drafts[r.request_id])
    return [drafts.get(r.request_id, []) for r in msg.requests]


def _hold(servicer, drafts: dict[str, list[int]]) -> None:
    """Drafts the worker holds from the last Propose, continuing where each request of `_request` stands."""
    for i, (rid, tokens) in enumerate(drafts.items()):
        servicer.worker.held._held[rid] = HeldDraft(10 + i, list(tokens), None)


def _plan(msg):
    return plan_input_batch(
        msg, vocab_size=VOCAB, max_model_len=64, num_cached_tokens=lambda rid: 64,
        placeholders=HeldDrafts.placeholders(msg),
    )  # fmt: skip


def test_planned_with_placeholders_then_filled_equals_planned_filled():
    msg = _request({"a": 3, "b": 2})
    assert HeldDrafts.placeholders(msg) == {"a": 3, "b": 2}
    planned = _plan(msg)
    filled = _fill(msg, {"a": [11, 12, 13], "b": [21, 22]})
    early = upload_input_batch(with_held_drafts(planned, filled, VOCAB), vocab_size=VOCAB)
    plain = build_input_batch(msg, vocab_size=VOCAB, max_model_len=64, num_cached_tokens=lambda rid: 64)
    lists = ("req_ids", "num_computed_tokens", "num_new_tokens", "token_ids", "num_draft_tokens", "query_start")
    for field in (*lists, "sampling_indices", "num_draft_tokens_per_req", "max_num_draft", "all_greedy", "any_filter"):
        assert getattr(early, field) == getattr(plain, field), field
    tensors = ("input_ids", "positions", "logits_indices", "draft_token_ids", "cu_num_draft", "cu_num_logits")
    for field in (*tensors, "temperature", "top_k", "top_p", "seeds", "first_logits_positions"):
        assert torch.equal(getattr(early, field), getattr(plain, field)), field
    assert early.token_ids[1] == [7, 11, 12, 13] and early.draft_token_ids.tolist() == [11, 12, 13, 21, 22]


def test_fewer_drafts_than_planned_is_planned_again():
    msg = _request({"a": 3, "b": 2})
    planned = _plan(msg)
    filled = _fill(msg, {"a": [11], "b": [21, 22]})  # the drafter made one draft for a
    assert with_held_drafts(planned, filled, VOCAB) is None


def test_a_held_draft_outside_the_vocabulary_is_refused_as_planning_would():
    msg = _request({"a": 2})
    planned = _plan(msg)
    filled = _fill(msg, {"a": [11, VOCAB]})
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        with_held_drafts(planned, filled, VOCAB)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        build_input_batch(msg, vocab_size=VOCAB, max_model_len=64, num_cached_tokens=lambda rid: 64)


def test_a_batch_with_placeholders_cannot_be_uploaded():
    with pytest.raises(ValueError, match="with_held_drafts"):
        upload_input_batch(_plan(_request({"a": 1})), vocab_size=VOCAB)


def test_only_requests_fill_can_fill_get_placeholders():
    msg = _request({"a": 2})
    msg.requests.append(VerifyItem("two_tokens", 0, [1, 2], sample=True, num_held_drafts=2))
    msg.requests.append(VerifyItem("chunk_held", 0, [1], sample=False, num_held_drafts=2))
    assert HeldDrafts.placeholders(msg) == {"a": 2}


class _Runner:
    """Records what the servicer asks of the runner."""

    def __init__(self):
        self.calls = []

    def free(self, ids):
        self.calls.append(("free", list(ids)))

    def prepare(self, req_ids, num_computed, num_new):
        self.calls.append(("prepare", list(num_new)))
        return Prepared(list(req_ids), list(num_computed), list(num_new), plan=None, use_kernel=False)

    def launch(self, batch, prepared, logits_plan=None):
        self.calls.append(("launch", batch.num_new_tokens, prepared is not None and prepared.matches(batch)))
        return LAUNCHED


def _servicer():
    servicer = VerifierServicer(drafter=None, device="cpu")
    runner = _Runner()
    runner.kv_cache = SimpleNamespace(num_tokens=lambda rid: 64)
    worker = VerifierWorker(runner, vocab_size=VOCAB, max_model_len=64, device="cpu")
    servicer.ready(worker, common_pb2.ModelInfo(vocab_size=VOCAB, max_model_len=64))
    return servicer


def test_the_servicer_steps_on_its_early_plan_with_the_real_drafts():
    servicer = _servicer()
    msg = _request({"a": 2})
    early = servicer.step._plan_early(msg)
    assert early.error is None and servicer.worker.runner.calls == [("free", []), ("prepare", [3, 3])]
    _hold(servicer, {"a": [11, 12]})
    batch, out, unfilled = servicer.step._launch(msg, early)
    assert out is LAUNCHED and batch.token_ids[1] == [7, 11, 12] and unfilled == [0, 0]
    assert servicer.worker.runner.calls[-1] == ("launch", [3, 3], True)  # on the early prepare: no second one


def test_an_early_error_is_raised_by_the_step_and_order_is_checked_once():
    servicer = _servicer()
    servicer.step._launch(_request({"a": 2}), None)  # iteration 2 has run
    stale = _request({"a": 2})  # iteration 2 again
    early = servicer.step._plan_early(stale)
    assert isinstance(early.error, FailedPrecondition)
    with pytest.raises(FailedPrecondition, match="strictly increase"):
        servicer.step._launch(stale, early)


def test_a_plan_refused_early_is_planned_again_by_the_step():
    servicer = _servicer()
    msg = _request({"a": 60})  # 60 placeholders after position 10 overflow max_model_len 64...
    early = servicer.step._plan_early(msg)
    assert early.planned is None and early.error is None
    _hold(servicer, {"a": [11, 12]})  # ... but only 2 drafts came: the step plans them and runs
    batch, out, _ = servicer.step._launch(msg, early)
    assert out is LAUNCHED and batch.num_new_tokens == [3, 3]
