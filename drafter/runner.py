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
from dataclasses import dataclass, field

import torch

from drafter.sampling import pick_drafts
from models.attention import use_kernel_for
from models.cuda_graphs import CudaGraphRunner
from models.kv_cache import AttentionMetadata, PagedKVCache
from models.mtp import MTPModule


@dataclass
class ProposeItem:
    request_id: str
    start_position: int  # position p of the first hidden-state row
    next_token_ids: list[int]  # x_{p+1} per row
    num_spec_tokens: int
    temperature: float = 0.0  # > 0: sampled drafts with their sparse q
    seed: int = 0


@dataclass
class ProposeOutput:
    drafts: list[list[int]]
    # Wall-clock stamps (time.time_ns): start, MTP step 0 done, steps 1..k-1 done.
    stamps_ns: tuple[int, int, int]
    # Per request, for sampled drafts: q's support and probabilities, [num_drafts, K] each.
    draft_probs: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)

    @property
    def step0_ns(self) -> int:
        return self.stamps_ns[1] - self.stamps_ns[0]

    @property
    def later_steps_ns(self) -> int:
        return self.stamps_ns[2] - self.stamps_ns[1]


class DrafterRunner:
    def __init__(
        self,
        mtp: MTPModule,
        kv_cache: PagedKVCache,
        draft_top_k: int = 16,
        *,
        attention_kernel: bool | None = None,
        cuda_graphs: bool | None = None,
        max_graph_tokens: int = 256,
    ):
        """`attention_kernel`: MTP steps with few new tokens per request run the Triton paged
        attention (default: on CUDA, for modules that support it). `cuda_graphs`: those steps
        replay CUDA graphs (default: on CUDA with the kernel)."""
        self.mtp = mtp
        self.draft_top_k = draft_top_k
        self.kv_cache = kv_cache
        self.device = next(mtp.parameters()).device
        self._first_position: dict[str, int] = {}  # pair position held at cache index 0
        on_cuda = kv_cache.device.type == "cuda"
        use = on_cuda if attention_kernel is None else attention_kernel
        self.attention_kernel = mtp.supports_attention_kernel and use
        if cuda_graphs is None:
            cuda_graphs = on_cuda and self.attention_kernel
        elif cuda_graphs and not self.attention_kernel:
            raise ValueError("CUDA graphs need the attention kernel (and an MTP module that supports it)")
        self.graphs = (
            CudaGraphRunner(
                mtp, kv_cache, max_model_len=mtp.config.max_position_embeddings, max_num_tokens=max_graph_tokens
            )
            if cuda_graphs
            else None
        )

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

    def _mtp_step(
        self,
        input_ids: torch.Tensor,  # [T] int64
        previous_hidden: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # MTP output [T, H]; logits [T, V] when a graph made them
        if self.graphs is not None and self.graphs.can_run(attn):
            return self.graphs.run(input_ids, positions, attn, previous_hidden)
        return self.mtp(input_ids, previous_hidden, positions, self.kv_cache, attn), None

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem], hidden_states: torch.Tensor) -> ProposeOutput:
        """hidden_states: [sum(len(item.next_token_ids)), hidden_size], rows in item order."""
        t0 = time.time_ns()
        drafts: list[list[int]] = [[] for _ in items]
        if not items:  # an iteration that only frees finished requests
            return ProposeOutput(drafts, (t0, t0, t0))
        for item in items:
            self._rollback(item)
        counts = [len(item.next_token_ids) for item in items]
        ids = [item.request_id for item in items]
        if not self.kv_cache.can_append(ids, counts):
            # Out of MTP cache: drop these requests' MTP state; they continue without drafts.
            self.free(ids)
            now = time.time_ns()
            return ProposeOutput(drafts, (t0, now, now))
        attn = self.kv_cache.prepare_step(ids, counts, use_kernel=use_kernel_for(self.attention_kernel, counts))
        input_ids = self._tensor([t for item in items for t in item.next_token_ids])
        # The MTP input for pair (h_p, x_{p+1}) sits at position p + 1, the position of x_{p+1}.
        positions = self._tensor(
            [item.start_position + 1 + j for item in items for j in range(len(item.next_token_ids))]
        )
        out, out_logits = self._mtp_step(input_ids, hidden_states, positions, attn)  # [T, H], [T, V] | None
        last_rows = torch.tensor(counts, device=self.device).cumsum(0) - 1
        active = [i for i, item in enumerate(items) if item.num_spec_tokens > 0]
        t1 = time.time_ns()
        if not active:
            return ProposeOutput(drafts, (t0, t1, t1))
        hidden = out[last_rows[active]]  # [num_active, H]
        logits = None if out_logits is None else out_logits[last_rows[active]]  # [num_active, V]
        temps = torch.tensor([it.temperature for it in items], dtype=torch.float32, device=self.device)
        seeds = torch.tensor([it.seed for it in items], dtype=torch.int64, device=self.device)
        last_pos = [items[i].start_position + counts[i] for i in active]  # position of x_{p+1}
        q_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in active if items[i].temperature > 0}
        num_steps = max(items[i].num_spec_tokens for i in active)
        for step in range(num_steps):
            idx = self._tensor(active)
            if logits is None:
                logits = self.mtp.compute_logits(hidden)
            pick = pick_drafts(logits, temps[idx], seeds[idx], self._tensor(last_pos) + 1, self.draft_top_k)
            for a, (j, tok) in enumerate(zip(active, pick.tokens.tolist())):
                drafts[j].append(tok)
                if j in q_rows:
                    q_rows[j].append((pick.q_ids[a], pick.q_probs[a]))
            if step + 1 == num_steps:
                break
            keep = [a for a, i in enumerate(active) if items[i].num_spec_tokens > step + 1]
            active = [active[a] for a in keep]
            ids = [items[i].request_id for i in active]
            if not self.kv_cache.can_append(ids, [1] * len(ids)):
                break
            attn = self.kv_cache.prepare_step(ids, [1] * len(ids), use_kernel=self.attention_kernel)
            last_pos = [last_pos[a] + 1 for a in keep]
            hidden, logits = self._mtp_step(pick.tokens[keep], hidden[keep], self._tensor(last_pos), attn)
        probs = [None] * len(items)
        for j, rows in q_rows.items():
            probs[j] = (torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))
        return ProposeOutput(drafts, (t0, t1, time.time_ns()), probs)
