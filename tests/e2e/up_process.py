"""`specsplit up` as a user runs it, in a process of its own, (its services found in /proc)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from specsplit.rpc.process import free_port

from .proc import processes


class Up:
    """`python -m specsplit up --model MODEL --port P ARGS…` (MODEL: a checkpoint path of its own, which names its
    services in the process table), with its output in files; ready once it printed the coordinator's address."""

    def __init__(self, model: pathlib.Path, logs: pathlib.Path, args: list[str], env: dict[str, str] | None = None):
        self.model, self.port = str(model), free_port()
        self.stdout, self.stderr = logs / "up.out", logs / "up.err"
        cmd = [sys.executable, "-m", "specsplit", "up", "--model", self.model, "--port", str(self.port), *args]
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        deadline = time.monotonic() + 240
        while "coordinator listening on" not in self.stdout.read_text():
            assert self.proc.poll() is None, f"specsplit up exited early:\n{self.stderr.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "specsplit up not ready in 240 s"
            time.sleep(0.2)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def children(self) -> dict[int, str]:
        """pid → command line of the live processes that name this checkpoint path, `up` itself aside."""
        return {pid: cmd for pid, cmd in processes().items() if self.model in cmd and pid != self.proc.pid}

    def pid(self, role: str) -> int:
        pids = [pid for pid, cmd in self.children().items() if f"specsplit serve {role} " in cmd]
        assert len(pids) == 1, (role, self.children())
        return pids[0]

    def lines(self) -> list[str]:
        """The supervisor's lines (the services' logs share the file)."""
        return [line for line in self.stderr.read_text().splitlines() if line.startswith("specsplit up: ")]

    def wait_for_line(self, text: str, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [line for line in self.lines() if text in line]
            if found:
                return found[-1]
            assert self.proc.poll() is None, f"specsplit up exited with {self.proc.returncode}: {self.lines()}"
            assert time.monotonic() < deadline, f"no line with {text!r} in {timeout_s} s: {self.lines()}"
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.children():  # only after a failed test: the SIGTERM test proves there are none
            os.kill(pid, signal.SIGKILL)
