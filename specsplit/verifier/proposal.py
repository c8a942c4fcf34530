"""A Propose's outcome on the verifier's side: the drafts per request (merged from the drafter replicas'
answers) and the stamps that say where its time went."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.proto import common_pb2, drafter_pb2


@dataclass
class Proposal:
    ok: bool
    drafts: list[list[int]]  # per request (empty without a drafter)
    error: str = ""
    hidden_state_bytes: int = 0
    propose_ns: int = 0
    draft_probs: list[common_pb2.DraftProbs | None] | None = None  # per request, for sampled drafts
    # Wall-clock stamps (Unix ns) of the first replica called: verifier sent / got the answer back,
    # drafter received / replied; and that drafter's MTP step 0 and steps 1..k-1 times.
    sent_ns: int = 0
    received_ns: int = 0
    drafter_received_ns: int = 0
    drafter_replied_ns: int = 0
    step0_ns: int = 0
    later_steps_ns: int = 0


def merge_replica_drafts(proposal: Proposal, indices: list[int], resp: drafter_pb2.ProposeResponse) -> None:
    """A replica's drafts (for the batch's requests at `indices`) into the iteration's proposal."""
    for i, d in zip(indices, resp.drafts):
        proposal.drafts[i] = list(d.token_ids)
        proposal.draft_probs[i] = d.draft_probs if d.HasField("draft_probs") else None
