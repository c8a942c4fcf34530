"""Bad input fails with a ValueError that names the argument; optional inputs behave as documented."""

import pytest
import torch

from specsplit.kernels import SparseDraftProbs, rejection_sample


def good_args(num_draft=(2, 0, 1), vocab_size=20):
    num_reqs, total = len(num_draft), sum(num_draft)
    return dict(
        target_logits=torch.randn(total + num_reqs, vocab_size),
        draft_token_ids=torch.randint(0, vocab_size, (total,)),
        cu_num_draft=torch.tensor([0, *torch.tensor(num_draft).cumsum(0).tolist()], dtype=torch.int32),
        temperature=torch.tensor([0.0, 1.0, 0.5])[:num_reqs],
        top_k=torch.zeros(num_reqs, dtype=torch.int32),
        top_p=torch.ones(num_reqs),
        seeds=torch.arange(num_reqs),
        positions=torch.arange(num_reqs) * 10,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(target_logits=torch.randn(5, 20)), "target_logits has 5 rows"),
        (dict(target_logits=torch.randn(6)), "target_logits must be a float tensor of shape"),
        (dict(target_logits=torch.zeros(6, 20, dtype=torch.int64)), "target_logits must be a float"),
        (dict(draft_token_ids=torch.zeros(3)), "draft_token_ids must be an integer tensor"),
        (dict(draft_token_ids=torch.zeros(4, dtype=torch.int64)), "target_logits has 6 rows"),
        (dict(cu_num_draft=torch.tensor([0, 2, 3], dtype=torch.int32)), "target_logits has 6 rows"),
        (dict(cu_num_draft=torch.tensor([0, 2, 2, 4], dtype=torch.int32)), "cu_num_draft[-1] = 4"),
        (dict(cu_num_draft=torch.zeros(0, dtype=torch.int32)), "cu_num_draft must have"),
        (dict(temperature=torch.ones(2)), "temperature must be a float tensor of shape [3]"),
        (dict(temperature=torch.ones(3, dtype=torch.int64)), "temperature must be a float"),
        (dict(top_k=torch.zeros(3)), "top_k must be an integer tensor"),
        (dict(top_p=torch.ones(4)), "top_p must be a float tensor of shape [3]"),
        (dict(seeds=torch.arange(2)), "seeds must be an integer tensor of shape [3]"),
        (dict(positions=torch.zeros(3, 1, dtype=torch.int64)), "positions must be"),
        (dict(draft_probs=torch.rand(3, 19)), "draft_probs must be a float tensor of shape [3, 20]"),
        (dict(draft_probs=torch.rand(4, 20)), "draft_probs must be a float tensor of shape [3, 20]"),
        (
            dict(draft_probs=SparseDraftProbs(torch.zeros(3, 4, dtype=torch.int64), torch.rand(3, 5))),
            "draft_probs.probs must be a float tensor of shape [3, 4]",
        ),
        (
            dict(draft_probs=SparseDraftProbs(torch.zeros(2, 4, dtype=torch.int64), torch.rand(2, 4))),
            "draft_probs.ids must be an integer tensor of shape [3, *]",
        ),
        (dict(draft_probs=[0.5]), "draft_probs must be None, a tensor or SparseDraftProbs"),
        (dict(coupled=torch.ones(2, dtype=torch.bool)), "coupled must be a bool or integer tensor of shape [3]"),
        (dict(coupled=torch.ones(3)), "coupled must be a bool or integer tensor"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_bad_input_raises_value_error_naming_it(change, message):
    args = good_args() | change
    with pytest.raises(ValueError) as info:
        rejection_sample(**args)
    assert message in str(info.value)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        rejection_sample(**good_args(), backend="triton")


def test_auto_backend_on_cpu_is_the_reference(same_output):
    args = good_args()
    same_output(rejection_sample(**args), rejection_sample(**args, backend="reference"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_top_k_top_p_tensors_means_off(same_output, backend):
    args = good_args()
    without = args | dict(top_k=None, top_p=None)
    same_output(rejection_sample(**without, backend=backend), rejection_sample(**args, backend=backend))
    assert rejection_sample(**args, backend=backend, max_num_draft=4).sampled.shape == (3, 5)


def test_no_requests_gives_empty_output():
    args = good_args(num_draft=())
    for backend in ("reference", "triton"):
        out = rejection_sample(**args, backend=backend)
        assert out.sampled.shape == (0, 1) and out.num_sampled.shape == (0,)


def test_half_precision_logits_are_upcast(batch_factory, same_output):
    batch = batch_factory(4, [2, 1, 3], vocab_size=64)
    args = [batch.logits.bfloat16(), batch.drafts, batch.cu_num_draft, batch.temperature]
    args += [batch.top_k, batch.top_p, batch.seeds, batch.positions]
    same_output(rejection_sample(*args, backend="triton"), rejection_sample(*args, backend="reference"))
