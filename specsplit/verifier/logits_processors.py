"""The target's logits of a step, per request, before rejection sampling: repetition, presence and frequency
penalties and min_tokens applied (vLLM's semantics), structured output's grammar masks (`specsplit/runtime/grammar.py`)
too, and the log-probabilities of the tokens it emits taken.

Verification against the processed target keeps speculation lossless with these options. A request's rows are its
last token's, then one per draft; row r predicts the token after the request's tokens so far and drafts[:r], and is
processed as if those drafts had been emitted: the sampler verifies every draft against the distribution
target-only decoding would use at that position. The drafter proposes from its unprocessed MTP head; its drafts
are only accepted less often.

Terms: a request's *history* is every token before its next one (prompt, then output, its last token included);
its first `num_prompt_tokens` are the prompt. Log-probabilities are the raw target's (log-softmax of the logits
before penalties, temperature, top-k and top-p: vLLM's default `raw_logprobs`).

A step where no request uses any of this runs none of it (`plan_logits` returns None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specsplit.client.results import TokenLogprobs
from specsplit.runtime.grammar import apply_masks
from specsplit.verifier.batch import Sampling


@dataclass(frozen=True)
class LogitsOptions:
    """One request's options that touch its logits (from its `Sampling`)."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_token_ids: tuple[int, ...] = ()  # masked while fewer than min_tokens output tokens are out
    logprobs: int | None = None  # None: none; N: the emitted token's and the top N
    grammar: str | None = None  # structured output (`specsplit/runtime/grammar.py`)

    @classmethod
    def of(cls, sp: Sampling) -> LogitsOptions | None:
        """The options of `sp`, or None when it uses none of them (the common case: nothing to do)."""
        if (
            not (sp.repetition_penalty is not None or sp.presence_penalty or sp.frequency_penalty or sp.min_tokens)
            and sp.logprobs is None
            and sp.grammar is None
        ):
            return None
        options = cls(
            repetition_penalty=1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            min_tokens=sp.min_tokens,
            end_token_ids=tuple(sp.end_token_ids),
            logprobs=sp.logprobs,
            grammar=sp.grammar,
        )
        used = options.penalized or options.min_tokens or options.logprobs is not None or options.grammar is not None
        return options if used else None

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_history(self) -> bool:
        """Its processing reads the request's history: penalties count its tokens, a grammar follows its output."""
        return self.penalized or self.grammar is not None


class TokenHistory:
    """A request's tokens for its penalties and grammar (`VerifierWorker`): its prompt, its output and the drafts it
    verifies, cut back to `num_computed_tokens` and extended in place every step (`set`), in one int64 array that
    grows by doubling, so that a step's host work is that of its new tokens. `view(n)` is its first n tokens without
    a copy: a later step writes from its own `num_computed_tokens` on (or into a new array), past a view of this
    step's history before its drafts, which the step's penalties, masks and Propose read before the next one."""

    def __init__(self, tokens=()):
        self._tokens = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self._len = len(tokens)
        self._tokens[: self._len] = tokens

    def __len__(self) -> int:
        return self._len

    def set(self, keep: int, tokens: list[int]) -> None:
        """The history becomes its first `keep` tokens, then `tokens`."""
        end = keep + len(tokens)
        if end > len(self._tokens):
            grown = np.empty(max(end, 2 * len(self._tokens)), dtype=np.int64)
            grown[:keep] = self._tokens[:keep]
            self._tokens = grown
        self._tokens[keep:end] = tokens
        self._len = end

    def view(self, n: int) -> np.ndarray:
        return self._tokens[:n]


_NO_HISTORY = np.empty(0, dtype=np.int64)


@dataclass
class RequestRows:
    """A sampling request's rows in the step's logits and what processing them needs."""

    index: int  # the request's index in the batch
    first_row: int  # its last token's row; its drafts' rows follow
    drafts: list[int]  # the drafts it verifies (one row each after the first)
    history: np.ndarray  # int64: its tokens before its last token's row's prediction (penalties, grammar; else none)
    num_prompt_tokens: int
    num_before: int  # tokens before the position its first row predicts (prompt + output so far)
    options: LogitsOptions
    allowed: np.ndarray | None = None  # grammar: [drafts + 1, words] int32 packed masks of its rows


@dataclass
class LogitsPlan:
    """The step's requests with options (`plan_logits`); `fill_masks`: fills the grammar masks of its constrained
    requests' rows (`RequestRows.allowed`), called by `apply` once the step's forward is queued, so that on a GPU the
    host computes them while the forward runs."""

    requests: list[RequestRows]
    fill_masks: Callable[[], None] | None = None

    @property
    def logprob_requests(self) -> list[RequestRows]:
        return [r for r in self.requests if r.options.logprobs is not None]


@dataclass
class LaunchedLogprobs:
    """Log-probabilities of a launched step, on the device until `to_host`."""

    requests: list[RequestRows]
    logprobs: torch.Tensor  # [R, V] float32 log-softmax of the raw rows
    top_values: torch.Tensor | None  # [R, N] of the most likely tokens (N the most any request asked), or None
    top_ids: torch.Tensor | None

    def chosen(self, sampled: torch.Tensor, sampling_slot: dict[int, int]) -> torch.Tensor:
        """[R] the log-probability of the token each row emitted (`sampled`: the sampler's [num_sampling,
        max_num_draft + 1] output, padded past num_sampled with a negative id; `sampling_slot`: each request's
        row in it). Rows past a request's emitted tokens get a value of an arbitrary token; `to_host` drops them."""
        slots, offsets = [], []
        for req in self.requests:
            slots += [sampling_slot[req.index]] * (len(req.drafts) + 1)
            offsets += range(len(req.drafts) + 1)
        device = sampled.device
        tokens = sampled[torch.tensor(slots, device=device), torch.tensor(offsets, device=device)].clamp(min=0)
        return self.logprobs.gather(1, tokens[:, None])[:, 0]


def plan_logits(
    sampling_indices: list[int],  # batch index of each sampling request, in the sampler's order
    num_drafts: list[int],  # per sampling request
    token_ids: list[list[int]],  # per request of the batch
    num_computed_tokens: list[int],  # per request of the batch
    options: list[LogitsOptions | None],  # per request of the batch
    num_prompt_tokens: list[int],  # per request of the batch
    histories: dict[int, np.ndarray],  # batch index -> history (`TokenHistory.view`), for the requests that read it
) -> LogitsPlan | None:
    """Which rows of the step's logits need processing, and how; None when none does."""
    requests, row = [], 0
    for j, i in enumerate(sampling_indices):
        d = num_drafts[j]
        if options[i] is not None:
            tokens = token_ids[i]
            num_before = num_computed_tokens[i] + len(tokens) - d
            drafts = tokens[len(tokens) - d :]
            history = histories.get(i, _NO_HISTORY)
            requests.append(RequestRows(i, row, drafts, history, num_prompt_tokens[i], num_before, options[i]))
        row += d + 1
    return LogitsPlan(requests) if requests else None


def take_logprobs(logits: torch.Tensor, plan: LogitsPlan) -> LaunchedLogprobs | None:
    """The raw rows' log-softmax (and top alternatives) of the requests that asked; before `apply`."""
    requests = plan.logprob_requests
    if not requests:
        return None
    rows = [r.first_row + k for r in requests for k in range(len(r.drafts) + 1)]
    rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows_t).float(), dim=-1)  # [R, V]
    n = max(r.options.logprobs for r in requests)
    top_values = top_ids = None
    if n > 0:
        top_values, top_ids = logprobs.topk(min(n, logprobs.shape[1]), dim=-1)
    return LaunchedLogprobs(requests, logprobs, top_values, top_ids)


def apply(logits: torch.Tensor, plan: LogitsPlan) -> None:
    """Penalties, min_tokens and grammar masks, in place on `logits` ([num_logits, V], the step's sampling rows)."""
    if plan.fill_masks is not None:
        plan.fill_masks()
    penalized = [r for r in plan.requests if r.options.penalized]
    if penalized:
        _apply_penalties(logits, penalized)
    constrained = [r for r in plan.requests if r.allowed is not None]
    if constrained:
        _apply_grammar(logits, constrained)
    masked_rows, masked_ids = [], []
    for r in plan.requests:
        o = r.options
        if not o.min_tokens or not o.end_token_ids:
            continue
        for k in range(len(r.drafts) + 1):
            if r.num_before + k - r.num_prompt_tokens < o.min_tokens:  # output tokens before this row's
                masked_rows += [r.first_row + k] * len(o.end_token_ids)
                masked_ids += o.end_token_ids
    if masked_rows:
        device = logits.device
        logits[torch.tensor(masked_rows, device=device), torch.tensor(masked_ids, device=device)] = float("-inf")


def _apply_grammar(logits: torch.Tensor, requests: list[RequestRows]) -> None:
    rows = [r.first_row + k for r in requests for k in range(r.allowed.shape[0])]
    apply_masks(logits, rows, np.concatenate([r.allowed for r in requests]))


def _apply_penalties(logits: torch.Tensor, requests: list[RequestRows]) -> None:
    """vLLM's order and formulas: repetition (on prompt and output tokens: a positive logit divided by the
    penalty, a negative one multiplied), then frequency (minus penalty x the token's count in the output) and
    presence (minus penalty if it is in the output at all).

    A request's output counts and prompt tokens are scattered once, into a row of its own, from its history as one
    array; each of its rows takes that row, plus the drafts before it. The host's work per request is then one
    array of its history, not a list of every token per row (which took about 0.1 s a step at batch 32, k 3 and
    6,000 tokens of history: `benchmarks/penalties.py`)."""
    device, vocab = logits.device, logits.shape[1]
    rows, request_of_row, draft_rows, draft_ids = [], [], [], []
    rep, freq, pres = [], [], []
    output_ids, output_of, prompt_ids, prompt_of = [], [], [], []
    for j, r in enumerate(requests):
        history = np.asarray(r.history, dtype=np.int64)  # the worker's is one already
        output_ids.append(history[r.num_prompt_tokens :])
        prompt_ids.append(history[: r.num_prompt_tokens])
        output_of.append(np.full(len(output_ids[-1]), j, dtype=np.int64))
        prompt_of.append(np.full(len(prompt_ids[-1]), j, dtype=np.int64))
        for k in range(len(r.drafts) + 1):
            n = len(rows)
            rows.append(r.first_row + k)
            request_of_row.append(j)
            draft_rows += [n] * k  # the drafts before this row's token count as output
            draft_ids += r.drafts[:k]
            rep.append(r.options.repetition_penalty)
            freq.append(r.options.frequency_penalty)
            pres.append(r.options.presence_penalty)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    x = logits.index_select(0, rows_t).float()  # [R, V]
    per_request = torch.tensor(request_of_row, dtype=torch.int64, device=device)
    counts = _scatter(len(requests), vocab, output_of, output_ids, torch.float32, device).index_select(0, per_request)
    if draft_ids:
        index = (torch.tensor(draft_rows, device=device), torch.tensor(draft_ids, device=device))
        counts.index_put_(index, torch.ones(len(draft_ids), device=device), accumulate=True)
    in_prompt = _scatter(len(requests), vocab, prompt_of, prompt_ids, torch.bool, device).index_select(0, per_request)
    rep_t = torch.tensor(rep, device=device)[:, None]
    seen = in_prompt | (counts > 0)
    penalty = torch.where(seen, rep_t, torch.ones_like(rep_t))
    x = torch.where(x > 0, x / penalty, x * penalty)
    x -= torch.tensor(freq, device=device)[:, None] * counts
    x -= torch.tensor(pres, device=device)[:, None] * (counts > 0).float()
    logits.index_copy_(0, rows_t, x.to(logits.dtype))


def _scatter(num_rows: int, vocab: int, rows: list[np.ndarray], ids: list[np.ndarray], dtype, device) -> torch.Tensor:
    """[num_rows, vocab] of `dtype` on `device`: per pair of `rows` and `ids`, float32 counts of each id in its row,
    or bool presence."""
    out = torch.zeros(num_rows, vocab, dtype=dtype, device=device)
    flat_ids = np.concatenate(ids)
    if not len(flat_ids):
        return out
    index = (torch.from_numpy(np.concatenate(rows)).to(device), torch.from_numpy(flat_ids).to(device))
    if dtype == torch.bool:
        out[index] = True
    else:
        out.index_put_(index, torch.ones(len(flat_ids), dtype=dtype, device=device), accumulate=True)
    return out


def logprobs_to_host(
    launched: LaunchedLogprobs,
    chosen: torch.Tensor,  # [R] `LaunchedLogprobs.chosen`
    num_sampled: list[int],  # per sampling request
    sampling_slot: dict[int, int],  # batch index -> sampling request
    num_reqs: int,
    sampled_token_ids: list[list[int]],  # per request of the batch
) -> list[list[TokenLogprobs] | None]:
    """Per request of the batch: one TokenLogprobs per emitted token (None where none was asked)."""
    chosen_h = chosen.tolist()
    values = launched.top_values.tolist() if launched.top_values is not None else None
    ids = launched.top_ids.tolist() if launched.top_ids is not None else None
    out: list[list[TokenLogprobs] | None] = [None] * num_reqs
    row = 0
    for r in launched.requests:
        n_top = r.options.logprobs
        emitted = num_sampled[sampling_slot[r.index]]
        entries = []
        tokens = sampled_token_ids[r.index]
        for k in range(emitted):
            top = ()
            if n_top and values is not None:
                top = tuple(zip(ids[row + k][:n_top], values[row + k][:n_top]))
            entries.append(TokenLogprobs(tokens[k], chosen_h[row + k], top))
        out[r.index] = entries
        row += len(r.drafts) + 1
    return out
