"""Async scheduling on the coordinator's side: placeholders for the drafts the verifier holds, their
trimming, their wire form, and post_step's accounting when the verifier had fewer drafts."""

import pytest

from specsplit.client.errors import FailedPrecondition
from specsplit.coordinator import wire
from specsplit.coordinator.iteration import DRAFT_PLACEHOLDER, VerifyResult
from specsplit.coordinator.observability import record_verify
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from tests.coordinator.test_scheduler import make


def decode_once(s: Scheduler, sampled: list[int]):
    """Prefill request 'a' (prompt 1..5) and sample `sampled` for it."""
    s.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10)))
    out = s.schedule()
    s.update_from_output(out, [VerifyResult("a", sampled, 0)])
    return s.requests["a"]


def test_post_step_leaves_placeholders_and_the_next_schedule_holds_them():
    s = make(k=3)
    r = decode_once(s, [42])
    assert r.spec_token_ids == [DRAFT_PLACEHOLDER] * 3
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_draft_tokens == 3
    assert item.token_ids == [42, DRAFT_PLACEHOLDER, DRAFT_PLACEHOLDER, DRAFT_PLACEHOLDER]
    assert r.num_kv_reserved == 5 + 4  # KV reserved for the last token and every placeholder

    msg = wire.verify_request(out, "c")
    (pb,) = msg.requests
    assert list(pb.token_ids) == [42] and pb.num_draft_tokens == 0 and pb.num_held_drafts == 3
    assert pb.num_computed_tokens == 5


def test_placeholders_are_trimmed_like_drafts():
    s = make(k=3)
    s.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3)))
    out = s.schedule()
    s.update_from_output(out, [VerifyResult("a", [42], 0)])
    # max_tokens 3 with one token out: at most one more draft can be accepted without overrunning it.
    assert s.requests["a"].spec_token_ids == [DRAFT_PLACEHOLDER]
    (item,) = s.schedule().scheduled
    assert item.num_draft_tokens == 1


def test_fewer_held_drafts_count_as_rejected_and_stats_count_only_those_run():
    s = make(k=3)
    r = decode_once(s, [42])
    out = s.schedule()
    # The verifier had 2 of the 3 drafts, accepted 1 of them: 2 sampled, num_rejected relative to 3.
    result = VerifyResult("a", [7, 8], 2, num_draft_tokens=2)
    s.update_from_output(out, [result])
    assert r.output_token_ids == [42, 7, 8]
    assert r.num_computed_tokens == 5 + 4 - 2 == r.num_tokens - 1
    assert (r.stats.num_draft_tokens, r.stats.num_accepted_tokens) == (2, 1)
    assert r.spec_token_ids == [DRAFT_PLACEHOLDER] * 3


def test_iteration_counts_use_the_drafts_run():
    s = make(k=3)
    decode_once(s, [42])
    out = s.schedule()

    class Span:
        def set_attributes(self, attrs):
            self.attrs = attrs

    class Response:
        hidden_state_bytes = 0
        drafter_ok = True

        class timing:
            forward_ns = propose_ns = 0

    span = Span()
    assert record_verify(span, out, [VerifyResult("a", [7, 8], 2, num_draft_tokens=2)], Response) == (2, 1)
    assert span.attrs["specsplit.rejected"] == 1


@pytest.mark.parametrize("num_draft_tokens", [4, 0])
def test_a_result_with_impossible_draft_counts_is_refused(num_draft_tokens):
    s = make(k=3)
    decode_once(s, [42])
    out = s.schedule()
    # 4 drafts run where 3 were scheduled; or 0 drafts run yet one accepted.
    bad = VerifyResult("a", [7, 8], 2, num_draft_tokens=num_draft_tokens)
    with pytest.raises(FailedPrecondition):
        s.update_from_output(out, [bad])


def test_preemption_drops_placeholders():
    s = make(k=3)
    r = decode_once(s, [42])
    s.reset_all()
    assert r.spec_token_ids == [] and r.num_computed_tokens == 0
    (item,) = s.schedule().scheduled
    assert item.num_draft_tokens == 0 and item.token_ids == [1, 2, 3, 4, 5, 42]


def test_no_placeholders_while_the_verifier_reports_the_drafter_down():
    s = make(k=3)
    s.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10)))
    out = s.schedule()
    s.update_from_output(out, [VerifyResult("a", [42], 0)], drafter_ok=False)
    assert s.requests["a"].spec_token_ids == []
    out = s.schedule()
    assert out.scheduled[0].token_ids == [42]
    s.update_from_output(out, [VerifyResult("a", [43], 0)], drafter_ok=True)
    assert s.requests["a"].spec_token_ids == [DRAFT_PLACEHOLDER] * 3
