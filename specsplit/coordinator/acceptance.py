"""Watches the server-wide acceptance rate and warns in the log when it collapses.

A collapse (a drafter serving the wrong MTP weights, a drafter that lost its state and keeps
restarting, a prompt distribution far from training) costs throughput silently: every iteration
still verifies k drafts. The monitor keeps the last `window` draft tokens' outcomes and warns once
when their acceptance rate falls below `threshold`; it re-arms when the rate recovers.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)


class AcceptanceMonitor:
    def __init__(self, window: int = 512, threshold: float = 0.1):
        self.window = window
        self.threshold = threshold
        self._outcomes: deque[tuple[int, int]] = deque()  # (draft tokens, accepted) per iteration
        self._drafts = 0
        self._accepted = 0
        self._warned = False

    @property
    def rate(self) -> float | None:
        return self._accepted / self._drafts if self._drafts >= self.window else None

    def record(self, num_draft_tokens: int, num_accepted: int) -> bool:
        """Adds one iteration's counts; returns True when this call logged a collapse warning."""
        if num_draft_tokens == 0:
            return False
        self._outcomes.append((num_draft_tokens, num_accepted))
        self._drafts += num_draft_tokens
        self._accepted += num_accepted
        while self._outcomes and self._drafts - self._outcomes[0][0] >= self.window:
            d, a = self._outcomes.popleft()
            self._drafts -= d
            self._accepted -= a
        rate = self.rate
        if rate is None:
            return False
        if rate < self.threshold and not self._warned:
            self._warned = True
            log.warning(
                "draft acceptance collapsed: %.3f over the last %d draft tokens (threshold %.2f); "
                "check the drafter's weights and health",
                rate,
                self._drafts,
                self.threshold,
            )
            return True
        if rate >= 2 * self.threshold:
            self._warned = False
        return False
