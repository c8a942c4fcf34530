"""Structured output's masks: each constrained request's grammar matcher, and the masks of its rows; the verifier's
and the drafter's alike.

The coordinator compiles a request's `structured_output` into one llguidance grammar (`Sampling.grammar`). The
verifier masks the target's logits with it, row by row, before rejection sampling, as
`specsplit/verifier/logits_processors.py` applies penalties: row r of a request is masked with the grammar's state
after its output so far and drafts[:r], as if those drafts had been emitted. A draft the grammar does not allow at its
row has no probability there and is rejected, and every token the sampler emits is one the grammar allows, so
verification stays lossless against target-only decoding under the same constraint. Once the grammar is complete
only EOS is allowed. The drafter masks its MTP logits the same way, one draft after another
(`specsplit/drafter/runner.py`), so that its drafts are ones the grammar allows: unmasked, about half of them were not
(docs/performance.md, "Structured output"). Its grammar leaves a JSON schema's loose string length bounds out
(`draft_grammar`): their masks are the slowest to fill, and a draft past one is rejected by the verifier's exact mask.

A request's matcher follows its output (the history the worker keeps for it, prompt excluded): what the matcher has
followed is compared with the output at every step, the new tokens are consumed, and a history that went another way
(a preemption, a re-prefill after a restart) starts a fresh matcher over the whole output. The drafter is sent the
output past what the request's earlier Proposes carried (`ProposeItem.output_offset`), and compares only what it
followed past there: its cost per Propose is that of the new tokens, not of the output's length. Drafts are consumed
to mask the rows after them and rolled back. Masks are llguidance's packed bitmasks: int32 words, bit i of word w
allowing token 32 w + i.
"""

from __future__ import annotations

import functools
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specsplit.client.errors import InvalidArgument
from specsplit.kernels.grammar_mask import BITS, apply_masks_reference, apply_masks_triton

IDLE_MATCHERS = 256  # finished requests' matchers kept for reuse (`Grammars._recycle`), about 0.2 MB each


@dataclass
class _Matcher:
    grammar: str
    matcher: object  # llguidance.LLMatcher
    followed: list[int] = field(default_factory=list)  # the output tokens it has followed: consumed up to an EOS
    ended: bool = False  # it followed an EOS: what came after was kept, not consumed


class MissingOutput(Exception):
    """A request's output came from an offset its matcher had not followed up to (`Grammars._matcher`)."""


class Grammars:
    """The constrained requests' matchers, over the tokenizer of the checkpoint at `tokenizer_dir` (loaded at the
    first constrained request: a verifier serving none needs no tokenizer), or over `tokenizer`, an
    llguidance.LLTokenizer given as it is."""

    def __init__(self, tokenizer_dir: str | Path | None, tokenizer=None):
        self.tokenizer_dir = tokenizer_dir
        self._tokenizer = tokenizer  # llguidance.LLTokenizer
        self._eos: frozenset[int] | None = None  # the tokenizer's EOS ids (`eos`)
        self._matchers: dict[str, _Matcher] = {}
        # Finished requests' matchers, reset, per grammar (least recently used first), for the next requests of it.
        self._idle: OrderedDict[str, list[object]] = OrderedDict()
        self._num_idle = 0
        self._executor = None  # llguidance.LLExecutor, made at the first masks
        self._builders = None  # threads making new requests' matchers (`_make_matchers`)
        # Drafts whose rows were masked, and those of them the grammar did not allow (rejected whatever the target
        # says): none while the drafter masks its drafts too (benchmarks/structured_output.py compares unmasked ones).
        self.checked = self.refused = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            if self.tokenizer_dir is None:
                raise InvalidArgument("structured output needs the checkpoint's tokenizer, which this verifier lacks")
            try:
                hf = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
            except (OSError, ValueError) as err:
                raise InvalidArgument(
                    f"structured output needs a tokenizer; none loads from {self.tokenizer_dir}: {err}"
                ) from None
            self._tokenizer = llguidance.hf.from_tokenizer(hf)
        return self._tokenizer

    @property
    def words(self) -> int:
        """int32 words of a mask."""
        return -(-self.tokenizer.vocab_size // BITS)

    @property
    def executor(self):
        """llguidance's executor, whose threads fill a batch's masks in parallel (dropping the GIL)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    @property
    def eos(self) -> frozenset[int]:
        if self._eos is None:
            self._eos = frozenset(self.tokenizer.eos_tokens)
        return self._eos

    def masks(self, request_id: str, grammar: str, output: list[int], drafts: list[int]) -> np.ndarray:
        """[len(drafts) + 1, words] int32: the tokens the grammar allows at each of the request's rows (`batch_masks`
        for one request)."""
        return self.batch_masks([(request_id, grammar, output, drafts)])[0]

    def batch_masks(
        self, requests: list[tuple[str, str, Sequence[int], list[int]]], kept: list[int] | None = None
    ) -> list[np.ndarray]:
        """Per (request id, grammar, output, drafts): [len(drafts) + 1, words] int32, the tokens the grammar allows
        at each of the request's rows. The output is a list or an int64 array; `kept`, per request, how many of its
        tokens are those its earlier calls gave (the verifier's history up to its num_computed_tokens): only what
        comes after them, and after what its matcher followed, is read (`_follow`); none where not given. Rows after a
        draft the grammar does not allow allow everything (nothing is emitted there: that draft is rejected). Rows
        after an EOS draft get the EOS row's mask: the matcher follows the output up to its first EOS (`_matcher`), so
        under ignore_eos what follows an EOS is masked as the EOS was, as target-only decoding masks it. The masks of
        every row are computed in parallel (llguidance's executor threads, which drop the GIL)."""
        import llguidance.numpy

        eos = self.eos
        self._make_matchers([(request_id, grammar) for request_id, grammar, _, _ in requests])
        jobs, firsts, after_eos = [], [], []
        total = 0
        for j, (request_id, grammar, output, drafts) in enumerate(requests):
            m = self._follow(request_id, grammar, output, kept[j] if kept is not None else 0)
            valid = m.matcher.validate_tokens(drafts)  # the leading drafts the grammar allows (an EOS not counted)
            used = drafts[:valid]
            if used and used[-1] in eos:
                used = used[:-1]
            ends = len(used) < len(drafts) and drafts[len(used)] in eos  # no row after an EOS matters
            self.checked += min(len(used) + 1, len(drafts))
            self.refused += len(used) < len(drafts) and not ends
            jobs.append((m.matcher, total, used))  # masks its rows total .. total + len(used)
            firsts.append(total)
            if ends:  # the EOS row, and the rows after it
                after_eos.append((total + len(used), total + len(drafts) + 1))
            total += len(drafts) + 1
        out = np.full((total, self.words), -1, dtype=np.int32)
        plain = [(matcher, row) for matcher, row, used in jobs if not used]  # llguidance takes no empty draft list
        drafted = [job for job in jobs if job[2]]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, plain, out)
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, out)
        for row, end in after_eos:
            out[row + 1 : end] = out[row]
        return [out[first : first + len(r[3]) + 1] for first, r in zip(firsts, requests)]

    def _make_matchers(self, requests: list[tuple[str, str]]) -> None:
        """Matchers for the (request id, grammar) pairs that have none for that grammar yet (a batch's new requests),
        parsed together: llguidance drops the GIL while it builds one (about 0.4-0.6 ms for a JSON schema at a
        152k vocabulary, docs/performance.md "Structured output"), so threads build them side by side; `_matcher`
        then finds them; a lone one is built here on the calling thread."""
        new = {rid: g for rid, g in requests if (m := self._matchers.get(rid)) is None or m.grammar != g}
        for rid, grammar in list(new.items()):
            self._recycle(self._matchers.pop(rid, None))  # another grammar's
            if (matcher := self._take_idle(grammar)) is not None:
                self._matchers[rid] = _Matcher(grammar, matcher)
                del new[rid]
        if not new:
            return
        import llguidance

        tokenizer = self.tokenizer

        def build(grammar: str):
            # A matcher of its own, parsed from the grammar. llguidance's `deep_copy` of one kept per grammar is
            # about a hundred times cheaper to make, but the copies share one lexer behind one lock: with them the
            # executor's threads took 3.3x as long for a batch's masks at batch 32 and 128 on a 16-core GPU host
            # (`benchmarks/structured_output.py`, docs/performance.md "Structured output").
            return llguidance.LLMatcher(tokenizer, grammar)

        if len(new) == 1:
            made = map(build, new.values())
        else:
            if self._builders is None:
                self._builders = ThreadPoolExecutor(min(32, os.cpu_count() or 1), thread_name_prefix="grammar")
            made = self._builders.map(build, new.values())
        for (rid, grammar), matcher in zip(new.items(), made):
            self._matchers[rid] = _Matcher(grammar, matcher)

    def _recycle(self, m: _Matcher | None) -> None:
        """Keeps a finished request's matcher, reset, for the next request of its grammar (at most `IDLE_MATCHERS`;
        those of the grammar whose last request finished longest ago are dropped first). Reset, a matcher keeps the
        lexer states it built while it ran, which a new one builds again over its first steps: a batch of new
        requests' first steps cost several times their later ones (`benchmarks/structured_output.py`,
        docs/performance.md "Structured output"). A copy of one matcher kept per grammar (`deep_copy`) would share
        its lexer with the others, behind one lock (`_make_matchers`)."""
        if m is None or m.matcher.is_error() or not m.matcher.reset():
            return
        self._idle.setdefault(m.grammar, []).append(m.matcher)
        self._idle.move_to_end(m.grammar)
        self._num_idle += 1
        while self._num_idle > IDLE_MATCHERS:
            self._take_idle(next(iter(self._idle)))

    def _take_idle(self, grammar: str):
        """A kept matcher of `grammar` (`_recycle`), taken out of the kept ones; None where none is kept."""
        idle = self._idle.get(grammar)
        if idle is None:
            return None
        matcher = idle.pop()
        self._num_idle -= 1
        if not idle:
            del self._idle[grammar]
        return matcher

    def _follow(self, request_id: str, grammar: str, output: Sequence[int], kept: int) -> _Matcher:
        """`_matcher` over the whole `output` (a list or an int64 array), of which the first `kept` tokens are those the
        caller gave before: what the matcher followed of them is not read again. Where the output went another way
        within what it followed past them, a fresh matcher follows the whole output."""
        m = self._matchers.get(request_id)
        offset = min(len(m.followed), kept) if m is not None and m.grammar == grammar else 0
        if offset:
            try:
                return self._matcher(request_id, grammar, token_list(output, offset), offset)
            except MissingOutput:
                pass
        return self._matcher(request_id, grammar, token_list(output, 0))

    def _matcher(self, request_id: str, grammar: str, output: list[int], offset: int = 0) -> _Matcher:
        """The request's matcher, having followed its output, which is `output` after its first `offset` tokens: those
        the matcher followed before (the drafter is sent the output past what its earlier Proposes carried, `offset`
        then the length they had; the verifier passes the whole output). What the matcher followed past `offset` is
        compared with `output`; an output that went another way starts a fresh matcher where the whole output is
        here, and raises `MissingOutput` where it is not (`offset` > 0). The output is consumed up to its first EOS
        (the request ends there: what a step emitted past it is kept, not consumed). Only the new tokens are consumed
        and looked at for an EOS, so a step's cost is that of its new tokens, plus, with `offset` 0, a comparison of
        the whole output."""
        m = self._matchers.get(request_id)
        seen = len(m.followed) if m is not None else 0
        if (
            m is None
            or m.grammar != grammar
            or not offset <= seen <= offset + len(output)
            or m.followed[offset:] != output[: seen - offset]
        ):  # none yet, another grammar, or an output that went another way
            if offset:
                raise MissingOutput(request_id)
            self._recycle(self._matchers.pop(request_id, None))
            self._make_matchers([(request_id, grammar)])
            m, seen = self._matchers[request_id], 0
        new = output[seen - offset :]
        if not new:
            return m
        if not m.ended:
            eos = self.eos
            taken = new
            if not eos.isdisjoint(new):
                taken = new[: next(j for j, t in enumerate(new) if t in eos)]
                m.ended = True
            if taken and m.matcher.try_consume_tokens(taken) != len(taken):
                del self._matchers[request_id]
                raise InvalidArgument(
                    f"request {request_id!r}: its output does not follow its grammar "
                    f"({m.matcher.get_error() or 'a token the grammar does not allow'})"
                )
        m.followed += new
        if m.matcher.is_error():
            raise InvalidArgument(f"request {request_id!r}: grammar error: {m.matcher.get_error()}")
        return m

    def free(self, request_ids) -> None:
        for rid in request_ids:
            self._recycle(self._matchers.pop(rid, None))

    def clear(self) -> None:
        self.free(list(self._matchers))


def token_list(tokens: Sequence[int], start: int) -> list[int]:
    """tokens[start:] as a list of ints (from a list, or an int64 array)."""
    tail = tokens[start:]
    return tail if isinstance(tail, list) else tail.tolist()


# A JSON schema's string length bounds of at least LOOSE_LENGTH characters, which the drafter's masks leave out
# (`draft_grammar`), and the keys of a schema whose values are schemas, lists of schemas, or maps of names to schemas.
LENGTH_BOUNDS = ("maxLength", "minLength")
LOOSE_LENGTH = 32
_SCHEMA_KEYS = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_KEYS += ("propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@functools.lru_cache(maxsize=256)
def draft_grammar(grammar: str) -> str:
    """The grammar the drafter masks its drafts with: `grammar` with its JSON schemas' loose string length bounds
    (`maxLength`, `minLength` of `LOOSE_LENGTH` characters or more) left out, every other grammar as it is. Within a
    length-bounded string each length is a lexer state of its own, whose first mask walks the vocabulary's trie
    (0.3-1.5 ms a row at a 152k vocabulary on the 2-core CPU, against 0.07-0.16 ms unbounded:
    `benchmarks/draft_masks.py`), and a batch's masks wait for their slowest row while the device waits for the
    masks; a loose bound is seldom reached, so its drafts rarely cross it, while a tight one is reached often and kept
    (docs/performance.md, "Structured output", has both). A draft past a bound is one the verifier's exact mask
    refuses: it is rejected there, lossless as every other draft."""
    try:
        top = json.loads(grammar)
    except ValueError:
        return grammar
    if not isinstance(top, dict) or not isinstance(top.get("grammars"), list):
        return grammar
    changed = False
    for entry in top["grammars"]:
        if isinstance(entry, dict) and "json_schema" in entry:
            changed |= _drop_length_bounds(entry["json_schema"])
    return json.dumps(top) if changed else grammar


def _drop_length_bounds(schema) -> bool:
    """Removes the loose `LENGTH_BOUNDS` from `schema` and the schemas within it, in place; whether any was there."""
    if not isinstance(schema, dict):
        return False
    changed = False
    for key in LENGTH_BOUNDS:
        bound = schema.get(key)
        if isinstance(bound, int | float) and bound >= LOOSE_LENGTH:
            del schema[key]
            changed = True
    for key in _SCHEMA_KEYS:
        changed |= _drop_length_bounds(schema.get(key))
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                changed |= _drop_length_bounds(sub)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                changed |= _drop_length_bounds(sub)
    return changed


class DraftMasks:
    """One Propose's masks, for the drafter: each constrained request's matcher follows its output once, then the
    drafts the Propose makes for it, each consumed once as it comes (not the drafts so far again at every step), and
    all of them rolled back at `close`, which leaves the matcher at the output. `requests`: per key (the caller's
    index of the request), its (request id, grammar, output from `offset` on, offset); its matcher is one of
    `draft_grammar(grammar)`. A request whose output that grammar refuses (which verification would not have let
    through: its error is in `errors`), one whose matcher had not followed its output up to its offset (`wanted`: the
    caller asks for the whole output), or one of whose drafts it refuses (a row drafted unmasked), allows everything
    from then on."""

    def __init__(self, grammars: Grammars, requests: dict[int, tuple[str, str, list[int], int]]):
        self._grammars = grammars
        self._matchers: dict[int, object] = {}  # llguidance.LLMatcher per key still masked
        self._consumed: dict[int, int] = {}  # per key, the drafts its matcher consumed
        self._ended: set[int] = set()  # keys past an EOS draft: masked as their EOS row was (`Grammars.batch_masks`)
        self.errors: dict[int, InvalidArgument] = {}
        self.wanted: list[int] = []  # keys whose output before their offset the matcher did not follow
        requests = {key: (rid, draft_grammar(g), output, at) for key, (rid, g, output, at) in requests.items()}
        self._requests = {key: (rid, g) for key, (rid, g, _, _) in requests.items()}  # for `follow`
        # New requests' matchers made together (their whole output is here); one missing past an offset is not made.
        grammars._make_matchers([(rid, grammar) for rid, grammar, _, at in requests.values() if not at])
        for key, (rid, grammar, output, offset) in requests.items():
            try:
                self._matchers[key] = grammars._matcher(rid, grammar, output, offset).matcher
                self._consumed[key] = 0
            except InvalidArgument as err:
                self.errors[key] = err
            except MissingOutput:
                self.wanted.append(key)

    def follow(self, tokens: dict[int, list[int]]) -> None:
        """Each key's output grows by `tokens[key]` (a device hand-off's step, read from the device once the matchers
        had followed what the Propose carried, so that the device's wait for the step hides that part). Before any
        fill. A key whose grammar refuses them (which verification would not have let through) allows everything."""
        for key, new in tokens.items():
            if key not in self._matchers or not new:
                continue
            rid, grammar = self._requests[key]
            followed = len(self._grammars._matchers[rid].followed)
            try:
                self._matchers[key] = self._grammars._matcher(rid, grammar, new, followed).matcher
            except InvalidArgument as err:
                del self._matchers[key], self._consumed[key]
                self.errors[key] = err

    def fill(self, jobs: list[tuple[int, int, list[int]]], out: np.ndarray) -> None:
        """Per job (row, key, the drafts this Propose made for the key so far), row `row` of `out` ([rows, words]
        int32, C-contiguous): what the key's grammar allows after its output and those drafts (drafts past an EOS left
        out); all ones where it allows everything. The rows are filled in parallel (llguidance's executor)."""
        import llguidance.numpy

        eos = self._grammars.eos
        fill = []
        consumed, ended = self._consumed, self._ended
        for row, key, drafts in jobs:
            matcher = self._matchers.get(key)
            if matcher is not None and len(drafts) > consumed[key] and key not in ended:
                new = drafts[consumed[key] :]
                stop = len(new) if eos.isdisjoint(new) else next(j for j, t in enumerate(new) if t in eos)
                taken = matcher.try_consume_tokens(new[:stop]) if stop else 0
                consumed[key] += taken
                if taken < stop:  # a draft its grammar refuses: unmasked from here on
                    self._release(key)
                    matcher = None
                elif stop < len(new):
                    ended.add(key)
            if matcher is None:
                out[row] = -1
            else:
                fill.append((matcher, row))
        if fill:
            llguidance.numpy.fill_next_token_bitmask_par(self._grammars.executor, fill, out)

    def close(self) -> None:
        """Every consumed draft rolled back."""
        for key in list(self._matchers):
            self._release(key)

    def _release(self, key: int) -> None:
        matcher, consumed = self._matchers.pop(key), self._consumed.pop(key)
        if consumed:
            matcher.rollback(consumed)


def apply_masks(
    logits: torch.Tensor, rows: list[int], words: np.ndarray, column_ids: torch.Tensor | None = None
) -> None:
    """-inf in `logits` ([N, V]) at rows `rows` wherever their packed masks `words` ([len(rows), W] int32) do not
    allow the token (ids past the masks' words included); a column is its token, or `column_ids`' ([V] int64: a
    draft vocabulary's). The masks travel to the device as they are (32 ids per word), in one copy (`upload_masks`),
    and are applied there: by one Triton kernel on a GPU (`specsplit/kernels/grammar_mask.py`), by torch ops
    elsewhere."""
    apply_packed(logits, upload_masks(rows, words, logits.device), column_ids)


def apply_packed(logits: torch.Tensor, packed: torch.Tensor, column_ids: torch.Tensor | None = None) -> None:
    """The masks of `packed` ([R, 1 + W] int32 on the logits' device: each mask's logits row, then its words) applied
    to `logits`: by the Triton kernel on a GPU, by torch ops elsewhere."""
    (apply_masks_triton if logits.is_cuda else apply_masks_reference)(logits, packed, column_ids)


def upload_masks(rows: list[int], words: np.ndarray, device: torch.device) -> torch.Tensor:
    """[len(rows), 1 + W] int32 on `device`: each mask's logits row, then its words. From pinned memory without a
    wait where `device` is a GPU (torch's pinned allocator keeps the buffer until the copy is done)."""
    pinned = torch.device(device).type == "cuda"
    host = torch.empty((len(rows), 1 + words.shape[1]), dtype=torch.int32, pin_memory=pinned)
    view = host.numpy()
    view[:, 0] = rows
    view[:, 1:] = words
    return host.to(device, non_blocking=pinned)
