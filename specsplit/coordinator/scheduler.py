"""Continuous-batching scheduler with chunked prefill, speculative drafts and preemption.

Each iteration `schedule()` decides, per request, which tokens the verifier runs:
- a request still prefilling gets a chunk of its prompt (as much as the token budget allows);
- a decoding request gets `[last token] + scheduled_spec_decode_tokens[req]`, the drafts the
  previous iteration's propose left in `request.spec_token_ids`, trimmed so that accepting all of
  them cannot overrun `max_tokens`, `max_model_len` or the token budget.
The number of drafts each decoding request asks for next (`num_spec_tokens`, at most the k above) is chosen for the
whole batch by the scheduler's `DraftPolicy` (draft_choice.py): with `adaptive` (the default) `AdaptiveDraftCount`,
from the requests' acceptance and the iteration times the engine reports (`record_iteration`); else
`FixedDraftCount`, every request its k.
`update_from_output()` is post_step: it appends the sampled tokens, rolls
`num_computed_tokens` back by `num_rejected`, applies stop conditions and
`update_draft_token_ids` (the next drafts become `request.spec_token_ids`).

Async scheduling (the only mode): the verifier answers before the drafter has proposed and keeps the
drafts itself, so `update_draft_token_ids` writes `num_spec_tokens` placeholders (`DRAFT_PLACEHOLDER`);
the next schedule trims them like drafts (budget, KV, lengths) and the verifier fills them in. A
placeholder the verifier cannot fill counts as rejected, so the accounting is the same.

KV blocks live in the verifier; the coordinator does their accounting here, so it can preempt
(recompute) the newest running request when the cache is full. With prefix caching (`prefix_cache.py`, on by
default) it also keeps the directory of the blocks the verifier caches: a new request starts on the cached blocks
its prompt begins with, a request's verified full blocks enter the cache, and evictable cached blocks are evicted
before any request is preempted.

A batch the verifier refuses deterministically (`isolate()`) is not failed whole: its requests are scheduled apart,
half of them at a time, until the one it refuses is alone; only that request fails.
"""

from __future__ import annotations

import time
from collections import deque

from specsplit.client.errors import FailedPrecondition, ResourceExhausted
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.draft_choice import DraftPolicy, draft_policy
from specsplit.coordinator.iteration import (
    DRAFT_PLACEHOLDER,
    ScheduledRequest,
    SchedulerOutput,
    StepUpdate,
    VerifyResult,
)
from specsplit.coordinator.prefix_cache import CacheCommands, PrefixCache
from specsplit.coordinator.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids: list[int], policy: DraftPolicy | None = None):
        """`policy`: the draft counts' policy with what it learned to go on from (by default a new one as `config`
        says: `draft_policy`)."""
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.iteration = 0
        self._to_free: list[str] = []  # requests whose KV the next iteration frees
        # Groups of requests of a refused batch, each scheduled alone in its turn (`isolate`).
        self._suspects: deque[set[str]] = deque()
        self.policy = policy if policy is not None else draft_policy(config)
        self.prefix_cache = PrefixCache(config.block_size) if config.enable_prefix_caching else None

    # ---- admission and removal -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise FailedPrecondition(f"request id {request.request_id!r} is already running")
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(f"waiting queue is full ({self.config.max_waiting} requests); retry later")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        # One count per draft position the request may use, whichever depths its iterations reach.
        request.stats.accepted_per_position.extend([0] * (self._k(request) - len(request.stats.accepted_per_position)))

    def finish_request(self, request_id: str, reason: str) -> bool:
        """Ends a request (abort, stop string, error); its KV is freed at the next iteration."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._to_free.append(request_id)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            if request.num_kv_tokens:
                self._to_free.append(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return True

    def reset_all(self) -> None:
        """The verifier lost its state: every running request re-prefills from the tokens held here."""
        for request in reversed(self.running):
            self._preempt(request)
        self.running.clear()
        if self.prefix_cache is not None:  # what the verifier holds is unknown: both forget every cached block
            self.prefix_cache.reset()

    def drafter_failed(self) -> None:
        """The verifier reported a failed drafter, which may have lost its MTP cache (`PrefixCache.drafter_lost`)."""
        if self.prefix_cache is not None:
            self.prefix_cache.drafter_lost()

    def isolate(self, request_ids: list[str]) -> list[str]:
        """The verifier refused the batch of these requests and would again (INVALID_ARGUMENT). Returns the one to
        fail when it was alone; otherwise the next iterations schedule one half of them, then the other, apart
        from every other request, and so on down to the request the verifier refuses. Call `reset_all()` after:
        the refused iteration's effect is unknown."""
        if len(request_ids) <= 1:
            return list(request_ids)  # (a group it was alone in is dropped once it finished)
        if self._suspects:  # the group being tried: the refused part's halves go first, what it did not run after
            rest = self._suspects.popleft() - set(request_ids)
            if rest:
                self._suspects.appendleft(rest)
        half = len(request_ids) // 2
        self._suspects.extendleft([set(request_ids[half:]), set(request_ids[:half])])
        return []

    def _suspect_group(self) -> set[str] | None:
        """The group of suspects this iteration schedules alone, or None (no batch is being isolated)."""
        while self._suspects:
            group = self._suspects[0] & self.requests.keys()
            if group:
                self._suspects[0] = group
                return group
            self._suspects.popleft()  # all of it finished or aborted
        return None

    def has_work(self) -> bool:
        """Anything to schedule: running or waiting requests, or KV to free."""
        return bool(self._to_free or self.running or self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- schedule ----------------------------------------------------------------------------
    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _kv_blocks(self, request: Request) -> int:
        """Blocks a running request holds, or will hold once its in-flight step is done, but those of the prefix
        cache's directory (counted there once, however many requests share them)."""
        return self._blocks(max(request.num_kv_tokens, request.num_kv_reserved)) - len(request.prefix.held)

    def _evict(self, need: int, free_blocks: int) -> int:
        """Free blocks once evictable cached blocks made room for `need` (as many as there are)."""
        if need > free_blocks and self.prefix_cache is not None:
            free_blocks += self.prefix_cache.evict(need - free_blocks)
        return free_blocks

    def schedule(self) -> SchedulerOutput:
        self.iteration += 1
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        group = self._suspect_group()
        cache = self.prefix_cache
        free_blocks = cfg.num_blocks - sum(self._kv_blocks(r) for r in self.running)
        if cache is not None:
            free_blocks -= cache.num_blocks
        num_preempted = 0
        queue = list(self.running)  # FCFS, preempt from the back
        kept: list[Request] = []
        while queue:
            request = queue.pop(0)
            if cache is not None:  # its blocks verified since are cached (blocks it holds either way: no change)
                cache.register(request, request.num_computed_tokens)
            if budget <= 0 or (group is not None and request.request_id not in group):
                kept.append(request)
                continue
            item = self._plan(request, budget)
            need = self._blocks(request.num_computed_tokens + len(item.token_ids)) - self._kv_blocks(request)
            need -= len(request.prefix.held)
            free_blocks = self._evict(need, free_blocks)
            while need > free_blocks and queue:
                free_blocks = self._evict(need, free_blocks + self._preempt(queue.pop()))
                num_preempted += 1
            if need > free_blocks:
                free_blocks += self._preempt(request)
                num_preempted += 1
                continue
            free_blocks -= need
            budget -= len(item.token_ids)
            request.spec_token_ids = []
            request.num_kv_reserved = item.num_computed_tokens + len(item.token_ids)
            scheduled.append(item)
            kept.append(request)

        # admission: FCFS among the waiting requests (of the suspect group, while a batch is isolated)
        while budget > 0 and len(kept) < cfg.max_num_seqs and not num_preempted:
            request = next((r for r in self.waiting if group is None or r.request_id in group), None)
            if request is None:
                break
            num_cached = self._start_on_cached_blocks(request)
            item = self._plan(request, budget)
            need = self._blocks(request.num_computed_tokens + len(item.token_ids)) - num_cached
            free_blocks = self._evict(need, free_blocks)
            if need > free_blocks:
                if num_cached:
                    self._release(request)
                    request.num_computed_tokens = 0
                break
            item.num_cached_blocks = num_cached
            if cache is not None:
                cache.count_admission(request, num_cached)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached * cfg.block_size
            self.waiting.remove(request)  # the first one but while a batch is isolated
            request.status = RequestStatus.RUNNING
            if request.admitted_time is None:
                request.admitted_time = time.monotonic()
                item.queue_time_ms = (request.admitted_time - request.arrival_time) * 1e3
            free_blocks -= need
            budget -= len(item.token_ids)
            request.num_kv_reserved = item.num_computed_tokens + len(item.token_ids)
            scheduled.append(item)
            kept.append(request)

        self.running = kept
        self._choose_drafts(scheduled)
        finished, self._to_free = self._to_free, []
        commands = cache.take_commands() if cache is not None else CacheCommands()
        return SchedulerOutput(self.iteration, scheduled, finished, num_preempted, commands)

    def _start_on_cached_blocks(self, request: Request) -> int:
        """A request about to be admitted with nothing computed starts on the cached blocks its tokens begin with;
        returns how many."""
        if self.prefix_cache is None or request.num_computed_tokens:
            return 0
        n = self.prefix_cache.lookup(request)
        if n:
            self.prefix_cache.attach(request, n)
            request.num_computed_tokens = n * self.config.block_size
        return n

    def _release(self, request: Request) -> None:
        """The request's KV is about to be freed: its verified full blocks enter the cache, and the cached blocks it
        held stay there."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(request, request.num_computed_tokens)
            self.prefix_cache.release(request)

    def _plan(self, request: Request, budget: int) -> ScheduledRequest:
        nc = request.num_computed_tokens
        remaining = request.num_tokens - nc
        if remaining > 1:  # prefill (a new prompt, or recompute after preemption)
            n = min(remaining, budget)
            tokens = [request.token_at(i) for i in range(nc, nc + n)]
            sample = nc + n == request.num_tokens
            next_token = 0 if sample else request.token_at(nc + n)
            return ScheduledRequest(
                request, nc, tokens, 0, sample, next_token, self._num_spec_after(request) if sample else 0
            )
        drafts = request.spec_token_ids[: self._max_drafts(request, budget)]
        tokens = [request.token_at(nc), *drafts]
        return ScheduledRequest(
            request,
            nc,
            tokens,
            len(drafts),
            True,
            0,
            self._num_spec_after(request),
        )

    def _choose_drafts(self, scheduled: list[ScheduledRequest]) -> None:
        """Each sampling request's `num_spec_tokens` (its cap until now) as the policy chooses."""
        sampling = [item for item in scheduled if item.sample]
        chosen = self.policy.choose(
            [item.num_spec_tokens for item in sampling],
            [item.request.position_counts for item in sampling],
            [item.request.sampling.max_tokens - len(item.request.output_token_ids) for item in sampling],
        )
        for item, n in zip(sampling, chosen):
            item.num_spec_tokens = n

    def choose_ahead(self, output: SchedulerOutput) -> None:
        """The next iteration's choice for `output`'s sampling requests, prepared now, while the verifier and drafter
        run `output` (`DraftPolicy.choose_ahead`: adaptive speculation computes its costly part, the best allocation);
        the next `schedule` takes it if its decoding batch is the same. Call it once `output`'s step is on its way,
        before its results."""
        requests = [item.request for item in output.scheduled if item.sample]
        if requests:
            self.policy.choose_ahead(
                [self._num_spec_after(r) for r in requests],  # (a cap that the step's tokens cut: chosen afresh)
                [r.position_counts for r in requests],
                [r.sampling.max_tokens - len(r.output_token_ids) for r in requests],
            )

    def record_iteration(
        self,
        output: SchedulerOutput,
        seconds: float,
        proposed: bool,
        num_later_steps: int,
        later_steps_s: float | None = None,
        propose_s: float | None = None,
    ) -> None:
        """An iteration's measured time (schedule to post_step), for the draft counts' policy: `proposed`, whether it
        covered a Propose, `num_later_steps` that Propose's drafter steps after step 0, `later_steps_s` their time
        as the drafter reports it and `propose_s` the rest of the Propose's time in it, when known. Iterations with a
        prefill chunk are not decode steps and are not learned from."""
        if not output.scheduled:
            return
        if any(not item.sample or len(item.token_ids) != item.num_draft_tokens + 1 for item in output.scheduled):
            return
        depth = max(item.num_draft_tokens for item in output.scheduled)
        self.policy.record_iteration(
            output.num_scheduled_tokens, num_later_steps, seconds, later_steps_s, proposed, propose_s, depth
        )

    def _k(self, request: Request) -> int:
        k = request.sampling.num_speculative_tokens
        return self.config.num_speculative_tokens if k is None else min(k, self.config.num_speculative_tokens)

    def _max_drafts(self, request: Request, budget: int) -> int:
        return max(
            0,
            min(
                self._k(request),
                budget - 1,
                request.sampling.max_tokens - len(request.output_token_ids) - 1,
                self.config.max_model_len - request.num_tokens - 1,
            ),
        )

    def _num_spec_after(self, request: Request) -> int:
        # After this step the request holds at least one more token.
        return max(
            0,
            min(
                self._k(request),
                request.sampling.max_tokens - len(request.output_token_ids) - 2,
                self.config.max_model_len - request.num_tokens - 2,
            ),
        )

    def _preempt(self, request: Request) -> int:
        """Recompute preemption: forget its KV, re-prefill prompt + output later (from its cached blocks, while
        they stay cached). Returns the blocks this frees."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(request, request.num_computed_tokens)
        freed = self._kv_blocks(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        if request.num_kv_tokens or request.num_kv_reserved:
            self._to_free.append(request.request_id)
        request.num_kv_tokens = 0
        request.num_kv_reserved = 0
        if request in self.running:
            self.running.remove(request)
        self.waiting.appendleft(request)
        return freed

    # ---- post_step -----------------------------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, results: list[VerifyResult], drafter_ok: bool = True
    ) -> list[StepUpdate]:
        """Post_step. `drafter_ok`: False when the verifier reported a failed (or absent) drafter; async
        scheduling then leaves no placeholders (no budget and KV spent on drafts that will not come)
        until a reply reports the drafter back."""
        if len(results) != len(output.scheduled):
            raise FailedPrecondition(f"verifier returned {len(results)} results for {len(output.scheduled)} requests")
        if self._suspects:  # answered: the suspects of this batch are cleared
            self._suspects[0] -= {item.request.request_id for item in output.scheduled}
            if not self._suspects[0]:
                self._suspects.popleft()
        updates = []
        for item, result in zip(output.scheduled, results):
            request = item.request
            if request.is_finished or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the iteration was in flight
            if result.request_id != request.request_id:
                raise FailedPrecondition(
                    f"verifier result for {result.request_id!r} where {request.request_id!r} was expected"
                )
            request.num_kv_tokens = item.num_computed_tokens + len(item.token_ids)
            request.num_kv_reserved = 0
            if not item.sample:
                request.num_computed_tokens += len(item.token_ids)
                request.stats.record(0, 0)
                continue
            num_sampled = len(result.sampled_token_ids)
            if not 1 <= num_sampled <= item.num_draft_tokens + 1 or result.num_rejected != (
                item.num_draft_tokens + 1 - num_sampled
            ):
                raise FailedPrecondition(
                    f"verifier returned num_sampled={num_sampled}, num_rejected={result.num_rejected} "
                    f"for {item.num_draft_tokens} drafts of {request.request_id!r}"
                )
            num_drafts = result.num_draft_tokens
            if not num_sampled - 1 <= num_drafts <= item.num_draft_tokens:
                raise FailedPrecondition(
                    f"verifier ran {num_drafts} drafts of {request.request_id!r} ({item.num_draft_tokens} scheduled) "
                    f"and accepted {num_sampled - 1}"
                )
            request.stats.record(num_drafts, num_sampled - 1)
            self.policy.record_verified(request.position_counts, num_drafts, num_sampled - 1)
            request.num_computed_tokens = request.num_kv_tokens - result.num_rejected
            update = StepUpdate(request)
            for token in result.sampled_token_ids:
                request.output_token_ids.append(token)
                update.new_token_ids.append(token)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    self.finish_request(request.request_id, reason)
                    update.finished = True
                    break
            if result.logprobs is not None:  # those of the tokens taken (a stop drops the rest)
                update.new_logprobs = result.logprobs[: len(update.new_token_ids)]
            if not update.finished:
                # update_draft_token_ids: placeholders for the drafts the verifier keeps.
                request.spec_token_ids = [DRAFT_PLACEHOLDER] * (item.num_spec_tokens if drafter_ok else 0)
            updates.append(update)
        return updates

    def _stop_reason(self, request: Request, token: int) -> str | None:
        if not request.sampling.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in request.sampling.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= request.sampling.max_tokens:
            return "length"
        if request.num_tokens >= self.config.max_model_len:
            return "length"
        return None
