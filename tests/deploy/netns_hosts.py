"""Hosts for multi-host tests on one machine: Linux network namespaces on a private /24.

Each host is a namespace with one veth link to a bridge in the test's own namespace, so the test
process reaches every host and every host reaches the others through the bridge. Cutting a host's
link (`cut`) sets the bridge side of its veth down: its packets go nowhere, its TCP peers see
silence (no reset), as when a node drops off the network. Needs root and iproute2.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def netns_unavailable() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"specsplit-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _free_subnet() -> str:
    """A 10.213.x.0/24 that no route of this machine already covers: returns "10.213.x"."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for x in [os.getpid() % 200 + 20, *range(20, 250)]:
        prefix = f"10.213.{x}"
        if prefix + "." not in routes and "10.213.0.0/16" not in routes and "10.0.0.0/8" not in routes:
            return prefix
    raise RuntimeError("no free 10.213.x.0/24")


class Hosts:
    """Namespaces `names` on one bridge; host i gets address PREFIX.(10 + i)."""

    def __init__(self, names: list[str]):
        tag = str(os.getpid())
        self.prefix = _free_subnet()
        self.bridge = f"ssb{tag}"
        self.netns = {n: f"specsplit-{tag}-{n}" for n in names}
        self.veth = {n: f"ss{tag}h{i}" for i, n in enumerate(names)}
        self.addr = {n: f"{self.prefix}.{10 + i}" for i, n in enumerate(names)}

    def up(self) -> Hosts:
        self.down()  # anything a crashed run of this pid left
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, ns in self.netns.items():
            _ip("netns", "add", ns)
            _ip("link", "add", self.veth[name], "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth[name], "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def down(self) -> None:
        for name, ns in self.netns.items():
            _ip("link", "del", self.veth[name], check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def exists(self) -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(ns in listed for ns in self.netns.values())

    def cut(self, name: str) -> None:
        _ip("link", "set", self.veth[name], "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.veth[name], "up")

    def bytes_to(self, name: str) -> int:
        """Bytes the bridge has sent to this host so far."""
        return int(Path(f"/sys/class/net/{self.veth[name]}/statistics/tx_bytes").read_text())

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


@dataclass
class HostProcess:
    """A command in a host's namespace; stdout lines queued, stderr to a log file."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    lines: queue.Queue = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, hosts: Hosts, name: str, cmd: list[str], log_dir: Path, env: dict[str, str]) -> HostProcess:
        log_path = log_dir / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", hosts.netns[name], *cmd],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                start_new_session=True,
            )
        hp = cls(name, proc, log_path)
        threading.Thread(target=hp._pump, daemon=True).start()
        return hp

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, prefix: str, deadline: float) -> str:
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}):\n{self.log()[-3000:]}")
            if line.startswith(prefix):
                return line
        raise TimeoutError(f"{self.name}: no {prefix!r} in time:\n{self.log()[-3000:]}")

    def wait_for_log(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {text!r} in its log within {timeout_s}s")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (graceful drain), SIGKILL after timeout_s."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
