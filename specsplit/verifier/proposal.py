"""A Propose's outcome on the verifier's side: the drafts per request (merged from the drafter replicas'
answers) and the stamps that say where its time went."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.verifier.batch import DraftProbs


@dataclass
class Proposal:
    ok: bool
    drafts: list[list[int]]  # per request (empty without a drafter)
    error: str = ""
    hidden_state_bytes: int = 0
    propose_ns: int = 0
    draft_probs: list[DraftProbs | None] | None = None  # per request, for sampled drafts
    # Wall-clock stamps (Unix ns) of the first replica called: verifier sent / got the answer back,
    # drafter received / replied; and that drafter's MTP step 0 and steps 1..k-1 times.
    sent_ns: int = 0
    received_ns: int = 0
    drafter_received_ns: int = 0
    drafter_replied_ns: int = 0
    step0_ns: int = 0
    later_steps_ns: int = 0
    # Structured output: requests whose drafter lacked their output before the Propose's output_offset.
    outputs_wanted: list[str] = field(default_factory=list)
