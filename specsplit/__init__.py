"""specsplit: MTP speculative decoding split into coordinator, verifier and drafter services.

This package is torch-free: the client SDK, CLI, errors and shared server plumbing.
"""

from specsplit.client import AsyncClient, Client
from specsplit.errors import SpecsplitError
from specsplit.results import GenerationDelta, GenerationResult, SpecStats

__all__ = ["AsyncClient", "Client", "GenerationDelta", "GenerationResult", "SpecStats", "SpecsplitError"]
