"""Test-wide set-up.

TRITON_INTERPRET=1 must be set before any module that defines Triton kernels is imported, so
kernels run on CPU tensors here; torch gets one thread per test process on the 2-core CI machine.

GPU tests (tests/gpu, marker ``gpu``) need a CUDA device and the real Triton compiler, so the interpreter must stay
off for them: with ``SPECSPLIT_GPU_TESTS=1`` in the environment this file leaves TRITON_INTERPRET unset. pyproject's
addopts deselect them (``-m "not gpu"``); on the GPU machine run them with

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu

Markers, set here by path: ``e2e`` for tests/e2e and tests/deploy (they start real processes), ``gpu`` for
tests/gpu, ``unit`` for everything else; ``-m unit`` / ``-m e2e`` select one part of the suite.
"""

import os
from pathlib import Path

import pytest

if os.environ.get("SPECSPLIT_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS = Path(__file__).resolve().parent
E2E_DIRS = {"e2e", "deploy"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/
            top = ""
        if top == "gpu":
            item.add_marker(pytest.mark.gpu)
        elif top in E2E_DIRS:
            item.add_marker(pytest.mark.e2e)
        elif item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.unit)
