"""Test-wide set-up.

TRITON_INTERPRET=1 must be set before any module that defines Triton kernels is imported, so
kernels run on CPU tensors here; torch gets one thread per test process on the 2-core CI machine.

GPU tests (tests/gpu, marker ``gpu``) need a CUDA device and the real Triton compiler, so the interpreter must stay
off for them: with ``SPECSPLIT_GPU_TESTS=1`` in the environment this file leaves TRITON_INTERPRET unset. pyproject's
addopts deselect them (``-m "not gpu"``); on the GPU machine run them with

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu

Under the interpreter, ``_patch_the_interpreter_once_per_launch`` cuts the interpreter's own overhead (not what a
kernel computes).

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


def _patch_the_interpreter_once_per_launch() -> None:
    """Triton's interpreter (3.x) patches ``triton.language`` for the launch (``GridExecutor.__call__``) and then
    again at every call of a ``@triton.jit`` device function (``InterpretedFunction.__call__``), rebuilding the same
    patches with ``inspect.getmembers`` and never restoring them: about a third of an interpreted kernel's time.
    Here a device function's re-patch is skipped when the language modules it sees are already patched in the
    running launch; the patches in place are the ones it would have set again, so every kernel runs as before. Had
    a module not been patched, a device function would fail at once ("Did you forget to add @triton.jit ?") rather
    than run differently."""
    import inspect

    import triton.language as tl

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    real_patch, grid_call = getattr(interpreter, "_patch_lang", None), interpreter.GridExecutor.__call__
    if real_patch is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: list[frozenset[int] | None] = []  # per running launch: ids of the language modules patched in it

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        if not patched:
            return real_patch(fn)
        if patched[-1] is not None and langs(fn) <= patched[-1]:
            return interpreter._LangPatchScope()  # nothing to restore: no attribute set
        patched[-1] = langs(fn) | (patched[-1] or frozenset())
        return real_patch(fn)

    def launch(self, *args, **kwargs):
        patched.append(None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_interpreter_once_per_launch()


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
