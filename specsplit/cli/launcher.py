"""Starts coordinator, verifier and drafter as three processes on this machine (`specsplit up`).

Each child runs `python -m specsplit serve <role> …`, so its command line names its role and
operators can find and signal it. Ports are picked free up front so the three load in parallel.
`role_commands` replaces that program for a role (e.g. a benchmark's wrapped drafter); the role's
usual arguments follow it.

The drafter's placement (`specsplit.rpc.placement`) goes to verifier and drafter alike: `colocated` (the
default: Unix sockets, CUDA IPC on a GPU, the device hand-off) or `pooled` (gRPC, hidden states by
grpc bytes or nccl). The coordinator always reaches its verifier on the verifier's Unix socket, and
every service's socket lives in one short directory of this cluster's, removed at stop(). Only the
coordinator listens on `host`; verifier and drafter bind to loopback.

On CUDA each model server sizes its KV cache from its share of its device (`--gpu-memory-utilization`): a
drafter on its verifier's device takes 0.1 of it, the verifier the rest of `up`'s share (0.9 by default), so
the two add up below 1. Two services on one device measure their memory in turn, not in parallel (a lock in
the socket directory: `specsplit.runtime.memory_profile`).

The services end with the process that started them, however it ends: on Linux each child asks the kernel
for SIGTERM when its parent's starting thread exits (`prctl(PR_SET_PDEATHSIG)`,
`specsplit.rpc.process.end_with_parent`, which every service calls first), so a SIGKILLed `up` leaves no service
holding its ports, and the last service to leave the socket directory removes it. Start a cluster from a thread that
outlives it (`up`: its main thread).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.rpc.placement import resolve_placement
from specsplit.rpc.process import COORDINATOR_ENV, PARENT_ENV, WORKER_HOST, free_port
from specsplit.runtime.kv_cache_size import service_shares

log = logging.getLogger(__name__)
METRICS_PORT_OFFSETS = {"coordinator": 0, "verifier": 1, "drafter": 2}


@dataclass
class Service:
    role: str
    proc: subprocess.Popen
    address: str
    lines: queue.Queue = field(default_factory=queue.Queue)
    log_path: Path | None = None
    ready_at: float | None = None  # time.monotonic() when it said it was listening
    output_closed: bool = False

    def poll_ready(self, timeout_s: float = 0.0) -> bool:
        """Whether it has said it is listening, reading what it printed (waiting up to timeout_s for more);
        False for good once its output has closed without that line (it exited)."""
        want = f"{self.role} listening on "
        deadline = time.monotonic() + timeout_s
        while self.ready_at is None and not self.output_closed:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:
                self.output_closed = True
            elif line.startswith(want):
                self.ready_at = time.monotonic()
        return self.ready_at is not None

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
        placement: str = "colocated",
        hidden_transport: str | None = None,
        verifier_device: str | None = None,
        drafter_device: str | None = None,
        metrics_port: int | None = None,
        http_port: int | None = None,
        gpu_memory_utilization: float | None = None,
        auth_token_file: str | Path | None = None,
        max_model_len: int | None = None,
    ):
        """device: for verifier and drafter unless verifier_device / drafter_device pin them apart
        (e.g. cuda:0 and cuda:1); placement: the drafter's (`specsplit.rpc.placement`), given to both model
        servers; hidden_transport: a pooled drafter's (grpc or nccl; None: grpc); metrics_port: Prometheus
        metrics of the coordinator on it, of verifier and drafter on the next two ports; http_port: the
        coordinator's OpenAI-compatible HTTP API on it (on `host`; None: off); gpu_memory_utilization: the share of
        each CUDA device the model servers on it may use together (None: 0.9), split between a verifier and a
        drafter on one device (`specsplit.runtime.kv_cache_size.service_shares`); UsageError when given for the CPU.
        tls_dir: TLS on the coordinator's APIs and mutual TLS between the three services, which dial each other at
        127.0.0.1 (`specsplit.rpc.security`); auth_token_file: the bearer tokens the coordinator's APIs require;
        max_model_len: the verifier's (None: the model's context length), which the coordinator takes from it."""
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
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), PARENT_ENV: str(os.getpid())}
        self.services: dict[str, Service] = {}
        self.tls_dir = str(tls_dir) if tls_dir else None
        self.auth_token_file = str(auth_token_file) if auth_token_file else None
        self.max_model_len = max_model_len
        self.load_format = load_format
        self.role_commands = role_commands or {}
        resolved = {role: resolve_placement(placement, d, hidden_transport) for role, d in self.devices.items()}
        if with_drafter and resolved["verifier"] != resolved["drafter"]:
            raise ValueError(
                f"a co-located drafter on {self.devices['drafter']} cannot take hidden states from a verifier on "
                f"{self.devices['verifier']} by {resolved['verifier'].hidden_transport}: put both on CUDA devices "
                "or both on the CPU, or use placement pooled"
            )
        self.placement = resolved["verifier"]
        model_servers = {role: d for role, d in self.devices.items() if with_drafter or role == "verifier"}
        self.memory_shares = service_shares(
            gpu_memory_utilization,
            model_servers,
            _tensor_parallel_size(verifier_args),
            _tensor_parallel_size(drafter_args),
        )
        self.hidden_transport_flag = hidden_transport
        self.metrics_port = metrics_port
        self.http_port = http_port
        self._socket_dir: str | None = None  # made by the first command that names it

    @property
    def hidden_transport(self) -> str:
        """The transport both model servers use (their placement's)."""
        return self.placement.hidden_transport

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str | None:
        """The HTTP API's base URL (`http://host:port`, https with `tls_dir`), None when it is off."""
        scheme = "https" if self.tls_dir else "http"
        return f"{scheme}://{self.host}:{self.http_port}" if self.http_port else None

    def command(self, role: str, port: int, peer: str | None = None) -> list[str]:
        program = self.role_commands.get(role, [sys.executable, "-m", "specsplit", "serve", role])
        host = self.host if role == "coordinator" else WORKER_HOST
        cmd = [*program, "--host", host, "--port", str(port), "--model", self.model]
        if role in ("verifier", "drafter"):
            cmd += ["--device", self.devices[role], "--dtype", self.dtype, "--load-format", self.load_format]
            cmd += ["--placement", self.placement.name, "--socket-dir", self.socket_dir]
            if role in self.memory_shares:
                cmd += ["--gpu-memory-utilization", f"{self.memory_shares[role]:g}"]
            if self.hidden_transport_flag is not None:
                cmd += ["--hidden-transport", self.hidden_transport_flag]
        if role == "verifier" and peer:
            cmd += ["--drafter", peer]
        if role == "verifier" and self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if role == "coordinator":
            cmd += ["--verifier", peer, "--num-speculative-tokens", str(self.k)]
            if self.http_port:
                cmd += ["--http-port", str(self.http_port)]
            if self.auth_token_file:
                cmd += ["--auth-token-file", self.auth_token_file]
        if self.tls_dir:
            cmd += ["--tls-dir", self.tls_dir]
        if self.metrics_port:
            cmd += ["--metrics-port", str(self.metrics_port + METRICS_PORT_OFFSETS[role])]
            if role != "coordinator":  # scraped where the coordinator listens, though they serve on loopback
                cmd += ["--metrics-host", self.host]
        return cmd + self.extra[role]

    @property
    def socket_dir(self) -> str:
        """Where verifier and drafter put their Unix sockets: short (a socket path holds at most 107 bytes)."""
        if self._socket_dir is None:
            self._socket_dir = tempfile.mkdtemp(prefix="specsplit-")
        return self._socket_dir

    def spawn(self, role: str, port: int, peer: str | None = None) -> Service:
        log_path = None
        stderr = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{role}.log"
            stderr = open(log_path, "a" if role in self.services else "w")  # noqa: SIM115 (a restart appends)
        try:
            proc = subprocess.Popen(
                self.command(role, port, peer),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=self._env(role),
                start_new_session=True,
            )
        finally:
            if stderr is not None:
                stderr.close()  # the child has its own copy
        host = self.host if role == "coordinator" else WORKER_HOST
        svc = Service(role, proc, f"{host}:{port}", log_path=log_path)
        threading.Thread(target=self._pump, args=(svc,), daemon=True).start()
        self.services[role] = svc
        return svc

    def _env(self, role: str) -> dict[str, str]:
        """The environment of a service; verifier and drafter learn their coordinator's pid (`COORDINATOR_ENV`)."""
        coordinator = self.services.get("coordinator")
        if role == "coordinator" or coordinator is None:
            return self.env
        return {**self.env, COORDINATOR_ENV: str(coordinator.proc.pid)}

    @staticmethod
    def _pump(svc: Service) -> None:
        for line in svc.proc.stdout:
            svc.lines.put(line.rstrip("\n"))
        svc.lines.put(None)

    def _worker_port(self) -> int:
        """A free port for a verifier or drafter, none of the ports this cluster gives its services otherwise (the
        metrics ports after `metrics_port` are bound only as each service starts, so free_port may hand one out)."""
        taken = {self.port, self.http_port}
        if self.metrics_port:
            taken.update(self.metrics_port + offset for offset in METRICS_PORT_OFFSETS.values())
        for _ in range(100):  # the OS hands out ports at random: a taken one comes back seldom
            port = free_port()
            if port not in taken:
                return port
        raise RuntimeError(f"no free port outside {sorted(p for p in taken if p)}")

    def start_drafter(self, port: int | None = None) -> Service:
        return self.spawn("drafter", port or self._worker_port())

    def start_verifier(self, port: int | None = None) -> Service:
        drafter = self.services.get("drafter")
        return self.spawn("verifier", port or self._worker_port(), drafter.address if drafter else None)

    def launch(self) -> None:
        """Spawns coordinator, drafter and verifier without waiting for them to load: the coordinator first, so the
        model servers know its pid (they outlive it, `outlive_the_coordinator`); it waits for its verifier."""
        verifier_port = self._worker_port()
        self.spawn("coordinator", self.port, f"{WORKER_HOST}:{verifier_port}")
        if self.with_drafter:
            self.start_drafter()
        self.start_verifier(verifier_port)

    def start(self, timeout_s: float = 300.0) -> LocalCluster:
        self.launch()
        deadline = time.monotonic() + timeout_s
        try:
            self.wait_ready(list(self.services.values()), deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, services: list[Service], deadline: float) -> None:
        """Until each of `services` has said it listens. Raises RuntimeError as soon as any of them exits (one
        waits on another: the coordinator on its verifier would wait its whole --startup-timeout for a verifier
        that exited), TimeoutError at `deadline`."""
        waiting = list(services)
        while waiting:
            for svc in waiting:
                if not svc.poll_ready() and svc.output_closed:
                    raise RuntimeError(f"{svc.role} exited with code {svc.proc.wait()}\n{svc.log_tail()}")
            waiting = [svc for svc in waiting if svc.ready_at is None]
            if waiting and time.monotonic() >= deadline:
                raise TimeoutError(f"{waiting[0].role} was not ready in time\n{self.not_ready()}")
            if waiting:
                waiting[0].poll_ready(timeout_s=min(0.2, max(0.0, deadline - time.monotonic())))

    def not_ready(self) -> str:
        """Each service that has not said it listens, with the end of its log: one waits on another (coordinator
        on verifier, a co-located verifier on its drafter), and the one it waits on tells why."""
        return "\n".join(
            f"--- {svc.role} (pid {svc.proc.pid}, {'running' if svc.proc.poll() is None else 'exited'}):\n"
            f"{svc.log_tail()}"
            for svc in self.services.values()
            if not svc.poll_ready()
        )

    def kill(self, role: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` and waits for the service to exit: SIGKILL 30 s; SIGTERM or SIGINT drain, which may take the
        service's whole `--shutdown-grace` (30 s by default), so 90 s."""
        svc = self.services[role]
        svc.proc.send_signal(sig)
        svc.proc.wait(timeout=30 if sig == signal.SIGKILL else 90)

    def restart(self, role: str, timeout_s: float = 120.0) -> Service:
        """Starts a stopped service again on the same address and waits until it serves."""
        svc = self.respawn(role)
        self.wait_ready([svc], time.monotonic() + timeout_s)
        return svc

    def respawn(self, role: str) -> Service:
        """Starts an exited service again with the same command, so on the same address; does not wait."""
        old = self.services[role]
        if old.proc.poll() is None:
            raise RuntimeError(f"{role} (pid {old.proc.pid}) is still running")
        port = int(old.address.rsplit(":", 1)[1])
        peer = None
        if role == "verifier" and "drafter" in self.services:
            peer = self.services["drafter"].address
        if role == "coordinator":
            peer = self.services["verifier"].address
        return self.spawn(role, port, peer)

    def stop(self, grace_s: float = 35.0) -> dict[str, int]:
        """Stops the services in order: SIGTERM to the coordinator first, which refuses new requests and finishes
        those in flight (its `--shutdown-grace`, 30 s by default) while verifier and drafter still serve them;
        then to verifier and drafter. A service still running `grace_s` after its SIGTERM is killed. Returns each
        service's exit code."""
        for roles in (["coordinator"], ["verifier", "drafter"]):
            group = [self.services[role] for role in roles if role in self.services]
            for svc in group:
                if svc.proc.poll() is None:
                    svc.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for svc in group:
                try:
                    svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s still running %g s after SIGTERM: killing it", svc.role, grace_s)
                    svc.proc.kill()
                    svc.proc.wait()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        return {role: svc.proc.returncode for role, svc in self.services.items()}

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _tensor_parallel_size(service_args: list[str] | None) -> int:
    """A model server's --tensor-parallel-size among its extra arguments (1 without it)."""
    args = service_args or []
    for i, arg in enumerate(args):
        if arg == "--tensor-parallel-size" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--tensor-parallel-size="):
            return int(arg.split("=", 1)[1])
    return 1
