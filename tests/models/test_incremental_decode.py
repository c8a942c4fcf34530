"""Prefill + incremental multi-token steps with rollbacks give the logits of one full forward."""

from __future__ import annotations

import pytest
import torch

from specsplit.models.loader import load_target

ATOL = 1e-4


def _full_forward_logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.make_kv_cache(num_blocks=64, block_size=4)
    attn = cache.prepare_step(["full"], [len(tokens)])
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), cache, attn)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_ragged_steps_with_rollbacks_match_full_forward(checkpoint_dir, architecture):
    model = load_target(checkpoint_dir(architecture))
    cache = model.make_kv_cache(num_blocks=48, block_size=4)
    g = torch.Generator().manual_seed(1)
    sequences: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def step(new_tokens: dict[str, int], rollback: dict[str, int] | None = None) -> None:
        for req_id, keep in (rollback or {}).items():
            cache.truncate(req_id, keep)
            del sequences[req_id][keep:]
        req_ids = list(new_tokens)
        starts = [cache.num_tokens(r) for r in req_ids]
        for r in req_ids:
            sequences[r] += torch.randint(0, model.config.vocab_size, (new_tokens[r],), generator=g).tolist()
        attn = cache.prepare_step(req_ids, [new_tokens[r] for r in req_ids])
        ids = torch.tensor([t for r, s in zip(req_ids, starts) for t in sequences[r][s:]])
        positions = torch.cat([torch.arange(s, len(sequences[r])) for r, s in zip(req_ids, starts)])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, cache, attn))
        row = 0
        for r, s in zip(req_ids, starts):
            n = len(sequences[r]) - s
            expected = _full_forward_logits(model, sequences[r])[s:]
            torch.testing.assert_close(logits[row : row + n], expected, atol=ATOL, rtol=0)
            row += n
        for r, tokens in sequences.items():
            assert cache.num_tokens(r) == len(tokens)

    step({"a": 9, "b": 3})  # prefill (b's prompt is chunked: rest comes with its first decode)
    step({"b": 6, "a": 3, "c": 5})  # chunk + verify-like step of last token + 2 drafts + new prompt
    step({"a": 3, "c": 3}, rollback={"a": 10})  # 2 drafts of a rejected: roll back, re-verify
    step({"a": 1, "b": 3, "c": 2}, rollback={"b": 7, "c": 5})  # rollback across a block boundary
    step({"c": 4, "a": 2}, rollback={"c": 1})
    step({"b": 1})
    # Full rollback and re-prefill of a request is just another step.
    step({"a": 5}, rollback={"a": 0})
