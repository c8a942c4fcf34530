"""What the verifier's step thread keeps about a step between its parts (`specsplit/verifier/servicer.py`): the plan
made while the drafts are on their way, and a direct Propose's step until it is finished."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.verifier.direct_propose import PendingPropose
from specsplit.verifier.input_batch import InputBatch, PlannedBatch
from specsplit.verifier.runner import Prepared, StepOutput


@dataclass
class EarlyStep:
    """A step planned before its held drafts are in (`VerifierServicer._plan_early`): its batch with
    placeholder drafts and its KV slots; or the error its beginning raised; or nothing (plan it then)."""

    planned: PlannedBatch | None = None
    prepared: Prepared | None = None
    error: Exception | None = None
    planned_ns: int = 0  # when the planning ended (the `plan_ahead` span)
    used: bool = False  # the step ran on this plan (False: it planned again, with the drafts that came)


@dataclass
class HeldStep:
    """A direct Propose's context: its step's batch, and the step once finished (a device hand-off sends
    the Propose before; an answer that comes first, a failure of the send, waits here for the step)."""

    batch: InputBatch
    step: StepOutput | None = None
    answered: PendingPropose | None = None

    def finished(self, step: StepOutput, keep) -> StepOutput:
        self.step = step
        if self.answered is not None:
            keep(self.answered)
        return step
