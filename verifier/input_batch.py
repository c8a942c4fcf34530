"""VerifyRequest → the verifier's input batch (validated), in the layout of the glossary.

For each request the target runs its `token_ids` at positions `num_computed_tokens ...`. A request
that samples gets `num_draft + 1` logits rows — its last `num_draft + 1` query rows —
`cu_num_logits` is their prefix sum and `logits_indices` picks them out of the flat hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.types import SparseDraftProbs
from models.step_upload import StepUpload
from protos import verifier_pb2
from specsplit.errors import FailedPrecondition, InvalidArgument
from verifier.draft_probs import RequestQ, batch_q, decode_q


@dataclass
class InputBatch:
    req_ids: list[str]
    num_computed_tokens: list[int]
    num_new_tokens: list[int]
    token_ids: list[list[int]]
    num_draft_tokens: list[int]  # trailing drafts in token_ids, per request
    sample: list[bool]
    next_token_ids: list[int]  # for non-final chunks
    num_spec_tokens: list[int]
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start: list[int]  # [num_reqs + 1] prefix sum of num_new_tokens
    # Sampling requests only (in batch order):
    sampling_indices: list[int]  # index into req_ids of each sampling request
    num_draft_tokens_per_req: list[int]
    cu_num_logits: torch.Tensor  # [num_sampling + 1] int32
    logits_indices: torch.Tensor  # [num_logits] int64
    draft_token_ids: torch.Tensor  # [num_draft_total] int64
    cu_num_draft: torch.Tensor  # [num_sampling + 1] int32
    temperature: torch.Tensor  # [num_sampling] float32
    top_k: torch.Tensor  # [num_sampling] int32
    top_p: torch.Tensor  # [num_sampling] float32
    seeds: torch.Tensor  # [num_sampling] int64
    first_logits_positions: torch.Tensor  # [num_sampling] int64
    draft_probs: SparseDraftProbs | None = None  # q of every draft when any request sampled its drafts
    # Known on the host, so the sampler needs no device sync: every temperature is 0; some request
    # uses top-k / top-p; the most drafts of one request.
    all_greedy: bool = False
    any_filter: bool = True
    max_num_draft: int | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def build_input_batch(
    msg: verifier_pb2.VerifyRequest,
    *,
    vocab_size: int,
    max_model_len: int,
    num_cached_tokens,  # callable: request id -> tokens the KV cache holds (0 if unknown)
    device: torch.device | str = "cpu",
    upload: StepUpload | None = None,  # the caller's, so its pinned buffer is reused step after step
) -> InputBatch:
    req_ids, nc_list, n_list, tokens_list, d_list, sample, next_ids, n_spec = [], [], [], [], [], [], [], []
    flat_ids, flat_pos, query_start = [], [], [0]
    sampling_indices, num_drafts, logits_idx, drafts = [], [], [], []
    temps, top_ks, top_ps, seeds, first_pos = [], [], [], [], []
    q_rows: list[RequestQ] = []  # per sampling request
    seen = set()
    for i, r in enumerate(msg.requests):
        rid = r.request_id
        if not rid:
            raise InvalidArgument(f"request {i} has an empty request_id")
        if rid in seen:
            raise InvalidArgument(f"request {rid!r} appears twice in one iteration")
        seen.add(rid)
        tokens = list(r.token_ids)
        n = len(tokens)
        nc = r.num_computed_tokens
        d = r.num_draft_tokens
        if n == 0:
            raise InvalidArgument(f"request {rid!r} has no token_ids")
        if nc < 0:
            raise InvalidArgument(f"request {rid!r}: num_computed_tokens {nc} is negative")
        if not 0 <= d <= n - 1:
            raise InvalidArgument(f"request {rid!r}: num_draft_tokens {d} not in [0, {n - 1}]")
        if d and not r.sample:
            raise InvalidArgument(f"request {rid!r}: drafts in a prefill chunk that does not sample")
        if nc + n > max_model_len:
            raise InvalidArgument(f"request {rid!r}: {nc} + {n} tokens exceed max_model_len {max_model_len}")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad or (not r.sample and not 0 <= r.next_token_id < vocab_size):
            raise InvalidArgument(f"request {rid!r}: token id outside the vocabulary [0, {vocab_size})")
        if r.num_spec_tokens < 0:
            raise InvalidArgument(f"request {rid!r}: num_spec_tokens {r.num_spec_tokens} is negative")
        cached = num_cached_tokens(rid)
        if nc > cached:
            raise FailedPrecondition(
                f"request {rid!r}: num_computed_tokens {nc} but this verifier holds {cached} of its "
                "tokens (restarted or preempted?); re-prefill it"
            )
        req_ids.append(rid)
        nc_list.append(nc)
        n_list.append(n)
        tokens_list.append(tokens)
        d_list.append(d)
        sample.append(r.sample)
        next_ids.append(r.next_token_id)
        n_spec.append(r.num_spec_tokens)
        flat_ids.extend(tokens)
        flat_pos.extend(range(nc, nc + n))
        if r.sample:
            sp = r.sampling
            top_p = sp.top_p if sp.HasField("top_p") else 1.0
            if not (sp.temperature >= 0 and 0 < top_p <= 1 and sp.top_k >= 0):
                raise InvalidArgument(f"request {rid!r}: invalid sampling parameters")
            sampling_indices.append(i)
            num_drafts.append(d)
            start = query_start[-1] + n - d - 1
            logits_idx.extend(range(start, start + d + 1))
            drafts.extend(tokens[n - d :])
            temps.append(sp.temperature)
            top_ks.append(sp.top_k)
            top_ps.append(top_p)
            seeds.append(sp.seed & (2**63 - 1))
            first_pos.append(nc + n - d - 1)
            q_rows.append(decode_q(r, rid, tokens[n - d :]))
        query_start.append(query_start[-1] + n)

    def cumsum(xs: list[int]) -> list[int]:
        out = [0]
        for x in xs:
            out.append(out[-1] + x)
        return out

    # Every tensor but the sparse q in one host→device copy.
    upload = upload or StepUpload(device)
    (
        (ids_t, pos_t, logits_idx_t, drafts_t, seeds_t, first_pos_t),
        (cu_logits_t, cu_draft_t, top_k_t),
        (temps_t, top_p_t),
    ) = upload(
        [flat_ids, flat_pos, logits_idx, drafts, seeds, first_pos],
        [cumsum([d + 1 for d in num_drafts]), cumsum(num_drafts), top_ks],
        [temps, top_ps],
    )
    return InputBatch(
        req_ids=req_ids,
        num_computed_tokens=nc_list,
        num_new_tokens=n_list,
        token_ids=tokens_list,
        num_draft_tokens=d_list,
        sample=sample,
        next_token_ids=next_ids,
        num_spec_tokens=n_spec,
        input_ids=ids_t,
        positions=pos_t,
        query_start=query_start,
        sampling_indices=sampling_indices,
        num_draft_tokens_per_req=num_drafts,
        cu_num_logits=cu_logits_t,
        logits_indices=logits_idx_t,
        draft_token_ids=drafts_t,
        cu_num_draft=cu_draft_t,
        temperature=temps_t,
        top_k=top_k_t,
        top_p=top_p_t,
        seeds=seeds_t,
        first_logits_positions=first_pos_t,
        draft_probs=batch_q(q_rows, vocab_size, device),
        all_greedy=all(t == 0 for t in temps),
        any_filter=any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps),
        max_num_draft=max(num_drafts, default=0),
    )
