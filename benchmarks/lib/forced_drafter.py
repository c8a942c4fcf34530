"""A drafter server whose runner forces acceptance (benchmarks only; see `forced_acceptance`).

    python -m benchmarks.lib.forced_drafter --alpha 0.8 --oracle oracle.json <args of `specsplit serve drafter`>

`benchmarks/e2e.py` starts it through `LocalCluster(role_commands={"drafter": [...]})`, with the
repository root on PYTHONPATH. The oracle file may be written after the server starts (`e2e.py --services-only`
takes the target's greedy continuations from target-only runs through these same services): until it exists the
runner's drafts are the MTP's own.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.lib.forced_acceptance import ForcedAcceptanceRunner, Oracle
from benchmarks.lib.wrapped_drafter import serve_wrapped


class ForcedOnceWritten:
    """The drafter's runner, wrapped in a `ForcedAcceptanceRunner` from the first call that finds the oracle file
    (written whole: renamed into place); same `propose` / `free`, other attributes pass through."""

    def __init__(self, runner, oracle_path: str, alpha: float | list[float], seed: int):
        self.runner, self.oracle_path, self.alpha, self.seed = runner, oracle_path, alpha, seed
        self.forced: ForcedAcceptanceRunner | None = None

    def _current(self):
        if self.forced is None and os.path.exists(self.oracle_path):
            self.forced = ForcedAcceptanceRunner(self.runner, Oracle.load(self.oracle_path), self.alpha, self.seed)
        return self.forced or self.runner

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def propose(self, *args):
        return self._current().propose(*args)

    def free(self, request_ids: list[str]) -> None:
        self._current().free(request_ids)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--alpha",
        type=float,
        nargs="+",
        required=True,
        help="probability that a draft is the oracle's token: one, or one per oracle sequence",
    )
    p.add_argument("--oracle", required=True, help="JSON written by Oracle.save")
    p.add_argument("--seed", type=int, default=0)
    ours, rest = p.parse_known_args(argv)
    alpha = ours.alpha[0] if len(ours.alpha) == 1 else ours.alpha
    serve_wrapped(rest, lambda runner: ForcedOnceWritten(runner, ours.oracle, alpha, ours.seed))


if __name__ == "__main__":
    main()
