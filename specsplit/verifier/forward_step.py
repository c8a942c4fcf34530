"""What a tensor-parallel follower needs to run the first rank's forward of a step (`ForwardStep`).

The first rank plans every step (batch, KV blocks, sampling); a follower keeps no request state at all. It
gets, per step, the flat token ids and positions, the KV cache's step plan (slots and block tables: the
blocks rank 0 allocated, which index the follower's cache of its KV heads alike) and the logits rows, and runs
the same forward, taking part in its collectives (`specsplit.runtime.tensor_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.models.kv_cache import StepPlan


@dataclass(frozen=True)
class ForwardStep:
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    plan: StepPlan
    use_kernel: bool
    logits_indices: list[int]  # [num_logits]

    @classmethod
    def of(cls, batch, plan: StepPlan, use_kernel: bool) -> ForwardStep:
        """The forward of `batch` (an InputBatch), from its host lists: no device sync."""
        ids = [t for tokens in batch.token_ids for t in tokens]
        positions = [p for nc, n in zip(batch.num_computed_tokens, batch.num_new_tokens) for p in range(nc, nc + n)]
        rows = []
        for j, i in enumerate(batch.sampling_indices):
            end = batch.query_start[i + 1]
            rows.extend(range(end - batch.num_draft_tokens_per_req[j] - 1, end))
        return cls(ids, positions, plan, use_kernel, rows)
