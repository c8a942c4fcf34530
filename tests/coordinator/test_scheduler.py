"""Scheduler behaviour: chunked prefill, draft trimming, post_step rollback, stops, preemption."""

import pytest

from specsplit.client.errors import FailedPrecondition, ResourceExhausted
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.iteration import DRAFT_PLACEHOLDER as P
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.request import Request, RequestStatus, SamplingParams
from specsplit.coordinator.scheduler import Scheduler

EOS = 99


def make(max_model_len=64, block_size=4, num_blocks=64, k=3, max_num_seqs=8, budget=32, max_waiting=16):
    cfg = SchedulerConfig(
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


def results(out, sampled, ran=None):
    """sampled[i]: tokens the verifier 'sampled' for scheduled request i; ran[i]: drafts it ran for the
    request's placeholders (default: every one, the verifier held a draft for each)."""
    res = []
    for i, item in enumerate(out.scheduled):
        s = sampled[i] if item.sample else []
        rej = item.num_draft_tokens + 1 - len(s) if item.sample else 0
        num_ran = (ran or {}).get(i, item.num_draft_tokens)
        res.append(VerifyResult(item.request.request_id, s, rej, num_ran))
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
    ups = s.update_from_output(out, results(out, [[42]]))
    r = s.requests["a"]
    assert ups[0].new_token_ids == [42]
    assert r.output_token_ids == [42] and r.num_computed_tokens == 10 and r.spec_token_ids == [P, P, P]


def test_decode_step_verifies_last_token_plus_drafts_and_rolls_back_rejected():
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]]))
    out = s.schedule()
    item = out.scheduled[0]
    assert item.token_ids == [50, P, P, P] and item.num_draft_tokens == 3  # the verifier fills them in
    assert out.scheduled_spec_decode_tokens == {"a": [P, P, P]}
    assert s.requests["a"].spec_token_ids == []  # taken by the scheduler
    # accept 1 draft (51), then a recovered token 60: num_sampled 2, num_rejected 2
    s.update_from_output(out, results(out, [[51, 60]]))
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
    s.update_from_output(out, results(out, [[50]]))
    out = s.schedule()
    assert out.scheduled[0].num_draft_tokens == 1  # 1 output, max 3: accepting 1 + bonus = 3
    s.update_from_output(out, results(out, [[51, 52]]))
    r = s.requests.get("a")
    assert r is None  # finished
    assert out.scheduled[0].request.finish_reason == "length"
    assert out.scheduled[0].request.output_token_ids == [50, 51, 52]


def test_acceptance_per_position_has_one_entry_per_draft_position_whatever_depth_was_verified():
    """k 3, but max_tokens lets only one draft be verified: the stats still name all 3 positions (the deeper two at
    0 accepted); a request capped at 2 drafts names 2, one asking for none names none."""
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=3))
    s.add_request(req("b", prompt_len=3, max_tokens=3, num_speculative_tokens=2))
    s.add_request(req("c", prompt_len=3, max_tokens=3, num_speculative_tokens=0))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50], [50], [50]]))
    out = s.schedule()
    assert [item.num_draft_tokens for item in out.scheduled] == [1, 1, 0]
    s.update_from_output(out, results(out, [[51, 52], [51, 52], [51]]))
    stats = {item.request.request_id: item.request.stats for item in out.scheduled}
    assert stats["a"].accepted_per_position == [1, 0, 0] and stats["a"].acceptance_per_position == [1.0, 0.0, 0.0]
    assert stats["b"].accepted_per_position == [1, 0]
    assert stats["c"].accepted_per_position == [] and stats["c"].num_drafts == 0


def test_drafts_are_trimmed_by_max_model_len():
    s = make(max_model_len=8)
    s.add_request(req("a", prompt_len=5, max_tokens=100))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]]))
    out = s.schedule()
    assert out.scheduled[0].num_draft_tokens == 1  # 6 tokens, max 8: one draft + bonus
    s.update_from_output(out, results(out, [[51, 52]]))
    assert out.scheduled[0].request.finish_reason == "length"
    assert out.scheduled[0].request.num_tokens == 8


def test_eos_stops_and_discards_tokens_after_it():
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]]))
    out = s.schedule()
    s.update_from_output(out, results(out, [[EOS, 52, 53, 54]]))  # the held drafts were EOS, 52, 53
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


def test_a_stop_token_id_stops_like_eos_even_with_ignore_eos():
    s = make()
    s.add_request(req("a", prompt_len=3, max_tokens=20, stop_token_ids=(52,), ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, results(out, [[50]]))
    out = s.schedule()
    s.update_from_output(out, results(out, [[51, 52, 53, 54]]))  # accepted 51, 52, 53; 54 the bonus token
    r = out.scheduled[0].request
    assert r.output_token_ids == [50, 51, 52] and r.finish_reason == "stop" and r.is_finished


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
    s.update_from_output(out, results(out, [[50]]))
    out = s.schedule()
    bad = [VerifyResult("a", [1, 2, 3, 4, 5], 0, 3)]  # 5 sampled for 3 drafts
    with pytest.raises(FailedPrecondition):
        s.update_from_output(out, bad)
    more_ran = [VerifyResult("a", [1], 3, 4)]  # ran 4 drafts for 3 placeholders
    with pytest.raises(FailedPrecondition, match="ran 4 drafts"):
        s.update_from_output(out, more_ran)


def test_per_request_k_caps_the_drafts():
    s = make(k=3)
    s.add_request(req("a", prompt_len=3, max_tokens=20, num_speculative_tokens=1))
    out = s.schedule()
    assert out.scheduled[0].num_spec_tokens == 1
    s.update_from_output(out, results(out, [[50]]))
    assert s.schedule().scheduled[0].num_draft_tokens == 1


def ids(out):
    return [i.request.request_id for i in out.scheduled]


def test_a_request_admitted_by_a_failed_iteration_is_freed_before_it_re_prefills():
    # The Verify that admitted "a" failed (no post_step): the verifier may hold its KV, so the reset frees
    # it in the next iteration, which prefills it again from the start.
    s = make(block_size=4, k=0)
    s.add_request(req("a", prompt_len=3))
    assert ids(s.schedule()) == ["a"]
    s.reset_all()
    out = s.schedule()
    assert out.finished_request_ids == ["a"] and ids(out) == ["a"]
    assert out.scheduled[0].num_computed_tokens == 0 and out.scheduled[0].token_ids == [1, 2, 3]


def test_config_refuses_more_drafts_than_the_verifier_takes():
    from specsplit.coordinator.config import MAX_SPECULATIVE_TOKENS
    from specsplit.kernels.types import MAX_DRAFTS_PER_REQUEST  # the coordinator states the limit without torch

    assert MAX_SPECULATIVE_TOKENS == MAX_DRAFTS_PER_REQUEST
    make(k=MAX_SPECULATIVE_TOKENS, budget=64)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        make(k=MAX_SPECULATIVE_TOKENS + 1, budget=64)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        make(k=-1)


def test_a_refused_batch_is_scheduled_apart_half_at_a_time_until_the_refused_request_is_alone():
    s = make()
    for rid in "abcd":
        s.add_request(req(rid))
    ids = lambda out: [item.request.request_id for item in out.scheduled]  # noqa: E731
    out = s.schedule()
    assert ids(out) == list("abcd")
    assert s.isolate(ids(out)) == []  # refused: nobody fails yet
    s.reset_all()
    s.add_request(req("e"))  # arrives meanwhile: waits until the suspects are sorted out
    out = s.schedule()
    assert ids(out) == ["a", "b"]
    assert s.isolate(ids(out)) == []
    s.reset_all()
    out = s.schedule()
    assert ids(out) == ["a"]
    s.update_from_output(out, results(out, [[7]]))  # answered: a is cleared
    out = s.schedule()
    assert ids(out) == ["b"]
    assert s.isolate(ids(out)) == ["b"]  # refused alone: the one to fail
    s.finish_request("b", "error")
    s.reset_all()
    out = s.schedule()
    assert ids(out) == ["c", "d"]  # the other half of the first refusal, alone
    s.update_from_output(out, results(out, [[7], [7]]))
    out = s.schedule()
    assert sorted(ids(out)) == ["a", "c", "d", "e"]  # nothing left to isolate: one batch again
    assert s.requests["a"].output_token_ids == [7] and s.requests["a"].num_preemptions == 3


def test_isolation_drops_a_group_whose_requests_all_finished():
    s = make()
    for rid in "abcd":
        s.add_request(req(rid))
    out = s.schedule()
    s.isolate([item.request.request_id for item in out.scheduled])
    s.reset_all()
    s.finish_request("a", "abort")
    s.finish_request("b", "abort")
    out = s.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["c", "d"]  # the group of a and b is gone
