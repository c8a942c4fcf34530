"""The Propose of a verifier step: one builder of its items for both kinds (`build_propose`), the finished step's
(each request's next tokens and rejections, its rows on the host) and a device hand-off's (each request's row count;
its tokens stay on the device), and the batch that splits them by drafter replica (`ProposeBatch`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specsplit.proto import drafter_pb2
from specsplit.runtime.grammar import token_list
from specsplit.verifier.batch import CachedPrefixes, Sampling


@dataclass
class ProposeBatch:
    """One iteration's drafter input before it is split by replica."""

    iteration: int
    items: Sequence[drafter_pb2.ProposeItem]  # per request, batch order
    row_offsets: list[int]  # [num_reqs + 1]: request i's hidden-state rows are [off[i], off[i+1])
    hidden_states: torch.Tensor  # [num_rows, hidden_size]
    # A device hand-off: the step's sampled tokens still on the device, items with num_rows.
    sampled: torch.Tensor | None = None  # [num_reqs, width]
    num_sampled: torch.Tensor | None = None  # [num_reqs]
    # The Propose of every request, built with the items (`items` are its requests): the first `message` of
    # them all is this one, no copy of each item made.
    request: drafter_pb2.ProposeRequest | None = None
    # Structured output: the constrained requests, whose output the drafter follows (`build_propose`).
    constrained: list[str] = field(default_factory=list)

    @property
    def hidden_state_bytes(self) -> int:
        return self.hidden_states.numel() * self.hidden_states.element_size()

    def rows(self, indices: list[int]) -> torch.Tensor:
        """[rows of the requests at `indices`, hidden_size], batch order kept."""
        if len(indices) == len(self.items):
            return self.hidden_states
        off = self.row_offsets
        return torch.cat([self.hidden_states[off[i] : off[i + 1]] for i in indices])

    def message(
        self, indices: list[int], finished: list[str], cached: list[tuple[str, int, bytes]] = ()
    ) -> drafter_pb2.ProposeRequest:
        """The Propose call for the requests at `indices`, without its hidden states (the transport adds them), with
        the frees and the prefix cache's registrations queued for its drafter."""
        if self.request is not None and len(indices) == len(self.items):
            msg, self.request = self.request, None  # the caller fills it in: given once
            msg.finished_request_ids.extend(finished)
        else:
            msg = drafter_pb2.ProposeRequest(
                iteration=self.iteration, requests=[self.items[i] for i in indices], finished_request_ids=finished
            )
        for rid, index, key in cached:
            msg.cached_blocks.add(request_id=rid, block_index=index, block_hash=key)
        return msg


def build_propose(
    iteration: int,
    req_ids: Sequence[str],
    start_positions: Sequence[int],
    num_spec_tokens: Sequence[int],
    sampling: Sequence[Sampling],
    hidden_states: torch.Tensor,
    *,
    next_token_ids: Sequence[Sequence[int]] | None = None,
    num_rejected: Sequence[int] | None = None,
    num_rows: Sequence[int] | None = None,
    sampled: torch.Tensor | None = None,
    num_sampled: torch.Tensor | None = None,
    grammar_outputs: dict[int, list[int]] | None = None,
    sampled_token_ids: Sequence[Sequence[int]] | None = None,
    outputs_sent: SentOutputs | None = None,
    cached_prefixes: CachedPrefixes | None = None,
) -> ProposeBatch:
    """The Propose of a step's requests: per request its id, the position its rows start at, the drafts it wants and
    what the drafter reads of its sampling; then either a finished step's `next_token_ids` (one row each) and
    `num_rejected`, or a device hand-off's `num_rows` with its `sampled` tokens and `num_sampled` on the device.
    `grammar_outputs`: batch index -> a constrained request's output before this step, sent with its grammar so that
    the drafter masks its drafts too, with the step's tokens after it (`sampled_token_ids`, a finished step's; on a
    device hand-off the drafter reads them from the device). `outputs_sent`: what each request's earlier Proposes
    carried, which its drafter followed: only the output past it is sent (`SentOutputs`); None: the whole output.
    `cached_prefixes`: the drafter's keys of the cached blocks requests started on, taken for the requests of this
    Propose."""
    msg = drafter_pb2.ProposeRequest(iteration=iteration)
    add = msg.requests.add
    hand_off = num_rows is not None
    constrained = []
    sent = outputs_sent if outputs_sent is not None else SentOutputs()
    for i, rid in enumerate(req_ids):
        item = add()  # fields set one by one: a ProposeItem(...) copied in costs several times more
        item.request_id = rid
        item.start_position = start_positions[i]
        item.num_spec_tokens = num_spec_tokens[i]
        if hand_off:
            item.num_rows = num_rows[i]
        else:
            item.next_token_ids.extend(next_token_ids[i])
            item.num_rejected = num_rejected[i]
        sp = sampling[i]
        # What the drafter reads of a request's sampling: a sampled request's temperature, seed and coupling (a greedy
        # one's temperature is 0, unset); not the rest (penalties, end tokens), which only the verifier applies.
        if sp.temperature:
            item.sampling.temperature = sp.temperature
            if sp.seed is not None:
                item.sampling.seed = sp.seed
            if sp.coupled:
                item.sampling.coupled = True
        if grammar_outputs and i in grammar_outputs:  # structured output: the drafter masks its drafts too
            item.sampling.grammar = sp.grammar
            step_tokens = sampled_token_ids[i] if sampled_token_ids is not None else ()
            item.output_offset, tail = sent.tail(rid, grammar_outputs[i], step_tokens)
            item.output_token_ids.extend(tail)
            constrained.append(rid)
        if cached_prefixes is not None:
            item.cached_block_hashes.extend(cached_prefixes.take(rid, start_positions[i]))
    offsets = [0, *itertools.accumulate(num_rows if hand_off else map(len, next_token_ids))]
    return ProposeBatch(iteration, msg.requests, offsets, hidden_states, sampled, num_sampled, msg, constrained)


class SentOutputs:
    """Structured output: per constrained request, the output its Proposes carried so far, which its drafter followed;
    the next Propose carries only what comes after (`ProposeItem.output_offset`). A request dropped (freed, its
    Propose failed, its drafter lacked its output: restarted, another replica) has its next Propose carry it whole.
    The verifier's `DrafterChannel` and the in-process `LocalDrafter` keep one each."""

    def __init__(self):
        self._sent: dict[str, int] = {}

    def tail(self, request_id: str, output: Sequence[int], step_tokens: Sequence[int] = ()) -> tuple[int, list[int]]:
        """What the request's Propose carries of its output (`output`, then `step_tokens`: a finished step's, which a
        hand-off's drafter reads from the device instead): (offset, the tokens from there), the offset being what its
        earlier Proposes carried, which becomes what this one carries."""
        offset = self._sent.get(request_id, 0)
        if offset > len(output):  # not this output's (its request started over): the whole of it
            offset = 0
        tail = token_list(output, offset)  # a list, or the worker's history (`TokenHistory.view`)
        if step_tokens:
            tail += step_tokens
        self._sent[request_id] = offset + len(tail)
        return offset, tail

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)

    def clear(self) -> None:
        self._sent.clear()
