"""On a CUDA GPU, through the three services (co-located: the device hand-off and CUDA IPC), the demo checkpoint's
seeded sampled requests (tests/e2e/test_seeded_sampling.py's twelve) give the tokens they give with no speculation:
with k 3, each alone, and with adaptive speculation in a shuffled batch beside unseeded requests. The Triton sampler's
coupled variant and the drafter's race run on the GPU here.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_seeded_sampling_cuda.py
"""

import random

import pytest

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import generate_concurrently
from tests.e2e.test_seeded_sampling import DEMO, KINDS, MAX_TOKENS, UNSEEDED, demo_prompts, differing

pytestmark = pytest.mark.gpu


def test_seeded_tokens_on_the_gpu_do_not_depend_on_speculation(tmp_path):
    prompts = demo_prompts()
    with LocalCluster(DEMO, num_speculative_tokens=3, device="cuda", log_dir=tmp_path) as cluster:
        with Client(cluster.address, timeout=300) as client:

            def alone(k: int) -> tuple[list[list[int]], int]:
                outs = [
                    client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True,
                                    num_speculative_tokens=k, **kind)
                    for p, kind in zip(prompts, KINDS)
                ]  # fmt: skip
                return [o.token_ids for o in outs], sum(o.stats.num_accepted_tokens for o in outs)

            reference, _ = alone(0)
            drafted, accepted = alone(3)
        requests = [(i, prompts[i], kind) for i, kind in enumerate(KINDS)]
        requests += [(None, prompts[len(KINDS) + j], kind) for j, kind in enumerate(UNSEEDED)]
        random.Random(11).shuffle(requests)
        outs = generate_concurrently(
            cluster.address, [p for _, p, _ in requests], MAX_TOKENS, per_prompt=[kind for _, _, kind in requests]
        )
    assert differing(drafted, reference) == []
    assert accepted > 0
    batched = [None] * len(KINDS)
    for n, (i, _, _) in enumerate(requests):
        if i is not None:
            batched[i] = outs[n].token_ids
    assert differing(batched, reference) == []
