"""A mistake on the command line or at start-up ends `specsplit` with exit code 2 and one line on stderr,
`specsplit <command>: <problem>; <fix>`, without a traceback (unless --log-level debug) and without the
noise of a gRPC server torn down after its event loop closed. Each test runs the real command."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specsplit", *argv], capture_output=True, text=True, timeout=120, env=env
    )


def refusal(*argv: str, env: dict[str, str] | None = None) -> str:
    """The one stderr line of a command that must be refused with exit code 2."""
    out = run(*argv, env=env)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    return lines[0]


def checkpoint(directory: Path, **changes) -> Path:
    """`directory` holding a copy of the demo's config.json with `changes` (value None: key removed) and
    nothing else."""
    directory.mkdir(exist_ok=True)
    config = json.loads((DEMO / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("role", ["coordinator", "verifier", "drafter"])
def test_a_missing_model_directory_is_refused(role, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    extra = ["--verifier", "127.0.0.1:1"] if role == "coordinator" else []
    line = refusal("serve", role, "--model", missing, *extra)
    assert line.startswith(f"specsplit serve {role}: checkpoint directory {missing!r} does not exist; give --model")


def test_an_unreadable_model_directory_is_refused(tmp_path, monkeypatch):
    """In-process: the tests run as root, for whom every directory is readable; `os.access` answers as it
    would for another user of a mode-0700 directory."""
    from specsplit.errors import UsageError
    from specsplit.models import start_up_checks

    monkeypatch.setattr(start_up_checks.os, "access", lambda path, mode: False)
    with pytest.raises(UsageError, match=r"cannot read checkpoint directory .* \(permission denied\); give --model"):
        start_up_checks.check_checkpoint(str(checkpoint(tmp_path / "m")), "auto", drafter=False)


def test_a_model_directory_without_a_config_is_refused(tmp_path):
    line = refusal("serve", "verifier", "--model", str(tmp_path))
    assert f"no config.json in checkpoint directory {str(tmp_path)!r}" in line and "give --model" in line


def test_a_config_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    line = refusal("serve", "verifier", "--model", str(tmp_path))
    assert f"{str(tmp_path / 'config.json')!r} is not JSON" in line and "give --model" in line


def test_a_model_directory_without_weights_is_refused(tmp_path):
    line = refusal("serve", "verifier", "--model", str(checkpoint(tmp_path)))
    assert "no model.safetensors or model.safetensors.index.json in" in line and "--load-format dummy" in line


def test_weights_of_other_shapes_than_the_config_are_refused_leaving_no_socket_directory(tmp_path):
    model = checkpoint(tmp_path / "model", hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
    (model / "model.safetensors").symlink_to(DEMO / "model.safetensors")
    # Its gRPC server and socket directory are up before the weights load: one line says the server was stopped
    # inside the event loop, and the directory (in TMPDIR, short: a socket path has at most 107 bytes) is gone.
    with tempfile.TemporaryDirectory() as temp:
        line = refusal("serve", "verifier", "--model", str(model), env={**os.environ, "TMPDIR": temp})
        assert not list(Path(temp).glob("specsplit-*"))
    assert line.startswith(f"specsplit serve verifier: checkpoint {str(model)!r}: tensor ")
    assert "has shape (4096, 320), expected (4096, 256)" in line


def test_a_drafter_checkpoint_without_mtp_layers_is_refused(tmp_path):
    model = str(checkpoint(tmp_path, num_nextn_predict_layers=None))
    line = refusal("serve", "drafter", "--model", model, "--load-format", "dummy")
    assert f"checkpoint {model!r} has no MTP layers" in line and "the drafter needs a checkpoint with MTP" in line


def test_a_missing_tokenizer_is_refused(tmp_path):
    model = str(checkpoint(tmp_path))  # config.json only
    line = refusal("serve", "coordinator", "--model", model, "--verifier", "127.0.0.1:1")
    assert line.startswith(f"specsplit serve coordinator: no tokenizer loads from {model!r}")
    assert "give --model the checkpoint directory that holds the tokenizer" in line


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    model = checkpoint(tmp_path, architectures=["FooForCausalLM"])
    line = refusal("serve", "drafter", "--model", str(model), "--load-format", "dummy")
    assert "unsupported architecture 'FooForCausalLM'" in line
    supported = line.split("supported: ", 1)[1].split(", ")
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM"} <= set(supported)


def test_a_port_in_use_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        up = refusal("up", "--port", str(port))
        serve = refusal("serve", "coordinator", "--model", str(DEMO), "--verifier", "127.0.0.1:1", "--port", str(port))
    in_use = f"127.0.0.1:{port} is in use; stop what listens there or give another --port (0: any free port)"
    assert up == f"specsplit up: {in_use}"
    assert serve == f"specsplit serve coordinator: {in_use}"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["serve", "drafter", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["serve", "drafter", "--num-blocks", "0"], "--num-blocks 0 is out of range; give a value >= 1"),
        (["serve", "verifier", "--port", "70000"], "--port 70000 is not a port number; give one in 0-65535"),
        (["serve", "verifier", "--shutdown-grace", "nan"], "--shutdown-grace nan is out of range; give a value >= 0"),
        (["serve", "verifier", "--device", "cuda:99"], "--device cuda:99 but this process sees"),
        (
            ["serve", "coordinator", "--verifier", "127.0.0.1:1", "--num-speculative-tokens", "99"],
            "--num-speculative-tokens 99 is out of range; give a value in 0-31",
        ),
        (["serve", "verifier", "--tls-dir", "/nonexistent"], "--tls-dir /nonexistent: missing tls.crt"),
        (
            ["serve", "coordinator", "--verifier", "127.0.0.1:1", "--auth-token-file", "/nonexistent"],
            "cannot read --auth-token-file /nonexistent (No such file or directory)",
        ),
    ],
    ids=["dtype", "num-blocks", "port", "shutdown-grace", "device", "num-speculative-tokens", "tls-dir", "tokens"],
)
def test_a_bad_flag_value_is_refused(argv, says):
    line = refusal(*argv, "--model", str(DEMO))
    assert line.startswith(f"specsplit {argv[0]} {argv[1]}: ") and says in line


def test_debug_logging_shows_the_traceback_above_the_line(tmp_path):
    out = run("serve", "verifier", "--model", str(tmp_path / "missing"), "--log-level", "debug")
    assert out.returncode == 2 and "Traceback (most recent call last)" in out.stderr
    assert out.stderr.splitlines()[-1].startswith("specsplit serve verifier: checkpoint directory")


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The process's stdout lines as they come (None at its end), read on a thread of their own."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_a_verifier_refuses_a_drafter_of_another_model(tmp_path):
    other = checkpoint(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=4000)
    drafter = subprocess.Popen(
        [sys.executable, "-m", "specsplit", "serve", "drafter", "--model", str(DEMO), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = lines_of(drafter).get(timeout=120)
        assert line is not None and line.startswith("drafter listening on "), line
        address = line.removeprefix("drafter listening on ")
        out = run("serve", "verifier", "--model", str(other), "--load-format", "dummy", "--drafter", address)
    finally:
        drafter.terminate()
        try:
            drafter.wait(timeout=30)
        except subprocess.TimeoutExpired:
            drafter.kill()
            drafter.wait(timeout=30)
    # Before it, the verifier logs its drafter pool at INFO; no traceback, no "Event loop is closed".
    assert out.returncode == 2 and "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"specsplit serve verifier: drafter {address} serves another model than this verifier ('demo', "
        "vocab_size 4096 vs 4000, hidden_size 320 vs 256); start both from the same checkpoint (--model)"
    )
