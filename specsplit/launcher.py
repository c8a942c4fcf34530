"""Starts coordinator, verifier and drafter as three processes on this machine (`specsplit up`).

Each child runs `python -m specsplit serve <role> …`, so its command line names its role and
operators can find and signal it. Ports are picked free up front so the three load in parallel.
`role_commands` replaces that program for a role (e.g. a benchmark's wrapped drafter); the role's
usual arguments follow it.

The hidden-state transport defaults to `auto`, resolved here before any command is built, so the
servers only ever see a concrete one (they default to grpc themselves: across machines only grpc
and nccl apply): cuda_ipc when verifier and drafter are both on CUDA devices (one host by
construction, one GPU or two) and the verifier talks to this cluster's one drafter; grpc otherwise.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.local_stream import DRAFTER_RPCS, VERIFIER_RPCS
from specsplit.transport import TRANSPORTS

log = logging.getLogger(__name__)
LOCAL_HIDDEN_TRANSPORTS = ("auto", *TRANSPORTS)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_hidden_transport(name: str, verifier_device: str, drafter_device: str, own_drafter: bool = True) -> str:
    """The transport `name` stands for on a local cluster. `auto`: cuda_ipc when both devices are CUDA
    devices and `own_drafter` (the verifier's one drafter is this cluster's; cuda_ipc refuses several
    or none), grpc otherwise; any other known name is itself."""
    if name not in LOCAL_HIDDEN_TRANSPORTS:
        raise ValueError(f"unknown hidden-state transport {name!r}; choose one of {', '.join(LOCAL_HIDDEN_TRANSPORTS)}")
    if name != "auto":
        return name
    on_cuda = all(d.partition(":")[0] == "cuda" for d in (verifier_device, drafter_device))
    return "cuda_ipc" if on_cuda and own_drafter else "grpc"


@dataclass
class Service:
    role: str
    proc: subprocess.Popen
    address: str
    lines: queue.Queue = field(default_factory=queue.Queue)
    log_path: Path | None = None

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class LocalCluster:
    """The three services as child processes. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        model: str,
        *,
        num_speculative_tokens: int = 3,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        log_dir: str | Path | None = None,
        with_drafter: bool = True,
        verifier_args: list[str] | None = None,
        drafter_args: list[str] | None = None,
        coordinator_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        tls_dir: str | Path | None = None,
        load_format: str = "auto",
        role_commands: dict[str, list[str]] | None = None,
        hidden_transport: str = "auto",
        verifier_device: str | None = None,
        drafter_device: str | None = None,
        drafter_rpc: str = "local",
        verifier_rpc: str = "local",
    ):
        """device: for verifier and drafter unless verifier_device / drafter_device pin them apart
        (e.g. cuda:0 and cuda:1); hidden_transport: auto, grpc, cuda_ipc or nccl, resolved once
        (`resolve_hidden_transport`) and given to both as the `hidden_transport` attribute;
        drafter_rpc: the verifier's `--drafter-rpc` (local: the drafter also serves ProposeStream on a
        Unix socket in a temporary directory of this cluster's, removed at stop()); verifier_rpc: the
        coordinator's `--verifier-rpc` (local: the verifier's VerifyStream on a socket there too)."""
        self.model = str(model)
        self.k = num_speculative_tokens
        self.host = host
        self.port = port or free_port(host)
        self.device = device
        self.devices = {"verifier": verifier_device or device, "drafter": drafter_device or device}
        self.dtype = dtype
        self.log_dir = Path(log_dir) if log_dir else None
        self.with_drafter = with_drafter
        self.extra = {
            "verifier": verifier_args or [],
            "drafter": drafter_args or [],
            "coordinator": coordinator_args or [],
        }
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.services: dict[str, Service] = {}
        self.tls_dir = str(tls_dir) if tls_dir else None
        self.load_format = load_format
        self.role_commands = role_commands or {}
        if drafter_rpc not in DRAFTER_RPCS:
            raise ValueError(f"unknown drafter rpc {drafter_rpc!r}; choose one of {', '.join(DRAFTER_RPCS)}")
        if verifier_rpc not in VERIFIER_RPCS:
            raise ValueError(f"unknown verifier rpc {verifier_rpc!r}; choose one of {', '.join(VERIFIER_RPCS)}")
        self.drafter_rpc, self.verifier_rpc = drafter_rpc, verifier_rpc
        self._socket_dir: str | None = None  # made by the first command that names the socket
        drafter_given = any(a == "--drafter" or a.startswith("--drafter=") for a in self.extra["verifier"])
        self._hidden_transport = resolve_hidden_transport(
            hidden_transport, self.devices["verifier"], self.devices["drafter"], with_drafter and not drafter_given
        )
        log.info("hidden-state transport: %s (asked for %s)", self._hidden_transport, hidden_transport)

    @property
    def hidden_transport(self) -> str:
        """The concrete transport both model servers get: never `auto`."""
        return self._hidden_transport

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self, role: str, port: int, peer: str | None = None) -> list[str]:
        program = self.role_commands.get(role, [sys.executable, "-m", "specsplit", "serve", role])
        cmd = [
            *program,
            "--host",
            self.host,
            "--port",
            str(port),
            "--model",
            self.model,
        ]
        if role in ("verifier", "drafter"):
            cmd += ["--device", self.devices[role], "--dtype", self.dtype, "--load-format", self.load_format]
            cmd += ["--hidden-transport", self.hidden_transport]
        if role == "verifier" and peer:
            cmd += ["--drafter", peer, "--drafter-rpc", self.drafter_rpc]
        if role == "drafter" and self.drafter_rpc == "local":
            cmd += ["--propose-socket", self.socket_path("drafter")]
        if role == "verifier" and self.verifier_rpc == "local":
            cmd += ["--verify-socket", self.socket_path("verifier")]
        if role == "coordinator":
            cmd += ["--verifier", peer, "--num-speculative-tokens", str(self.k), "--verifier-rpc", self.verifier_rpc]
        if self.tls_dir:
            cmd += ["--tls-dir", self.tls_dir]
        return cmd + self.extra[role]

    def socket_path(self, role: str) -> str:
        """The drafter's `--propose-socket` or the verifier's `--verify-socket`: short (a Unix socket
        path holds at most 107 bytes)."""
        if self._socket_dir is None:
            self._socket_dir = tempfile.mkdtemp(prefix="specsplit-")
        return os.path.join(self._socket_dir, f"{role}.sock")

    def spawn(self, role: str, port: int, peer: str | None = None) -> Service:
        log_path = None
        stderr = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{role}.log"
            stderr = open(log_path, "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            self.command(role, port, peer),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        svc = Service(role, proc, f"{self.host}:{port}", log_path=log_path)
        threading.Thread(target=self._pump, args=(svc,), daemon=True).start()
        self.services[role] = svc
        return svc

    @staticmethod
    def _pump(svc: Service) -> None:
        for line in svc.proc.stdout:
            svc.lines.put(line.rstrip("\n"))
        svc.lines.put(None)

    def start_drafter(self, port: int | None = None) -> Service:
        return self.spawn("drafter", port or free_port(self.host))

    def start_verifier(self, port: int | None = None) -> Service:
        drafter = self.services.get("drafter")
        return self.spawn("verifier", port or free_port(self.host), drafter.address if drafter else None)

    def start(self, timeout_s: float = 300.0) -> LocalCluster:
        if self.with_drafter:
            self.start_drafter()
        self.start_verifier()
        self.spawn("coordinator", self.port, self.services["verifier"].address)
        deadline = time.monotonic() + timeout_s
        try:
            for svc in list(self.services.values()):
                self.wait_ready(svc, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, svc: Service, deadline: float) -> None:
        want = f"{svc.role} listening on "
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{svc.role} was not ready in time\n{svc.log_tail()}")
            try:
                line = svc.lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{svc.role} exited with code {svc.proc.wait()}\n{svc.log_tail()}")
            if line.startswith(want):
                return

    def kill(self, role: str, sig: int = signal.SIGKILL) -> None:
        svc = self.services[role]
        svc.proc.send_signal(sig)
        svc.proc.wait(timeout=30)

    def restart(self, role: str, timeout_s: float = 120.0) -> Service:
        """Starts a stopped service again on the same address."""
        old = self.services[role]
        port = int(old.address.rsplit(":", 1)[1])
        peer = None
        if role == "verifier" and "drafter" in self.services:
            peer = self.services["drafter"].address
        if role == "coordinator":
            peer = self.services["verifier"].address
        svc = self.spawn(role, port, peer)
        self.wait_ready(svc, time.monotonic() + timeout_s)
        return svc

    def stop(self, grace_s: float = 10.0) -> None:
        for svc in self.services.values():
            if svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for svc in self.services.values():
            try:
                svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
