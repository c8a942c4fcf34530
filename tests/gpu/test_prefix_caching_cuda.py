"""On a CUDA GPU, through the three services as `up` starts them (co-located: CUDA IPC, the device hand-off, CUDA
graphs), greedy requests sharing a prefix give with prefix caching the tokens they give with it off (the demo
checkpoint in fp32): one at a time, then together, then again once their own blocks are cached.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu/test_prefix_caching_cuda.py
"""

import pytest

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import generate_concurrently
from tests.engine.test_prefix_caching_llm import DEMO, prompts_sharing

pytestmark = pytest.mark.gpu


def run(tmp_path, prompts, caching: bool):
    args = [] if caching else ["--no-enable-prefix-caching"]
    with LocalCluster(DEMO, num_speculative_tokens=3, device="cuda", log_dir=tmp_path, coordinator_args=args) as c:
        with Client(c.address, timeout=300) as client:
            alone = [client.generate(prompt_token_ids=p, max_tokens=24, ignore_eos=True) for p in prompts]
        together = generate_concurrently(c.address, prompts, 24)
        again = generate_concurrently(c.address, prompts, 24)
    return alone, [together[i] for i in range(len(prompts))], [again[i] for i in range(len(prompts))]


def test_greedy_with_prefix_hits_on_the_gpu_equals_caching_off(tmp_path):
    tails = [[300 + i, 400 + i, 500 + i] for i in range(6)] + [[300, 400, 500]] * 2
    prompts = prompts_sharing(150, tails) + prompts_sharing(37, [[9, 8, 7]])
    on = run(tmp_path / "on", prompts, True)
    off = run(tmp_path / "off", prompts, False)
    for got, want in zip(on, off):
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.cached_tokens for o in on[0]) > 0 and all(o.cached_tokens > 0 for o in on[2])
    assert all(o.cached_tokens == 0 for runs in off for o in runs)
    assert sum(o.stats.num_accepted_tokens for runs in on for o in runs) > 0
