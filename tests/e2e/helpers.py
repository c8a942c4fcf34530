"""Helpers shared by the end-to-end tests."""

import threading

from specsplit import Client


def greedy_ignoring_eos(hf_greedy, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of n tokens, carried on past an EOS the way the services do
    with ignore_eos."""
    out: list[int] = []
    while len(out) < n:
        out.extend(hf_greedy(prompt + out, n - len(out)))
    return out[:n]


def generate_concurrently(address: str, prompts: list[list[int]], max_tokens: int) -> dict[int, object]:
    """One greedy Generate per prompt, all at once (one client thread each); raises the first failure."""
    outs, errors = {}, []

    def run(i):
        try:
            with Client(address, timeout=120) as client:
                outs[i] = client.generate(prompt_token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return outs


def start_streams(address: str, prompts: list[list[int]], max_tokens: int, on_progress=lambda n: None):
    """One greedy stream per prompt (ignoring EOS), each on a client thread of its own; on_progress(n) after
    each delta, n the stream's tokens so far. Returns (threads, results by prompt index, errors); join the
    threads before reading the other two."""
    results, errors = {}, []

    def run(i):
        try:
            with Client(address, timeout=240) as client:
                ids = []
                for delta in client.stream(prompt_token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True):
                    ids.extend(delta.token_ids)
                    on_progress(len(ids))
                results[i] = ids
        except Exception as err:  # noqa: BLE001 - surfaced by the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results, errors
