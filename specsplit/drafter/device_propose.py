"""The inputs of propose() on a device hand-off: the verifier's sampled tokens are still on the GPU
(`DrafterRunner.propose` runs the same steps as on the host path, from these inputs).

On the host path the verifier waits for its sampled tokens, then sends them, and only then can the
drafter plan and launch its MTP steps: the GPU idles through both services' host work. On a device
hand-off (`DeviceTokens`) the verifier sends the Propose as soon as its step is queued; the drafter
plans every step on the host while the verifier's step still runs, and its MTP steps wait on the GPU
(`DeviceTokens.wait`) for the verifier's work, not on the host.

What the host cannot know yet is how many of each request's rows are valid (`num_sampled`). So:
- step 0 runs over all rows of each request (its last token and every draft it verified), whatever
  was accepted. The rows past `num_sampled` write MTP KV entries at positions that the later steps
  overwrite or the next Propose's rollback drops, and the causal mask keeps any step from reading them;
- steps 1..k-1 are planned as if every draft had been accepted, and their positions, context lengths
  and KV slots are moved back on the device by `shift = num_sampled - rows` (≤ 0) per request;
- the input of step 1 is each request's row `num_sampled - 1`, picked on the device.
The drafts, the tokens and `num_sampled` come to the host in the one device→host copy at the end; the
items' `next_token_ids` are filled from it, as the host path would have had them.

Only greedy drafts (sampled ones need their positions on the host) and steps on the attention kernel,
which reads only device tensors, take this path (`can_propose_on_device`).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from specsplit.models.kv_cache import AttentionMetadata
from specsplit.transport.base import DeviceTokens


def can_propose_on_device(runner, items) -> bool:
    """Whether `runner` (a DrafterRunner) proposes for these device items on the device path."""
    return (
        bool(items)
        and runner.attention_kernel
        and all(item.temperature == 0 and item.num_rows > 0 for item in items)
        and any(item.num_spec_tokens > 0 for item in items)
    )


def shifted(
    attn: AttentionMetadata,
    positions: torch.Tensor,  # [n] int64
    shift: torch.Tensor,  # [n] int64, ≤ 0
) -> tuple[AttentionMetadata, torch.Tensor]:
    """A one-token-per-request step planned as if every draft had been accepted, moved by `shift`
    ([n] int64, ≤ 0) positions per request on the device: context lengths, KV slots and positions."""
    context = attn.token_context_lens + shift.to(torch.int32)  # [n]
    index = context.to(torch.int64) - 1  # cache index of each request's new token
    size = attn.block_size
    blocks = attn.block_tables.gather(1, (index // size).unsqueeze(1)).squeeze(1)  # [n]
    slots = blocks.to(torch.int64) * size + index % size
    moved = dataclasses.replace(attn, token_context_lens=context, slot_mapping=slots, seq_lens=context)
    return moved, positions + shift


def valid_rows_on_host(items, hidden_states: torch.Tensor, dev: DeviceTokens) -> torch.Tensor:
    """A device hand-off the device path does not take: waits for the tokens on the host and fills the
    items from them; returns the valid rows of `hidden_states` ([sum(num_rows), H] → [sum(num_sampled), H])."""
    dev.wait()
    tokens, num_sampled = tokens_to_host(dev)
    fill_tokens(items, tokens, num_sampled)
    starts = [0, *itertools.accumulate(item.num_rows for item in items)]
    index = [s + j for s, item in zip(starts, items) for j in range(len(item.next_token_ids))]
    return hidden_states.index_select(0, torch.tensor(index, device=hidden_states.device))


def tokens_to_host(dev: DeviceTokens) -> list[torch.Tensor]:
    """The verifier's tokens and num_sampled on the host (a wait for the device)."""
    return [dev.tokens.cpu(), dev.num_sampled.cpu()]


def fill_tokens(items, tokens: torch.Tensor, num_sampled: torch.Tensor) -> None:
    """The items' next_token_ids and num_rejected, from the host copies of the device tokens."""
    for item, row, n in zip(items, tokens.tolist(), num_sampled.tolist()):
        item.next_token_ids = row[:n]
        item.num_rejected = item.num_rows - n
