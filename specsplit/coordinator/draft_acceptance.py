"""Acceptance per draft position, per request and server-wide, for choosing how many drafts to ask for.

Position j (0-based) is *reached* when an iteration verified more than j drafts and accepted the first j; it is
accepted when draft j was kept too. a_j = accepted_j / reached_j is the acceptance of draft j given that the drafts
before it were accepted, so a request with drafts 0..d-1 emits 1 + sum over i < d of prod_{j <= i} a_j tokens on
average. A request's own counts are few, so its estimate is shrunk toward the server's recent per-position acceptance
(`ServerAcceptance`, a Beta-like prior of `PRIOR_WEIGHT` pseudo-observations, scaled by the request's position 0:
`ServerAcceptance.gains`); the server's own estimate of a position is shrunk toward the position before it, and
positions the server never reached take the deepest one it did.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

PRIOR_WEIGHT = 8.0  # pseudo-observations of the server's acceptance in each request's estimate
DEFAULT_ACCEPTANCE = 0.5  # before the server has verified any draft
SERVER_PRIOR_WEIGHT = 2.0  # pseudo-observations of DEFAULT_ACCEPTANCE in the server's acceptance
SERVER_HALF_LIFE = 1024  # reached observations per position after which an old one weighs half


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
        self.version = 0  # bumped by every record
        self._reached: list[float] = []
        self._accepted: list[float] = []
        self._prior: tuple[int, int, np.ndarray] = (-1, 0, np.zeros(0))  # `means` kept: (version, positions, means)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.version += 1
        num_reached = min(num_drafts, num_accepted + 1)
        while len(self._reached) < num_reached:
            self._reached.append(0.0)
            self._accepted.append(0.0)
        for j in range(num_reached):
            self._reached[j] = self._reached[j] * self._keep + 1.0
            self._accepted[j] = self._accepted[j] * self._keep + (1.0 if j < num_accepted else 0.0)

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
