"""Triton kernels and their pure-torch references (imports only torch and triton)."""

from kernels.rejection import rejection_sample
from kernels.types import RejectionOutput, SparseDraftProbs

__all__ = ["RejectionOutput", "SparseDraftProbs", "rejection_sample"]
