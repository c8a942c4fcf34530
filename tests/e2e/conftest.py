"""Fixtures that start the three services as real processes on 127.0.0.1 (and stop them)."""

import pathlib
import time

import pytest
import torch

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.rpc.process import free_port
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_tokenizer import make_llama_like


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A tiny Llama whose tokenizer adds BOS to text and has a chat template, as Llama checkpoints do."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", architecture="llama", seed=1)
    make_llama_like(path)
    return path


@pytest.fixture(scope="session")
def hf_greedy(tiny_checkpoint):
    """transformers' own generate() on the same checkpoint: the oracle for lossless output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.generation_config.eos_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()

    return generate


# Each service drains on SIGTERM: NOT_SERVING for 1 s, then in-flight calls get up to 60 s (test_shutdown.py).
DRAIN = ["--shutdown-delay", "1.0", "--shutdown-grace", "60"]


@pytest.fixture(scope="session")
def session_cluster(tiny_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=logs,
        # A fixed k (the default, said here because these tests count on it): the tests of faults, transports and
        # security count on drafts, which adaptive speculation stops asking for when the tiny model's drafts are
        # rejected (test_adaptive.py runs it).
        coordinator_args=["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--no-adaptive", *DRAIN],
        verifier_args=DRAIN,
        drafter_args=DRAIN,
        http_port=free_port(),  # the OpenAI-compatible HTTP API (test_openai_api.py)
    ) as c:
        yield c


@pytest.fixture(scope="module")
def demo_fixed_k(tmp_path_factory):
    """The trained demo checkpoint co-located with a fixed k of 3 (`--no-adaptive`: every request its k drafts each
    iteration, 3 unless it asks for fewer); one per test module."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
    logs = tmp_path_factory.mktemp("demo-fixed-k")
    with LocalCluster(demo, num_speculative_tokens=3, log_dir=logs, coordinator_args=["--no-adaptive"]) as c:
        yield c


@pytest.fixture
def cluster(session_cluster):
    """The session's cluster, whole for each test: the fault and shutdown tests kill or stop its services, and a
    service an earlier test left stopped is started again (drafter, verifier, coordinator), after which a
    generation must get drafts (the verifier has found its drafter again) before the test starts."""
    services = session_cluster.services
    stopped = [role for role in ("drafter", "verifier", "coordinator") if services[role].proc.poll() is not None]
    for role in stopped:
        session_cluster.restart(role)
    if stopped:
        deadline = time.monotonic() + 30  # the verifier probes a lost drafter with backoff (<= 5 s)
        with Client(session_cluster.address, timeout=60) as client:
            while client.generate(prompt_token_ids=[5, 6], max_tokens=8, ignore_eos=True).stats.num_draft_tokens == 0:
                assert time.monotonic() < deadline, f"no drafts 30 s after restarting {stopped}"
                time.sleep(0.2)
    return session_cluster
