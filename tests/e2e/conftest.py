"""Fixtures that start the three services as real processes on 127.0.0.1 (and stop them)."""

import pathlib

import pytest
import torch

from specsplit.launcher import LocalCluster
from tests.fixtures.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> pathlib.Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", architecture="llama", seed=1)


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


@pytest.fixture(scope="session")
def cluster(tiny_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=logs,
        coordinator_args=["--max-num-seqs", "8", "--max-num-batched-tokens", "64"],
    ) as c:
        yield c
