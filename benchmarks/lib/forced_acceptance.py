"""Forced acceptance (benchmarks only, never used when serving): measure speed against a chosen
acceptance rate on models whose own drafts mean nothing (random weights).

The oracle holds, for every benchmark prompt, the target's greedy continuation (from a target-only
run). `ForcedAcceptanceRunner` wraps the drafter's runner: the real MTP steps still run (their cost
is real), then each draft is replaced, independently per position with probability `alpha`, by the
oracle's token for that position, and otherwise by a token that differs from it. The coin is one per
prompt and position, whichever draft of whichever iteration proposes it: every mode of a comparison (any
k, adaptive) meets the same easy and hard positions (common random numbers), so their comparison is not
blurred by each drawing its own acceptance; a position's coin is seen once (a reached position is then
emitted), so the accepted counts stay geometric in `alpha`. With greedy
verification a draft is accepted exactly when it equals the target's argmax, so the acceptance rate
of a position that is reached comes out ≈ alpha, and the output is still the target's own.

The drafter never sees prompts, only positions and the tokens that follow them; a request is
matched to its oracle sequence by its id where the benchmark named it so (`prompt_request_id`), else by its
tokens at positions 1..KEY_LEN (prompts must differ there), or, for a request started on cached blocks (prefix
caching: the drafter sees only what follows them), by the tokens it shows, where one sequence has them there.

Under structured output (`e2e.py --structured`) the target's output is its greedy continuation under the request's
grammar: the oracle then also holds, for the same prompts, the target-only run's constrained continuations, and a
request whose Propose carries a grammar is forced from those (with the same coins as its unconstrained twin).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KEY_LEN = 16
_MASK = (1 << 64) - 1


@dataclass
class Oracle:
    sequences: list[list[int]]  # per prompt: prompt + the target's greedy continuation
    vocab_size: int
    # Per prompt: prompt + the target's greedy continuation under the benchmark's structured output (None: none).
    constrained: list[list[int]] | None = None
    _index: dict[tuple[int, ...], int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.constrained is not None and [s[: 1 + KEY_LEN] for s in self.constrained] != [
            s[: 1 + KEY_LEN] for s in self.sequences
        ]:
            raise ValueError("the constrained continuations must follow the same prompts")
        for i, seq in enumerate(self.sequences):
            key = tuple(seq[1 : 1 + KEY_LEN])
            if len(key) < KEY_LEN or self._index.setdefault(key, i) != i:
                raise ValueError(f"prompt {i} is shorter than {KEY_LEN + 1} tokens or not unique in its first ones")

    def lookup(self, tokens_from_position_1: list[int]) -> int | None:
        return self._index.get(tuple(tokens_from_position_1[:KEY_LEN]))

    def find(self, first_position: int, tokens: list[int], constrained: bool) -> int | None:
        """The one sequence whose tokens at positions first_position … are `tokens` (a request started on cached blocks
        shows the drafter only what follows them), or None where none or several are."""
        end = first_position + len(tokens)
        found = [i for i, seq in enumerate(self.of(constrained)) if seq[first_position:end] == tokens]
        return found[0] if len(found) == 1 and tokens else None

    def of(self, constrained: bool) -> list[list[int]] | None:
        """The continuations a request with a grammar (`constrained`) or without one is forced from."""
        return self.constrained if constrained else self.sequences

    def save(self, path: Path) -> None:
        raw = {"vocab_size": self.vocab_size, "sequences": self.sequences, "constrained": self.constrained}
        path.write_text(json.dumps(raw))

    @classmethod
    def load(cls, path: str | Path) -> Oracle:
        raw = json.loads(Path(path).read_text())
        return cls(raw["sequences"], raw["vocab_size"], raw.get("constrained"))


def prompt_request_id(index: int, tag: str) -> str:
    """A request id that names its prompt, the oracle sequence it continues (`index_of_request` reads it back): the
    benchmarks name their requests so, and the runner matches them by it."""
    return f"{tag}-p{index}"


def index_of_request(request_id: str) -> int | None:
    """The prompt a `prompt_request_id` names; None for any other id (the coordinator's own are hex uuids)."""
    _, sep, tail = request_id.rpartition("-p")
    return int(tail) if sep and tail.isdigit() else None


def _uniform(*keys: int) -> float:
    """A deterministic uniform in [0, 1) per key tuple (splitmix64), the same in every process."""
    x = 0
    for k in keys:
        x = (x ^ (k & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return (x >> 11) / float(1 << 53)


@dataclass
class _Track:
    history: list[int] = field(default_factory=list)  # history[p - 1]: the token at position p >= 1
    oracle: int | None = None  # index into Oracle.sequences once matched
    lost: bool = False  # history has a gap or left the oracle: drafts stay the MTP's own
    constrained: bool = False  # its Proposes carry a grammar: forced from Oracle.constrained


class ForcedAcceptanceRunner:
    """Wraps a `specsplit.drafter.runner.DrafterRunner` (same `propose` / `free`; other attributes pass through)."""

    def __init__(self, runner, oracle: Oracle, alpha: float | list[float], seed: int = 0):
        """`alpha`: one acceptance rate, or one per oracle sequence (per prompt: a mixed batch). A request is matched
        to its sequence by its id where that names it (`prompt_request_id`), else by its tokens at positions
        1..KEY_LEN, which the drafter sees only if it proposed right after the prompt: a request that adaptive
        speculation gave no drafts then would stay unmatched, its drafts the MTP's own, as if its acceptance were 0."""
        alphas = [alpha] * len(oracle.sequences) if isinstance(alpha, (int, float)) else list(alpha)
        if len(alphas) != len(oracle.sequences) or not all(0.0 <= a <= 1.0 for a in alphas):
            raise ValueError(f"alpha must be in [0, 1], one or one per prompt; got {alpha}")
        self.runner, self.oracle, self.alphas, self.seed = runner, oracle, alphas, seed
        self._tracks: dict[str, _Track] = {}
        self.num_forced = 0  # draft positions decided by the oracle coin
        self.num_kept = 0  # … of which got the oracle's token
        self.num_lost = 0  # requests that left their oracle sequence (should stay 0)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def free(self, request_ids: list[str]) -> None:
        self.runner.free(request_ids)
        for rid in request_ids:
            self._tracks.pop(rid, None)

    def propose(self, items, hidden_states, device_tokens=None):
        if device_tokens is None:
            out = self.runner.propose(items, hidden_states)
        else:  # a device hand-off: propose() fills the items' tokens from the device
            out = self.runner.propose(items, hidden_states, device_tokens)
        for item, drafts in zip(items, out.drafts):
            track = self._tracks.get(item.request_id)
            if track is None:
                track = self._tracks[item.request_id] = _Track(constrained=item.grammar is not None)
                # A constrained request without constrained continuations to follow keeps the MTP's drafts.
                track.lost = self.oracle.of(track.constrained) is None
                index = index_of_request(item.request_id)
                track.oracle = index if index is not None and index < len(self.oracle.sequences) else None
                if track.oracle is None and item.cached_block_hashes and not track.lost:
                    # started on cached blocks (prefix caching): what follows them is all it shows
                    found = self.oracle.find(item.start_position + 1, list(item.next_token_ids), track.constrained)
                    track.oracle, track.lost = found, found is None
            self._observe(track, item.start_position, item.next_token_ids)
            if drafts and track.oracle is not None and not track.lost:
                last = item.start_position + len(item.next_token_ids)  # position of the newest token
                self._force(track, last, drafts)
        return out

    def _observe(self, track: _Track, start_position: int, next_token_ids: list[int]) -> None:
        """Records the tokens at positions start_position + 1 …, dropping what a rollback undid."""
        first = start_position + 1
        if len(track.history) < first - 1:  # a gap: the drafter missed iterations (adaptive speculation chose none)
            if track.oracle is None or track.lost:
                track.lost = True
                return
            # The output so far is the target's continuation (lossless; checked on every later token): fill it in.
            track.history.extend(self.oracle.of(track.constrained)[track.oracle][len(track.history) + 1 : first])
        del track.history[first - 1 :]
        track.history.extend(next_token_ids)
        if track.oracle is None and len(track.history) >= KEY_LEN:
            track.oracle = self.oracle.lookup(track.history)
            track.lost = track.lost or track.oracle is None
        if track.oracle is not None and not track.lost:
            seq = self.oracle.of(track.constrained)[track.oracle]
            if seq[first : first + len(next_token_ids)] != list(next_token_ids)[: max(0, len(seq) - first)]:
                track.lost = True  # the output left the target-only continuation
                self.num_lost += 1

    def _force(self, track: _Track, last: int, drafts: list[int]) -> None:
        index = track.oracle
        seq = self.oracle.of(track.constrained)[index]
        for i in range(len(drafts)):
            position = last + 1 + i
            if position >= len(seq):
                return  # past the known continuation: the MTP's own drafts
            want = seq[position]
            self.num_forced += 1
            if _uniform(self.seed, index, position) < self.alphas[index]:
                drafts[i] = want
                self.num_kept += 1
            elif drafts[i] == want:
                drafts[i] = (want + 1) % self.oracle.vocab_size
