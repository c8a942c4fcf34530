"""Keeps the services of `specsplit up` running, as a process manager would.

A verifier or drafter that exits is started again, with the same command on the same address, after a
backoff that doubles with each exit in a row (`RestartPolicy`). The coordinator keeps serving meanwhile:
it re-prefills its requests on a restarted verifier and schedules no drafts while the drafter is away, so
output does not change. A service that exits again soon after each of `max_restarts` restarts in a row is
given up, with one line saying which and why. The coordinator is not restarted (it holds every request's
state). `run()` returns 0 after `stop()` (a signal), 1 when a service is given up or the coordinator
exits, 2 when a service refused to start with code 2 (a user's mistake, named in its own line); either way
every service is stopped first, the coordinator before the others (`LocalCluster.stop`: its requests in
flight finish while verifier and drafter still serve), and after `stop()` a service that does not exit 0
makes it 1.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from specsplit.cli.launcher import LocalCluster

RESTARTED_ROLES = ("verifier", "drafter")


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # restarts in a row, each followed by an exit within stable_s, before giving up
    backoff_s: float = 1.0  # the wait before the first restart of a row; doubled before each further one
    max_backoff_s: float = 30.0
    stable_s: float = 30.0  # a service that served this long before it exited starts a new row

    def delay_s(self, restart: int) -> float:
        """The wait before restart number `restart` (1-based) of a row."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (restart - 1))


@dataclass
class _Restarts:
    """One restarted role: its restarts in a row, when the last one began, when the next one is due."""

    in_a_row: int = 0
    started_at: float = 0.0
    due_at: float | None = None  # set while backing off


def describe_exit(code: int) -> str:
    """`exited with code 1`, `was killed by SIGKILL`: a Popen return code in words."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class Supervisor:
    def __init__(
        self,
        cluster: LocalCluster,
        policy: RestartPolicy = RestartPolicy(),
        startup_timeout_s: float = 600.0,
        say: Callable[[str], None] | None = None,
        tick_s: float = 0.2,
    ):
        """startup_timeout_s: for the first start and for each restart; say: where the supervisor's lines
        go (default: stderr, each prefixed `specsplit up:`)."""
        self.cluster = cluster
        self.policy = policy
        self.startup_timeout_s = startup_timeout_s
        self.say = say or (lambda line: print(f"specsplit up: {line}", file=sys.stderr, flush=True))
        self.tick_s = tick_s
        self._stopping = False
        self._restarts: dict[str, _Restarts] = {}
        self._start_failure = 1  # run()'s exit code when the first start fails

    def stop(self) -> None:
        """Ends run() at its next tick. Only sets a flag, so a signal handler may call it."""
        self._stopping = True

    def run(self, on_ready: Callable[[], None] = lambda: None) -> int:
        """Starts the services, calls on_ready once all of them serve, then supervises them until stop() (0),
        a service given up or the coordinator's exit (1). Stops every service before it returns."""
        try:
            code = self._supervise(on_ready)
        except BaseException:
            self.cluster.stop()
            raise
        if code is not None:
            self.cluster.stop()
            return code
        # stop() while all served: each service must exit 0, or `up` says which did not and exits 1
        failed = {role: code for role, code in self.cluster.stop().items() if code != 0}
        for role, code in failed.items():
            self.say(f"{role} {describe_exit(code)} while stopping")
        return 1 if failed else 0

    def _supervise(self, on_ready: Callable[[], None]) -> int | None:
        """run()'s exit code, or None after stop() once every service served."""
        if not self._start():
            return 0 if self._stopping else self._start_failure
        on_ready()
        while not self._stopping:
            if self._coordinator_exited() or any(self._given_up(role) for role in self._restarts):
                return 1
            time.sleep(self.tick_s)
        return None

    def _start(self) -> bool:
        """True once every service serves; False at stop(), or (having said why) if one exits or is late.
        A service that fails its first start is not restarted: that is a configuration error."""
        self.cluster.launch()
        now = time.monotonic()
        deadline = now + self.startup_timeout_s
        self._restarts = {r: _Restarts(started_at=now) for r in RESTARTED_ROLES if r in self.cluster.services}
        waiting = list(self.cluster.services.values())
        while waiting and not self._stopping:
            for svc in waiting:
                if not svc.poll_ready() and svc.proc.poll() is not None:
                    self.say(f"{svc.role} {describe_exit(svc.proc.returncode)} while starting; stopping all services")
                    # a service refusing a user's mistake exits 2 (with its own line above): so does `up`
                    self._start_failure = 2 if svc.proc.returncode == 2 else 1
                    return False
            waiting = [svc for svc in waiting if svc.ready_at is None]
            if waiting and time.monotonic() > deadline:
                late = ", ".join(svc.role for svc in waiting)
                self.say(f"{late} not serving after {self.startup_timeout_s:g} s; stopping all services")
                return False
            time.sleep(self.tick_s)
        return not waiting

    def _coordinator_exited(self) -> bool:
        code = self.cluster.services["coordinator"].proc.poll()
        if code is not None:
            self.say(f"coordinator {describe_exit(code)}; it holds the requests' state, so all services stop")
        return code is not None

    def _given_up(self, role: str) -> bool:
        """Restarts `role` if it has exited and its backoff is over; True (having said why) once it is given up."""
        state, svc, now = self._restarts[role], self.cluster.services[role], time.monotonic()
        if state.due_at is not None:
            if now >= state.due_at:
                state.due_at, state.started_at = None, now
                self.cluster.respawn(role)
            return False
        if svc.ready_at is None and svc.poll_ready():
            self.say(f"{role} serving again (pid {svc.proc.pid})")
        if svc.proc.poll() is None:
            if svc.ready_at is not None or now - state.started_at <= self.startup_timeout_s:
                return False
            self.say(f"{role} not serving {self.startup_timeout_s:g} s after its restart; killing it")
            svc.proc.kill()
            svc.proc.wait(timeout=30)
        code = svc.proc.returncode
        if svc.ready_at is not None and now - svc.ready_at >= self.policy.stable_s:
            state.in_a_row = 0
        if state.in_a_row >= self.policy.max_restarts:
            self.say(
                f"giving up on the {role}: it {describe_exit(code)} within {self.policy.stable_s:g} s of each of "
                f"its last {state.in_a_row} restarts; stopping all services"
            )
            return True
        state.in_a_row += 1
        delay = self.policy.delay_s(state.in_a_row)
        state.due_at = now + delay
        self.say(
            f"{role} {describe_exit(code)}; restarting it in {delay:g} s "
            f"(restart {state.in_a_row} in a row, at most {self.policy.max_restarts})"
        )
        return False
