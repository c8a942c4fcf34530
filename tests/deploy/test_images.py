"""The images start: each Dockerfile's build replayed into a fresh virtual environment (no Docker engine),
then the three entry points run as the images would run them, until `grpc.health.v1` says SERVING,
and a generation goes through them.

Replayed exactly: the files each `COPY` puts into the image (nothing else from the checkout: the services
run from a directory outside it, with no PYTHONPATH) and each `RUN pip install`, as written, with the
image's `ARG` defaults and `ENV`. Three differences: the torch wheel comes from this machine's local CPU build
instead of `--index-url` (no network), the operating-system `RUN`s (apt-get, useradd) are left out, and pip
installs without byte-compiling (`--no-compile`: the same files, faster). Images whose COPY and pip steps are
the same (verifier and drafter) share one environment. `CMD`'s hosts and ports become 127.0.0.1 and free ports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from deploy_tools import ROOT
from test_docker import ROLES, dockerfile, instructions

pytestmark = pytest.mark.timeout(1200)

IMAGE_ROOT = "/opt/specsplit"  # the images' WORKDIR
IMAGE_VENV = "/opt/venv"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReplayedImage:
    """One Dockerfile's build, replayed under `root` (the image's /opt/specsplit) with its own venv."""

    def __init__(self, role: str, root: Path):
        self.role, self.root, self.venv = role, root, root / "venv"
        self.ins = instructions(dockerfile(role))
        self.args = {}
        self.env = {}
        for inst, text in self.ins:
            if inst == "ARG" and "=" in text:
                name, value = text.split("=", 1)
                self.args[name] = value
            elif inst == "ENV":
                for name, value in re.findall(r'(\w+)=("[^"]*"|\S+)', text):
                    self.env[name] = value.strip('"')

    def build_steps(self) -> tuple[str, ...]:
        """What decides the environment's content: COPY and pip steps, in order."""
        return tuple(f"{i} {a}" for i, a in self.ins if i == "COPY" or (i == "RUN" and "pip install" in a))

    def build(self) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True, timeout=300)
        workdir = self.root / "app"
        workdir.mkdir(parents=True)
        for inst, text in self.ins:
            if inst == "COPY":
                *sources, dest = text.split()
                for src in sources:
                    self._copy(ROOT / src, workdir / dest, dest.endswith("/"))
            elif inst == "RUN" and "pip install" in text:
                self._run(text, workdir)

    @staticmethod
    def _copy(src: Path, dest: Path, into: bool) -> None:
        target = dest / src.name if into and src.is_file() else dest
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)

    def _run(self, command: str, workdir: Path) -> None:
        command = re.sub(r'--index-url\s+"?\$\{?TORCH_INDEX_URL\}?"?\s*', "", command)  # offline: local wheel
        # Not byte-compiled at install (a third of the replay's time: torch's thousands of modules); the same files,
        # and the modules the services import compile on first import.
        command = command.replace("pip install ", "pip install --no-compile ")
        for name, value in self.args.items():
            command = command.replace("${" + name + "}", value).replace("$" + name, value)
        out = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            cwd=workdir,
            env=self.environ(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, f"{self.role}: RUN {command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k.startswith(("PIP_", "LANG", "LC_")) or k in ("HOME", "TMPDIR")}
        for name, value in self.env.items():
            env[name] = value.replace("$PATH", os.environ["PATH"]).replace(IMAGE_VENV, str(self.venv))
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', os.environ['PATH'])}"
        env["HOME"] = str(self.root)
        env.pop("PIP_NO_CACHE_DIR", None)  # the replay may reuse pip's cache; the installed files are the same
        return env

    def entry_command(self, ports: dict[str, int], metrics_port: int, http_port: int) -> list[str]:
        (entry,) = [json.loads(a) for i, a in self.ins if i == "ENTRYPOINT"]
        (cmd,) = [json.loads(a) for i, a in self.ins if i == "CMD"]
        argv = [*entry, *cmd]
        out = []
        for i, a in enumerate(argv):
            prev = argv[i - 1] if i else ""
            if prev == "--host":
                a = "127.0.0.1"
            elif prev == "--port":
                a = str(ports[self.role])
            elif prev == "--metrics-port":
                a = str(metrics_port)
            elif prev == "--http-port":
                a = str(http_port)
            for role, port in ROLES.items():
                a = a.replace(f"dns:///specsplit-{role}:{port}", f"127.0.0.1:{ports[role]}")
                a = a.replace(f"specsplit-{role}:{port}", f"127.0.0.1:{ports[role]}")
            out.append(a.replace(IMAGE_ROOT, str(self.root / "app")))
        return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """role -> its replayed image; one environment per distinct set of build steps, the environments built side
    by side (as `docker build` of several images would: each its own directories, its own pip cache)."""
    built: dict[tuple[str, ...], ReplayedImage] = {}
    out = {}
    for role in ROLES:
        image = ReplayedImage(role, tmp_path_factory.mktemp(role))
        twin = built.setdefault(image.build_steps(), image)
        image.root, image.venv = twin.root, twin.venv
        out[role] = image
    with ThreadPoolExecutor(len(built)) as pool:  # pip is one process per build, mostly on one core
        for build in [pool.submit(image.build) for image in built.values()]:
            build.result()
    return out


def test_each_image_installs_only_its_role(images):
    python = str(images["coordinator"].venv / "bin" / "python")
    check = "import importlib.util as u; print([m for m in ('torch', 'triton') if u.find_spec(m)])"
    assert subprocess.run([python, "-c", check], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    worker = str(images["verifier"].venv / "bin" / "python")
    out = subprocess.run([worker, "-c", check], capture_output=True, text=True, check=True)
    assert "torch" in out.stdout


def test_the_images_entry_points_serve_the_demo_checkpoint(images, tmp_path):
    ports = {role: _free_port() for role in ROLES}
    http_port = _free_port()
    procs: dict[str, subprocess.Popen] = {}
    logs = {role: open(tmp_path / f"{role}.log", "w") for role in ROLES}  # noqa: SIM115 (closed below)
    try:
        for role in ("drafter", "verifier", "coordinator"):  # as Kubernetes would start them, in any order
            image = images[role]
            procs[role] = subprocess.Popen(
                image.entry_command(ports, _free_port(), http_port),
                cwd=tmp_path,  # outside the checkout: only what the image installed can be imported
                env=image.environ(),
                stdout=logs[role],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 420
        for role in ("drafter", "verifier", "coordinator"):
            image = images[role]
            (health,) = [json.loads(a.split("CMD", 1)[1]) for i, a in image.ins if i == "HEALTHCHECK"]
            probe = [str(image.venv / "bin" / "python"), str(image.root / "app" / "healthcheck.py")]
            probe += [f"127.0.0.1:{ports[role]}", health[-1]]
            while subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
                for name, p in procs.items():
                    assert p.poll() is None, f"{name} exited {p.returncode}:\n{_tail(tmp_path / f'{name}.log')}"
                assert time.monotonic() < deadline, f"{role} not SERVING:\n{_tail(tmp_path / f'{role}.log')}"
                time.sleep(1.0)
        from specsplit import Client

        with Client(f"127.0.0.1:{ports['coordinator']}", timeout=120) as client:
            result = client.generate("def read_lines(path):\n", max_tokens=16, ignore_eos=True)
        assert result.completion_tokens == 16
        assert result.stats.num_draft_tokens > 0  # the drafter image drafted
        # the coordinator image serves the OpenAI-compatible HTTP API too (its CMD's --http-port)
        body = {"model": "demo", "prompt": "def read_lines(path):\n", "max_tokens": 4, "ignore_eos": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""
