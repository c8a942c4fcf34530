"""GPU tests: they need a CUDA device and the real Triton compiler. Run them on the GPU machine with

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu

(``SPECSPLIT_GPU_TESTS=1`` keeps ``tests/conftest.py`` from setting ``TRITON_INTERPRET=1``; ``-m gpu`` overrides the
``-m "not gpu"`` of pyproject's addopts.) Collecting them needs neither; a run without CUDA or under the
interpreter fails every test here rather than skipping it.
"""

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _cuda_and_compiled_triton() -> None:
    """Session-wide and so set up before any module's fixture that touches the GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 is set: run with SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu")
    if not torch.cuda.is_available():
        pytest.fail("no CUDA device: tests/gpu runs on a GPU machine only")
