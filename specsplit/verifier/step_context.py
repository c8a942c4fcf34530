"""What the verifier's step thread keeps about a step while its Propose runs (`specsplit/verifier/servicer.py`):
the step's batch, and the step once finished (a device hand-off sends the Propose before)."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.verifier.direct_propose import PendingPropose
from specsplit.verifier.input_batch import InputBatch
from specsplit.verifier.runner import StepOutput


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
