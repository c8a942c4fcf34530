"""A service started by a LocalCluster ends with it (`process.end_with_parent`, asked by the service itself after
exec: a `preexec_fn` would make subprocess fork, running gRPC's fork handlers in the parent, which hung a test process
holding gRPC channels while it restarted a drafter). The whole path, a SIGKILLed `specsplit up` leaving no service,
is tests/e2e/test_up_supervision.py's."""

import os
import subprocess
import sys
import time

import pytest

from specsplit.cli import launcher
from specsplit.rpc import process

CHILD = "from specsplit.rpc.process import end_with_parent; end_with_parent(); import time; time.sleep(30)"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def _child(parent_pid: int | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != process.PARENT_ENV}
    if parent_pid is not None:
        env[process.PARENT_ENV] = str(parent_pid)
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env)


def test_a_child_whose_named_parent_is_gone_ends_at_once():
    """The parent died between the child's start and its request: the child's parent is no longer the pid it was
    given, so it sends itself SIGTERM."""
    proc = _child(parent_pid=os.getpid() + 1_000_000)  # (not this child's parent)
    try:
        assert proc.wait(timeout=30) == -15
    finally:
        proc.kill()


def test_a_child_of_a_living_parent_keeps_running_and_one_started_elsewhere_is_untouched():
    for parent in (os.getpid(), None):
        proc = _child(parent)
        try:
            time.sleep(1.0)
            assert proc.poll() is None
        finally:
            proc.kill()
            proc.wait(timeout=30)


def test_a_local_cluster_names_itself_to_its_children_and_forks_without_a_preexec_fn(monkeypatch):
    """Its children's environment names this process; the spawn passes no preexec_fn (so no fork handlers run)."""
    seen = {}

    class FakePopen:
        def __init__(self, cmd, **kwargs):
            seen.update(kwargs)
            raise RuntimeError("stop here")

    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    cluster = launcher.LocalCluster("ckpt")
    with pytest.raises(RuntimeError, match="stop here"):
        cluster.spawn("coordinator", 1234)
    assert seen["env"][process.PARENT_ENV] == str(os.getpid()) and seen.get("preexec_fn") is None
