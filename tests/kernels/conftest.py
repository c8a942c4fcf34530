"""Batches for the rejection-sampler tests, built from a seeded generator.

Fixtures hand out the builder so that every test file shares one way to lay out a ragged batch.
"""

from dataclasses import dataclass, replace

import pytest
import torch

from specsplit.kernels import RejectionOutput, SparseDraftProbs, rejection_sample
from specsplit.kernels.triton_rejection import rejection_sample_triton
from specsplit.kernels.triton_rejection_launch import Launch


@dataclass(frozen=True)
class Batch:
    logits: torch.Tensor  # [num_logits, V]
    drafts: torch.Tensor  # [num_draft_total]
    cu_num_draft: torch.Tensor  # [num_reqs + 1] int32
    temperature: torch.Tensor  # [num_reqs]
    top_k: torch.Tensor  # [num_reqs] int32
    top_p: torch.Tensor  # [num_reqs]
    seeds: torch.Tensor  # [num_reqs] int64
    positions: torch.Tensor  # [num_reqs] int64
    dense_q: torch.Tensor  # [num_draft_total, V]
    sparse_q: SparseDraftProbs  # [num_draft_total, K]

    @property
    def num_draft(self) -> list[int]:
        return (self.cu_num_draft[1:] - self.cu_num_draft[:-1]).tolist()

    def draft_probs(self, mode: str) -> SparseDraftProbs | torch.Tensor | None:
        return {"one_hot": None, "dense": self.dense_q, "sparse": self.sparse_q}[mode]

    def sample(
        self,
        mode: str = "one_hot",
        backend: str = "reference",
        chunk: int | None = None,
        launch: Launch | None = None,
        race_in_stats: bool = False,
    ) -> RejectionOutput:
        """Triton with a launch shape: ``launch``, or ``chunk`` vocabulary ids (a power of 2) per
        program and per tile in both kernels, to split rows across programs (``race_in_stats``: one-hot
        and sparse batches race in the stats kernel)."""
        if chunk is not None:
            launch = Launch(chunk, chunk, 4, chunk, chunk, 4, race_in_stats)
        if launch is not None:
            return rejection_sample_triton(
                self.logits, self.drafts, self.cu_num_draft, self.temperature, self.top_k, self.top_p,
                self.seeds, self.positions, self.draft_probs(mode), launch=launch,
            )  # fmt: skip
        return rejection_sample(
            self.logits,
            self.drafts,
            self.cu_num_draft,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seeds,
            self.positions,
            draft_probs=self.draft_probs(mode),
            backend=backend,
        )

    def select(self, reqs: list[int]) -> "Batch":
        """The sub-batch of requests ``reqs``, in that order."""
        cu = self.cu_num_draft.tolist()
        draft_rows = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in reqs]).long()
        logits_rows = torch.cat([torch.arange(cu[r] + r, cu[r + 1] + r + 1) for r in reqs]).long()
        num_draft = torch.tensor([self.num_draft[r] for r in reqs])
        index = torch.tensor(reqs)
        return replace(
            self,
            logits=self.logits[logits_rows],
            drafts=self.drafts[draft_rows],
            cu_num_draft=torch.cat([torch.zeros(1), num_draft.cumsum(0)]).to(torch.int32),
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            seeds=self.seeds[index],
            positions=self.positions[index],
            dense_q=self.dense_q[draft_rows],
            sparse_q=SparseDraftProbs(self.sparse_q.ids[draft_rows], self.sparse_q.probs[draft_rows]),
        )


def make_batch(
    seed: int,
    num_draft: list[int],
    vocab_size: int,
    greedy: list[bool] | None = None,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    num_q_ids: int = 4,
    hit_rate: float = 0.6,
) -> Batch:
    """A ragged batch whose drafts hit the target's argmax with probability ``hit_rate``.

    Dense q is a random softmax; sparse q keeps its top ``num_q_ids`` ids (last slot -1 on every
    other row, first slot the draft if it was missing); drafts are the target's argmax or a draw from
    q; a few drafts are padded (-1). Every third request is greedy unless ``greedy`` says otherwise.
    """
    gen = torch.Generator().manual_seed(seed)
    num_reqs, num_draft_total = len(num_draft), sum(num_draft)
    num_logits = num_draft_total + num_reqs
    scale = 1 + 9 * torch.rand(num_logits, 1, generator=gen)  # from flat to peaked rows
    logits = torch.randn(num_logits, vocab_size, generator=gen) * scale
    dense_q = (torch.randn(num_draft_total, vocab_size, generator=gen) * 2).softmax(-1)
    cu = torch.tensor([0, *torch.tensor(num_draft).cumsum(0).tolist()], dtype=torch.int32)
    req_of_draft = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(num_draft))
    draft_logits_rows = torch.arange(num_draft_total) + req_of_draft
    argmax = logits[draft_logits_rows].argmax(-1)
    from_q = torch.multinomial(dense_q, 1, generator=gen).squeeze(1) if num_draft_total else argmax
    hit = torch.rand(num_draft_total, generator=gen) < hit_rate
    drafts = torch.where(hit, argmax, from_q)
    drafts[torch.rand(num_draft_total, generator=gen) < 0.08] = -1
    top_ids = dense_q.topk(min(num_q_ids, vocab_size), dim=-1).indices
    missing = (drafts >= 0) & ~(top_ids[:, :-1] == drafts[:, None]).any(-1)
    ids = top_ids.clone()
    ids[missing, 0] = drafts[missing]  # the sparse q the draft was "sampled" from lists it
    ids[(ids[:, -1] == ids[:, 0]) & (ids.shape[1] > 1), -1] = -1  # ids stay unique
    ids[1::2, -1] = -1
    probs = dense_q.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    greedy = greedy if greedy is not None else [r % 3 == 0 for r in range(num_reqs)]
    return Batch(
        logits=logits,
        drafts=drafts,
        cu_num_draft=cu,
        temperature=torch.tensor([0.0 if g else 0.5 + 0.25 * (r % 4) for r, g in enumerate(greedy)]),
        top_k=torch.tensor(top_k or [0] * num_reqs, dtype=torch.int32),
        top_p=torch.tensor(top_p or [1.0] * num_reqs),
        seeds=torch.randint(-(2**62), 2**62, (num_reqs,), generator=gen),
        positions=torch.randint(0, 100_000, (num_reqs,), generator=gen),
        dense_q=dense_q,
        sparse_q=SparseDraftProbs(ids, probs),
    )


def assert_same_output(a: RejectionOutput, b: RejectionOutput) -> None:
    assert torch.equal(a.sampled, b.sampled), f"\n{a.sampled}\n!=\n{b.sampled}"
    assert torch.equal(a.num_sampled, b.num_sampled)
    assert torch.equal(a.num_rejected, b.num_rejected)
    assert a.num_sampled.dtype == b.num_sampled.dtype == torch.int32
    assert a.sampled.dtype == b.sampled.dtype == torch.int64


@pytest.fixture
def batch_factory():
    return make_batch


@pytest.fixture
def same_output():
    return assert_same_output
