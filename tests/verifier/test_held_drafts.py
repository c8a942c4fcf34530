"""The verifier's held drafts (async scheduling): kept after a Propose, filled into the next
iteration's placeholders only where the request continues exactly where the drafts start."""

from types import SimpleNamespace

import pytest
import torch

from specsplit.client.errors import InvalidArgument
from specsplit.verifier.batch import DraftProbs, VerifyBatch, VerifyItem
from specsplit.verifier.held_drafts import HeldDrafts


def batch_and_step():
    # "a": decode step, last token at 9 + 3 drafts, 2 accepted → 3 sampled, last sampled token at 12.
    # "b": final prefill chunk at 0..4 → 1 sampled at 5. "c": non-final chunk (no sample, no drafts).
    batch = SimpleNamespace(
        req_ids=["a", "b", "c"],
        sample=[True, True, False],
        num_computed_tokens=[9, 0, 0],
        num_new_tokens=[4, 5, 8],
        num_draft_tokens=[3, 0, 0],
    )
    step = SimpleNamespace(sampled_token_ids=[[11, 12, 13], [50], []])
    return batch, step


def verify_request(*items) -> VerifyBatch:
    requests = [VerifyItem(rid, nc, [last], sample=True, num_held_drafts=n) for rid, nc, last, n in items]
    return VerifyBatch(iteration=1, requests=requests)


def test_held_drafts_fill_the_next_iterations_placeholders():
    held = HeldDrafts()
    batch, step = batch_and_step()
    probs = DraftProbs(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2))
    held.keep(batch, step, [[1, 2, 3], [4, 5, 6], []], [None, probs, None])
    assert len(held) == 2
    msg = verify_request(("a", 12, 13, 3), ("b", 5, 50, 2))
    assert held.fill(msg) == [0, 0]
    a, b = msg.requests
    assert a.token_ids == [13, 1, 2, 3] and a.num_draft_tokens == 3 and a.draft_probs is None
    assert b.token_ids == [50, 4, 5] and b.num_draft_tokens == 2 and b.draft_probs is probs
    assert len(held) == 0  # used once


def test_a_request_that_moved_elsewhere_gets_no_drafts():
    held = HeldDrafts()
    held.keep(*batch_and_step(), [[1, 2, 3], [4, 5, 6], []], None)
    # "a" was re-prefilled (preempted) and stands at another position; "z" never had drafts.
    msg = verify_request(("a", 7, 13, 3), ("z", 3, 9, 2))
    assert held.fill(msg) == [3, 2]
    assert [r.token_ids for r in msg.requests] == [[13], [9]]
    assert all(r.num_draft_tokens == 0 for r in msg.requests)


def test_fewer_held_drafts_than_placeholders_and_a_failed_propose():
    held = HeldDrafts()
    batch, step = batch_and_step()
    held.keep(batch, step, [[1], [4, 5, 6], []], None)
    held.keep(batch, step, [[1], [], []], None)  # the next Propose failed for "b": its old drafts go
    msg = verify_request(("a", 12, 13, 3), ("b", 5, 50, 3))
    assert held.fill(msg) == [2, 3]
    assert msg.requests[0].token_ids == [13, 1]


def test_freed_requests_lose_their_drafts():
    held = HeldDrafts()
    held.keep(*batch_and_step(), [[1, 2, 3], [4, 5, 6], []], None)
    held.free(["a"])
    assert held.fill(verify_request(("a", 12, 13, 3))) == [3]
    held.clear()
    assert len(held) == 0


@pytest.mark.parametrize("field", ["drafts", "two_tokens", "no_sample", "negative"])
def test_placeholders_with_drafts_or_without_sampling_are_invalid(field):
    msg = verify_request(("a", 12, 13, 3))
    r = msg.requests[0]
    if field == "drafts":
        r.token_ids = [*r.token_ids, 5]
        r.num_draft_tokens = 1
    elif field == "two_tokens":
        r.token_ids = [*r.token_ids, 5]
    elif field == "no_sample":
        r.sample = False
    else:
        r.num_held_drafts = -1
    with pytest.raises(InvalidArgument):
        HeldDrafts().fill(msg)


def test_requests_freed_while_their_propose_ran_are_not_held():
    held = HeldDrafts()
    cached = {"a": 13}.get  # "b" was freed meanwhile
    held.keep(*batch_and_step(), [[1, 2, 3], [4, 5, 6], []], None, lambda rid: cached(rid, 0))
    assert len(held) == 1
    assert held.fill(verify_request(("a", 12, 13, 3), ("b", 5, 50, 2))) == [0, 2]
