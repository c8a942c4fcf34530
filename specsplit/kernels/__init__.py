"""Triton kernels and their pure-torch references (imports only torch and triton)."""

from specsplit.kernels.rejection import rejection_sample
from specsplit.kernels.types import RejectionOutput, SparseDraftProbs

__all__ = ["RejectionOutput", "SparseDraftProbs", "rejection_sample"]
