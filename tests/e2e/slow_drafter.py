"""A drafter server whose Proposes sleep: `python -m tests.e2e.slow_drafter SECONDS [--every-propose] <args of
specsplit serve drafter>`, started through `LocalCluster(role_commands=...)`. The first Propose sleeps SECONDS
(`test_slow_steps.py`); with `--every-propose`, each one does (`tests/deploy/test_autoscaling.py`)."""

from __future__ import annotations

import sys
import time

from benchmarks.lib.wrapped_drafter import serve_wrapped

EVERY_PROPOSE = "--every-propose"


def _sleeping_through_a_first_use(seconds: float) -> None:
    time.sleep(seconds)


class FirstProposeSleeps:
    """Wraps a DrafterRunner; other attributes pass through."""

    def __init__(self, runner, seconds: float):
        self.runner, self.seconds = runner, seconds

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def propose(self, items, hidden_states):
        if self.seconds:
            seconds, self.seconds = self.seconds, 0.0
            _sleeping_through_a_first_use(seconds)
        return self.runner.propose(items, hidden_states)


class EveryProposeSleeps(FirstProposeSleeps):
    """A drafter slower than its autoscaler's latency target: each Propose sleeps `seconds` before it drafts."""

    def propose(self, items, hidden_states):
        time.sleep(self.seconds)
        return self.runner.propose(items, hidden_states)


def main() -> None:
    seconds, args = float(sys.argv[1]), sys.argv[2:]
    wrapper = FirstProposeSleeps
    if args[:1] == [EVERY_PROPOSE]:
        wrapper, args = EveryProposeSleeps, args[1:]
    serve_wrapped(args, lambda runner: wrapper(runner, seconds))


if __name__ == "__main__":
    main()
