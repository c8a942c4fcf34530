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
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from deploy_tools import ROOT
from test_docker import ROLES, dockerfile, instructions

from specsplit.rpc.process import free_port

pytestmark = pytest.mark.timeout(1200)

IMAGE_ROOT = "/opt/specsplit"  # the images' WORKDIR
IMAGE_VENV = "/opt/venv"


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
    ports = {role: free_port() for role in ROLES}
    http_port = free_port()
    procs: dict[str, subprocess.Popen] = {}
    logs = {role: open(tmp_path / f"{role}.log", "w") for role in ROLES}  # noqa: SIM115 (closed below)
    try:
        for role in ("drafter", "verifier", "coordinator"):  # as Kubernetes would start them, in any order
            image = images[role]
            procs[role] = subprocess.Popen(
                image.entry_command(ports, free_port(), http_port),
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


# ---- every overlay's every container, as Kubernetes would run it ----------------------------------------------------
# The manifests' own command, args, env (the ConfigMap's literals, the container's env) and volumes, in the replayed
# image of the container's image name, with what only a cluster provides stood in for on this machine: the CPU
# (SPECSPLIT_DEVICE / SPECSPLIT_DTYPE, no --gpu-memory-utilization), a directory per volume (the model volume holding
# the demo checkpoint, or for pooled-tp a tiny checkpoint whose heads split as SPECSPLIT_VERIFIER_TP asks), 127.0.0.1
# for 0.0.0.0 and for Services' names, a free local port for each port of a pod, and one replica per Deployment. Only
# the specsplit images' containers run (the OpenTelemetry collector's image is not ours; its address gets a closed
# local port).

CPU = {"SPECSPLIT_DEVICE": "cpu", "SPECSPLIT_DTYPE": "float32"}
GPU_ONLY = ("--gpu-memory-utilization",)  # refused on the CPU (it sizes KV caches from device memory): left out
MODEL_VOLUME = "specsplit-model"  # the PersistentVolumeClaim of the GPU overlays


def _free_ports(n: int) -> int:
    """The first of n consecutive free ports (`up --metrics-port P` serves P, P+1, P+2)."""
    import socket

    for _ in range(100):
        base = free_port()
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


class OverlayPods:
    """One overlay's Deployments (specsplit containers only) as local processes."""

    def __init__(self, overlay: str, images: dict[str, ReplayedImage], root: Path, model: Path):
        from test_manifests import by_kind, config, render

        self.docs = render(overlay)
        self.images, self.root = images, root
        self.config = {**config(self.docs), **CPU, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
        self.deployments = {
            name: dep["spec"]["template"]
            for name, dep in by_kind(self.docs, "Deployment").items()
            if any(c["image"].startswith("specsplit-") for c in dep["spec"]["template"]["spec"]["containers"])
        }
        self.services = by_kind(self.docs, "Service")
        self.model = model
        self.ports: dict[str, dict[int, int]] = {name: {} for name in self.deployments}
        for name, template in self.deployments.items():
            for c in template["spec"]["containers"]:
                for a in c.get("args", []):
                    if a.startswith("--metrics-port=") and c.get("command", [""])[1:2] == ["up"]:
                        p = int(a.split("=")[1])
                        base = _free_ports(3)
                        self.ports[name].update({p + i: base + i for i in range(3)})
        self.procs: dict[str, subprocess.Popen] = {}

    def port(self, deployment: str, port: int) -> int:
        return self.ports[deployment].setdefault(port, free_port())

    def volume_dirs(self, deployment: str) -> dict[str, Path]:
        """volume name → its local directory."""
        out = {}
        for v in self.deployments[deployment]["spec"].get("volumes", []):
            claim = v.get("persistentVolumeClaim", {}).get("claimName")
            if claim == MODEL_VOLUME:
                out[v["name"]] = self.model.parent
            else:
                out[v["name"]] = self.root / deployment / v["name"]
                out[v["name"]].mkdir(parents=True, exist_ok=True)
        return out

    def service_address(self, name: str, port: int) -> str:
        """A Service's name and port, as the pod behind it listens here."""
        spec = self.services[name]["spec"]
        (sp,) = [p for p in spec["ports"] if p["port"] == port]
        selector = spec["selector"]
        (deployment,) = [d for d, t in self.deployments.items() if selector.items() <= t["metadata"]["labels"].items()]
        target = sp.get("targetPort", port)
        if isinstance(target, str):
            (target,) = [
                p["containerPort"]
                for c in self.deployments[deployment]["spec"]["containers"]
                for p in c.get("ports", [])
                if p["name"] == target
            ]
        return f"127.0.0.1:{self.port(deployment, target)}"

    def _local(self, deployment: str, text: str, mounts: dict[str, Path], image: ReplayedImage) -> str:
        """A manifest string as it reads on this machine."""
        if mounts:  # one pass, longest path first: a replaced path is not replaced again
            paths = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
            text = re.sub(rf"(?<![\w/])({paths})(?=/|$|\s|\")", lambda m: str(mounts[m.group(1)]), text)
        text = text.replace(IMAGE_ROOT, str(image.root / "app"))
        # One pass: a Service's address becomes its pod's local port, this pod's 127.0.0.1:PORT its own local port.
        text = re.sub(
            r"(?:dns:///)?(specsplit-[a-z-]+|127\.0\.0\.1):(\d+)", lambda m: self._address(m, deployment), text
        )
        text = re.sub(
            r"(--[a-z-]*port)=(\d+)", lambda m: f"{m.group(1)}={self.port(deployment, int(m.group(2)))}", text
        )
        return text.replace("0.0.0.0", "127.0.0.1")

    def _address(self, m: re.Match, deployment: str) -> str:
        name, port = m.group(1), int(m.group(2))
        if name == "127.0.0.1":
            return f"127.0.0.1:{self.port(deployment, port)}"
        if name in self.services and self.services[name]["spec"].get("selector"):
            return self.service_address(name, port)
        return m.group(0)

    def image(self, c: dict) -> ReplayedImage:
        """The replayed image of a container's image name."""
        return self.images[c["image"].split(":")[0].removeprefix("specsplit-")]

    def container_run(self, deployment: str, c: dict) -> tuple[ReplayedImage, list[str], dict[str, str], Path]:
        image = self.image(c)
        volumes = self.volume_dirs(deployment)
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in volumes}
        workdir = mounts.get("/tmp") or self.root / deployment / f"{c['name']}-tmp"
        workdir.mkdir(parents=True, exist_ok=True)
        mounts.setdefault("/tmp", workdir)
        raw = dict(self.config)  # the manifest's values: $(VAR) reads these; each value is made local once, below
        for e in c.get("env", []):
            if "valueFrom" in e:
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", e
                raw[e["name"]] = f"{deployment}-0"  # the pod's name
            else:
                raw[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: raw[m.group(1)], e["value"])
        env = image.environ()
        env.update({k: self._local(deployment, v, mounts, image) for k, v in raw.items()})
        env["TMPDIR"] = env["HOME"] = str(mounts["/tmp"])
        (entry,) = [json.loads(a) for i, a in image.ins if i == "ENTRYPOINT"]
        (cmd,) = [json.loads(a) for i, a in image.ins if i == "CMD"]
        argv = [*(c.get("command") or entry), *(c.get("args") if "args" in c else cmd)]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: raw[m.group(1)], a) for a in argv if not a.startswith(GPU_ONLY)]
        argv = [self._local(deployment, a, mounts, image) for a in argv]
        argv[0] = str(image.venv / "bin" / argv[0])
        return image, argv, env, workdir

    def probe(self, deployment: str, c: dict) -> list[str]:
        """The container's readiness probe as a command on this machine."""
        image = self.image(c)
        probe = c["readinessProbe"]
        if "grpc" in probe:
            port = self.port(deployment, probe["grpc"]["port"])
            argv = ["python", f"{IMAGE_ROOT}/healthcheck.py", f"127.0.0.1:{port}", probe["grpc"].get("service", "")]
        else:
            argv = [self._local(deployment, a, {}, image) for a in probe["exec"]["command"]]
        assert argv[0] == "python", argv
        return [str(image.venv / "bin" / "python"), *[a.replace(IMAGE_ROOT, str(image.root / "app")) for a in argv[1:]]]

    def containers(self):
        for deployment, template in self.deployments.items():
            for c in template["spec"]["containers"]:
                if c["image"].startswith("specsplit-"):
                    yield deployment, c

    def start(self, logs: Path) -> None:
        for deployment, c in self.containers():
            image, argv, env, workdir = self.container_run(deployment, c)
            key = f"{deployment}/{c['name']}"
            with open(logs / f"{deployment}-{c['name']}.log", "w") as log:
                self.procs[key] = subprocess.Popen(
                    argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()


@pytest.mark.parametrize("overlay", ["colocated", "cpu-demo", "pooled", "pooled-tp"])
def test_every_overlays_every_container_serves_with_its_images_packages(images, overlay, tmp_path):
    from test_manifests import OVERLAYS

    assert overlay in OVERLAYS
    volume = tmp_path / "volume"
    if overlay == "pooled-tp":  # the demo model's 5 heads do not split 8 ways
        from tests.fixtures.tiny import write_tiny_checkpoint

        model = write_tiny_checkpoint(volume / "model", num_attention_heads=8, num_key_value_heads=8, seed=3)
    else:
        model = volume / "model"
        shutil.copytree(ROOT / "checkpoints" / "demo", model)
    root = Path(tempfile.mkdtemp(prefix="ov-"))  # short: the pods' Unix socket paths hold at most 107 bytes
    pods = OverlayPods(overlay, images, root, model)
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        pods.start(logs)
        deadline = time.monotonic() + 420
        for deployment, c in pods.containers():
            probe = pods.probe(deployment, c)
            while subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
                for key, p in pods.procs.items():
                    log = logs / f"{key.replace('/', '-')}.log"
                    assert p.poll() is None, f"{overlay}: {key} exited {p.returncode}:\n{_tail(log)}"
                assert time.monotonic() < deadline, f"{overlay}: {deployment}/{c['name']} not SERVING"
                time.sleep(1.0)
        from specsplit import Client

        with Client(pods.service_address("specsplit-coordinator", 50051), timeout=120) as client:
            result = client.generate(prompt_token_ids=[5, 6, 7, 8], max_tokens=12, ignore_eos=True)
        assert result.completion_tokens == 12
        assert result.stats.num_draft_tokens > 0  # verifier and drafter found each other as deployed
    finally:
        pods.stop()
        shutil.rmtree(root, ignore_errors=True)
