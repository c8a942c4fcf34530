"""The supervision loop of `specsplit up` (specsplit/cli/supervisor.py) over stand-in services: small Python
processes that print the `<role> listening on` line and wait, or exit at once while the file `<role>.crash`
exists in their --model directory. The same behaviour through the real services:
tests/e2e/test_up_supervision.py."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from specsplit.cli.launcher import LocalCluster
from specsplit.cli.supervisor import RestartPolicy, Supervisor

STAND_IN = """
import os, pathlib, signal, sys, time
role, args = sys.argv[1], sys.argv[2:]
model = pathlib.Path(args[args.index("--model") + 1])

def on_sigterm(signum, frame):  # as the services drain: a stamp in terms.log, then exit 0 (or <role>.code's)
    with open(model / "terms.log", "a") as f:
        f.write(f"{role} {time.time()}\\n")
    time.sleep(0.3 if role == "coordinator" else 0.0)  # its requests in flight finish
    code = model / f"{role}.code"
    os._exit(int(code.read_text()) if code.exists() else 0)

signal.signal(signal.SIGTERM, on_sigterm)
print(f"{role} loading", file=sys.stderr, flush=True)
if (pathlib.Path(args[args.index("--model") + 1]) / f"{role}.crash").exists():
    sys.exit(3)
if (pathlib.Path(args[args.index("--model") + 1]) / f"{role}.refuse").exists():
    sys.exit(2)  # a user's mistake, as the real services refuse one
if not (pathlib.Path(args[args.index("--model") + 1]) / f"{role}.silent").exists():
    print(f"{role} listening on 127.0.0.1:0", flush=True)
time.sleep(120)
"""
ROLES = ("coordinator", "verifier", "drafter")
FAST = RestartPolicy(max_restarts=3, backoff_s=0.05, max_backoff_s=0.2, stable_s=30.0)


class Running:
    """A Supervisor's run() on a thread, its lines and its return code."""

    def __init__(self, model_dir, policy: RestartPolicy = FAST, startup_timeout_s: float = 30.0):
        commands = {role: [sys.executable, "-c", STAND_IN, role] for role in ROLES}
        self.cluster = LocalCluster(model_dir, role_commands=commands)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.supervisor = Supervisor(self.cluster, policy, startup_timeout_s, say=self.lines.append, tick_s=0.02)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.supervisor.run(self.ready.set)

    def pid(self, role: str) -> int:
        return self.cluster.services[role].proc.pid

    def wait_for(self, condition, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"not within {timeout_s} s; lines: {self.lines}"
            time.sleep(0.02)

    def finish(self, timeout_s: float = 30.0) -> int | None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"run() still running; lines: {self.lines}"
        return self.code

    def all_stopped(self) -> bool:
        return all(svc.proc.poll() is not None for svc in self.cluster.services.values())


@pytest.fixture
def running(tmp_path):
    runs: list[Running] = []

    def start(**kwargs) -> Running:
        runs.append(Running(tmp_path, **kwargs))
        return runs[-1]

    yield start
    for run in runs:
        run.supervisor.stop()
        run.finish()


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay_s(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_an_exited_service_is_restarted_on_its_address_and_the_others_keep_running(running, role):
    run = running()
    assert run.ready.wait(20), run.lines
    before = {r: run.pid(r) for r in ROLES}
    address = run.cluster.services[role].address
    run.cluster.services[role].proc.send_signal(signal.SIGKILL)
    run.wait_for(lambda: run.pid(role) != before[role] and run.cluster.services[role].ready_at is not None)
    assert run.cluster.services[role].address == address
    assert run.lines == [
        f"{role} was killed by SIGKILL; restarting it in 0.05 s (restart 1 in a row, at most 3)",
        f"{role} serving again (pid {run.pid(role)})",
    ]
    others = [r for r in ROLES if r != role]
    assert all(run.pid(r) == before[r] and run.cluster.services[r].proc.poll() is None for r in others)
    run.supervisor.stop()
    assert run.finish() == 0
    assert run.all_stopped()


def test_a_crash_looping_service_is_given_up_with_one_line_and_everything_stops(running, tmp_path):
    run = running()
    assert run.ready.wait(20), run.lines
    (tmp_path / "drafter.crash").touch()
    run.cluster.services["drafter"].proc.send_signal(signal.SIGKILL)
    assert run.finish() == 1
    assert run.lines[-1] == (
        "giving up on the drafter: it exited with code 3 within 30 s of each of its last 3 restarts; "
        "stopping all services"
    )
    assert [line.split(";")[0] for line in run.lines[:-1]] == [
        "drafter was killed by SIGKILL",
        "drafter exited with code 3",
        "drafter exited with code 3",
    ]
    assert run.all_stopped()


def test_a_service_that_served_past_stable_s_starts_a_new_row_of_restarts(running):
    run = running(policy=RestartPolicy(max_restarts=1, backoff_s=0.05, stable_s=0.2))
    assert run.ready.wait(20), run.lines
    for _ in range(3):  # more exits than max_restarts, each after serving past stable_s
        svc = run.cluster.services["drafter"]
        run.wait_for(lambda svc=svc: svc.ready_at is not None and time.monotonic() - svc.ready_at > 0.3)
        svc.proc.send_signal(signal.SIGKILL)
        run.wait_for(lambda svc=svc: run.cluster.services["drafter"] is not svc)
    assert [line for line in run.lines if "restarting" in line] == [
        "drafter was killed by SIGKILL; restarting it in 0.05 s (restart 1 in a row, at most 1)"
    ] * 3
    assert run.code is None  # still supervising


def test_the_coordinator_is_not_restarted_and_its_exit_stops_everything(running):
    run = running()
    assert run.ready.wait(20), run.lines
    run.cluster.services["coordinator"].proc.send_signal(signal.SIGKILL)
    assert run.finish() == 1
    assert run.lines == ["coordinator was killed by SIGKILL; it holds the requests' state, so all services stop"]
    assert run.all_stopped()


def test_a_service_that_fails_its_first_start_is_not_restarted(running, tmp_path):
    (tmp_path / "verifier.crash").touch()
    run = running()
    assert run.finish() == 1
    assert run.lines == ["verifier exited with code 3 while starting; stopping all services"]
    assert not run.ready.is_set() and run.all_stopped()


def test_a_service_refusing_a_mistake_at_start_makes_up_exit_2(running, tmp_path):
    (tmp_path / "drafter.refuse").touch()
    run = running()
    assert run.finish() == 2
    assert run.lines == ["drafter exited with code 2 while starting; stopping all services"]
    assert run.all_stopped()


def test_a_service_silent_past_the_startup_timeout_stops_everything(running, tmp_path):
    (tmp_path / "drafter.silent").touch()
    run = running(startup_timeout_s=0.5)
    assert run.finish() == 1
    assert run.lines == ["drafter not serving after 0.5 s; stopping all services"]
    assert run.all_stopped()


def test_a_cluster_that_does_not_start_in_time_says_which_service_is_silent_with_its_log(tmp_path):
    (tmp_path / "drafter.silent").touch()
    commands = {role: [sys.executable, "-c", STAND_IN, role] for role in ROLES}
    cluster = LocalCluster(tmp_path, role_commands=commands, log_dir=tmp_path / "logs")
    with pytest.raises(TimeoutError) as raised:
        cluster.start(timeout_s=10.0)  # the stand-ins print at once; time to spare on a loaded machine
    message = str(raised.value)
    assert "--- drafter (pid " in message and "running):\ndrafter loading" in message
    assert "--- coordinator" not in message and "--- verifier" not in message  # both said they listen
    assert all(svc.proc.poll() is not None for svc in cluster.services.values())  # start() stopped them


def test_a_cluster_fails_to_start_as_soon_as_a_service_exits_though_another_waits_on_it(tmp_path):
    """The coordinator, silent as one waiting for its verifier, is not waited for past the verifier's exit."""
    (tmp_path / "coordinator.silent").touch()
    (tmp_path / "verifier.crash").touch()
    commands = {role: [sys.executable, "-c", STAND_IN, role] for role in ROLES}
    cluster = LocalCluster(tmp_path, role_commands=commands, log_dir=tmp_path / "logs")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="verifier exited with code 3\nverifier loading"):
        cluster.start(timeout_s=120.0)
    assert time.monotonic() - began < 60  # not the 120 s deadline
    assert all(svc.proc.poll() is not None for svc in cluster.services.values())


def test_stop_stops_the_coordinator_before_the_model_services(running, tmp_path):
    """The coordinator finishes its requests in flight while verifier and drafter still serve them: they get
    SIGTERM only once it has exited."""
    run = running()
    assert run.ready.wait(20), run.lines
    run.supervisor.stop()
    assert run.finish() == 0 and run.lines == []
    stamps = dict(line.split() for line in (tmp_path / "terms.log").read_text().splitlines())
    assert set(stamps) == set(ROLES)
    assert float(stamps["verifier"]) >= float(stamps["coordinator"]) + 0.3
    assert float(stamps["drafter"]) >= float(stamps["coordinator"]) + 0.3


def test_a_service_that_does_not_exit_0_when_stopped_makes_up_exit_1(running, tmp_path):
    (tmp_path / "verifier.code").write_text("5")
    run = running()
    assert run.ready.wait(20), run.lines
    run.supervisor.stop()
    assert run.finish() == 1
    assert run.lines == ["verifier exited with code 5 while stopping"]
    assert run.all_stopped()


def test_stop_during_start_up_stops_everything_with_code_0(running, tmp_path):
    (tmp_path / "verifier.silent").touch()
    run = running()
    run.wait_for(lambda: len(run.cluster.services) == 3)
    run.supervisor.stop()
    assert run.finish() == 0
    assert run.lines == [] and run.all_stopped()
