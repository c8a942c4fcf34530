"""propose(): the drafter's MTP steps over one iteration's hidden states.

For each request the verifier sends the target hidden states h_p of the iteration's valid
positions p and the token x_{p+1} that follows each. The drafter
1. rolls its MTP KV back to the first new position (dropping the k - 1 speculative entries of the
   previous propose, and whatever verification rejected);
2. MTP step 0: runs the MTP layer over all (h_p, x_{p+1}) pairs of the batch at once; the output
   of each request's last pair gives draft 1;
3. steps 1..k-1: reuses the MTP layer on its own output h' and the draft it just made, one
   position further, for the requests that want more drafts (on one CUDA device replayed as graphs, `later_steps.py`:
   one graph of all of them, or with grammar masks to fill on the host a graph per part; otherwise a step at a time).
A request whose history the drafter lacks (new replica, restart, or a gap after a failed call)
starts afresh at the first new position: drafts may be worse for a while, output never changes.

Prefix caching: full blocks of a request's MTP KV held from pair position 0 are registered under the drafter keys
the verifier sends (`cache_blocks`), in the cache's own pool (`PagedBlocks`: shared by reference count, evicted least
recently used first); a request the verifier started on cached blocks, whose history the drafter lacks, starts on the
MTP KV of its item's keys where the cache holds them all (`_rollback`), and afresh otherwise.

Tensor-parallel (`serve drafter --tensor-parallel-size N`, `specsplit.drafter.ranks`): rank 0's runner
broadcasts each `propose` (its items and hidden states), `free` and `cache_blocks` to the followers, whose runners
then run the same calls, keeping the same MTP cache; rank 0 alone gets the logits and picks each step's drafts, which
it broadcasts as the next step's input tokens.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specsplit.drafter.device_propose import (
    can_propose_on_device,
    fill_tokens,
    shifted,
    tokens_to_host,
    valid_rows_on_host,
)
from specsplit.drafter.draft_vocab import DraftVocabulary
from specsplit.drafter.later_steps import LaterStepsGraphs, LaterStepsRun
from specsplit.drafter.sampling import noise_seed, pick_drafts, to_ids
from specsplit.drafter.step_timer import StepTimer
from specsplit.models.attention import use_kernel_for, use_precompiled_sdpa
from specsplit.models.kv_cache import AttentionMetadata, KVCacheFull, PagedKVCache, StepPlan
from specsplit.models.mtp import MTPModule
from specsplit.models.parallel import broadcast_from_first, broadcast_tensor_from_first, tp_rank, tp_size
from specsplit.models.step_upload import StepUpload
from specsplit.runtime.cuda_graphs import resolve_step_path
from specsplit.runtime.grammar import DraftMasks, Grammars, apply_packed
from specsplit.runtime.warm_up import warm_up_eager
from specsplit.transport.base import DeviceTokens

# A sampled step's temperatures [n] float32, noise seeds [n] int64 and noise counters [n] int64 (`sampling.py`).
_Sampling = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# A step's drafts [n] int64, and for sampled steps q's support and probabilities [n, K].
_Pick = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# A later step: rows of the previous step that go on ([n] int64, None: all), attention, positions [n], sampling.
_LaterStep = tuple[torch.Tensor | None, AttentionMetadata, torch.Tensor, _Sampling | None]

log = logging.getLogger(__name__)
TABLES = 2  # the block tables' place in `StepPlan.int32_arrays`
# A constrained row whose grammar allows more than this share of the vocabulary drafts its later steps unmasked
# (`DrafterRunner._mask_grammars`).
WIDE_MASK = 0.5
# The share is estimated from about this many 64-bit words of each mask, evenly spaced (every word where a mask has
# fewer): a mask is either narrow (a JSON integer: about 700 of 152k ids) or most of the vocabulary (inside a string),
# and counting the bits of a whole mask took 0.13 ms a step at batch 32 on the H100 host, longer than a tenth of the
# MTP step it waits beside (docs/performance.md, "Structured output").
WIDE_SAMPLE = 128


@dataclass
class ProposeItem:
    request_id: str
    start_position: int  # position p of the first hidden-state row
    next_token_ids: list[int]  # x_{p+1} per row
    num_spec_tokens: int
    temperature: float = 0.0  # > 0: sampled drafts with their sparse q
    seed: int = 0
    # A device hand-off (`specsplit/drafter/device_propose.py`): the request's rows (its last token and every draft
    # verified), next_token_ids empty until propose() fills them from the device; 0 on the host path.
    num_rows: int = 0
    num_rejected: int = 0  # filled with next_token_ids on a device hand-off
    coupled: bool = False  # sampled with the verifier's noise (the seed is the user's: `sampling.py`)
    grammar: str | None = None  # structured output: its drafts are masked with this grammar (`_mask_grammars`)
    # With a grammar: the request's output so far, less its first output_offset tokens, which its earlier Proposes
    # carried. On a device hand-off it ends before the step's tokens, which the masks follow once they are read from
    # the device (`DraftMasks.follow`), or which `_add_step_tokens` adds where the hand-off is proposed on the host.
    output: list[int] = field(default_factory=list)
    output_offset: int = 0
    # Prefix caching: the drafter keys of the cached blocks the verifier started the request on (their tokens are
    # start_position), on its first Propose after that; empty otherwise.
    cached_block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class ProposeOutput:
    drafts: list[list[int]]
    # Wall-clock stamps (time.time_ns): start, MTP step 0 done, steps 1..k-1 done.
    stamps_ns: tuple[int, int, int]
    # Per request, for sampled drafts: q's support and probabilities, [num_drafts, K] each.
    draft_probs: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    # Constrained requests (their indices) whose output before their output_offset the drafter lacks: drafted without
    # their grammar; their next Propose is to carry the whole output.
    outputs_wanted: list[int] = field(default_factory=list)

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
        max_graph_tokens: int = 512,
        tokenizer_dir=None,
        draft_vocab: DraftVocabulary | None = None,
    ):
        """`attention_kernel`: MTP steps with few new tokens per request run the Triton paged
        attention (default: on CUDA, for modules that support it). `cuda_graphs`: those steps
        replay CUDA graphs (default: on CUDA with the kernel). `tokenizer_dir`: the checkpoint whose tokenizer
        structured output's grammars run over (None: constrained requests are drafted unmasked). `draft_vocab`: the
        ids the module's draft head projects onto (`draft_vocab.py`, attached to `mtp` already; None: every id)."""
        self.mtp = mtp
        self.draft_vocab = draft_vocab
        self.draft_top_k = draft_top_k
        self.kv_cache = kv_cache
        self.device = next(mtp.parameters()).device
        self._first_position: dict[str, int] = {}  # pair position held at cache index 0
        # Per request: where its exact MTP entries (step 0's, of verified tokens, never the later steps' speculative
        # ones) end before its last Propose, and that Propose's item, whose rows extend them if they start there.
        self._exact: dict[str, tuple[int, ProposeItem]] = {}
        # Prefix cache, in tokens: of the requests that came with cached block keys and no history here, the
        # positions they start at (queries) and those the cache held (hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.attention_kernel, self.graphs = resolve_step_path(
            mtp, kv_cache, attention_kernel, cuda_graphs, mtp.config.max_position_embeddings, max_graph_tokens
        )
        # Proposes on one device: steps 1..k-1 on graphs (`later_steps.py`). Not tensor-parallel: a follower's steps
        # have no logits (rank 0 picks each step's drafts and broadcasts them).
        self.later_steps = (
            LaterStepsGraphs(mtp, kv_cache, self.graphs, self._column_ids, draft_top_k)
            if self.graphs is not None and tp_size() == 1
            else None
        )
        # A constrained step's masks: filled on the host (pinned on a GPU: `_host_words`), and, for the steps not
        # replayed as the later steps' graphs, on the device with each row's index first (`apply_packed`'s layout).
        self._words: torch.Tensor | None = None
        self._step_masks: torch.Tensor | None = None
        use_precompiled_sdpa()  # eager steps: no per-shape cuDNN plan builds mid-run
        if kv_cache.device.type == "cuda":  # large eager MTP steps once, before any request waits for them

            def eager_step(ids, positions, attn):
                dtype = mtp.eh_proj.weight.dtype  # a latent (MLA) cache has no `k`
                previous = torch.zeros(ids.numel(), mtp.config.hidden_size, dtype=dtype, device=ids.device)
                return mtp.compute_logits(mtp(ids, previous, positions, kv_cache, attn)[-1:])

            steps, seconds = warm_up_eager(kv_cache, eager_step)
            log.info("drafter: %d eager warm-up steps in %.1f s", steps, seconds)
        self._upload = StepUpload(self.device)  # each step's small arrays, one pinned buffer
        self._timer = StepTimer(self.device)
        self.grammars = Grammars(tokenizer_dir)

    def free(self, request_ids: list[str]) -> None:
        if tp_size() > 1 and tp_rank() == 0:
            share_free(request_ids)
        self._free(request_ids)

    def _free(self, request_ids: list[str]) -> None:
        self.grammars.free(request_ids)
        for rid in request_ids:
            self.kv_cache.free(rid)
            self._first_position.pop(rid, None)
            self._exact.pop(rid, None)

    def cache_blocks(self, blocks: list[tuple[str, int, bytes]]) -> None:
        """Registers (request id, block index, drafter key) blocks in the MTP cache's prefix cache: each one whose
        entries the runner holds exact, of a request held from pair position 0 (a request started afresh later holds
        other entries; speculative entries, or those after a lost Propose, are not the block's); the others are
        skipped."""
        if not blocks:
            return
        if tp_size() > 1 and tp_rank() == 0:
            share_cache_blocks(blocks)
        first, size = self._first_position, self.kv_cache.block_size
        for rid, index, key in blocks:
            if first.get(rid) == 0 and (index + 1) * size <= self._exact_end(rid):
                self.kv_cache.cache_block(rid, index, key)

    def _exact_end(self, rid: str) -> int:
        """The pair position where the request's exact MTP entries end (held since its first position)."""
        end, last = self._exact[rid]
        return last.start_position + len(last.next_token_ids) if end == last.start_position else end

    def _rollback(self, item: ProposeItem) -> None:
        rid, p = item.request_id, item.start_position
        first = self._first_position.get(rid)
        cached = self.kv_cache.num_tokens(rid)
        if first is not None and first <= p <= first + cached:
            try:
                self.kv_cache.truncate(rid, p - first)
            except ValueError:  # into a block it shares with other requests, which it must not write: afresh
                pass
            else:
                self._exact[rid] = (min(self._exact_end(rid), p), item)
                return
        self._free([rid])
        self._exact[rid] = (p, item)
        keys = item.cached_block_hashes
        if keys and len(keys) * self.kv_cache.block_size == p:
            self.prefix_cache_queries += p
            if self.kv_cache.attach(rid, keys):  # the MTP KV of pair positions 0 .. p - 1
                self.prefix_cache_hits += p
                self._first_position[rid] = 0
                return
        self._first_position[rid] = p

    @property
    def _column_ids(self) -> torch.Tensor | None:
        """The draft vocabulary's id of each logits column ([N] int64 on the device); None: a column is its id."""
        return None if self.draft_vocab is None else self.draft_vocab.ids

    def _mtp_step(
        self,
        input_ids: torch.Tensor,  # [T] int64
        previous_hidden: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """MTP output [T, H]; logits [T, V] when a graph made them (None on a tensor-parallel follower's); whether
        a graph ran (its logits are made: every rank took part in their gather)."""
        if self.graphs is not None and self.graphs.can_run(attn):
            return *self.graphs.run(input_ids, positions, attn, previous_hidden), True
        return self.mtp(input_ids, previous_hidden, positions, self.kv_cache, attn), None, False

    def propose(
        self, items: list[ProposeItem], hidden_states: torch.Tensor, device_tokens: DeviceTokens | None = None
    ) -> ProposeOutput:
        """`_propose`; with a draft vocabulary, a new set installed first where its ranking is done, and the items'
        tokens counted after."""
        vocab = self.draft_vocab
        if vocab is None:
            return self._propose(items, hidden_states, device_tokens)
        vocab.swap()
        out = self._propose(items, hidden_states, device_tokens)
        vocab.observe([t for item in items for t in item.next_token_ids])
        return out

    @torch.inference_mode()
    def _propose(
        self, items: list[ProposeItem], hidden_states: torch.Tensor, device_tokens: DeviceTokens | None = None
    ) -> ProposeOutput:
        """hidden_states: [sum(len(item.next_token_ids)), hidden_size], rows in item order; on a device
        hand-off (`device_tokens`, `device_propose.py`) [sum(item.num_rows), hidden_size], valid once
        `device_tokens.wait()` is queued.

        One path: a device hand-off differs only in its step inputs. Its tokens stay on the device, step 0
        runs over every row of each request, and the later steps, planned as if every draft had been
        accepted, move back on the device by `num_sampled - rows`. The host plans each step (KV slots,
        positions, row selections) without waiting for the device, the steps are launched back to back
        and the drafts come to the host in one device→host copy at the end."""
        t0 = time.time_ns()
        if tp_size() > 1 and tp_rank() == 0:  # the followers run this call too (`specsplit.drafter.ranks`)
            hidden_states, device_tokens = share_propose(items, hidden_states, device_tokens)
        dev = device_tokens
        if dev is not None and not can_propose_on_device(self, items):
            hidden_states, dev = valid_rows_on_host(items, hidden_states, dev), None  # the host's inputs
            _add_step_tokens(items, [item.next_token_ids for item in items])
        drafts: list[list[int]] = [[] for _ in items]
        if not items:  # an iteration that only frees finished requests
            return ProposeOutput(drafts, (t0, t0, t0))
        for item in items:
            self._rollback(item)
        counts = [item.num_rows if dev is not None else len(item.next_token_ids) for item in items]
        ids = [item.request_id for item in items]
        more = [max(item.num_spec_tokens - 1, 0) for item in items]  # later steps per request
        plan = self._plan_steps(ids, counts, more)
        if plan is None:  # Out of MTP cache: drop these requests' MTP state; they continue without drafts.
            self._free(ids)
            if dev is not None:
                dev.wait()
                fill_tokens(items, *tokens_to_host(dev))
            now = time.time_ns()
            return ProposeOutput(drafts, (t0, now, now))
        active = [i for i, item in enumerate(items) if item.num_spec_tokens > 0]
        last_rows = [end - 1 for end in itertools.accumulate(counts)]
        # The MTP input for pair (h_p, x_{p+1}) sits at position p + 1, the position of x_{p+1}.
        positions = [item.start_position + 1 + j for item, n in zip(items, counts) for j in range(n)]
        last_pos = [items[i].start_position + counts[i] for i in active]  # of x_{p+1}; hand-off: all accepted
        sampling64, sampling32 = self._sampling_arrays(items, active, last_pos)
        constrained = self.grammars.tokenizer_dir is not None and any(items[i].grammar is not None for i in active)
        # S later steps on graphs (constrained: one part at a time, `_masked_later_steps`); 0: step by step.
        chained_steps = self._chained_steps(items, active, plan)
        # The later steps' graph: each row's last position (int64), its request, cache entries and steps (int32).
        chain64 = [last_pos] if chained_steps else []
        chain32 = []
        if chained_steps:
            chain32 = [active, [plan.seq_lens[i] for i in active], [plan.more_steps[i] for i in active]]
        step_tokens = None  # constrained, on a hand-off: the step's tokens on their way to the host
        if dev is not None:  # the device's tokens, gathered from its [num_reqs, width] rows
            width = dev.tokens.shape[1]
            ragged = any(c != width for c in counts)
            gather = [r * width + j for r, c in enumerate(counts) for j in range(c)] if ragged else []
            tokens64 = [counts, gather, active]  # active: those that want drafts, whose last rows step 1 takes
            # Nothing of this Propose reaches the device before the wait: work queued ahead of it would
            # take the GPU from the verifier's step (two contexts take turns on it).
            dev.wait()
            if constrained:  # step 0's masks follow them: copied before the MTP steps, waited for once step 0 is queued
                step_tokens = _HostCopy([dev.tokens, dev.num_sampled])
        else:
            tokens64 = [[t for item in items for t in item.next_token_ids]]
        int64, int32, float32 = self._upload(
            [*tokens64, positions, [last_rows[i] for i in active], *plan.int64_arrays, *sampling64, *chain64],
            [*plan.int32_arrays, *chain32],
            sampling32,
        )
        if chained_steps:
            chain_inputs = [int64.pop(), *int32[-3:]]
            int32 = int32[:-3]
        if dev is not None:
            counts_t, gather_t, active_t = int64[:3]
            flat = dev.tokens.reshape(-1)
            input_ids = flat.index_select(0, gather_t) if ragged else flat
            input_ids = input_ids.clamp_min(0)  # columns past num_sampled may hold padding
        else:
            input_ids = int64[0]
        positions_t, select, slots = int64[len(tokens64) : len(tokens64) + 3]
        sampling = _sampling(int64[len(tokens64) + 3 :], float32)
        seq_lens = [item.start_position + 1 + n for item, n in zip(items, counts)]  # MTP cache positions
        graph_tokens = self.graphs.buckets[-1] if self.graphs is not None else 0
        use_kernel = use_kernel_for(self.attention_kernel, counts, seq_lens, graph_tokens)
        attn = plan.metadata([slots], int32, use_kernel=use_kernel)
        out, out_logits, graphed = self._mtp_step(input_ids, hidden_states, positions_t, attn)  # [T, H], [T, V]
        t1 = time.time_ns()
        if not active:
            return ProposeOutput(drafts, (t0, t1, t1))
        self._timer.start()
        shift = None
        if dev is not None:  # rows past num_sampled were rejected: each request's last valid row
            shift = dev.num_sampled - counts_t  # [num_reqs] ≤ 0
            if len(active) < len(items):
                shift = shift.index_select(0, active_t)  # [num_active]
            select = select + shift
        hidden = out.index_select(0, select)  # [num_active, H]
        if not graphed:
            logits = self.mtp.compute_logits(hidden)
        else:
            logits = None if out_logits is None else out_logits.index_select(0, select)
        drafted: dict[int, list[int]] = {i: [] for i in active}  # constrained: each item's drafts so far, on the host
        wide: set[int] = set()  # constrained items drafted unmasked from step 1 on (`_mask_grammars`)
        masks = None  # constrained, on rank 0: the Propose's masks (`DraftMasks`), its drafts rolled back at the end
        if constrained:  # the matchers follow what the Propose carried, then (a hand-off) the step's tokens
            masks = self._draft_masks(items, active)
            if step_tokens is not None and masks is not None:  # a tensor-parallel follower has no masks to follow
                tokens, num_sampled = step_tokens.lists()
                masks.follow({i: tokens[i][: num_sampled[i]] for i in active if items[i].grammar is not None})
        try:
            if constrained:
                self._mask_grammars(masks, logits, items, active, drafted, wide)
                constrained = any(_to_mask(items, i, wide) for i in active)  # later masks
            picks = [self._pick(logits, sampling, hidden.shape[0])]
            # Constrained: the drafts just picked go to the host without a wait, and are waited for once the next
            # step's forward is queued, so that the device runs it while the host fills the masks after those drafts.
            copying = _DraftsCopy(active, picks[-1][0]) if constrained and logits is not None else None
            if chained_steps:  # steps 1..S replayed as graphs, every row in each (past its steps its drafts dropped)
                run = self.later_steps.start(
                    picks[0][0],
                    hidden,
                    *chain_inputs,
                    attn.block_tables,
                    shift,
                    None if sampling is None else sampling[:2],
                    chained_steps,
                    words=self.grammars.words if constrained else 0,
                )
                if constrained:
                    self._masked_later_steps(run, masks, items, active, plan, drafted, wide, copying, chained_steps)
                else:
                    run.all()
                later = run.outputs()
                q_ids, q_probs = later[1:] if sampling is not None else (None, None)  # [S, n, K] each
                for s in range(chained_steps):
                    picks.append(
                        (later[0][s], None if q_ids is None else q_ids[s], None if q_probs is None else q_probs[s])
                    )
                steps, actives = [], [active] * chained_steps
            else:
                steps, actives = self._plan_later_steps(items, active, last_pos, plan, attn.block_tables)
            for step, (step_rows, (keep, attn, positions_t, sampling)) in enumerate(zip(actives, steps), start=1):
                tokens = picks[-1][0]  # [n] the drafts just made are the next step's input tokens
                if keep is not None:  # requests that want no more drafts leave the step
                    tokens, hidden = tokens.index_select(0, keep), hidden.index_select(0, keep)
                    shift = None if shift is None else shift.index_select(0, keep)
                if shift is not None:
                    attn, positions_t = shifted(attn, positions_t, shift)
                hidden, logits, graphed = self._mtp_step(tokens, hidden, positions_t, attn)
                if not graphed:
                    logits = self.mtp.compute_logits(hidden)
                if constrained:
                    if copying is not None:
                        copying.note(drafted)
                    self._mask_grammars(masks, logits, items, step_rows, drafted, wide)
                    constrained = any(_to_mask(items, i, wide) for i in step_rows)
                picks.append(self._pick(logits, sampling, hidden.shape[0]))
                if constrained and logits is not None and step < len(steps):  # the last step's drafts feed no mask
                    copying = _DraftsCopy(step_rows, picks[-1][0])
        finally:
            if masks is not None:
                masks.close()
        if tp_rank() != 0:  # a follower: its steps are done, the drafts are rank 0's to answer with
            return ProposeOutput(drafts, (t0, t1, t1))
        tokens, q_ids, q_probs = self._to_host(picks, dev, items)
        t2 = time.time_ns()
        t1 = self._timer.split(t1, t2)
        out = _collect(items, [active, *actives], tokens, q_ids, q_probs, (t0, t1, t2))
        if masks is not None:
            out.outputs_wanted = masks.wanted
        if chained_steps:  # a row's drafts, and q rows, past its steps
            for i in active:
                kept = 1 + plan.more_steps[i]
                del out.drafts[i][kept:]
                if out.draft_probs[i] is not None:
                    out.draft_probs[i] = tuple(t[:kept] for t in out.draft_probs[i])
        return out

    def _chained_steps(self, items: list[ProposeItem], active: list[int], plan: StepPlan) -> int:
        """How many later steps this propose can run as one graph (`later_steps.py`), 0 where it runs them step by
        step: on one device, with rows and block tables the graphs take."""
        if self.later_steps is None or not active:
            return 0
        width = len(plan.int32_arrays[TABLES]) // len(items)
        if not self.later_steps.can_run(len(active), len(items), width):
            return 0
        return max(plan.more_steps[i] for i in active)

    def _draft_masks(self, items: list[ProposeItem], active: list[int]) -> DraftMasks | None:
        """The masks of a constrained Propose's drafting items, on rank 0 (which picks the drafts)."""
        if tp_rank() != 0:
            return None
        masks = DraftMasks(
            self.grammars,
            {
                i: (items[i].request_id, items[i].grammar, items[i].output, items[i].output_offset)
                for i in active
                if items[i].grammar
            },
        )
        for i, err in masks.errors.items():  # its rows allow everything
            log.warning("drafter: request %r drafted without its grammar: %s", items[i].request_id, err)
        if masks.wanted:
            log.info(
                "drafter: %d requests drafted without their grammar, their whole output asked for", len(masks.wanted)
            )
        return masks

    def _mask_grammars(
        self,
        masks: DraftMasks | None,  # None on a tensor-parallel follower: rank 0 picks
        logits: torch.Tensor | None,  # [n, V] this step's, one row per item of `rows`
        items: list[ProposeItem],
        rows: list[int],  # this step's items, in row order
        drafted: dict[int, list[int]],  # each item's drafts so far in this Propose, on the host (`_DraftsCopy.note`)
        wide: set[int],  # items drafted unmasked from here on; those whose mask allows most tokens join it
    ) -> None:
        """Masks the rows of constrained requests with their grammar's state after their output and the drafts this
        Propose made for them so far, so that the draft picked next is one the grammar allows. A request whose output
        its grammar refuses (which verification would not have let through) is drafted unmasked.

        A row whose mask allows more than `WIDE_MASK` of the vocabulary (inside a JSON string, say) drafts its later
        steps unmasked: there the masks cost the most (the trie of the whole vocabulary walked: llguidance's slow
        states) and change the fewest drafts, and a Propose none of whose rows needs a later mask runs its later
        steps as one graph, with no wait for the host between them. On the demo model under a JSON schema the
        acceptance is nearly that of masking every step: 2.77 tokens per iteration against 2.78 (docs/performance.md,
        "Structured output")."""
        if logits is None or masks is None:
            return
        masked = [(row, i) for row, i in enumerate(rows) if _to_mask(items, i, wide)]
        if not masked:
            return
        m = len(masked)  # only the masked rows' masks are filled and copied: a batch may be mostly unconstrained
        words = self._host_words(m)
        view = words.numpy()
        masks.fill([(j, i, drafted[i]) for j, (_, i) in enumerate(masked)], view)
        _widen(view, list(range(m)), [i for _, i in masked], wide)
        if self._step_masks is None or self._step_masks.shape[0] < m:
            size = max(m, self.graphs.buckets[-1] if self.graphs is not None else 0)
            self._step_masks = torch.empty((size, 1 + self.grammars.words), dtype=torch.int32, device=self.device)
        packed = self._step_masks[:m]  # each mask's logits row, then its words (`apply_packed`)
        pinned = self.device.type == "cuda"  # torch's pinned allocator keeps the rows until their copy is done
        packed[:, 0].copy_(
            torch.tensor([row for row, _ in masked], dtype=torch.int32, pin_memory=pinned), non_blocking=True
        )
        packed[:, 1:].copy_(words, non_blocking=True)  # the host writes `words` again after a later wait
        apply_packed(logits, packed, self._column_ids)

    def _masked_later_steps(
        self,
        run: LaterStepsRun,
        masks: DraftMasks,
        items: list[ProposeItem],
        active: list[int],
        plan: StepPlan,
        drafted: dict[int, list[int]],
        wide: set[int],
        copying: _DraftsCopy,  # step 0's drafts on their way to the host
        num_steps: int,  # S, the later steps of the deepest row
    ) -> None:
        """A constrained Propose's later steps on their graphs (`later_steps.py`), a step at a time: its forward
        queued, then, while the device runs it, its rows' masks filled on the host after the drafts before them
        (as `_mask_grammars` does: a row past its steps, wide or unconstrained allows everything), then its pick,
        whose drafts go to the host for the next step's masks."""
        words = self._host_words(len(active))
        for s in range(num_steps):
            run.forward(s)
            copying.note(drafted)
            jobs = [
                (a, i, drafted[i]) for a, i in enumerate(active) if _to_mask(items, i, wide) and plan.more_steps[i] > s
            ]
            view, masked = words.numpy(), {a for a, _, _ in jobs}
            view[[a for a in range(len(active)) if a not in masked]] = -1  # a row past its steps, wide or unconstrained
            masks.fill(jobs, view)
            _widen(view, [a for a, _, _ in jobs], [i for _, i, _ in jobs], wide)
            run.pick(s, words)
            if s + 1 < num_steps:
                copying = _DraftsCopy(active, run.drafts(s))

    def _host_words(self, n: int) -> torch.Tensor:
        """[n, W] int32 on the host, pinned on a GPU: a constrained step's masks, one row per row of the step. The
        same buffer every step: a step's masks are filled after the wait for the drafts before them, which the device
        picks after the copy of the masks before."""
        if self._words is None or self._words.shape[0] < n:
            size = max(n, self.graphs.buckets[-1] if self.graphs is not None else 0)
            pinned = self.device.type == "cuda"
            self._words = torch.empty((size, self.grammars.words), dtype=torch.int32, pin_memory=pinned)
        return self._words[:n]

    def _pick(self, logits: torch.Tensor | None, sampling: _Sampling | None, n: int) -> _Pick:
        """logits: [n, V] float32 (a draft vocabulary's: [n, N]) → drafts [n] (token ids); argmax alone when every row
        is greedy. Tensor-parallel: rank 0 picks and every rank gets its drafts (a follower's `logits` are None)."""
        if logits is None:
            return broadcast_tensor_from_first(torch.empty(n, dtype=torch.int64, device=self.device)), None, None
        if sampling is None:
            pick = to_ids(logits.argmax(dim=-1), self._column_ids), None, None
        else:
            temperature, seeds, counters = sampling
            step = pick_drafts(
                logits,
                temperature,
                seeds,
                counters,
                self.draft_top_k,
                any_sampled=True,
                column_ids=self._column_ids,
                vocab_size=self.mtp.config.vocab_size,
            )
            pick = step.tokens, step.q_ids, step.q_probs
        if tp_size() > 1:
            broadcast_tensor_from_first(pick[0])
        return pick

    @staticmethod
    def _sampling_arrays(
        items: list[ProposeItem], rows: list[int], last_pos: list[int]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """int64 [noise seeds, noise counters] and float32 [temperatures] of a step's rows; none when all are greedy.
        A draft's counter is that of the verifier's row scoring it: the position of the token before it, the row's
        last token (`last_pos`)."""
        if all(items[i].temperature == 0 for i in rows):
            return [], []
        seeds = [noise_seed(items[i].seed, items[i].coupled) for i in rows]
        return [seeds, last_pos], [[items[i].temperature for i in rows]]

    def _plan_steps(self, ids: list[str], counts: list[int], more: list[int]):
        """Step 0's plan, with the KV blocks of every later step allocated (`more[r]` one-token steps of request
        r, capped, fewer drafts, while the MTP cache has no room for them all); None: no room for step 0."""
        for cap in range(max(more, default=0), -1, -1):
            try:
                return self.kv_cache.plan_step(ids, counts, [min(m, cap) for m in more])
            except KVCacheFull:  # the cache is left as it was
                continue
        return None

    def _plan_later_steps(
        self,
        items: list[ProposeItem],
        active: list[int],
        last_pos: list[int],
        first: StepPlan,  # step 0's, which planned the KV slots of the later steps too
        first_tables: torch.Tensor,  # [num_reqs, width] step 0's block tables on the device
    ) -> tuple[list[_LaterStep], list[list[int]]]:
        """Steps 1..k-1 (their KV slots planned with step 0's), their other inputs on the host, uploaded in one
        copy; and the requests of each step. A step of every request attends over step 0's block tables, not
        a copy of them."""
        rows, actives, layout = active, [], []
        position = dict(zip(active, last_pos))  # of each active request's last token
        host64: list[list[int]] = []
        host32: list[list[int]] = []
        host_f: list[list[float]] = []
        for step, (kept, plan) in enumerate(first.later_steps(), start=1):
            full = len(kept) == len(rows)
            keep = [] if full else [a for a, i in enumerate(rows) if items[i].num_spec_tokens > step]
            last_pos = [position[i] + step for i in kept]
            sampling64, sampling32 = self._sampling_arrays(items, kept, last_pos)
            host64 += [*plan.int64_arrays, last_pos, *([] if full else [keep]), *sampling64]
            shared = plan.block_tables is first.block_tables
            int32_arrays = plan.int32_arrays
            host32 += [a for j, a in enumerate(int32_arrays) if not (shared and j == TABLES)]
            host_f += sampling32
            layout.append((plan, len(int32_arrays), shared, not full, bool(sampling32)))
            actives.append(kept)
            rows = kept
        if not layout:
            return [], []
        int64, int32, float32 = (iter(arrays) for arrays in self._upload(host64, host32, host_f))
        steps = []
        for plan, num_int32, shared, has_keep, has_sampling in layout:
            int32_step = [first_tables.view(-1) if shared and j == TABLES else next(int32) for j in range(num_int32)]
            attn = plan.metadata([next(int64)], int32_step, use_kernel=self.attention_kernel)
            positions = next(int64)
            keep = next(int64) if has_keep else None
            sampling = _sampling([next(int64), next(int64)], [next(float32)]) if has_sampling else None
            steps.append((keep, attn, positions, sampling))
        return steps, actives

    def _to_host(self, picks: list[_Pick], dev: DeviceTokens | None, items: list[ProposeItem]):
        """Every step's drafts (concatenated) and sampled q rows, in one device→host copy; on a device hand-off
        the verifier's tokens and num_sampled come in the same copy and fill the items' next_token_ids."""
        tokens = torch.cat([p[0] for p in picks])  # [sum of the steps' rows]
        sampled = [p for p in picks if p[1] is not None]
        device = [tokens]
        if sampled:  # q rows of the steps with a sampled request: [rows of those steps, K]
            device += [torch.cat([p[1] for p in sampled]), torch.cat([p[2] for p in sampled])]
        if dev is not None:
            device += [dev.tokens, dev.num_sampled]
        if tokens.device.type == "cuda":  # pinned destinations, one wait
            host = [t.to("cpu", non_blocking=True) for t in device]
            self._timer.stop()
        else:
            host = [t.cpu() for t in device]
        if dev is not None:
            fill_tokens(items, *host[-2:])
            host = host[:-2]
        return host[0].tolist(), *(host[1:] if sampled else (None, None))


def _to_mask(items: list[ProposeItem], i: int, wide: set[int]) -> bool:
    """Whether item i's drafts are masked: constrained, and its grammar not found wide (`WIDE_MASK`) in this Propose."""
    return items[i].grammar is not None and i not in wide


def _widen(words: np.ndarray, rows: list[int], keys: list[int], wide: set[int]) -> None:
    """`wide` gains the keys (one per row of `rows`) whose masks (`words[row]`) allow more than `WIDE_MASK` of the
    vocabulary, as counted in `WIDE_SAMPLE` evenly spaced words of each row (all of a smaller mask's), 64 bits at a
    time where the words pair up, without copying the rows out. A row judged otherwise than its whole mask would be
    costs only time or acceptance: the verifier's exact masks decide what is emitted."""
    if not rows:
        return
    pairs = words.view(np.uint64) if words.shape[1] % 2 == 0 and words.flags.c_contiguous else words.view(np.uint32)
    sample = pairs[:, :: max(1, pairs.shape[1] // WIDE_SAMPLE)]
    allowed = np.bitwise_count(sample).sum(axis=1, dtype=np.int32).tolist()
    limit = WIDE_MASK * sample.shape[1] * sample.itemsize * 8
    wide.update(key for row, key in zip(rows, keys) if allowed[row] > limit)


def _add_step_tokens(items: list[ProposeItem], tokens: list[list[int]]) -> None:
    """A device hand-off's constrained items carry their output before the step (the verifier sent them before its
    step finished): the step's tokens complete it where the hand-off is proposed from the host's inputs."""
    for item, step in zip(items, tokens):
        if item.grammar is not None:
            item.output = item.output + step


class _HostCopy:
    """Device tensors on their way to the host: on a GPU into pinned memory without a wait, and `lists` waits for this
    copy alone, not for the work queued after it."""

    def __init__(self, tensors: list[torch.Tensor]):
        if tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self.host, tensors):
                host.copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = tensors, None

    def lists(self) -> list[list]:
        if self.done is not None:
            self.done.synchronize()
        return [host.tolist() for host in self.host]


class _DraftsCopy(_HostCopy):
    """A step's drafts (`tokens`, the drafts of its rows' items `rows`) on their way to the host: taken only by
    Proposes with a constrained request, since the next step's grammar masks follow them; waited for once the next
    step's forward is queued (`note`)."""

    def __init__(self, rows: list[int], tokens: torch.Tensor):
        super().__init__([tokens])
        self.rows = rows

    def note(self, drafted: dict[int, list[int]]) -> None:
        """The drafts onto each item's host list of drafts so far."""
        for i, token in zip(self.rows, self.lists()[0]):
            drafted[i].append(token)


def _sampling(int64: list[torch.Tensor], float32: list[torch.Tensor]) -> _Sampling | None:
    """The device copies of `_sampling_arrays` (int64 [seeds, counters], float32 [temperatures])."""
    return (float32[0], int64[0], int64[1]) if float32 else None


def _collect(
    items: list[ProposeItem],
    actives: list[list[int]],  # per step, the items that drafted in it
    tokens: list[int],  # every step's drafts, step after step
    q_ids: torch.Tensor | None,  # [rows of the sampled steps, K] on the host
    q_probs: torch.Tensor | None,  # [rows of the sampled steps, K] on the host
    stamps_ns: tuple[int, int, int],
) -> ProposeOutput:
    """Host drafts per request, and per sampled request its q rows ([num_drafts, K] each)."""
    drafts: list[list[int]] = [[] for _ in items]
    q_rows: dict[int, list[int]] = {}
    offset = q_offset = 0
    for rows in actives:
        for a, j in enumerate(rows):
            drafts[j].append(tokens[offset + a])
        offset += len(rows)
        if any(items[j].temperature > 0 for j in rows):  # this step picked with q
            for a, j in enumerate(rows):
                if items[j].temperature > 0:
                    q_rows.setdefault(j, []).append(q_offset + a)
            q_offset += len(rows)
    probs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
    if q_rows:  # one gather of every sampled request's rows, split into a view per request
        index = torch.tensor([row for rows in q_rows.values() for row in rows])
        ids, p = q_ids[index], q_probs[index]
        if len(q_rows) == 1:
            per_request = [(ids, p)]
        else:
            sizes = [len(rows) for rows in q_rows.values()]
            per_request = zip(ids.split(sizes), p.split(sizes))
        for j, q in zip(q_rows, per_request):
            probs[j] = q
    return ProposeOutput(drafts, stamps_ns, probs)


@dataclass(frozen=True)
class RunnerCall:
    """One call of rank 0's runner, for its followers: a propose of `items` over `num_rows` hidden-state rows
    (broadcast next), a free of `free`, or a `cache_blocks` of `cache_blocks`."""

    items: list | None = None  # ProposeItem, with their next_token_ids
    num_rows: int = 0
    free: list[str] | None = None
    cache_blocks: list[tuple[str, int, bytes]] | None = None


def share_propose(items, hidden_states: torch.Tensor, device_tokens):
    """Rank 0, before its propose: the call broadcast to the followers. Returns the call's (hidden_states,
    device_tokens): a device hand-off's valid rows, its items' tokens filled on the host, and no device tokens."""
    if device_tokens is not None:
        hidden_states, device_tokens = valid_rows_on_host(items, hidden_states, device_tokens), None
    broadcast_from_first(RunnerCall(items=items, num_rows=hidden_states.shape[0]))
    broadcast_tensor_from_first(hidden_states.contiguous())
    return hidden_states, device_tokens


def share_free(request_ids: list[str]) -> None:
    broadcast_from_first(RunnerCall(free=list(request_ids)))


def share_cache_blocks(blocks: list[tuple[str, int, bytes]]) -> None:
    broadcast_from_first(RunnerCall(cache_blocks=list(blocks)))
