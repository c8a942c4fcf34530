"""Drafts the verifier keeps from one iteration's Propose for the next (async scheduling).

The verifier answers the coordinator as soon as the tokens are
sampled; the drafter's drafts stay here. The coordinator schedules the next iteration meanwhile with
placeholders (`ScheduledRequest.num_held_drafts`) and `fill()` puts the held drafts in their place.
A held entry is used only when it continues exactly where the request now stands: its drafts follow
the request's last sampled token, at the position the coordinator sends as the request's last token.
Anything else (the drafter failed, the verifier restarted, the request was preempted) leaves the
placeholders unfilled: the iteration runs fewer drafts and counts the missing ones as rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.client.errors import InvalidArgument
from specsplit.verifier.batch import DraftProbs, VerifyBatch, VerifyItem
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.runner import StepOutput


@dataclass
class HeldDraft:
    last_position: int  # position of the request's last sampled token; the drafts follow it
    token_ids: list[int]
    probs: DraftProbs | None  # q of sampled drafts


class HeldDrafts:
    def __init__(self) -> None:
        self._held: dict[str, HeldDraft] = {}

    def __len__(self) -> int:
        return len(self._held)

    def keep(
        self,
        batch: InputBatch,
        step: StepOutput,
        drafts: list[list[int]],  # per request of the batch
        probs: list[DraftProbs | None] | None,
        num_cached_tokens=None,  # callable: request id -> tokens the KV cache holds; 0: freed meanwhile
    ) -> None:
        """The Propose of `batch`'s step is back: hold each sampling request's drafts for its next
        iteration, unless the request was freed while the Propose ran."""
        for i, rid in enumerate(batch.req_ids):
            freed = num_cached_tokens is not None and not num_cached_tokens(rid)
            if freed or not (batch.sample[i] and drafts[i]):
                self._held.pop(rid, None)
                continue
            num_sampled = len(step.sampled_token_ids[i])
            last = batch.num_computed_tokens[i] + batch.num_new_tokens[i] - batch.num_draft_tokens[i] - 1 + num_sampled
            self._held[rid] = HeldDraft(last, list(drafts[i]), probs[i] if probs else None)

    @staticmethod
    def placeholders(msg: VerifyBatch) -> dict[str, int]:
        """Request id → held drafts asked for, of the requests `fill` can fill (one token, no drafts,
        sampling): what a batch planned before the drafts are in holds in their place."""
        return {r.request_id: r.num_held_drafts for r in msg.requests if r.num_held_drafts > 0 and _fillable(r)}

    def fill(self, msg: VerifyBatch, filled: list[list[int]] | None = None) -> list[int]:
        """Puts the held drafts into `msg`'s requests that ask for them (in place); returns, per
        request, how many of its placeholders stayed unfilled. `filled`, when given, gets per request the
        drafts put in (`with_held_drafts` takes them from there, not from the message)."""
        unfilled = []
        for r in msg.requests:
            n = r.num_held_drafts
            if n == 0:
                unfilled.append(0)
                if filled is not None:
                    filled.append([])
                continue
            if n < 0 or not _fillable(r):
                raise InvalidArgument(
                    f"request {r.request_id!r}: num_held_drafts {n} needs one token, no drafts and sample"
                )
            held = self._held.pop(r.request_id, None)
            use = []
            if held is not None and held.last_position == r.num_computed_tokens:
                use = held.token_ids[:n]
            if use:
                r.token_ids = r.token_ids + use
                r.num_draft_tokens = len(use)
                if held.probs is not None:
                    r.draft_probs = held.probs
            unfilled.append(n - len(use))
            if filled is not None:
                filled.append(use)
        return unfilled

    def free(self, request_ids) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)

    def clear(self) -> None:
        self._held.clear()


def _fillable(r: VerifyItem) -> bool:
    """Where held drafts may go: a sampling request's one token, with no drafts of its own."""
    return not r.num_draft_tokens and r.sample and len(r.token_ids) == 1
