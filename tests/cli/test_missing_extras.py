"""A command run from an install without its extra (the base install is the client SDK alone) ends with one
line naming the extra to install and exit code 2, not a traceback. Each case runs the real command in a fresh
process where the extra's module cannot be imported (`sys.modules[name] = None`, as when it is not installed).
`generate --address` needs no extra (tests/e2e/test_base_install.py runs it from a base install)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

DEMO = str(pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo")
RUN = (
    "import sys; sys.modules[sys.argv[1]] = None; from specsplit.cli.commands import main; sys.exit(main(sys.argv[2:]))"
)


@pytest.mark.parametrize(
    "missing, argv, extra",
    [
        ("torch", ["generate", "--local", "--model", DEMO, "hi"], "coordinator,worker"),
        ("transformers", ["serve", "coordinator", "--model", DEMO, "--verifier", "127.0.0.1:1"], "coordinator"),
        ("torch", ["serve", "verifier", "--model", DEMO], "worker"),
        ("torch", ["serve", "drafter", "--model", DEMO], "worker"),
        ("torch", ["up", "--model", DEMO, "--port", "0"], "coordinator,worker"),
        ("torch", ["train-demo", "--help"], "worker"),
    ],
    ids=["generate-local", "serve-coordinator", "serve-verifier", "serve-drafter", "up", "train-demo"],
)
def test_a_command_without_its_extra_names_the_extra(missing, argv, extra):
    out = subprocess.run([sys.executable, "-c", RUN, missing, *argv], capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    command = " ".join(argv[:2] if argv[0] == "serve" else argv[:1])
    wanted = re.escape(f"specsplit {command}: this command needs the specsplit[{extra}] extra (no module named '")
    wanted += re.escape(missing) + r"(\.\w+)*" + re.escape(f"'); pip install 'specsplit[{extra}]'")  # or a submodule
    assert re.fullmatch(wanted, lines[0]), lines[0]


def test_a_missing_module_of_specsplit_itself_is_not_blamed_on_an_extra():
    """A module of the package missing is a broken install or a bug: its traceback is kept."""
    out = subprocess.run(
        [sys.executable, "-c", RUN, "specsplit.cli.trace_view", "trace", "/nonexistent"], capture_output=True, text=True
    )
    assert out.returncode == 1 and "ModuleNotFoundError" in out.stderr and "extra" not in out.stderr
