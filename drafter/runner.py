"""propose(): the drafter's MTP steps over one iteration's hidden states.

For each request the verifier sends the target hidden states h_p of the iteration's valid
positions p and the token x_{p+1} that follows each. The drafter
1. rolls its MTP KV back to the first new position (dropping the k - 1 speculative entries of the
   previous propose, and whatever verification rejected);
2. MTP step 0: runs the MTP layer over all (h_p, x_{p+1}) pairs of the batch at once; the output
   of each request's last pair gives draft 1;
3. steps 1..k-1: reuses the MTP layer on its own output h' and the draft it just made, one
   position further, for the requests that want more drafts.
A request whose history the drafter lacks (new replica, restart, or a gap after a failed call)
starts afresh at the first new position: drafts may be worse for a while, output never changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from models.kv_cache import PagedKVCache
from models.mtp import MTPModule


@dataclass
class ProposeItem:
    request_id: str
    start_position: int  # position p of the first hidden-state row
    next_token_ids: list[int]  # x_{p+1} per row
    num_spec_tokens: int


@dataclass
class ProposeOutput:
    drafts: list[list[int]]
    step0_ns: int
    later_steps_ns: int


class DrafterRunner:
    def __init__(self, mtp: MTPModule, kv_cache: PagedKVCache):
        self.mtp = mtp
        self.kv_cache = kv_cache
        self.device = next(mtp.parameters()).device
        self._first_position: dict[str, int] = {}  # pair position held at cache index 0

    def free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.kv_cache.free(rid)
            self._first_position.pop(rid, None)

    def _rollback(self, item: ProposeItem) -> None:
        rid, p = item.request_id, item.start_position
        first = self._first_position.get(rid)
        cached = self.kv_cache.num_tokens(rid)
        if first is None or not first <= p <= first + cached:
            self.free([rid])
            self._first_position[rid] = p
        else:
            self.kv_cache.truncate(rid, p - first)

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem], hidden_states: torch.Tensor) -> ProposeOutput:
        """hidden_states: [sum(len(item.next_token_ids)), hidden_size], rows in item order."""
        t0 = time.perf_counter_ns()
        drafts: list[list[int]] = [[] for _ in items]
        for item in items:
            self._rollback(item)
        counts = [len(item.next_token_ids) for item in items]
        ids = [item.request_id for item in items]
        if not self.kv_cache.can_append(ids, counts):
            # Out of MTP cache: drop these requests' MTP state; they continue without drafts.
            self.free(ids)
            return ProposeOutput(drafts, time.perf_counter_ns() - t0, 0)
        attn = self.kv_cache.prepare_step(ids, counts)
        input_ids = self._tensor([t for item in items for t in item.next_token_ids])
        # The MTP input for pair (h_p, x_{p+1}) sits at position p + 1, the position of x_{p+1}.
        positions = self._tensor(
            [item.start_position + 1 + j for item in items for j in range(len(item.next_token_ids))]
        )
        out = self.mtp(input_ids, hidden_states, positions, self.kv_cache, attn)  # [T, H]
        last_rows = torch.tensor(counts, device=self.device).cumsum(0) - 1
        active = [i for i, item in enumerate(items) if item.num_spec_tokens > 0]
        t1 = time.perf_counter_ns()
        if not active:
            return ProposeOutput(drafts, t1 - t0, 0)
        hidden = out[last_rows[active]]  # [num_active, H]
        tokens = self.mtp.compute_logits(hidden).argmax(dim=-1)  # [num_active]
        last_pos = [items[i].start_position + counts[i] for i in active]  # position of x_{p+1}
        for step in range(max(items[i].num_spec_tokens for i in active)):
            for j, tok in zip(active, tokens.tolist()):
                drafts[j].append(tok)
            if step + 1 == max(items[i].num_spec_tokens for i in active):
                break
            keep = [a for a, i in enumerate(active) if items[i].num_spec_tokens > step + 1]
            active = [active[a] for a in keep]
            ids = [items[i].request_id for i in active]
            if not self.kv_cache.can_append(ids, [1] * len(ids)):
                break
            attn = self.kv_cache.prepare_step(ids, [1] * len(ids))
            last_pos = [last_pos[a] + 1 for a in keep]
            hidden = self.mtp(tokens[keep], hidden[keep], self._tensor(last_pos), self.kv_cache, attn)
            tokens = self.mtp.compute_logits(hidden).argmax(dim=-1)
        return ProposeOutput(drafts, t1 - t0, time.perf_counter_ns() - t1)
