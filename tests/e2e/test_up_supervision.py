"""`specsplit up` supervises its services as a process manager would (specsplit/cli/supervisor.py), run as a user
runs it, on the demo checkpoint (real acceptance): a SIGKILLed drafter or verifier is restarted while greedy
streams run, and every stream equals target-only greedy output (the same `up`, asked for no drafts before any
kill); a drafter that fails at every restart is given up with one line and `up` exits 1; `up` prints the
coordinator's address, its three services are its own children, and SIGTERM on `up` leaves no process behind
(read from /proc: every process whose command line names the test's checkpoint path, a symlink of its own, and
every process in the sessions the children led); nor does a SIGKILL or SIGHUP on `up`, nor its socket directory.

The module's `up` serves the kill tests, then the SIGTERM test stops it (with streams in flight, which finish)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from specsplit import Client

from .helpers import start_streams
from .proc import processes, stat
from .up_process import Up

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "if __name__ == '__main__':\n",
]
N_TOKENS = 40
KILL_TOKENS = 160  # streams long enough that a service or `up` is signalled while they run (40 ran out once in CI)
NO_ADAPTIVE = ["--no-adaptive"]  # drafts every iteration: a drafter restarted is seen by its drafts


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up")
    (logs / "model").symlink_to(DEMO)
    u = Up(logs / "model", logs, NO_ADAPTIVE)
    yield u
    u.close()


@pytest.fixture(scope="module")
def prompts_and_reference(up):
    return _target_only(up, KILL_TOKENS)


def _target_only(up: Up, n_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts' token ids and, for each, the target's greedy output alone (num_speculative_tokens=0)."""
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    prompts = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]

    def target_only(ids: list[int]) -> list[int]:
        with Client(up.address, timeout=120) as client:
            return client.generate(
                prompt_token_ids=ids, max_tokens=n_tokens, ignore_eos=True, num_speculative_tokens=0
            ).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return prompts, list(pool.map(target_only, prompts))


@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_a_killed_service_is_restarted_and_every_stream_equals_target_only_greedy(up, prompts_and_reference, role):
    prompts, reference = prompts_and_reference
    progressed = threading.Event()
    threads, results, errors = start_streams(up.address, prompts, KILL_TOKENS, lambda n: n >= 8 and progressed.set())
    assert progressed.wait(120)
    old = up.pid(role)
    os.kill(old, signal.SIGKILL)
    assert len(results) < len(prompts)  # the kill lands mid-stream
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == reference
    up.wait_for_line(f"{role} was killed by SIGKILL; restarting it in")
    back = up.wait_for_line(f"{role} serving again")
    assert back.endswith(f"(pid {up.pid(role)})") and up.pid(role) != old
    with Client(up.address, timeout=60) as client:  # the restarted service is used: drafts again
        deadline = time.monotonic() + 20  # the verifier probes a lost drafter with backoff (<= 5 s)
        while True:
            out = client.generate(prompt_token_ids=prompts[0], max_tokens=12, ignore_eos=True)
            if out.stats.num_draft_tokens > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert out.stats.num_draft_tokens > 0 and out.token_ids == reference[0][:12]


def test_a_restarted_drafter_is_counted_out_once_and_back_once(up, prompts_and_reference):
    """Streams run without a pause through a drafter's SIGKILL, its restart and the verifier's health probe finding
    it back: the verifier says once that the drafter failed and once that it is back (Proposes it could not send
    while the drafter was counted out do not count it out again once a probe found it back)."""
    prompts, _ = prompts_and_reference
    seen = len(up.stderr.read_text().splitlines())
    pid = up.pid("drafter")
    threads, _, errors = start_streams(up.address, prompts, N_TOKENS)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    back_at = None
    while back_at is None or time.monotonic() < back_at + 2.0:  # traffic on until 2 s after the drafter is back
        assert time.monotonic() < deadline, "the verifier did not find the drafter back in 180 s"
        if not any(t.is_alive() for t in threads):
            assert not errors, errors
            threads, _, errors = start_streams(up.address, prompts, N_TOKENS)
        if back_at is None and any(" is back" in line for line in _verifier_lines(up, seen)):
            back_at = time.monotonic()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert not errors, errors
    lines = _verifier_lines(up, seen)
    assert len([line for line in lines if "drafter_pool: drafter" in line and " failed (" in line]) == 1, lines
    assert len([line for line in lines if " is back" in line]) == 1, lines


def _verifier_lines(up: Up, skip: int) -> list[str]:
    """The verifier's log lines after the first `skip` lines of `up`'s stderr."""
    return [line for line in up.stderr.read_text().splitlines()[skip:] if " verifier " in line]


def test_sigterm_finishes_the_streams_in_flight_and_every_child_exits_0(up, prompts_and_reference):
    """SIGTERM on `up` mid-stream: the coordinator is stopped first and finishes its streams while verifier and
    drafter still serve them (each equals target-only greedy output), then the rest; `up` exits 0 only if every
    service did."""
    prompts, reference = prompts_and_reference
    listening = [line for line in up.stdout.read_text().splitlines() if line.startswith("coordinator listening on")]
    assert listening[0] == f"coordinator listening on 127.0.0.1:{up.port}"
    children = up.children()
    assert sorted(cmd.split("specsplit serve ")[1].split()[0] for cmd in children.values()) == [
        "coordinator",
        "drafter",
        "verifier",
    ]
    assert {int(stat(pid)[1]) for pid in children} == {up.proc.pid}  # `up`'s own children, restarted ones too
    progressed = threading.Event()
    threads, results, errors = start_streams(up.address, prompts, KILL_TOKENS, lambda n: n >= 8 and progressed.set())
    assert progressed.wait(120)
    up.proc.send_signal(signal.SIGTERM)
    assert len(results) < len(prompts)  # the signal lands mid-stream
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == reference
    assert up.proc.wait(60) == 0, up.lines()
    assert up.children() == {}
    assert _in_sessions(children) == {}


def test_a_crash_looping_drafter_is_given_up_with_one_line_and_up_exits_1(tmp_path):
    (tmp_path / "model").symlink_to(DEMO)
    u = Up(tmp_path / "model", tmp_path, NO_ADAPTIVE)
    try:
        children = u.children()
        (tmp_path / "model").unlink()  # every restart now fails to load the checkpoint
        os.kill(u.pid("drafter"), signal.SIGKILL)
        assert u.proc.wait(180) == 1
        given_up = [line for line in u.lines() if "giving up" in line]
        assert len(given_up) == 1
        code = given_up[0].removeprefix("specsplit up: giving up on the drafter: it exited with code ").split()[0]
        assert int(code) != 0
        assert given_up[0].endswith("within 30 s of each of its last 3 restarts; stopping all services")
        assert [line.split(";")[0] for line in u.lines() if "restarting" in line] == [
            "specsplit up: drafter was killed by SIGKILL",
            f"specsplit up: drafter exited with code {code}",
            f"specsplit up: drafter exited with code {code}",
        ]
        assert u.children() == {}
        assert _in_sessions(children) == {}
    finally:
        u.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_up_killed_or_hung_up_takes_its_services_and_socket_directory_with_it(tmp_path, sig):
    """A SIGKILLed `up` (no chance to stop anything) or a closed terminal's SIGHUP, with streams in flight: the
    streams finish, each equal to target-only greedy output (after a SIGKILL the kernel signals the three services at
    once; verifier and drafter serve their coordinator until it has drained), then no service is left running under
    PID 1 holding the port, and the socket directory `up` made in $TMPDIR is gone."""
    (tmp_path / "model").symlink_to(DEMO)
    temp = tempfile.mkdtemp()  # short: socket paths hold at most 107 bytes
    try:
        u = Up(tmp_path / "model", tmp_path, NO_ADAPTIVE, env={**os.environ, "TMPDIR": temp})
        try:
            children = u.children()
            assert len(children) == 3 and len(list(pathlib.Path(temp).glob("specsplit-*"))) == 1
            prompts, reference = _target_only(u, KILL_TOKENS)
            progressed = threading.Event()
            threads, results, errors = start_streams(
                u.address, prompts, KILL_TOKENS, lambda n: n >= 8 and progressed.set()
            )
            assert progressed.wait(120)
            u.proc.send_signal(sig)
            assert len(results) < len(prompts)  # the signal lands mid-stream
            code = u.proc.wait(60)
            assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
            for t in threads:
                t.join(120)
            assert not errors, errors
            assert [results[i] for i in range(len(prompts))] == reference
            # The services drain (SIGTERM from the kernel) and exit, reaped by whoever adopted them. A process whose
            # memory is already released reads an empty command line while its threads still exit, so wait on the
            # sessions the services led (which hold the services themselves), not on the command lines alone.
            deadline = time.monotonic() + 60
            while (u.children() or _in_sessions(children)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert u.children() == {}
            assert _in_sessions(children) == {}
            assert not list(pathlib.Path(temp).glob("specsplit-*"))  # (torch may leave caches of its own)
        finally:
            u.close()
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _in_sessions(leaders: dict[int, str]) -> dict[int, str]:
    """pid → command line of every live process in a session one of `leaders` led (the leaders included)."""
    commands = processes()
    return {pid: commands.get(pid, "") for pid, sid in _sessions().items() if sid in leaders}


def _sessions() -> dict[int, int]:
    """pid → session id of every live (not zombie) process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat(int(entry))) is not None:
            out[int(entry)] = int(fields[3])
    return out
