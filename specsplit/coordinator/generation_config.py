"""Sampling defaults: the API's own, overridden by the checkpoint's `generation_config.json` (as vLLM applies it).

A request that leaves temperature, top_p, top_k or repetition_penalty unset gets the checkpoint's value where
`generation_config.json` sets one (vLLM's `generation_config="auto"`; `do_sample` is ignored, as vLLM ignores
it), else the API's default: greedy on the gRPC API (temperature 0), OpenAI's temperature 1 on the
HTTP API.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """What an unset sampling option becomes."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    def with_generation_config(self, checkpoint: str | Path) -> SamplingDefaults:
        """These defaults with the values `checkpoint`/generation_config.json sets (a missing or unreadable file,
        or a value of the wrong type, changes nothing)."""
        path = Path(checkpoint) / "generation_config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            return self
        except (OSError, ValueError) as err:
            log.warning("ignoring %s: %s", path, err)
            return self
        found = {}
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("repetition_penalty", float)):
            value = config.get(name) if isinstance(config, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                found[name] = kind(value)
        return replace(self, **found)


GRPC_DEFAULTS = SamplingDefaults()  # the gRPC API's own: greedy
OPENAI_DEFAULTS = SamplingDefaults(temperature=1.0)  # the HTTP API's own: OpenAI's
