"""Model work on a second GPU: every thread a model server runs model work on makes the server's device
current (CUDA's current device is per thread; Triton launches on it)."""

import threading

import torch

from models.device import device_executor, use_device


def test_executor_threads_make_the_server_device_current(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    with device_executor("cuda:1", 2, "model") as pool:
        names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(8)}
    assert names and all(n.startswith("model") for n in names)
    assert {n for n, _ in calls} == names  # each worker bound itself, before its first task
    assert all(d == torch.device("cuda:1") for _, d in calls)


def test_cpu_and_bare_cuda_servers_touch_no_cuda_state(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_device("cpu")
    use_device("cuda")  # no index: the current device, whichever it is
    with device_executor("cpu", 1, "model") as pool:
        assert pool.submit(lambda: 1 + 1).result() == 2
    assert calls == []
