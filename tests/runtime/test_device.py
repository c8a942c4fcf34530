"""Model work on a second GPU: every thread a model server runs model work on makes the server's device
current (CUDA's current device is per thread; Triton launches on it)."""

import asyncio
import threading
import time

import pytest
import torch

from specsplit.runtime.device import StepThread, device_executor, use_device


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


def test_step_thread_binds_the_device_and_runs_calls_in_order(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    steps = StepThread("cuda:1", "verifier-step")

    async def main():
        return await asyncio.gather(*[steps.run(lambda i=i: (i, threading.current_thread().name)) for i in range(20)])

    out = asyncio.run(main())
    steps.close()
    assert [i for i, _ in out] == list(range(20))
    assert {name for _, name in out} == {"verifier-step"}
    assert calls == [("verifier-step", torch.device("cuda:1"))]


def test_step_thread_raises_the_call_s_error_and_survives_a_cancelled_caller():
    steps = StepThread("cpu", "step")

    def fail():
        raise ValueError("bad step")

    async def main():
        with pytest.raises(ValueError, match="bad step"):
            await steps.run(fail)
        slow = asyncio.ensure_future(steps.run(time.sleep, 0.05))
        await asyncio.sleep(0.01)
        slow.cancel()  # the call still runs to its end; its result is dropped
        return await steps.run(lambda: 2 + 2)

    assert asyncio.run(main()) == 4
    steps.close()
