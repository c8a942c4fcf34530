"""Acceptance per draft position, per request and server-wide, for choosing how many drafts to ask for.

Position j (0-based) is *reached* when an iteration verified more than j drafts and accepted the first j; it is
accepted when draft j was kept too. a_j = accepted_j / reached_j is the acceptance of draft j given that the drafts
before it were accepted, so a request with drafts 0..d-1 emits 1 + sum over i < d of prod_{j <= i} a_j tokens on
average. A request's own counts are few, so its estimate is shrunk toward the server's recent per-position acceptance
(`ServerAcceptance`, a Beta-like prior of `PRIOR_WEIGHT` pseudo-observations, scaled by the request's position 0:
`ServerAcceptance.gains`); the server's own estimate of a position is shrunk toward the position before it, and
positions the server never reached take the deepest one it did.

The server's counts also keep a recent window (`FAST_HALF_LIFE`): where it makes the server's estimate of a position
unlikely (a log-likelihood ratio above `CHANGE_LLR`: a drafter that got better or worse), the server forgets its older
counts of that position and the deeper ones, and goes on from the recent ones (`end_iteration`, once per iteration).
The window also forgets in iterations that verify no draft, so that after a run without drafts an exploration's few
verified drafts make it.
Without this, a server that learned a low acceptance and stopped drafting needed hundreds of verified drafts to
believe a better one; at batch 1, with one exploration every few hundred iterations, that took thousands of
iterations (docs/design.md §9, "A drafter whose acceptance changed").
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import numpy as np

PRIOR_WEIGHT = 8.0  # pseudo-observations of the server's acceptance in each request's estimate
DEFAULT_ACCEPTANCE = 0.5  # before the server has verified any draft
SERVER_PRIOR_WEIGHT = 2.0  # pseudo-observations of DEFAULT_ACCEPTANCE in the server's acceptance
SERVER_HALF_LIFE = 1024  # reached observations per position after which an old one weighs half
FAST_HALF_LIFE = 16  # the same, of the recent window that tells a change
# The recent window's log-likelihood ratio (its own mean against the server's estimate) above which the acceptance is
# taken to have changed: e^7, about 1,100 to 1.
CHANGE_LLR = 7.0


@dataclass
class PositionCounts:
    """One request's drafts reached and accepted per position (0-based)."""

    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    version: int = 0  # bumped by every record
    _row: tuple = field(default=(-1, 0, b""), init=False, repr=False, compare=False)  # (version, positions, row)

    def row(self, num_positions: int) -> bytes:
        """Reached then accepted at positions 0..num_positions-1 (0 where never reached), as float64 bytes (the
        chooser joins the batch's into one array), kept until the next record."""
        version, positions, row = self._row
        if version != self.version or positions != num_positions:
            pad = [0] * max(0, num_positions - len(self.reached))
            row = array("d", [*self.reached[:num_positions], *pad, *self.accepted[:num_positions], *pad]).tobytes()
            self._row = (self.version, num_positions, row)
        return row

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` drafts of which the first `num_accepted` were kept."""
        self.version += 1
        num_reached = min(num_drafts, num_accepted + 1)
        if len(self.reached) < num_reached:
            grow = num_reached - len(self.reached)
            self.reached.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for j in range(num_reached):
            self.reached[j] += 1
        for j in range(num_accepted):
            self.accepted[j] += 1


class ServerAcceptance:
    """The server's recent per-position acceptance: exponentially decayed counts over all requests."""

    def __init__(self, half_life: float = SERVER_HALF_LIFE):
        self._keep = 0.5 ** (1.0 / half_life)
        self._keep_fast = 0.5 ** (1.0 / FAST_HALF_LIFE)
        self.version = 0  # bumped by every record
        self.changes = 0  # times a change was detected
        self._reached: list[float] = []
        self._accepted: list[float] = []
        self._recent_reached: list[float] = []
        self._recent_accepted: list[float] = []
        self._prior: tuple[int, int, np.ndarray] = (-1, 0, np.zeros(0))  # `means` kept: (version, positions, means)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.version += 1
        num_reached = min(num_drafts, num_accepted + 1)
        while len(self._reached) < num_reached:
            for counts in (self._reached, self._accepted, self._recent_reached, self._recent_accepted):
                counts.append(0.0)
        for j in range(num_reached):
            kept = 1.0 if j < num_accepted else 0.0
            self._reached[j] = self._reached[j] * self._keep + 1.0
            self._accepted[j] = self._accepted[j] * self._keep + kept
            self._recent_reached[j] = self._recent_reached[j] * self._keep_fast + 1.0
            self._recent_accepted[j] = self._recent_accepted[j] * self._keep_fast + kept

    def end_iteration(self, verified: bool) -> None:
        """After an iteration's records (once per iteration: the test is not on every request's record). One that
        verified no draft ages the recent window by one observation, so that after a run without drafts the few an
        exploration verifies make it; one that verified drafts is tested for a change (`CHANGE_LLR`): where the window
        makes the estimate of a position unlikely, that position and the deeper ones go on from the window alone."""
        if not verified:
            keep = self._keep_fast
            self._recent_reached = [n * keep for n in self._recent_reached]
            self._recent_accepted = [n * keep for n in self._recent_accepted]
            return
        means = self.means(len(self._reached))
        for j, (n, hits) in enumerate(zip(self._recent_reached, self._recent_accepted)):
            if n > 0 and n * _divergence(hits / n, means[j]) > CHANGE_LLR:
                self._reached[j:] = self._recent_reached[j:]
                self._accepted[j:] = self._recent_accepted[j:]
                self.changes += 1
                return

    def means(self, num_positions: int) -> list[float]:
        """Acceptance per position 0..num_positions-1, each shrunk by `SERVER_PRIOR_WEIGHT` pseudo-observations toward
        the position before it (position 0: toward `DEFAULT_ACCEPTANCE`, so that a few early rejections cannot stop
        drafting for good); deeper than any reached: the deepest reached one's. A deep position is reached only
        after the ones before it were accepted, so rarely where acceptance is low: shrunk toward a fixed value
        instead, its few observations could make it look better than the positions before it, and deeper drafts
        would be asked for (docs/design.md §9, "Acceptance")."""
        out, last = [], DEFAULT_ACCEPTANCE
        for j in range(num_positions):
            if j < len(self._reached) and self._reached[j] > 0:
                weight = SERVER_PRIOR_WEIGHT
                last = (self._accepted[j] + weight * last) / (self._reached[j] + weight)
            out.append(last)
        return out

    def gains(self, caps: list[int], counts: list[PositionCounts], max_cap: int) -> np.ndarray:
        """[num_reqs, max_cap]: the marginal gain prod_{j <= i} a_rj of request r's draft i (0 past its cap).

        a_rj = (accepted_rj + w * prior_rj) / (reached_rj + w): the request's counts shrunk toward a prior, the
        server's acceptance at j scaled by how the request's position 0 compares with the server's (deeper positions
        are reached rarely: a request that is often rejected at once is assumed to be so further on as well)."""
        version, positions, prior = self._prior
        if version != self.version or positions != max_cap:
            prior = np.array(self.means(max_cap))
            self._prior = (self.version, max_cap, prior)
        own = np.frombuffer(b"".join([c.row(max_cap) for c in counts]), np.float64).reshape(len(counts), 2 * max_cap)
        reached, accepted = own[:, :max_cap], own[:, max_cap:]
        w = PRIOR_WEIGHT
        a0 = (accepted[:, 0] + w * min(1.0, prior[0])) / (reached[:, 0] + w)
        mean = np.minimum(1.0, prior * (a0 / prior[0])[:, None])  # (the means are never 0: shrunk toward 0.5)
        mean[:, 0] = min(1.0, prior[0])
        gains = ((accepted + w * mean) / (reached + w)).cumprod(axis=1)
        if min(caps) < max_cap:
            gains[np.arange(max_cap) >= np.array(caps)[:, None]] = 0.0
        return gains


def _divergence(observed: float, expected: float) -> float:
    """Kullback-Leibler divergence of Bernoulli(observed) from Bernoulli(expected), per observation."""
    expected = min(max(expected, 1e-6), 1 - 1e-6)
    total = 0.0
    for p, q in ((observed, expected), (1 - observed, 1 - expected)):
        if p > 0:
            total += p * math.log(p / q)
    return total
