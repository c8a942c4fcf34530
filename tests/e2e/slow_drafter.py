"""A drafter server whose first Propose sleeps (`test_slow_steps.py`): `python -m tests.e2e.slow_drafter SECONDS
<args of specsplit serve drafter>`, started through `LocalCluster(role_commands=...)`."""

from __future__ import annotations

import asyncio
import sys
import time

from specsplit.cli import parse_args
from specsplit.drafter.server import DrafterConfig, serve
from specsplit.grpc_server import setup_logging


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


def main() -> None:
    seconds = float(sys.argv[1])
    config = DrafterConfig.from_args(parse_args(["serve", "drafter", *sys.argv[2:]]))
    setup_logging("drafter", config.server.log_level)
    asyncio.run(serve(config, wrap_runner=lambda runner: FirstProposeSleeps(runner, seconds)))


if __name__ == "__main__":
    main()
