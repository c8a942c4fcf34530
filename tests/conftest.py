"""Test-wide set-up.

TRITON_INTERPRET=1 must be set before any module that defines Triton kernels is imported, so
kernels run on CPU tensors here; torch gets one thread per test process on the 2-core CI machine.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
