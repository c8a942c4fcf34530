"""specsplit: MTP speculative decoding split into coordinator, verifier and drafter services.

Importing it stays torch-free (the client SDK, errors, results); `specsplit.LLM` and the model-side
subpackages import torch when used.
"""

from importlib.metadata import PackageNotFoundError, version

from specsplit.client.errors import SpecsplitError
from specsplit.client.results import GenerationDelta, GenerationResult, SpecStats
from specsplit.client.sdk import AsyncClient, Client

__all__ = ["LLM", "AsyncClient", "Client", "GenerationDelta", "GenerationResult", "SpecStats", "SpecsplitError"]

try:
    __version__ = version("specsplit")  # the installed distribution's (pyproject.toml)
except PackageNotFoundError:  # a source tree run without installing it
    __version__ = "unknown"


def __getattr__(name: str):
    """`specsplit.LLM` (offline generation in one process) imports torch, so only when asked for."""
    if name == "LLM":
        from specsplit.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'specsplit' has no attribute {name!r}")
