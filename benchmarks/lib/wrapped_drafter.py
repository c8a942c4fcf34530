"""`specsplit serve drafter` with its runner wrapped, for benchmarks and tests (the product has no hook for it).

`serve_wrapped(argv, wrap)` replaces `specsplit.drafter.loading.load_and_size` in this process (the drafter's
`serve` imports it when called) by one that returns `wrap(runner)` for the runner it built, then runs the CLI's
`specsplit serve drafter` on `argv`: its logging, metrics, start-up refusals and exit are the command's. Tensor-parallel
followers are spawned processes that load with the real function: only rank 0's runner, the one that serves, is
wrapped.
"""

from __future__ import annotations

from collections.abc import Callable


def serve_wrapped(argv: list[str], wrap: Callable) -> None:
    """Serves a drafter (`argv`: the arguments of `specsplit serve drafter`) whose runner is `wrap(runner)`;
    `wrap`'s object is served in its place, so it passes through the attributes it does not change."""
    from specsplit.cli import commands as cli
    from specsplit.drafter import loading

    load = loading.load_and_size

    def load_and_wrap(config, step_path: dict, rank: int = 0):
        module, runner = load(config, step_path, rank)
        return module, wrap(runner)

    loading.load_and_size = load_and_wrap
    cli.main(["serve", "drafter", *argv])  # a service ends its process here
