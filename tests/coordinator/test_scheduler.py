"""Scheduler behaviour: chunked prefill, draft trimming, post_step rollback, stops, preemption."""

import pytest

from coordinator.config import SchedulerConfig
from coordinator.iteration import VerifyResult
from coordinator.request import Request, RequestStatus, SamplingParams
from coordinator.scheduler import Scheduler
from specsplit.errors import FailedPrecondition, ResourceExhausted

EOS = 99


def make(
    max_model_len=64, block_size=4, num_blocks=64, k=3, max_num_seqs=8, budget=32, max_waiting=16, micro_batches=1
):
    cfg = SchedulerConfig(
        num_micro_batches=micro_batches,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        num_speculative_tokens=k,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_waiting=max_waiting,
    )
    return Scheduler(cfg, [EOS])


def req(rid, prompt_len=5, max_tokens=10, **kw):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def results(out, sampled, drafts=None):
    """sampled[i]: tokens the verifier 'sampled' for scheduled request i."""
    res = []
    for i, item in enumerate(out.scheduled):
        s = sampled[i] if item.sample else []
        rej = item.num_draft_tokens + 1 - len(s) if item.sample else 0
        res.append(VerifyResult(item.request.request_id, s, rej, (drafts or {}).get(i, [])))
    return res


def test_prefill_is_chunked_by_token_budget_and_samples_only_on_last_chunk():
    s = make(budget=4)
    s.add_request(req("a", prompt_len=10))
    out = s.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [1, 2, 3, 4] and not item.sample and item.next_token_id == 5
    assert item.num_spec_tokens == 0
    s.update_from_output(out, results(out, []))
    assert s.requests["a"].num_computed_tokens == 4
    out = s.schedule()
    assert out.scheduled[0].token_ids == [5, 6, 7, 8]
    s.update_from_output(out, results(out, []))
    out = s.schedule()
    item = out.scheduled[0]
    assert item.token_ids == [9, 10] and item.sample and item.num_spec_tokens == 3
    ups = s.update_from_output(out, results(out, [[42]], {0: [7, 8, 9]}))
    r = s.requests["a"]
    assert ups[0].new_token_ids == [42]
    assert r.output_token_ids == [42] and r.num_computed_tokens == 10 and r.spec_token_ids == [7, 8, 9]


def test_decode_step_verifies_last_token_plus_drafts_and_rolls_back_rejected():
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]], {0: [51, 52, 53]}))
    out = s.schedule()
    item = out.scheduled[0]
    assert item.token_ids == [50, 51, 52, 53] and item.num_draft_tokens == 3
    assert out.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert s.requests["a"].spec_token_ids == []  # taken by the scheduler
    # accept 1 draft (51), then a recovered token 60: num_sampled 2, num_rejected 2
    s.update_from_output(out, results(out, [[51, 60]], {0: [61, 62, 63]}))
    r = s.requests["a"]
    assert r.output_token_ids == [50, 51, 60]
    assert r.num_computed_tokens == r.num_tokens - 1 == 5
    assert r.stats.num_draft_tokens == 3 and r.stats.num_accepted_tokens == 1
    assert r.stats.accepted_per_position == [1, 0, 0]


def test_drafts_are_trimmed_so_max_tokens_cannot_be_overrun():
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=3))
    out = s.schedule()
    assert out.scheduled[0].num_spec_tokens == 1  # after this step at most 3 - 1 - 1 more drafts fit
    s.update_from_output(out, results(out, [[50]], {0: [51, 52, 53]}))
    out = s.schedule()
    assert out.scheduled[0].num_draft_tokens == 1  # 1 output, max 3: accepting 1 + bonus = 3
    s.update_from_output(out, results(out, [[51, 52]]))
    r = s.requests.get("a")
    assert r is None  # finished
    assert out.scheduled[0].request.finish_reason == "length"
    assert out.scheduled[0].request.output_token_ids == [50, 51, 52]


def test_drafts_are_trimmed_by_max_model_len():
    s = make(max_model_len=8)
    s.add_request(req("a", prompt_len=5, max_tokens=100))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]], {0: [51, 52, 53]}))
    out = s.schedule()
    assert out.scheduled[0].num_draft_tokens == 1  # 6 tokens, max 8: one draft + bonus
    s.update_from_output(out, results(out, [[51, 52]]))
    assert out.scheduled[0].request.finish_reason == "length"
    assert out.scheduled[0].request.num_tokens == 8


def test_eos_stops_and_discards_tokens_after_it():
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]], {0: [EOS, 52, 53]}))
    out = s.schedule()
    s.update_from_output(out, results(out, [[EOS, 52, 53, 54]]))
    r = out.scheduled[0].request
    assert r.output_token_ids == [50, EOS] and r.finish_reason == "stop" and r.is_finished
    # its KV is freed on the verifier at the next iteration
    assert s.schedule().finished_request_ids == ["a"]


def test_ignore_eos_keeps_generating():
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=3, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, results(out, [[EOS]]))
    assert not out.scheduled[0].request.is_finished


def test_requests_join_and_leave_between_iterations_within_max_num_seqs():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, prompt_len=2, max_tokens=2))
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["a", "b"]
    s.update_from_output(out, results(out, [[7], [7]]))
    out = s.schedule()
    s.update_from_output(out, results(out, [[8], [8]]))  # a and b finish (max_tokens 2)
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["c"]
    assert sorted(out.finished_request_ids) == ["a", "b"]


def test_preemption_when_kv_blocks_run_out_recomputes_the_newest_request():
    # 4 blocks of 4 tokens; two requests of 8 prompt tokens need 2 blocks each.
    s = make(block_size=4, num_blocks=4, k=0, budget=64)
    s.add_request(req("old", prompt_len=8, max_tokens=10))
    s.add_request(req("new", prompt_len=8, max_tokens=10))
    out = s.schedule()
    assert len(out.scheduled) == 2
    s.update_from_output(out, results(out, [[1], [1]]))  # the next step's 9th token needs a 3rd block
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["old"]
    assert out.num_preempted == 1 and out.finished_request_ids == ["new"]
    new = s.requests["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert new.output_token_ids == [1]  # tokens are kept; they are re-prefilled later


def test_preempted_request_is_reprefilled_over_prompt_and_output():
    s = make(block_size=4, num_blocks=64, k=0)
    s.add_request(req("a", prompt_len=3, max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, results(out, [[9]]))
    s.reset_all()  # the verifier lost its state
    out = s.schedule()
    item = out.scheduled[0]
    assert item.num_computed_tokens == 0 and item.token_ids == [1, 2, 3, 9] and item.sample


def test_abort_frees_kv_and_skips_in_flight_results():
    s = make()
    s.add_request(req("a"))
    out = s.schedule()
    assert s.finish_request("a", "abort")
    assert s.update_from_output(out, results(out, [[1]])) == []
    assert s.schedule().finished_request_ids == ["a"]
    assert not s.finish_request("a", "abort")


def test_waiting_queue_is_bounded_and_ids_are_unique():
    s = make(max_waiting=2)
    s.add_request(req("a"))
    with pytest.raises(FailedPrecondition):
        s.add_request(req("a"))
    s.add_request(req("b"))
    with pytest.raises(ResourceExhausted):
        s.add_request(req("c"))


def test_inconsistent_verifier_result_is_rejected():
    s = make()
    s.add_request(req("a", prompt_len=3))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]], {0: [1, 2, 3]}))
    out = s.schedule()
    bad = [VerifyResult("a", [1, 2, 3, 4, 5], 0, [])]  # 5 sampled for 3 drafts
    with pytest.raises(FailedPrecondition):
        s.update_from_output(out, bad)


def test_per_request_k_caps_the_drafts():
    s = make(k=3)
    s.add_request(req("a", prompt_len=3, max_tokens=20, num_speculative_tokens=1))
    out = s.schedule()
    assert out.scheduled[0].num_spec_tokens == 1
    s.update_from_output(out, results(out, [[50]], {0: [51, 52, 53]}))
    assert s.schedule().scheduled[0].num_draft_tokens == 1


# ---- micro-batches: two iterations in flight, disjoint requests ---------------------------------------


def ids(out):
    return [i.request.request_id for i in out.scheduled]


def test_micro_batches_split_the_running_requests_and_keep_them():
    s = make(max_num_seqs=4, micro_batches=2, k=0)
    for rid in "abcd":
        s.add_request(req(rid))
    first, second = s.schedule(0), s.schedule(1)  # both in flight
    assert ids(first) == ["a", "b"] and ids(second) == ["c", "d"] and second.micro_batch == 1
    s.update_from_output(first, results(first, [[7], [7]]))
    again = s.schedule(0)
    assert ids(again) == ["a", "b"]  # the other micro-batch's requests stay out while in flight
    s.update_from_output(second, results(second, [[7], [7]]))
    assert ids(s.schedule(1)) == ["c", "d"]


def test_kv_accounting_counts_the_other_micro_batchs_step_in_flight():
    # 4 blocks of 4 tokens. "a" (8 prompt tokens, 2 blocks) is in flight in micro-batch 0 and holds no
    # KV yet by the coordinator's last update; "b" needs 3 blocks and must not be admitted beside it.
    s = make(block_size=4, num_blocks=4, k=0, budget=64, micro_batches=2)
    s.add_request(req("a", prompt_len=8))
    s.add_request(req("b", prompt_len=12))
    assert ids(s.schedule(0)) == ["a"]
    out = s.schedule(1)
    assert ids(out) == [] and s.requests["b"].status is RequestStatus.WAITING


def test_micro_batches_free_and_preempt_only_their_own_requests():
    s = make(block_size=4, num_blocks=6, k=0, budget=64, max_num_seqs=4, micro_batches=2)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, prompt_len=4))
    m0 = s.schedule(0)
    m1 = s.schedule(1)
    assert ids(m0) == ["a", "b"] and ids(m1) == ["c"]
    assert s.finish_request("c", "abort")  # micro-batch 1's request: freed by micro-batch 1's next iteration
    s.update_from_output(m0, results(m0, [[1], [1]]))
    s.update_from_output(m1, results(m1, [[1]]))
    assert s.schedule(0).finished_request_ids == []
    assert s.schedule(1).finished_request_ids == ["c"]


def test_a_preempted_request_returns_to_its_own_micro_batch():
    s = make(block_size=4, num_blocks=64, k=0, max_num_seqs=2, micro_batches=2)
    for rid in "ab":
        s.add_request(req(rid, prompt_len=3))
    m0, m1 = s.schedule(0), s.schedule(1)
    assert ids(m0) == ["a"] and ids(m1) == ["b"]
    s.update_from_output(m0, results(m0, [[9]]))
    s.update_from_output(m1, results(m1, [[9]]))
    s.reset_all()  # the verifier lost its state: both re-prefill, each in its own micro-batch
    out0 = s.schedule(0)
    assert ids(out0) == ["a"] and out0.finished_request_ids == ["a"]  # freed, then recomputed, in order
    out1 = s.schedule(1)
    assert ids(out1) == ["b"] and out1.finished_request_ids == ["b"]
    assert out1.scheduled[0].token_ids == [1, 2, 3, 9]


def test_config_refuses_more_drafts_than_the_verifier_takes():
    from coordinator.config import MAX_SPECULATIVE_TOKENS
    from kernels.rejection import MAX_DRAFTS_PER_REQUEST  # the coordinator states the limit without torch

    assert MAX_SPECULATIVE_TOKENS == MAX_DRAFTS_PER_REQUEST
    make(k=MAX_SPECULATIVE_TOKENS, budget=64)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        make(k=MAX_SPECULATIVE_TOKENS + 1, budget=64)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        make(k=-1)
