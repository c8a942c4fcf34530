"""Paged KV cache with per-request block tables and rollback.

Each request caches its tokens contiguously from cache index 0: cache index i is the i-th token of the
request's cached sequence, stored at slot `block_table[i // block_size] * block_size + i % block_size`.
Rollback (`truncate`) only moves the request's length back and returns whole blocks past it; stale
K/V left in a kept block is overwritten by the next `prepare_step`, never read, because attention
reads only cache indices below `seq_len`.

Prefix caching: a full block can be registered under a key (`cache_block`; the caller's hash of everything its
entries depend on), and a new request can start on the cached blocks of its keys (`attach`) instead of computing them.
A cached block is shared by reference count; once no request holds it, it stays cached and evictable, and allocation
takes free blocks first, then evicts the least recently released cached block. A request never writes into a block
it shares: it only appends after its full cached blocks (rollback into one it alone holds uncaches it first).

The cache owns the block accounting of its own requests; RoPE positions are the caller's business.
`PagedBlocks` is that accounting; `PagedKVCache` adds per-head K and V, and DeepSeek-V3's
`specsplit.models.deepseek_v3.latent_cache.LatentKVCache` one MLA latent per token instead.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specsplit.models.padded_batch import PaddedBatch, build_padded_batch
from specsplit.models.step_upload import StepUpload


class KVCacheFull(RuntimeError):
    """Not enough free blocks for a step; the cache is left exactly as it was."""


@dataclass
class AttentionMetadata:
    """Where the new tokens of one ragged step go, and what each request attends over.

    The device tensors arrive in one host→device copy (`specsplit.models.step_upload`); with `use_kernel`
    (the Triton path) the forward reads only them, so it never syncs with the host.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sum of new tokens per request
    seq_lens: torch.Tensor  # [num_reqs] int32, cached + new tokens per request after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, -1 padded
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token (-1: padding, not written)
    token_req_index: torch.Tensor  # [num_tokens] int32, the request (row of block_tables) of each token
    # Cache entries each token attends over: its request's cache indices 0 .. len - 1 (causal; 0 = padding).
    token_context_lens: torch.Tensor  # [num_tokens] int32
    block_size: int
    # Host copies, so a per-request loop needs no device→host sync.
    query_start_loc_host: list[int] = field(default_factory=list)  # [num_reqs + 1]
    seq_lens_host: list[int] = field(default_factory=list)  # [num_reqs]
    block_tables_host: list[list[int]] = field(default_factory=list)  # [num_reqs][blocks of the request]
    # True: attention runs the Triton kernel over the device tensors (graph-safe); False: the
    # per-request SDPA loop over `context_slots`.
    use_kernel: bool = False

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def context_start_loc_host(self) -> list[int]:  # [num_reqs + 1]
        return [0, *itertools.accumulate(self.seq_lens_host)]

    @functools.cached_property
    def context_slots(self) -> torch.Tensor:  # [sum(seq_lens)] int64
        """Flat slots of every cached token (old and new) of every request, request after request:
        request r's are context_slots[context_start_loc[r] : context_start_loc[r] + seq_lens[r]].
        Built on first use, by the eager (SDPA / MLA) paths only."""
        slots, valid = self._slot_grid
        return slots[valid].to(self.slot_mapping.device)

    @functools.cached_property
    def _slot_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """On the host: [num_reqs, max_seq_len] flat slot of each request's cache index (0 past its
        end) and whether that index holds one of its tokens."""
        size, width = self.block_size, max(len(t) for t in self.block_tables_host)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.block_tables_host], dtype=torch.int64)
        max_len = max(self.seq_lens_host)
        slots = (tables[:, :, None] * size + torch.arange(size)).flatten(1)[:, :max_len]
        valid = torch.arange(max_len)[None, :] < torch.tensor(self.seq_lens_host)[:, None]
        return torch.where(valid, slots, 0), valid

    @functools.cached_property
    def padded_batch(self) -> PaddedBatch | None:
        """The step as one padded batch for a single SDPA call (`specsplit/models/padded_batch.py`), or None where the
        per-request loop is better. Built once per step."""
        return build_padded_batch(
            self.query_start_loc_host, self.seq_lens_host, self._slot_grid[0], self.slot_mapping.device
        )


@dataclass
class StepPlan:
    """The host arrays of one step (`PagedBlocks.plan_step`); `metadata` pairs them with their device copies."""

    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    slot_mapping: list[int]  # [num_tokens]
    token_req_index: list[int]  # [num_tokens]
    token_context_lens: list[int]  # [num_tokens]
    block_tables: list[list[int]]  # [num_reqs][blocks of the request]
    block_size: int
    flat_tables: list[int] | None = None  # the block tables padded and flattened, when made already
    more_steps: list[int] | None = None  # per request, the one-token steps planned to follow (`later_steps`)

    @property
    def int64_arrays(self) -> list[list[int]]:
        return [self.slot_mapping]

    @functools.cached_property
    def int32_arrays(self) -> list[list[int]]:
        """Made once per plan: the block tables flattened, each padded to the widest with -1."""
        if self.flat_tables is None:
            width = max(map(len, self.block_tables))
            self.flat_tables = []
            for t in self.block_tables:  # whole-list extends: a per-element comprehension costs more
                self.flat_tables += t
                if len(t) < width:
                    self.flat_tables += [-1] * (width - len(t))
        return [self.query_start_loc, self.seq_lens, self.flat_tables, self.token_req_index, self.token_context_lens]

    def later_steps(self) -> list[tuple[list[int], StepPlan]]:
        """The one-token steps that follow this one (the drafter's steps 1..k-1), whose KV blocks this plan
        allocated (`plan_step(..., more_steps=...)`): step s takes one token of each request with
        `more_steps[r] >= s`. Per step, those requests' indices (into this plan's) and its plan, worked out from
        this plan's lists without the cache: no allocation, a slot per request (plain Python beats numpy here:
        converting the block tables costs more than it saves; docs/performance.md, "Host time around the GPU work
        (CPU)"). Steps with every request share this plan's block tables."""
        more = self.more_steps or []
        size, seq_lens, tables, n = self.block_size, self.seq_lens, self.block_tables, len(self.seq_lens)
        rows = list(range(n))
        steps = []
        for s in range(1, max(more, default=0) + 1):
            if any(more[r] < s for r in rows):
                rows = [r for r in rows if more[r] >= s]
            full = len(rows) == n
            context = [seq_lens[r] + s for r in rows]  # cache entries once the step's token is in
            slots = [tables[r][(c - 1) // size] * size + (c - 1) % size for r, c in zip(rows, context)]
            positions = list(range(len(rows)))
            plan = StepPlan(
                [*positions, len(rows)],
                context,
                slots,
                positions,
                context,
                tables if full else [tables[r] for r in rows],
                size,
                self.int32_arrays[2] if full else None,
            )
            steps.append((rows, plan))
        return steps

    def metadata(
        self, int64: list[torch.Tensor], int32: list[torch.Tensor], *, use_kernel: bool = False
    ) -> AttentionMetadata:
        """int64 / int32: device copies of `int64_arrays` / `int32_arrays`, in their order."""
        (slots,) = int64
        query_start_loc, seq_lens, tables, token_req_index, token_context_lens = int32
        return AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=tables.view(len(self.block_tables), -1),
            slot_mapping=slots,
            token_req_index=token_req_index,
            token_context_lens=token_context_lens,
            block_size=self.block_size,
            query_start_loc_host=self.query_start_loc,
            seq_lens_host=self.seq_lens,
            block_tables_host=self.block_tables,
            use_kernel=use_kernel,
        )


@dataclass
class _RequestBlocks:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedBlocks:
    """The block accounting every paged cache shares: per-request block tables over a pool of
    `num_blocks` blocks of `block_size` tokens, rollback, the metadata of a step, and the prefix cache.

    Every block is free, held by requests, or cached and held by none (evictable). Subclasses own the cache
    tensors (indexed by slot) and say on which `device` they live.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._requests: dict[str, _RequestBlocks] = {}
        self._upload: StepUpload | None = None  # made on first use, once the subclass knows its device
        # Prefix cache. `_refs`: the requests holding each held block that is cached or shared (every other held
        # block has one holder, so a cache that never caches skips the counting); `_evictable`: cached blocks no
        # request holds, least recently released first. An uncached block is in `_refs` only while shared.
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def num_free_blocks(self) -> int:
        """Blocks a step can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks under a key, held by requests or evictable."""
        return len(self._block_of)

    def has(self, req_id: str) -> bool:
        return req_id in self._requests

    def num_tokens(self, req_id: str) -> int:
        request = self._requests.get(req_id)
        return request.num_tokens if request is not None else 0

    def block_table(self, req_id: str) -> list[int]:
        request = self._requests.get(req_id)
        return list(request.blocks) if request is not None else []

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Forget tokens at cache index >= num_tokens; return the blocks no longer needed."""
        request = self._requests.get(req_id)
        cached = request.num_tokens if request is not None else 0
        if not 0 <= num_tokens <= cached:
            raise ValueError(f"cannot truncate request {req_id!r} to {num_tokens} tokens: it has {cached} cached")
        if request is None or num_tokens == cached:  # nothing to roll back (every draft was accepted)
            return
        keep = self._blocks_for(num_tokens)
        if num_tokens % self.block_size and self._refs:
            # The request writes into its kept last block next: a block it shares stays as the others hold it, and
            # a cached one it alone holds stops being cached.
            block = request.blocks[keep - 1]
            holders = self._refs.get(block)
            if holders is not None:
                if holders > 1:
                    raise ValueError(
                        f"cannot truncate request {req_id!r} to {num_tokens} tokens: its block {block} is shared"
                    )
                self.evict([self._key_of[block]])
        self._release(request.blocks[keep:])
        del request.blocks[keep:]
        request.num_tokens = num_tokens

    def free(self, req_id: str) -> None:
        request = self._requests.pop(req_id, None)
        if request is not None:
            self._release(request.blocks)

    def _release(self, blocks: list[int]) -> None:
        """Blocks leaving a request, its last first: an unshared uncached one is free; a cached one no request holds
        any more becomes evictable (a request's later blocks are evicted before its earlier ones)."""
        refs = self._refs
        if not refs:  # nothing cached or shared
            self._free.extend(reversed(blocks))
            return
        for block in reversed(blocks):
            n = refs.get(block)
            if n is None:
                self._free.append(block)
            elif n == 1:  # cached (an uncached block is counted only while shared)
                del refs[block]
                self._evictable[block] = None
            elif n == 2 and block not in self._key_of:  # an uncached block with one holder left: a plain block of it
                del refs[block]
            else:
                refs[block] = n - 1

    def cache_block(self, req_id: str, index: int, key: bytes) -> bool:
        """Registers block `index` of the request under `key`; False, changing nothing, unless the request holds that
        block full, `key` is not cached and the block is not cached under another key."""
        request = self._requests.get(req_id)
        if request is None or index < 0 or request.num_tokens < (index + 1) * self.block_size:
            return False
        block = request.blocks[index]
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        self._refs.setdefault(block, 1)  # a block shared already keeps its count
        return True

    def attach(self, req_id: str, keys: list[bytes]) -> bool:
        """Starts a request the cache does not hold (or holds with no tokens) on the cached blocks of `keys`, in
        order: `len(keys) * block_size` tokens. False, changing nothing, if a key is not cached."""
        request = self._requests.get(req_id)
        block_of = self._block_of
        if (request is not None and (request.num_tokens or request.blocks)) or not all(k in block_of for k in keys):
            return False
        blocks = [block_of[k] for k in keys]
        refs, evictable = self._refs, self._evictable
        for block in blocks:
            if block in evictable:
                del evictable[block]
                refs[block] = 1
            else:
                refs[block] += 1
        self._requests[req_id] = _RequestBlocks(blocks, len(blocks) * self.block_size)
        return True

    def cached_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys of `keys` are cached."""
        for n, key in enumerate(keys):
            if key not in self._block_of:
                return n
        return len(keys)

    def evict(self, keys: list[bytes]) -> None:
        """Forgets these keys (those not cached are ignored): an evictable block is free; a held one is freed when
        the last request holding it lets it go."""
        for key in keys:
            block = self._block_of.pop(key, None)
            if block is None:
                continue
            del self._key_of[block]
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)
            elif self._refs[block] == 1:  # one holder: a plain block of it now
                del self._refs[block]

    def forget_cached(self) -> None:
        """Forgets every key."""
        self.evict(list(self._block_of))

    def _evict_lru(self, n: int) -> None:
        """The `n` least recently released cached blocks no request holds become free."""
        for _ in range(n):
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self._free.append(block)

    def can_append(self, req_ids: list[str], num_new_tokens: list[int]) -> bool:
        self._check_step(req_ids, num_new_tokens)
        return self._blocks_needed(req_ids, num_new_tokens) <= self.num_free_blocks

    def prepare_step(
        self, req_ids: list[str], num_new_tokens: list[int], *, use_kernel: bool = False
    ) -> AttentionMetadata:
        """Allocates room for each request's new tokens after its cached ones and describes the step.

        Advances every request's cached length by its new tokens (the caller then runs the forward
        that writes them). Raises KVCacheFull, changing nothing, when blocks run out.
        """
        return self.upload_step(self.plan_step(req_ids, num_new_tokens), use_kernel=use_kernel)

    def upload_step(self, plan: StepPlan, *, use_kernel: bool = False) -> AttentionMetadata:
        """The device half of `prepare_step`: `plan`'s arrays in one host→device copy."""
        if self._upload is None:
            self._upload = StepUpload(self.device)
        int64, int32, _ = self._upload(plan.int64_arrays, plan.int32_arrays)
        return plan.metadata(int64, int32, use_kernel=use_kernel)

    def plan_step(self, req_ids: list[str], num_new_tokens: list[int], more_steps: list[int] | None = None) -> StepPlan:
        """The host half of `prepare_step` (allocation and host arrays, no device work), so a caller
        can plan several steps and upload their arrays together with its own in one copy.

        more_steps: per request, one-token steps that follow this one (the drafter's steps 1..k-1): their
        blocks are allocated and their tokens counted as cached now, and `StepPlan.later_steps` plans them.
        Takes free blocks first, then evicts cached ones no request holds (least recently released first)."""
        self._check_step(req_ids, num_new_tokens)
        more_steps = more_steps or [0] * len(req_ids)
        needed = self._blocks_needed(req_ids, [n + m for n, m in zip(num_new_tokens, more_steps)])
        if needed > len(self._free):
            if needed > self.num_free_blocks:
                raise KVCacheFull(f"step needs {needed} new KV blocks, only {self.num_free_blocks} free")
            self._evict_lru(needed - len(self._free))

        query_start_loc = [0]
        seq_lens: list[int] = []
        slot_mapping: list[int] = []
        token_req_index: list[int] = []
        token_context_lens: list[int] = []
        tables: list[list[int]] = []
        size, requests, free = self.block_size, self._requests, self._free
        total = 0
        for r, (req_id, num_new, more) in enumerate(zip(req_ids, num_new_tokens, more_steps)):
            request = requests.get(req_id)
            if request is None:
                request = requests[req_id] = _RequestBlocks()
            blocks = request.blocks
            start = request.num_tokens
            end = start + num_new
            for _ in range(-(-(end + more) // size) - len(blocks)):
                blocks.append(free.pop())
            request.num_tokens = end + more
            if num_new == 1:  # decode / draft steps: one slot
                slot_mapping.append(blocks[start // size] * size + start % size)
                token_req_index.append(r)
                token_context_lens.append(end)
            else:
                first = blocks[start // size] * size + start % size
                if start // size == (end - 1) // size:  # all in one block: consecutive slots
                    slot_mapping += range(first, first + num_new)
                else:
                    slot_mapping += [blocks[i // size] * size + i % size for i in range(start, end)]
                token_req_index += [r] * num_new
                token_context_lens += range(start + 1, end + 1)
            total += num_new
            query_start_loc.append(total)
            seq_lens.append(end)
            tables.append(blocks.copy())
        plan = StepPlan(query_start_loc, seq_lens, slot_mapping, token_req_index, token_context_lens, tables, size)
        plan.more_steps = more_steps
        return plan

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _blocks_needed(self, req_ids: list[str], num_new_tokens: list[int]) -> int:
        size, requests, needed = self.block_size, self._requests, 0
        for r, n in zip(req_ids, num_new_tokens):
            request = requests.get(r)
            if request is None:
                needed += -(-n // size)
            else:  # no copy of the block table (`block_table` makes one)
                needed += -(-(request.num_tokens + n) // size) - len(request.blocks)
        return needed

    @staticmethod
    def _check_step(req_ids: list[str], num_new_tokens: list[int]) -> None:
        if len(req_ids) != len(num_new_tokens):
            raise ValueError(f"{len(req_ids)} request ids but {len(num_new_tokens)} token counts")
        if not req_ids:
            raise ValueError("a step needs at least one request")
        if len(set(req_ids)) != len(req_ids):
            raise ValueError(f"duplicate request ids in one step: {req_ids}")
        if any(n < 1 for n in num_new_tokens):
            raise ValueError(f"every request needs >= 1 new token, got {num_new_tokens}")


class PagedKVCache(PagedBlocks):
    """Full K and V per layer and KV head (Llama-style attention)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_layers < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_layers, num_blocks and block_size must be >= 1, got {num_layers}, {num_blocks}, {block_size}"
            )
        super().__init__(num_blocks, block_size)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies, K and V over all layers."""
        return (self.k.nbytes + self.v.nbytes) // (self.num_blocks * self.block_size)
