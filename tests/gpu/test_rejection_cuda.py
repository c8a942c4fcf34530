"""On a CUDA GPU, the Triton rejection sampler against the torch reference on the same device, for random ragged
batches of every mode (greedy, one-hot, dense, sparse q), k = 0..5, odd vocab sizes and top-k / top-p: 200 batches
of 1-8 requests. No request's tokens may differ, except at a near-tie: on the GPU the race kernel computes its logs
with the hardware's approximations (``lg2.approx``, and ``fast_clock`` for the clocks: a few ulp; its error over
every uniform is checked too) where the reference's torch.log2 is correctly rounded, so when two candidates' race
scores agree to ~1e-6 (relative) the two may pick different winners. Such a request (same accepted drafts, only the
recovered / bonus token differs, both tokens' reference scores within 1e-5) is a near-tie, not a failure.

Then 40 batches of 64 to 256 requests (vocab 32,000 or 151,936, k 3 or 5, drafts accepted about 60 % of the time,
so requests stop at every row): grids of several waves, where the stats kernel's early exit skips rows while other
rows of the same request run. Each is sampled three times, since a race between programs would show as tokens that
change from call to call. Batches of more requests than a CUDA grid's axes 1 and 2 hold (65,535) match too. And
after the verifier's start-up warm-up, calls whose per-request inputs start at odd offsets compile no new kernel
variant.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

from specsplit.kernels import SparseDraftProbs, rejection_sample
from specsplit.kernels.filtering import logit_thresholds
from specsplit.kernels.reference import LOG2E, densify, group_sums
from specsplit.kernels.rng import GROUP_SIZE, group_clocks, row_key, vocab_clocks
from specsplit.kernels.triton_race_kernel import race_kernel
from specsplit.kernels.triton_rejection import rejection_sample_triton, warm_up
from specsplit.kernels.triton_rejection_kernels import stats_accept_kernel
from specsplit.kernels.triton_rejection_launch import Launch
from specsplit.kernels.triton_rng import fast_clock

pytestmark = pytest.mark.gpu

NEAR_TIE = 1e-5
CLOCK_TOLERANCE = 1e-6  # relative: the race scores' differences from the reference stay far below NEAR_TIE
CASES = 200
LARGE_CASES = 40
GRID_AXIS_LIMIT = 65_535  # programs along a CUDA grid's axes 1 and 2 (axis 0: 2**31 - 1)


@triton.jit
def _clock_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n, other=0.5)
    tl.store(out_ptr + offs, fast_clock(u, True), mask=offs < n)


def on_device(gen: torch.Generator, dev: str, logits, drafts, cu, temperature, top_k, top_p, q, **extra) -> dict:
    """A batch's sampler inputs on ``dev``, its seeds and positions drawn from ``gen`` last."""
    batch = cu.numel() - 1
    return dict(
        target_logits=logits.to(dev),
        draft_token_ids=drafts.to(dev),
        cu_num_draft=cu.to(dev),
        temperature=temperature.float().to(dev),
        top_k=None if top_k is None else top_k.to(dev),
        top_p=None if top_p is None else top_p.to(dev),
        seeds=torch.randint(0, 2**62, (batch,), generator=gen).to(dev),
        positions=torch.randint(0, 4096, (batch,), generator=gen).to(dev),
        draft_probs=q,
        **extra,
    )


def draft_q(gen: torch.Generator, mode: str, drafts: torch.Tensor, vocab: int, dev: str):
    """The drafts' q: None (one-hot), a random dense softmax, or 16 unique ids per draft, the draft first."""
    n = drafts.numel()
    if mode == "dense" and n:
        return (torch.randn(n, vocab, generator=gen) * 3).softmax(-1).to(dev)
    if mode != "sparse" or not n:
        return None
    rows = []
    for d in drafts.tolist():
        others = torch.randperm(vocab, generator=gen)[:16]
        rows.append(torch.cat([torch.tensor([d]), others[others != d][:15]]))
    probs = torch.rand(n, 16, generator=gen)
    return SparseDraftProbs(torch.stack(rows).to(dev), (probs / probs.sum(-1, keepdim=True)).to(dev))


def case(gen: torch.Generator, i: int, dev: str = "cuda") -> dict:
    """A batch of 1-8 requests, 0-5 drafts each, about 30 % greedy, 30 % with top-k, 30 % with top-p."""
    vocab = [100, 1000, 32000, 151936][i % 4]
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    ks = torch.randint(0, 6, (batch,), generator=gen)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = ks.cumsum(0)
    n_draft, n_logits = int(cu[-1]), int(cu[-1]) + batch
    logits = torch.randn(n_logits, vocab, generator=gen) * 3
    drafts = torch.randint(0, vocab, (n_draft,), generator=gen)
    mode = ["one_hot", "dense", "sparse"][i % 3]
    temperature = torch.where(torch.rand(batch, generator=gen) < 0.3, 0.0, 0.7 + torch.rand(batch, generator=gen))
    top_k = torch.where(torch.rand(batch, generator=gen) < 0.3, torch.randint(1, 50, (batch,), generator=gen), 0)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.3, 0.5 + 0.5 * torch.rand(batch, generator=gen), 1.0)
    q = draft_q(gen, mode, drafts, vocab, dev)
    return on_device(gen, dev, logits, drafts, cu, temperature, top_k.int(), top_p.float(), q)


def large_case(gen: torch.Generator, i: int, dev: str = "cuda") -> dict:
    """A batch of 64-256 requests whose drafts are accepted about 60 % of the time, without top-k / top-p."""
    vocab = (32000, 151936)[i % 2]
    batch = (64, 256)[(i // 2) % 2]
    k = (3, 5)[(i // 4) % 2]
    mode = ["one_hot", "dense", "sparse"][i % 3]
    cu = torch.arange(batch + 1, dtype=torch.int32) * k
    logits = torch.randn(batch * (k + 1), vocab, generator=gen) * 3
    draft_rows = torch.arange(batch * (k + 1)).view(batch, k + 1)[:, :k].reshape(-1)
    drafts = torch.randint(0, vocab, (batch * k,), generator=gen)
    boost = torch.rand(batch * k, generator=gen) < 0.6  # p(draft) close to 1 on these rows
    logits[draft_rows[boost], drafts[boost]] = 40.0
    temperature = torch.where(torch.rand(batch, generator=gen) < 0.2, 0.0, 0.7 + torch.rand(batch, generator=gen))
    q = draft_q(gen, mode, drafts, vocab, dev)
    return on_device(gen, dev, logits, drafts, cu, temperature, None, None, q, max_num_draft=k)


def past_grid_limit_case(gen: torch.Generator, mode: str, num_reqs: int = GRID_AXIS_LIMIT + 65, dev: str = "cuda"):
    """More requests than a grid axis past the first holds, 2 drafts each, vocab 3,000 (two race groups), about
    20 % greedy, drafts accepted about 60 % of the time; built on ``dev``."""
    vocab, k = 3000, 2
    n_draft = num_reqs * k
    dev_gen = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    cu = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev) * k
    logits = torch.randn(num_reqs * (k + 1), vocab, generator=dev_gen, device=dev) * 3
    draft_rows = torch.arange(num_reqs * (k + 1), device=dev).view(num_reqs, k + 1)[:, :k].reshape(-1)
    drafts = torch.randint(0, vocab, (n_draft,), generator=dev_gen, device=dev)
    boost = torch.rand(n_draft, generator=dev_gen, device=dev) < 0.6
    logits[draft_rows[boost], drafts[boost]] = 40.0
    greedy = torch.rand(num_reqs, generator=dev_gen, device=dev) < 0.2
    temperature = torch.where(greedy, 0.0, 0.7 + torch.rand(num_reqs, generator=dev_gen, device=dev))
    q = None
    if mode == "dense":
        q = (torch.randn(n_draft, vocab, generator=dev_gen, device=dev) * 3).softmax(-1)
    elif mode == "sparse":  # 16 unique ids per draft, the draft first
        others = torch.rand(n_draft, vocab - 1, generator=dev_gen, device=dev).topk(15).indices + 1
        ids = (drafts[:, None] + torch.cat([torch.zeros_like(others[:, :1]), others], dim=1)) % vocab
        probs = torch.rand(n_draft, 16, generator=dev_gen, device=dev)
        q = SparseDraftProbs(ids, probs / probs.sum(-1, keepdim=True))
    return on_device(gen, dev, logits, drafts, cu, temperature, None, None, q, max_num_draft=k)


def race_gap(inputs: dict, r: int, col: int, token_a: int, token_b: int) -> float:
    """Relative gap between two tokens' race scores at request r's stop column, as the reference
    computes them: their groups' scores when they lie in different groups, else the ids' own (from p, or
    from max(p - q, 0) when a dense / sparse draft was rejected)."""
    if float(inputs["temperature"][r]) <= 0:  # greedy: an argmax, not a race, may not differ
        return 1.0
    cu = inputs["cu_num_draft"].tolist()
    row = cu[r] + r + col
    logits = inputs["target_logits"][row : row + 1].float()
    t = inputs["temperature"][r : r + 1]
    if inputs["top_k"] is None and inputs["top_p"] is None:
        threshold = torch.full((1,), float("-inf"), device=logits.device)
    else:
        threshold = logit_thresholds(logits, t, inputs["top_k"][r : r + 1], inputs["top_p"][r : r + 1])
    x = (logits / t[:, None]).masked_fill(logits < threshold[:, None], float("-inf"))[0]
    key = row_key(inputs["seeds"][r : r + 1], inputs["positions"][r : r + 1] + col)
    clocks = vocab_clocks(key, x.numel())[0]
    draft = int(inputs["draft_token_ids"][cu[r] + col]) if col < cu[r + 1] - cu[r] else -1
    q = inputs["draft_probs"]
    p = x.softmax(-1)
    weights = p.clone()
    if draft >= 0 and q is None:
        weights[draft] = 0.0
    elif draft >= 0:
        q = densify(q, x.numel()) if isinstance(q, SparseDraftProbs) else q
        weights = (p - q[cu[r] + col]).clamp(min=0)
    if token_a // GROUP_SIZE != token_b // GROUP_SIZE:  # the tokens' groups: the race over the groups' masses
        num_groups = -(-x.numel() // GROUP_SIZE)
        score = group_sums(weights[None], num_groups)[0] / group_clocks(key, num_groups)[0]
        token_a, token_b = token_a // GROUP_SIZE, token_b // GROUP_SIZE
    elif q is not None and draft >= 0:
        score = weights / clocks
    else:
        score = x * LOG2E - clocks.log2()
    a, b = float(score[token_a]), float(score[token_b])
    if not (math.isfinite(a) and math.isfinite(b)):
        return 1.0
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def differing_requests(inputs: dict, calls: int, launch: Launch | None = None) -> tuple[list[str], int]:
    """(the requests whose Triton tokens differ from the reference's other than at a near-tie, described; the
    number of near-ties), over ``calls`` calls of the Triton sampler on the same inputs (with ``launch``, that
    launch shape instead of the default one)."""
    b = rejection_sample(**inputs, backend="reference")
    bad, near_ties = [], 0
    for call in range(calls):
        if launch is None:
            a = rejection_sample(**inputs, backend="triton")
        else:
            a = rejection_sample_triton(**inputs, launch=launch)
        diff = (a.sampled != b.sampled).any(-1) | (a.num_sampled != b.num_sampled)
        for r in diff.nonzero().flatten().tolist():
            col = int(b.num_sampled[r]) - 1
            same_prefix = int(a.num_sampled[r]) == col + 1 and torch.equal(a.sampled[r, :col], b.sampled[r, :col])
            gap = race_gap(inputs, r, col, int(a.sampled[r, col]), int(b.sampled[r, col])) if same_prefix else 1.0
            line = f"call {call} request {r}: triton {a.sampled[r].tolist()} reference {b.sampled[r].tolist()}, "
            print(line + f"race-score gap {gap:.1e}")
            if gap < NEAR_TIE:
                near_ties += 1
            else:
                bad.append(line + f"race-score gap {gap:.1e}")
    return bad, near_ties


def compiled_variants() -> int:
    kernels = (stats_accept_kernel, race_kernel)
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())


def unaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values, starting one element into a larger buffer (not 16-byte aligned)."""
    return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)


# First in this module, as it was first in the script it replaces: the variants compiled by the other tests'
# calls could otherwise hide one that the warm-up misses.
def test_unaligned_per_request_inputs_compile_nothing_after_the_warm_up():
    """Calls whose per-request inputs start at odd offsets (as the verifier's views into its upload buffer do)
    after the verifier's start-up warm-up compile no new kernel variant, with coupled requests too."""
    vocab, dev = 151936, torch.device("cuda")
    warm_up(vocab, dev)
    before = compiled_variants()
    modes = ("greedy", "one_hot", "sparse", "one_hot coupled", "sparse coupled")
    for mode, k in itertools.product(modes, (3, 5)):
        for batch in (1, 7, 64, 65):
            n_draft = batch * k
            probs = None
            if mode.startswith("sparse"):
                ids = torch.randint(0, vocab, (n_draft, 16), device=dev)
                probs = SparseDraftProbs(unaligned(ids), torch.full((n_draft, 16), 1 / 16, device=dev))
            rejection_sample_triton(
                torch.randn(batch * (k + 1), vocab, device=dev),
                unaligned(torch.randint(0, vocab, (n_draft,), device=dev)),
                unaligned(torch.arange(0, n_draft + 1, k, dtype=torch.int32, device=dev)),
                unaligned(torch.full((batch,), 0.0 if mode == "greedy" else 0.8, device=dev)),
                None,
                None,
                unaligned(torch.arange(batch, device=dev)),
                unaligned(torch.full((batch,), 7, dtype=torch.int64, device=dev)),
                draft_probs=probs,
                max_num_draft=k,
                all_greedy=mode == "greedy",
                coupled=unaligned(torch.ones(batch, dtype=torch.int32, device=dev)) if "coupled" in mode else None,
            )
    torch.cuda.synchronize()
    assert before > 0  # the warm-up compiled the kernels
    assert compiled_variants() - before == 0


def test_race_clock_error_over_every_uniform():
    """Max relative error of the GPU's race clock (``fast_clock`` with the hardware's approximations) against
    -log2(u) in float64, over every uniform the RNG can produce (odd multiples of 2^-24)."""
    u64 = (torch.arange(2**23, dtype=torch.float64, device="cuda") * 2 + 1) * 2.0**-24
    u = u64.float()
    out = torch.empty_like(u)
    _clock_kernel[(triton.cdiv(u.numel(), 1024),)](u, out, u.numel(), BLOCK=1024)
    truth = -torch.log2(u64)
    error = ((out.double() - truth).abs() / truth).max().item()
    print(f"race clock on the GPU: max relative error {error:.2e} over all 2^23 uniforms")
    assert error <= CLOCK_TOLERANCE


@pytest.mark.parametrize("i", range(CASES))
def test_small_batches_match_the_reference(i):
    bad, _ = differing_requests(case(torch.Generator().manual_seed(i), i), calls=1)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("i", range(LARGE_CASES))
def test_large_batches_match_the_reference_on_every_call(i):
    inputs = large_case(torch.Generator().manual_seed(1_000_000 + i), i)
    bad, _ = differing_requests(inputs, calls=3)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("mode", ["one_hot", "dense", "sparse"])
@pytest.mark.parametrize("launch", [None, Launch(1024, 512, 4, 1024, 512, 4)], ids=["default", "three_chunks"])
def test_batches_past_the_grid_axis_limit_match_the_reference(mode, launch):
    """65,600 requests: the stats kernel folds (chunk, request) into grid axis 0, where CUDA allows 2**31 - 1
    programs; with three chunks per row (and per dense race) that axis holds 196,800 (chunk, request) pairs."""
    inputs = past_grid_limit_case(torch.Generator().manual_seed(7), mode)
    assert inputs["seeds"].numel() > GRID_AXIS_LIMIT
    bad, _ = differing_requests(inputs, calls=1, launch=launch)
    assert not bad, "\n".join(bad)
