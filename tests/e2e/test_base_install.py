"""The package as `pip install specsplit` ships it, without extras (the client SDK alone: no torch, no
transformers, no OpenTelemetry SDK, no prometheus_client): a fresh virtual environment gets the project from a copy
of the files the Dockerfiles copy (pyproject.toml, README.md, specsplit/), and its `specsplit` console script
runs `--help`, `--version`, `generate --address` against a real cluster (started by this test's environment) and
`trace` on that cluster's span files; every other command ends with one line naming the extra it needs."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from specsplit import Client
from specsplit.cli.launcher import LocalCluster

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_IN_THE_BASE_INSTALL = ("torch", "numpy", "transformers", "opentelemetry.sdk", "prometheus_client", "fastapi")


@pytest.fixture(scope="module")
def base_install(tmp_path_factory) -> pathlib.Path:
    """The `specsplit` console script of a fresh venv with the project installed without extras."""
    root = tmp_path_factory.mktemp("base-install")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "specsplit", source / "specsplit", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(source)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    missing = "import importlib.util, sys; print([m for m in sys.argv[1:] if importlib.util.find_spec(m)])"
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", missing, *NOT_IN_THE_BASE_INSTALL],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "[]", f"not a base install: {found.stdout}"
    return venv / "bin" / "specsplit"


def _run(script: pathlib.Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command run from a directory outside the source tree, so it imports the installed package."""
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=script.parent)


@pytest.fixture(scope="module")
def traced_cluster(tiny_checkpoint, tmp_path_factory):
    """A cluster whose services write their spans to files (`specsplit trace` reads them)."""
    tmp = tmp_path_factory.mktemp("base-install-cluster")
    env = {"OTEL_TRACES_EXPORTER": "file", "SPECSPLIT_TRACE_DIR": str(tmp / "traces")}
    with LocalCluster(tiny_checkpoint, num_speculative_tokens=2, log_dir=tmp, env=env) as cluster:
        cluster.trace_dir = tmp / "traces"
        yield cluster


def test_help_and_version(base_install):
    helped = _run(base_install, "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert all(command in helped.stdout for command in ("serve", "up", "generate", "trace", "train-demo"))
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    shown = _run(base_install, "--version")
    assert (shown.returncode, shown.stdout.strip()) == (0, f"specsplit {version}"), shown.stderr[-3000:]


def test_generate_and_trace(base_install, traced_cluster, tmp_path):
    """generate --address gives the SDK's greedy tokens; trace draws that request from the services' span files."""
    out = _run(base_install, "generate", "--address", traced_cluster.address, "--max-tokens", "8", "--json", "hello")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    with Client(traced_cluster.address, timeout=60) as client:
        assert result["token_ids"] == client.generate("hello", max_tokens=8).token_ids
    request_id = result["request_id"]
    coordinator_spans = traced_cluster.trace_dir / "coordinator.jsonl"
    deadline = time.monotonic() + 60  # spans are exported in batches, every 0.5 s
    while not (coordinator_spans.exists() and request_id in coordinator_spans.read_text()):
        assert time.monotonic() < deadline, "the coordinator wrote no span of the request in 60 s"
        time.sleep(0.2)
    picture = tmp_path / "trace.svg"
    traced = _run(base_install, "trace", str(traced_cluster.trace_dir), "--request", request_id, "-o", str(picture))
    assert traced.returncode == 0, traced.stderr[-3000:]
    assert traced.stdout.startswith(f"request {request_id}: ") and picture.read_text().startswith("<svg")
    missing = _run(base_install, "trace", str(tmp_path / "no-such-file.jsonl"))
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and len(lines) == 1 and lines[0].startswith("specsplit trace: cannot read "), lines


@pytest.mark.parametrize(
    "argv, extra",
    [
        (["serve", "coordinator", "--verifier", "127.0.0.1:1"], "coordinator"),
        (["serve", "verifier"], "worker"),
        (["serve", "drafter"], "worker"),
        (["up", "--port", "0"], "coordinator,worker"),
        (["generate", "--local", "hi"], "coordinator,worker"),
        (["train-demo", "--help"], "worker"),
    ],
    ids=["serve-coordinator", "serve-verifier", "serve-drafter", "up", "generate-local", "train-demo"],
)
def test_every_other_command_names_its_extra_in_one_line(base_install, tiny_checkpoint, argv, extra):
    model = [] if argv[0] == "train-demo" else ["--model", str(tiny_checkpoint)]
    out = _run(base_install, *argv, *model)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    command = " ".join(argv[:2] if argv[0] == "serve" else argv[:1])
    wanted = re.escape(f"specsplit {command}: this command needs the specsplit[{extra}] extra (no module named '")
    assert re.match(wanted + r"[\w.]+'\); pip install 'specsplit\[" + re.escape(extra) + r"\]'$", lines[0]), lines[0]
