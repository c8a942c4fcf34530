"""A mistake on the command line or at start-up ends `specsplit` with exit code 2 and one line on stderr,
`specsplit <command>: <problem>; <fix>`, without a traceback (unless --log-level debug) and without the
noise of a gRPC server torn down after its event loop closed. Each test runs the real command.

Most refusals come only after the command has imported torch or transformers (3-5 s of one core each): those
commands (`slow`) are started two at a time when the first test that needs one asks, each test then reads its
own command's result."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"


# One process spawned at a time (the slow commands are waited for two at a time, from a thread pool). A command
# spawned from a pool thread gets its environment as a dict made on the main thread: with env=None the child's exec
# reads the process's `environ`, which the main thread's next tests change meanwhile (monkeypatch.setenv), and
# CPython spawns with vfork, the child sharing the parent's memory until the exec: it failed twice, in CI and beside
# a CPU hog, with "OSError: [Errno 14] Bad address" from the child's exec.
_SPAWN = threading.Lock()


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specsplit", *argv]
    with _SPAWN:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def refusal(*argv: str, env: dict[str, str] | None = None) -> str:
    """The one stderr line of a command that must be refused with exit code 2."""
    return refusal_line(run(*argv, env=env))


def refusal_line(out: subprocess.CompletedProcess) -> str:
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


BAD_FLAGS = {
    "dtype": (["serve", "drafter", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    "num-blocks": (["serve", "drafter", "--num-blocks", "0"], "--num-blocks 0 is out of range; give a value >= 1"),
    "draft-vocab-size": (
        ["serve", "drafter", "--draft-vocab-size", "-1"],
        "--draft-vocab-size -1 is out of range; give a value >= 0",
    ),
    "draft-vocab-file": (
        ["serve", "drafter", "--draft-vocab-size", "100", "--draft-vocab-file", "/nonexistent"],
        "--draft-vocab-file /nonexistent: No such file or directory",
    ),
    "gpu-memory-utilization": (
        ["serve", "drafter", "--gpu-memory-utilization", "1.5"],
        "argument --gpu-memory-utilization: must be a fraction in (0, 1], got 1.5",
    ),
    "gpu-memory-utilization on the cpu": (
        ["serve", "verifier", "--gpu-memory-utilization", "0.5"],
        "--gpu-memory-utilization sizes the KV cache from CUDA device memory, not on --device cpu; there give "
        "--num-blocks",
    ),
    "port": (["serve", "verifier", "--port", "70000"], "--port 70000 is not a port number; give one in 0-65535"),
    "shutdown-grace": (
        ["serve", "verifier", "--shutdown-grace", "nan"],
        "--shutdown-grace nan is out of range; give a value >= 0",
    ),
    "device": (["serve", "verifier", "--device", "cuda:99"], "--device cuda:99 but this process sees"),
    "num-speculative-tokens": (
        ["serve", "coordinator", "--verifier", "127.0.0.1:1", "--num-speculative-tokens", "99"],
        "--num-speculative-tokens 99 is out of range; give a value in 0-31",
    ),
    "tls-dir": (["serve", "verifier", "--tls-dir", "/nonexistent"], "--tls-dir /nonexistent: missing tls.crt"),
    "socket-dir": (  # (a pooled drafter serves a socket too, for verifiers on its host)
        ["serve", "drafter", "--placement", "pooled", "--socket-dir", "/dev/null/sockets"],
        "--socket-dir /dev/null/sockets cannot be made a directory (Not a directory); give one this user can create",
    ),
    "tokens": (
        ["serve", "coordinator", "--verifier", "127.0.0.1:1", "--auth-token-file", "/nonexistent"],
        "cannot read --auth-token-file /nonexistent (No such file or directory)",
    ),
}


@pytest.fixture(scope="module")
def slow(request, tmp_path_factory):
    """The slower commands of the module's selected tests, run two at a time from the first test that asks (each
    keeps one core busy while the tests wait): name -> (the checkpoint directory it was given, a Future of its
    CompletedProcess). "socket TMPDIR": the TMPDIR of the "other shapes" verifier (short: socket paths)."""
    root = tmp_path_factory.mktemp("mistakes")
    socket_tmp = tempfile.mkdtemp()
    (root / "no-config").mkdir()
    (root / "not-json").mkdir()
    (root / "not-json" / "config.json").write_text("{not json")
    other_shapes = checkpoint(root / "other-shapes", hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
    (other_shapes / "model.safetensors").symlink_to(DEMO / "model.safetensors")
    verifier, drafter = ["serve", "verifier"], ["serve", "drafter", "--load-format", "dummy"]
    # name -> (the test that reads it, checkpoint directory, argv but --model, TMPDIR)
    commands = {
        "no config": ("test_a_model_directory_without_a_config_is_refused", root / "no-config", verifier, None),
        "not json": ("test_a_config_that_is_not_json_is_refused", root / "not-json", verifier, None),
        "no weights": ("test_a_model_directory_without_weights_is_refused", checkpoint(root / "empty"), verifier, None),
        "other shapes": (
            "test_weights_of_other_shapes_than_the_config_are_refused_leaving_no_socket_directory",
            other_shapes,
            verifier,
            socket_tmp,
        ),
        "no mtp": (
            "test_a_drafter_checkpoint_without_mtp_layers_is_refused",
            checkpoint(root / "no-mtp", num_nextn_predict_layers=None),
            drafter,
            None,
        ),
        "no tokenizer": (
            "test_a_missing_tokenizer_is_refused",
            checkpoint(root / "config-only"),
            ["serve", "coordinator", "--verifier", "127.0.0.1:1"],
            None,
        ),
        "architecture": (
            "test_an_unsupported_architecture_is_refused_naming_the_supported_ones",
            checkpoint(root / "foo", architectures=["FooForCausalLM"]),
            drafter,
            None,
        ),
        **{
            f"flag {name}": ("test_a_bad_flag_value_is_refused", DEMO, argv, None)
            for name, (argv, _) in BAD_FLAGS.items()
        },
    }
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    pool = ThreadPoolExecutor(2)
    started: dict[str, tuple[Path, Future | None]] = {"socket TMPDIR": (Path(socket_tmp), None)}
    for name, (test, model, argv, tmpdir) in commands.items():
        if test in selected:
            env = {**os.environ} if tmpdir is None else {**os.environ, "TMPDIR": tmpdir}
            # Any free port: two at once would find the role's default port taken (a verifier binds before it loads).
            port = [] if "--port" in argv else ["--port", "0"]
            started[name] = (model, pool.submit(run, *argv, *port, "--model", str(model), env=env))
    yield started
    pool.shutdown(cancel_futures=True)
    shutil.rmtree(socket_tmp, ignore_errors=True)


def slow_refusal(slow: dict[str, tuple[Path, Future]], name: str) -> tuple[Path, str]:
    """The checkpoint directory `name`'s command was given and the one stderr line it was refused with."""
    model, out = slow[name]
    return model, refusal_line(out.result())


@pytest.mark.parametrize("role", ["coordinator", "verifier", "drafter"])
def test_a_missing_model_directory_is_refused(role, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    extra = ["--verifier", "127.0.0.1:1"] if role == "coordinator" else []
    line = refusal("serve", role, "--model", missing, *extra)
    assert line.startswith(f"specsplit serve {role}: checkpoint directory {missing!r} does not exist; give --model")


def test_an_unreadable_model_directory_is_refused(tmp_path, monkeypatch):
    """In-process: the tests run as root, for whom every directory is readable; `os.access` answers as it
    would for another user of a mode-0700 directory."""
    from specsplit.client.errors import UsageError
    from specsplit.runtime import start_up_checks

    monkeypatch.setattr(start_up_checks.os, "access", lambda path, mode: False)
    with pytest.raises(UsageError, match=r"cannot read checkpoint directory .* \(permission denied\); give --model"):
        start_up_checks.check_checkpoint(str(checkpoint(tmp_path / "m")), "auto", drafter=False)


def test_a_model_directory_without_a_config_is_refused(slow):
    model, line = slow_refusal(slow, "no config")
    assert f"no config.json in checkpoint directory {str(model)!r}" in line and "give --model" in line


def test_a_config_that_is_not_json_is_refused(slow):
    model, line = slow_refusal(slow, "not json")
    assert f"{str(model / 'config.json')!r} is not JSON" in line and "give --model" in line


def test_a_model_directory_without_weights_is_refused(slow):
    _, line = slow_refusal(slow, "no weights")
    assert "no model.safetensors or model.safetensors.index.json in" in line and "--load-format dummy" in line


def test_weights_of_other_shapes_than_the_config_are_refused_leaving_no_socket_directory(slow):
    # Its gRPC server and socket directory are up before the weights load: one line says the server was stopped
    # inside the event loop, and the directory (in TMPDIR, short: a socket path has at most 107 bytes) is gone.
    model, line = slow_refusal(slow, "other shapes")
    assert not list(slow["socket TMPDIR"][0].glob("specsplit-*"))
    assert line.startswith(f"specsplit serve verifier: checkpoint {str(model)!r}: tensor ")
    assert "has shape (4096, 320), expected (4096, 256)" in line


def test_a_drafter_checkpoint_without_mtp_layers_is_refused(slow):
    model, line = slow_refusal(slow, "no mtp")
    assert f"checkpoint {str(model)!r} has no MTP layers" in line
    assert "the drafter needs a checkpoint with MTP" in line


def test_a_missing_tokenizer_is_refused(slow):
    model, line = slow_refusal(slow, "no tokenizer")  # config.json only
    assert line.startswith(f"specsplit serve coordinator: no tokenizer loads from {str(model)!r}")
    assert "give --model the checkpoint directory that holds the tokenizer" in line


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(slow):
    _, line = slow_refusal(slow, "architecture")
    assert "unsupported architecture 'FooForCausalLM'" in line
    supported = line.split("supported: ", 1)[1].split(", ")
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM"} <= set(supported)


def test_a_port_in_use_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        up = refusal("up", "--port", str(port))
        serve = refusal("serve", "coordinator", "--model", str(DEMO), "--verifier", "127.0.0.1:1", "--port", str(port))
        http_up = refusal("up", "--port", "0", "--http-port", str(port))
        http_serve = refusal(
            "serve", "coordinator", "--model", str(DEMO), "--verifier", "127.0.0.1:1", "--port", "0", "--http-port",
            str(port),
        )  # fmt: skip
    in_use = f"127.0.0.1:{port} is in use; stop what listens there or give another --port (0: any free port)"
    assert up == f"specsplit up: {in_use}"
    assert serve == f"specsplit serve coordinator: {in_use}"
    http_in_use = f"127.0.0.1:{port} is in use; stop what listens there or give another --http-port"
    assert http_up == f"specsplit up: {http_in_use}"
    assert http_serve == f"specsplit serve coordinator: {http_in_use}"


@pytest.mark.parametrize("flag", list(BAD_FLAGS))
def test_a_bad_flag_value_is_refused(slow, flag):
    argv, says = BAD_FLAGS[flag]
    _, line = slow_refusal(slow, f"flag {flag}")
    assert line.startswith(f"specsplit {argv[0]} {argv[1]}: ") and says in line


def test_up_refuses_a_gpu_memory_share_on_the_cpu():
    line = refusal("up", "--port", "0", "--gpu-memory-utilization", "0.5")
    assert line == (
        "specsplit up: --gpu-memory-utilization sizes the KV caches from CUDA device memory, not on --device cpu; "
        "leave it out on the CPU"
    )


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


def test_a_drafter_logs_its_given_kv_cache_size_and_a_verifier_refuses_it_for_another_model(tmp_path):
    other = checkpoint(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=4000)
    drafter_log = tmp_path / "drafter.log"
    with _SPAWN:
        drafter = subprocess.Popen(
            [sys.executable, "-m", "specsplit", "serve", "drafter", "--model", str(DEMO), "--num-blocks", "40"],
            stdout=subprocess.PIPE,
            stderr=drafter_log.open("w"),
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
    # The demo's MTP cache: 1 layer x K and V x 5 KV heads x head_dim 64 x float32 = 2,560 bytes a token.
    kv_lines = [line for line in drafter_log.read_text().splitlines() if "KV cache: " in line]
    assert len(kv_lines) == 1 and kv_lines[0].endswith(
        "KV cache: 40 blocks × 16 tokens = 640 tokens (0.00153 GiB), --num-blocks"
    ), kv_lines
