"""Both runners keep SDPA off PyTorch's cuDNN backend, which on the GPU machine builds (and compiles) an
execution plan for every new prefill shape mid-run (`specsplit.models.attention.use_precompiled_sdpa`)."""

import pytest
import torch

from specsplit.drafter.runner import DrafterRunner
from specsplit.models.loader import load_mtp, load_target
from specsplit.verifier.runner import VerifierRunner
from tests.fixtures.tiny import write_tiny_checkpoint


@pytest.fixture
def cudnn_sdpa_on():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_runner_turns_off_cudnn_sdpa(tmp_path, cudnn_sdpa_on, role):
    ckpt = write_tiny_checkpoint(tmp_path / "m", architecture="llama", seed=1)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    if role == "verifier":
        model = load_target(ckpt)
        VerifierRunner(model, model.make_kv_cache(8, 4), sampler_backend="reference")
    else:
        mtp = load_mtp(ckpt)
        DrafterRunner(mtp, mtp.make_kv_cache(8, 4))
    assert not torch.backends.cuda.cudnn_sdp_enabled()
