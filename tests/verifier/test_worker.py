"""The verifier's worker over a real runner (tiny checkpoint, CPU): a step's drafts are kept and fill the next
step's placeholders only where they continue the request, a request freed while its Propose ran keeps nothing,
and an iteration that only frees launches nothing."""

import pytest

from specsplit.models.loader import load_target
from specsplit.verifier.batch import VerifyBatch, VerifyItem
from specsplit.verifier.runner import VerifierRunner
from specsplit.verifier.worker import VerifierWorker
from tests.fixtures.tiny import write_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_target(write_tiny_checkpoint(tmp_path_factory.mktemp("w") / "m", architecture="qwen3", seed=5))


@pytest.fixture
def worker(model):
    runner = VerifierRunner(model, model.make_kv_cache(64, 4), sampler_backend="reference")
    return VerifierWorker(runner, vocab_size=model.config.vocab_size, max_model_len=256, device="cpu")


def _message(iteration: int, **request) -> VerifyBatch:
    msg = VerifyBatch(iteration=iteration, requests=[])
    if request:
        msg.requests.append(VerifyItem(sample=True, num_spec_tokens=2, **request))
    return msg


def _prefill(worker):
    """Iteration 1, request "a"'s prompt: the sampled token and the step."""
    batch, launched, unfilled = worker.launch(_message(1, request_id="a", num_computed_tokens=0, token_ids=PROMPT))
    step = worker.finish(batch, launched)
    assert unfilled == [0] and len(step.sampled_token_ids[0]) == 1
    return batch, step


def test_kept_drafts_fill_the_next_step_where_they_continue_the_request(worker):
    batch, step = _prefill(worker)
    worker.keep(batch, step, [[11, 12]], None)
    last = step.sampled_token_ids[0][0]
    msg = _message(2, request_id="a", token_ids=[last], num_computed_tokens=len(PROMPT), num_held_drafts=2)
    batch, launched, unfilled = worker.launch(msg)
    assert unfilled == [0] and batch.token_ids[0] == [last, 11, 12] and batch.num_draft_tokens == [2]
    step = worker.finish(batch, launched)
    assert 1 <= len(step.sampled_token_ids[0]) <= 3  # the sampler judged the two drafts


def test_drafts_that_do_not_continue_the_request_are_counted_unfilled(worker):
    batch, step = _prefill(worker)
    worker.keep(batch, step, [[11, 12]], None)
    last = step.sampled_token_ids[0][0]
    # The coordinator rolled "a" back one token (e.g. a preemption re-prefill): the drafts follow another position.
    msg = _message(2, request_id="a", token_ids=[last], num_computed_tokens=len(PROMPT) - 1, num_held_drafts=2)
    batch, _, unfilled = worker.launch(msg)
    assert unfilled == [2] and batch.token_ids[0] == [last] and batch.num_draft_tokens == [0]


def test_a_request_freed_while_its_propose_ran_keeps_no_drafts(worker):
    batch, step = _prefill(worker)
    worker.free(["a"])  # an abort reached the verifier before the Propose's answer
    worker.keep(batch, step, [[11, 12]], None)
    assert len(worker.held) == 0 and worker.kv_cache.num_free_blocks == worker.kv_cache.num_blocks


def test_an_iteration_that_only_frees_launches_nothing(worker):
    _prefill(worker)
    msg = _message(2)
    msg.finished_request_ids.append("a")
    worker.free(msg.finished_request_ids)
    batch, launched, unfilled = worker.launch(msg)
    step = worker.finish(batch, launched)
    assert launched is None and batch.num_reqs == 0 and unfilled == [] and step.sampled_token_ids == []
    assert worker.kv_cache.num_free_blocks == worker.kv_cache.num_blocks
