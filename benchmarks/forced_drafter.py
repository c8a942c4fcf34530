"""A drafter server whose runner forces acceptance (benchmarks only; see `forced_acceptance`).

    python -m benchmarks.forced_drafter --alpha 0.8 --oracle oracle.json <args of `specsplit serve drafter`>

`benchmarks/e2e.py` starts it through `LocalCluster(role_commands={"drafter": [...]})`, with the
repository root on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.forced_acceptance import ForcedAcceptanceRunner, Oracle
from specsplit import telemetry
from specsplit.cli import parse_args
from specsplit.drafter.server import DrafterConfig, serve
from specsplit.grpc_server import setup_logging


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alpha", type=float, required=True, help="probability that a draft is the oracle's token")
    p.add_argument("--oracle", required=True, help="JSON written by Oracle.save")
    p.add_argument("--seed", type=int, default=0)
    ours, rest = p.parse_known_args(argv)
    config = DrafterConfig.from_args(parse_args(["serve", "drafter", *rest]))
    setup_logging("drafter", config.server.log_level)
    telemetry.setup("drafter", metrics_port=config.server.metrics_port)
    oracle = Oracle.load(ours.oracle)
    try:
        asyncio.run(serve(config, wrap_runner=lambda r: ForcedAcceptanceRunner(r, oracle, ours.alpha, ours.seed)))
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
