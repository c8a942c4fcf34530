"""Fixtures the drafter's tests share: a tiny Llama checkpoint with an MTP layer, and its MTP module (one per
test module)."""

import pytest

from specsplit.models.loader import load_mtp
from tests.fixtures.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("d") / "m", architecture="llama", seed=5)


@pytest.fixture(scope="module")
def mtp(tiny_dir):
    return load_mtp(tiny_dir)
