"""`capturing` (specsplit/runtime/cuda_graphs.py): Python's cyclic garbage collector is off for the length of a CUDA
graph capture and back as it was after it, also when the capture fails; torch's own capture context (which needs a
GPU) is replaced by a recorder here."""

import contextlib
import gc

import pytest

from specsplit.runtime import cuda_graphs


@pytest.fixture
def recorded(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        seen.append(("enter", gc.isenabled(), g, pool))
        yield
        seen.append(("exit", gc.isenabled()))

    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", graph)
    return seen


def test_the_collector_is_off_during_the_capture_and_on_after(recorded):
    assert gc.isenabled()
    with cuda_graphs.capturing("g", "pool"):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert recorded == [("enter", False, "g", "pool"), ("exit", False)]


def test_a_failed_capture_turns_the_collector_back_on(recorded):
    with pytest.raises(RuntimeError, match="capture"), cuda_graphs.capturing("g", None):
        raise RuntimeError("operation failed due to a previous error during capture")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(recorded):
    gc.disable()
    try:
        with cuda_graphs.capturing("g", None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
