"""Losing the drafter never changes output; a restarted drafter is used again (on the session's cluster,
tests/e2e/conftest.py)."""

import signal
import threading
import time

from specsplit import Client

from .helpers import greedy_ignoring_eos


def test_killing_the_drafter_mid_generation_keeps_greedy_output_identical(cluster, hf_greedy):
    prompt = [7, 8, 9, 10, 11]
    n = 160
    got: list[int] = []
    killed = threading.Event()
    with Client(cluster.address, timeout=180) as client:
        for delta in client.stream(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True):
            got.extend(delta.token_ids)
            if len(got) >= 10 and not killed.is_set():
                cluster.kill("drafter", signal.SIGKILL)
                killed.set()
        assert killed.is_set()
        assert cluster.services["drafter"].proc.returncode == -signal.SIGKILL
        # ignore_eos: compare against transformers past any EOS by generating the same length
        expected = greedy_ignoring_eos(hf_greedy, prompt, n)
        assert got == expected

        # Without a drafter requests still complete, with no drafts.
        out = client.generate(prompt_token_ids=[3, 4], max_tokens=8, ignore_eos=True)
        assert len(out.token_ids) == 8 and out.stats.num_draft_tokens == 0

        cluster.restart("drafter")
        out = None
        deadline = time.monotonic() + 20  # the verifier probes a lost drafter with backoff (<= 5 s)
        while time.monotonic() < deadline:
            out = client.generate(prompt_token_ids=[3, 4], max_tokens=12, ignore_eos=True)
            if out.stats.num_draft_tokens > 0:
                break
            time.sleep(0.2)
        assert out.stats.num_draft_tokens > 0
