"""A VerifyBatch (`batch.py`) → the verifier's input batch (validated), in the layout of the glossary.

For each request the target runs its `token_ids` at positions `num_computed_tokens ...`. A request
that samples gets `num_draft + 1` logits rows — its last `num_draft + 1` query rows —
`cu_num_logits` is their prefix sum and `logits_indices` picks them out of the flat hidden states.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specsplit.client.errors import FailedPrecondition, InvalidArgument
from specsplit.kernels.types import MAX_DRAFTS_PER_REQUEST, SparseDraftProbs
from specsplit.models.step_upload import StepUpload
from specsplit.verifier.batch import VerifyBatch
from specsplit.verifier.draft_probs import RequestQ, batch_q, decode_q


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
    coupled: torch.Tensor | None = None  # [num_sampling] int32: 1 for a coupled request; None when none is
    # Known on the host, so the sampler needs no device sync: every temperature is 0; some request
    # uses top-k / top-p; the most drafts of one request.
    all_greedy: bool = False
    any_filter: bool = True
    max_num_draft: int | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def hand_off_rows(self) -> list[int] | None:
        """Per request, its rows (its last token and every draft it verifies) when the step can go to the
        drafter as a device hand-off (`specsplit/drafter/device_propose.py`): every request a greedy decode step,
        and one at least wants drafts. None otherwise."""
        if self.num_reqs == 0 or len(self.sampling_indices) != self.num_reqs or not self.all_greedy:
            return None
        rows = [d + 1 for d in self.num_draft_tokens]
        if self.num_new_tokens != rows or not all(self.sample) or max(self.num_spec_tokens) == 0:
            return None
        return rows


@dataclass
class PlannedBatch:
    """An input batch's host side (validated lists), before its one upload (`upload_input_batch`).

    `plan_input_batch(..., placeholders=...)` plans a batch before its held drafts are in, with
    placeholder drafts; `with_held_drafts` then puts the real ones in place."""

    req_ids: list[str]
    num_computed_tokens: list[int]
    num_new_tokens: list[int]
    token_ids: list[list[int]]
    num_draft_tokens: list[int]
    sample: list[bool]
    next_token_ids: list[int]
    num_spec_tokens: list[int]
    flat_ids: list[int]
    flat_pos: list[int]
    query_start: list[int]
    sampling_indices: list[int]
    num_drafts: list[int]  # per sampling request
    logits_idx: list[int]
    drafts: list[int]  # every sampling request's drafts, request after request
    draft_start: list[int]  # per request: where its drafts start in `drafts` (-1: it does not sample)
    temps: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int]
    coupled: list[int]  # 1 for a request verified by coupled sampling
    first_pos: list[int]
    msgs: list  # per sampling request, its VerifyItem (its q is checked at upload)
    placeholders: dict[str, int]  # request id → placeholder drafts planned in its place
    cu_num_logits: list[int]  # [num_sampling + 1] prefix sum of num_drafts + 1
    cu_num_draft: list[int]  # [num_sampling + 1] prefix sum of num_drafts
    placeholder_index: list[tuple[int, int]]  # (index, placeholder drafts) of each request planned with some


def build_input_batch(
    msg: VerifyBatch,
    *,
    vocab_size: int,
    max_model_len: int,
    num_cached_tokens,  # callable: request id -> tokens the KV cache holds (0 if unknown)
    device: torch.device | str = "cpu",
    upload: StepUpload | None = None,  # the caller's, so its pinned buffer is reused step after step
) -> InputBatch:
    planned = plan_input_batch(
        msg, vocab_size=vocab_size, max_model_len=max_model_len, num_cached_tokens=num_cached_tokens
    )
    return upload_input_batch(planned, vocab_size=vocab_size, device=device, upload=upload)


def plan_input_batch(
    msg: VerifyBatch,
    *,
    vocab_size: int,
    max_model_len: int,
    num_cached_tokens,  # callable: request id -> tokens the KV cache holds (0 if unknown)
    placeholders: dict[str, int] | None = None,
) -> PlannedBatch:
    """The batch's lists, validated; raises SpecsplitError naming the first bad field.

    placeholders: request id → n, for requests whose n held drafts are not in `msg` yet (async
    scheduling: one token, no drafts): planned as if followed by n drafts of token 0."""
    placeholders = placeholders or {}
    req_ids, nc_list, n_list, tokens_list, d_list, sample, next_ids, n_spec = [], [], [], [], [], [], [], []
    flat_ids, flat_pos, query_start = [], [], [0]
    sampling_indices, num_drafts, logits_idx, drafts, draft_start = [], [], [], [], []
    temps, top_ks, top_ps, seeds, coupled, first_pos, msgs, placeholder_index = [], [], [], [], [], [], [], []
    seen = set()
    for i, r in enumerate(msg.requests):
        rid = r.request_id
        if not rid:
            raise InvalidArgument(f"request {i} has an empty request_id")
        if rid in seen:
            raise InvalidArgument(f"request {rid!r} appears twice in one iteration")
        seen.add(rid)
        tokens = list(r.token_ids)
        nc = r.num_computed_tokens
        d = r.num_draft_tokens
        if rid in placeholders:
            tokens += [0] * placeholders[rid]
            d = placeholders[rid]
            placeholder_index.append((i, d))
        n = len(tokens)
        if n == 0:
            raise InvalidArgument(f"request {rid!r} has no token_ids")
        if nc < 0:
            raise InvalidArgument(f"request {rid!r}: num_computed_tokens {nc} is negative")
        if not 0 <= d <= n - 1:
            raise InvalidArgument(f"request {rid!r}: num_draft_tokens {d} not in [0, {n - 1}]")
        if d > MAX_DRAFTS_PER_REQUEST:
            raise InvalidArgument(f"request {rid!r}: {d} drafts; at most {MAX_DRAFTS_PER_REQUEST} per request")
        if d and not r.sample:
            raise InvalidArgument(f"request {rid!r}: drafts in a prefill chunk that does not sample")
        if nc + n > max_model_len:
            raise InvalidArgument(f"request {rid!r}: {nc} + {n} tokens exceed max_model_len {max_model_len}")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad or (not r.sample and not 0 <= r.next_token_id < vocab_size):
            raise _outside_vocabulary(rid, vocab_size)
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
            top_p = sp.top_p
            if not (sp.temperature >= 0 and 0 < top_p <= 1 and sp.top_k >= 0):
                raise InvalidArgument(f"request {rid!r}: invalid sampling parameters")
            sampling_indices.append(i)
            num_drafts.append(d)
            start = query_start[-1] + n - d - 1
            logits_idx.extend(range(start, start + d + 1))
            draft_start.append(len(drafts))
            drafts.extend(tokens[n - d :])
            temps.append(sp.temperature)
            top_ks.append(sp.top_k)
            top_ps.append(top_p)
            seeds.append((sp.seed or 0) & (2**63 - 1))
            coupled.append(int(sp.coupled and sp.temperature > 0))
            first_pos.append(nc + n - d - 1)
            msgs.append(r)
        else:
            draft_start.append(-1)
        query_start.append(query_start[-1] + n)
    cu_draft = [0, *itertools.accumulate(num_drafts)]
    cu_logits = [c + j for j, c in enumerate(cu_draft)]  # each request's drafts + 1
    return PlannedBatch(
        req_ids, nc_list, n_list, tokens_list, d_list, sample, next_ids, n_spec, flat_ids, flat_pos, query_start,
        sampling_indices, num_drafts, logits_idx, drafts, draft_start, temps, top_ks, top_ps, seeds, coupled, first_pos,
        msgs, dict(placeholders), cu_logits, cu_draft, placeholder_index,
    )  # fmt: skip


def with_held_drafts(planned: PlannedBatch, filled: list[list[int]], vocab_size: int) -> PlannedBatch | None:
    """`planned` (made with placeholders) with the drafts `HeldDrafts.fill` has since put into its message
    (`filled`: per request of the message, the drafts put in), in place; None when a request got fewer drafts
    than planned (plan it again). Raises InvalidArgument for a draft outside the vocabulary, as planning would."""
    token_ids, flat_ids, drafts = planned.token_ids, planned.flat_ids, planned.drafts
    query_start, draft_start = planned.query_start, planned.draft_start
    for i, n in planned.placeholder_index:
        real = filled[i]
        if len(real) != n:
            return None
        if min(real) < 0 or max(real) >= vocab_size:
            raise _outside_vocabulary(planned.req_ids[i], vocab_size)
        token_ids[i][1:] = real
        at = query_start[i] + 1
        flat_ids[at : at + n] = real
        at = draft_start[i]
        drafts[at : at + n] = real
    planned.placeholders = {}
    return planned


def upload_input_batch(
    planned: PlannedBatch,
    *,
    vocab_size: int,
    device: torch.device | str = "cpu",
    upload: StepUpload | None = None,
) -> InputBatch:
    """The planned batch on `device`: every tensor but the sparse q in one host→device copy."""
    if planned.placeholders:
        raise ValueError("a batch planned with placeholder drafts needs with_held_drafts() first")
    p = planned
    draft_probs = None
    if any(r.draft_probs is not None for r in p.msgs):  # sampled drafts' q (greedy steps send none)
        q_rows: list[RequestQ] = [
            decode_q(r, r.request_id, p.drafts[start : start + d])
            for r, start, d in zip(p.msgs, (p.draft_start[i] for i in p.sampling_indices), p.num_drafts)
        ]
        draft_probs = batch_q(q_rows, vocab_size, device)
    upload = upload or StepUpload(device)
    any_coupled = any(p.coupled)
    (
        (ids_t, pos_t, logits_idx_t, drafts_t, seeds_t, first_pos_t),
        (cu_logits_t, cu_draft_t, top_k_t, *coupled_t),
        (temps_t, top_p_t),
    ) = upload(
        [p.flat_ids, p.flat_pos, p.logits_idx, p.drafts, p.seeds, p.first_pos],
        [p.cu_num_logits, p.cu_num_draft, p.top_ks, *([p.coupled] if any_coupled else [])],
        [p.temps, p.top_ps],
    )
    return InputBatch(
        req_ids=p.req_ids,
        num_computed_tokens=p.num_computed_tokens,
        num_new_tokens=p.num_new_tokens,
        token_ids=p.token_ids,
        num_draft_tokens=p.num_draft_tokens,
        sample=p.sample,
        next_token_ids=p.next_token_ids,
        num_spec_tokens=p.num_spec_tokens,
        input_ids=ids_t,
        positions=pos_t,
        query_start=p.query_start,
        sampling_indices=p.sampling_indices,
        num_draft_tokens_per_req=p.num_drafts,
        cu_num_logits=cu_logits_t,
        logits_indices=logits_idx_t,
        draft_token_ids=drafts_t,
        cu_num_draft=cu_draft_t,
        temperature=temps_t,
        top_k=top_k_t,
        top_p=top_p_t,
        seeds=seeds_t,
        first_logits_positions=first_pos_t,
        draft_probs=draft_probs,
        coupled=coupled_t[0] if any_coupled else None,
        all_greedy=all(t == 0 for t in p.temps),
        any_filter=any(k > 0 for k in p.top_ks) or any(tp < 1 for tp in p.top_ps),
        max_num_draft=max(p.num_drafts, default=0),
    )


def _outside_vocabulary(rid: str, vocab_size: int) -> InvalidArgument:
    return InvalidArgument(f"request {rid!r}: token id outside the vocabulary [0, {vocab_size})")
